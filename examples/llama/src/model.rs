//! The Llama decoder: token embedding, pre-norm blocks of grouped-query causal attention and a
//! SwiGLU MLP, a final RMSNorm and a head, untied or tied to the embedding.
//!
//! Weights are stored the burn way, `[in, out]` for matrices (`x.matmul(w)`); `hf.rs` transposes
//! to Hugging Face's `[out, in]` on export and back on import.
//!
//! The model computes in its parameters' dtype (fp32, or bf16/f16 under mixed precision), except
//! where 16 bits lose too much, as Hugging Face's Llama does: the norms' mean square, the
//! attention softmax and the loss run in fp32.

use burn::module::{Module, Param};
use burn::tensor::activation::{log_softmax, silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};

use crate::config::LlamaConfig;
use crate::rope::{self, Rope};

/// Root-mean-square normalisation with a learned scale.
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// Scale, `[hidden]`.
    pub weight: Param<Tensor<B, 1>>,
    /// Added to the mean square.
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    /// Normalises the last dimension of `x`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.forward_scaled(x, self.weight.val())
    }

    /// Normalises the last dimension of `x` and multiplies by `scale`, this norm's weight as
    /// the caller wants it seen (tensor parallelism routes it through its group).
    pub fn forward_scaled<const D: usize>(
        &self,
        x: Tensor<B, D>,
        scale: Tensor<B, 1>,
    ) -> Tensor<B, D> {
        let dtype = x.dtype();
        let x = in_dtype(x, DType::F32);
        let rms = (x.clone().powi_scalar(2).mean_dim(D - 1) + self.eps).sqrt();
        in_dtype(x / rms, dtype) * scale.unsqueeze()
    }
}

/// Grouped-query causal self-attention with rotary positions.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// `[hidden, heads * head_dim]`.
    pub q_proj: Param<Tensor<B, 2>>,
    /// `[hidden, kv_heads * head_dim]`.
    pub k_proj: Param<Tensor<B, 2>>,
    /// `[hidden, kv_heads * head_dim]`.
    pub v_proj: Param<Tensor<B, 2>>,
    /// `[heads * head_dim, hidden]`.
    pub o_proj: Param<Tensor<B, 2>>,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Rotary settings.
    pub rope: Rope,
}

/// What depends on position only, shared by every layer of one forward pass: the rotary
/// tables and the causal mask.
#[derive(Debug, Clone)]
pub struct Positions<B: Backend> {
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
    mask: Tensor<B, 4>,
}

impl<B: Backend> Positions<B> {
    /// The rotary tables and causal mask for sequences of `seq` tokens and heads of `head_dim`,
    /// in `dtype`, the activations' dtype.
    pub fn new(
        seq: usize,
        head_dim: usize,
        rope: &Rope,
        (device, dtype): (&B::Device, DType),
    ) -> Self {
        let (cos, sin) = rope::tables::<B>(seq, head_dim, rope, device);
        let mask = causal_mask::<B>(seq, device);
        Self {
            cos: in_dtype(cos, dtype),
            sin: in_dtype(sin, dtype),
            mask: in_dtype(mask, dtype),
        }
    }
}

impl<B: Backend> Attention<B> {
    fn head_dim(&self) -> usize {
        self.q_proj.dims()[1] / self.heads
    }

    /// The rotary tables and causal mask for sequences of `seq` tokens, in the weights' dtype.
    pub fn positions(&self, seq: usize, device: &B::Device) -> Positions<B> {
        let dtype = self.q_proj.val().dtype();
        Positions::new(seq, self.head_dim(), &self.rope, (device, dtype))
    }

    /// `x`: `[batch, seq, hidden]` to `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<B, 3>, positions: &Positions<B>) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let head_dim = self.head_dim();
        let split = |w: &Param<Tensor<B, 2>>, heads: usize| {
            linear(x.clone(), w)
                .reshape([batch, seq, heads, head_dim])
                .swap_dims(1, 2)
        };
        let q = split(&self.q_proj, self.heads);
        let k = split(&self.k_proj, self.kv_heads);
        let v = split(&self.v_proj, self.kv_heads);
        let context =
            attend(q, k, v, positions)
                .swap_dims(1, 2)
                .reshape([batch, seq, self.heads * head_dim]);
        linear(context, &self.o_proj)
    }
}

/// Causal attention of query heads `q` `[batch, heads, seq, head_dim]` over key/value heads
/// `k`, `v` `[batch, kv_heads, seq, head_dim]` (each shared by `heads / kv_heads` query heads),
/// with rotary positions; the context comes back shaped like `q`. The same for every head, so
/// tensor parallelism calls it on each rank's heads.
pub fn attend<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    positions: &Positions<B>,
) -> Tensor<B, 4> {
    let (cos, sin) = (&positions.cos, &positions.sin);
    let group = q.dims()[1] / k.dims()[1];
    let head_dim = q.dims()[3];
    let q = rope::apply(q, cos, sin);
    let k = repeat_kv(rope::apply(k, cos, sin), group);
    let v = repeat_kv(v, group);
    let scores = q.matmul(k.swap_dims(2, 3)) / (head_dim as f64).sqrt();
    let scores = scores + positions.mask.clone();
    let dtype = scores.dtype();
    in_dtype(softmax(in_dtype(scores, DType::F32), 3), dtype).matmul(v)
}

/// Repeats each key/value head for the `group` query heads that share it.
fn repeat_kv<B: Backend>(x: Tensor<B, 4>, group: usize) -> Tensor<B, 4> {
    if group == 1 {
        return x;
    }
    let [batch, kv_heads, seq, head_dim] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .repeat_dim(2, group)
        .reshape([batch, kv_heads * group, seq, head_dim])
}

/// `-inf` above the diagonal, `0` elsewhere, shaped `[1, 1, seq, seq]` to broadcast.
fn causal_mask<B: Backend>(seq: usize, device: &B::Device) -> Tensor<B, 4> {
    let values = (0..seq * seq)
        .map(|i| {
            if i % seq > i / seq {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect::<Vec<_>>();
    Tensor::from_data(TensorData::new(values, [1, 1, seq, seq]), device)
}

/// `x @ w` for `x` of any rank and a `[in, out]` weight (the same product the tensor-parallel
/// layers compute on their shards).
fn linear<B: Backend, const D: usize>(x: Tensor<B, D>, w: &Param<Tensor<B, 2>>) -> Tensor<B, D> {
    burn_tensor_parallel::linear::matmul(x, w.val())
}

/// SwiGLU: `down(silu(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// `[hidden, intermediate]`.
    pub gate_proj: Param<Tensor<B, 2>>,
    /// `[hidden, intermediate]`.
    pub up_proj: Param<Tensor<B, 2>>,
    /// `[intermediate, hidden]`.
    pub down_proj: Param<Tensor<B, 2>>,
}

impl<B: Backend> Mlp<B> {
    /// `[batch, seq, hidden]` to `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let gate = silu(linear(x.clone(), &self.gate_proj));
        linear(gate * linear(x, &self.up_proj), &self.down_proj)
    }
}

/// One pre-norm Transformer block.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    /// Norm before attention.
    pub input_layernorm: RmsNorm<B>,
    /// Attention.
    pub self_attn: Attention<B>,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm<B>,
    /// MLP.
    pub mlp: Mlp<B>,
}

impl<B: Backend> Block<B> {
    /// Residual attention, then residual MLP.
    pub fn forward(&self, x: Tensor<B, 3>, positions: &Positions<B>) -> Tensor<B, 3> {
        let attended = self
            .self_attn
            .forward(self.input_layernorm.forward(x.clone()), positions);
        let x = x + attended;
        x.clone() + self.mlp.forward(self.post_attention_layernorm.forward(x))
    }
}

/// The whole decoder.
#[derive(Module, Debug)]
pub struct Llama<B: Backend> {
    /// `[vocab, hidden]`.
    pub embed_tokens: Param<Tensor<B, 2>>,
    /// Transformer blocks.
    pub layers: Vec<Block<B>>,
    /// Final norm.
    pub norm: RmsNorm<B>,
    /// `[hidden, vocab]`; none when the head is tied to the embedding, whose transpose it
    /// reads, so the one weight gets the gradients of both uses.
    pub lm_head: Option<Param<Tensor<B, 2>>>,
}

impl<B: Backend> Llama<B> {
    /// Builds the model from `seed` alone: each matrix is drawn from its own generator, seeded by
    /// `seed` and the tensor's name, so the weights do not depend on the backend, the device,
    /// the order of construction or the parallel layout.
    pub fn init(config: &LlamaConfig, seed: u64, device: &B::Device) -> Self {
        Self::build(config, device, |name, shape| {
            let mut rng = StdRng::seed_from_u64(seed ^ fnv1a(name.as_bytes()));
            let dist = Normal::new(0.0f32, config.initializer_range as f32).unwrap();
            let values: Vec<f32> = (0..shape[0] * shape[1])
                .map(|_| dist.sample(&mut rng))
                .collect();
            Tensor::from_data(TensorData::new(values, shape), device)
        })
    }

    /// The model's structure with zero matrices, to load weights into (drawing random ones
    /// first would take a minute for `llama-7b`).
    pub fn skeleton(config: &LlamaConfig, device: &B::Device) -> Self {
        Self::build(config, device, |_, shape| Tensor::zeros(shape, device))
    }

    /// Builds every block; `matrix(name, shape)` gives each matrix, named as Hugging Face names
    /// it.
    fn build(
        config: &LlamaConfig,
        device: &B::Device,
        matrix: impl Fn(&str, [usize; 2]) -> Tensor<B, 2>,
    ) -> Self {
        let (h, f, v) = (
            config.hidden_size,
            config.intermediate_size,
            config.vocab_size,
        );
        let (heads, kv_heads) = (config.num_attention_heads, config.num_key_value_heads);
        let kv = kv_heads * config.head_dim();
        let normal = |name: &str, shape| Param::from_tensor(matrix(name, shape));
        let norm = || RmsNorm {
            weight: Param::from_tensor(Tensor::ones([h], device)),
            eps: config.rms_norm_eps,
        };
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let name = |part: &str| format!("model.layers.{i}.{part}.weight");
                Block {
                    input_layernorm: norm(),
                    self_attn: Attention {
                        q_proj: normal(&name("self_attn.q_proj"), [h, h]),
                        k_proj: normal(&name("self_attn.k_proj"), [h, kv]),
                        v_proj: normal(&name("self_attn.v_proj"), [h, kv]),
                        o_proj: normal(&name("self_attn.o_proj"), [h, h]),
                        heads,
                        kv_heads,
                        rope: config.rope(),
                    },
                    post_attention_layernorm: norm(),
                    mlp: Mlp {
                        gate_proj: normal(&name("mlp.gate_proj"), [h, f]),
                        up_proj: normal(&name("mlp.up_proj"), [h, f]),
                        down_proj: normal(&name("mlp.down_proj"), [f, h]),
                    },
                }
            })
            .collect();
        Self {
            embed_tokens: normal("model.embed_tokens.weight", [v, h]),
            layers,
            norm: norm(),
            lm_head: (!config.tie_word_embeddings).then(|| normal("lm_head.weight", [h, v])),
        }
    }

    /// The head's weight, `[hidden, vocab]`: its own, or the embedding's transpose when tied.
    pub fn head_weight(&self) -> Tensor<B, 2> {
        head_weight(self.lm_head.as_ref(), Some(&self.embed_tokens))
            .expect("the whole model holds its embedding")
    }

    /// Logits `[batch, seq, vocab]` for `tokens` `[batch, seq]`.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let mut x = embed(&self.embed_tokens, tokens);
        if let Some(first) = self.layers.first() {
            let positions = first.self_attn.positions(x.dims()[1], &x.device());
            for layer in &self.layers {
                x = layer.forward(x, &positions);
            }
        }
        head(&self.norm, self.head_weight(), x)
    }

    /// Mean next-token cross-entropy (nats) of `targets` given `inputs`, both `[batch, seq]`.
    pub fn loss(&self, inputs: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        next_token_loss(self.forward(inputs), targets)
    }
}

/// The rows of `table` `[vocab, hidden]` for `tokens` `[batch, seq]`: `[batch, seq, hidden]`.
pub fn embed<B: Backend>(table: &Param<Tensor<B, 2>>, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    let [batch, seq] = tokens.dims();
    let hidden = table.dims()[1];
    table
        .val()
        .select(0, tokens.reshape([batch * seq]))
        .reshape([batch, seq, hidden])
}

/// The head's weight `[hidden, vocab]` of a part of the model holding `lm_head` and
/// `embedding`: its own, or, tied, the embedding's transpose; none when the model is tied and
/// the embedding is elsewhere.
pub fn head_weight<B: Backend>(
    lm_head: Option<&Param<Tensor<B, 2>>>,
    embedding: Option<&Param<Tensor<B, 2>>>,
) -> Option<Tensor<B, 2>> {
    match (lm_head, embedding) {
        (Some(lm_head), _) => Some(lm_head.val()),
        (None, Some(embedding)) => Some(embedding.val().transpose()),
        (None, None) => None,
    }
}

/// The final norm and the head `weight` `[hidden, vocab]`: logits `[batch, seq, vocab]` of
/// the last hidden states.
pub fn head<B: Backend>(norm: &RmsNorm<B>, weight: Tensor<B, 2>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    burn_tensor_parallel::linear::matmul(norm.forward(x), weight)
}

/// Mean cross-entropy (nats) of `targets` `[batch, seq]` under `logits` `[batch, seq, vocab]`.
pub fn next_token_loss<B: Backend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
) -> Tensor<B, 1> {
    let [batch, seq] = targets.dims();
    let vocab = logits.dims()[2];
    let logits = in_dtype(logits.reshape([batch * seq, vocab]), DType::F32);
    let log_probs = log_softmax(logits, 1);
    let picked = log_probs.gather(1, targets.reshape([batch * seq, 1]));
    picked.mean().neg()
}

/// `x` in `dtype`; no operation when it is in it already, so fp32 runs compute exactly as
/// before mixed precision existed.
pub fn in_dtype<B: Backend, const D: usize>(x: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    if x.dtype() == dtype { x } else { x.cast(dtype) }
}

/// FNV-1a: gives every tensor name its own stream of random numbers, and keys cached data.
pub(crate) fn fnv1a<'a>(bytes: impl IntoIterator<Item = &'a u8>) -> u64 {
    bytes
        .into_iter()
        .fold(0xcbf2_9ce4_8422_2325, |hash, &byte| {
            (hash ^ byte as u64).wrapping_mul(0x0100_0000_01b3)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn initial_loss_is_near_uniform_and_init_is_reproducible() {
        let config = LlamaConfig::preset("tiny").unwrap();
        let device = Default::default();
        let model = Llama::<Flex>::init(&config, 7, &device);
        let tokens = Tensor::<Flex, 2, Int>::from_ints([[1, 2, 3, 4], [5, 6, 7, 8]], &device);
        let loss: f32 = model.loss(tokens.clone(), tokens.clone()).into_scalar();
        assert!((loss - (256f32).ln()).abs() < 0.1, "loss {loss}");
        let again = Llama::<Flex>::init(&config, 7, &device);
        let loss_again: f32 = again.loss(tokens.clone(), tokens).into_scalar();
        assert_eq!(loss.to_bits(), loss_again.to_bits());
    }

    #[test]
    fn a_tied_heads_gradient_is_the_sum_of_both_uses() {
        type A = burn::backend::Autodiff<Flex>;
        let config = LlamaConfig::preset("tiny")
            .unwrap()
            .with_tie_word_embeddings(true);
        let device = Default::default();
        let tied = Llama::<A>::init(&config, 5, &device);
        assert!(tied.lm_head.is_none());
        // The same weights untied: the head a copy of the embedding's transpose.
        let mut untied = tied.clone();
        let copy = tied.embed_tokens.val().transpose().into_data();
        untied.lm_head = Some(Param::from_tensor(Tensor::from_data(copy, &device)));
        let tokens = Tensor::<A, 2, Int>::from_ints([[1, 2, 3, 4], [5, 6, 7, 8]], &device);
        let loss = |m: &Llama<A>| m.loss(tokens.clone(), tokens.clone().flip([1]));
        let (tied_loss, untied_loss) = (loss(&tied), loss(&untied));
        assert_eq!(
            tied_loss.clone().into_data(),
            untied_loss.clone().into_data()
        );
        let tied_grads = tied_loss.backward();
        let untied_grads = untied_loss.backward();
        let grad = |p: &Param<Tensor<A, 2>>, grads| p.val().grad(grads).unwrap();
        let want = grad(&untied.embed_tokens, &untied_grads)
            + grad(untied.lm_head.as_ref().unwrap(), &untied_grads).transpose();
        let got = grad(&tied.embed_tokens, &tied_grads);
        let error: f32 = (got - want.clone()).abs().max().into_scalar();
        let scale: f32 = want.abs().max().into_scalar();
        assert!(error <= 1e-6 * scale, "{error} of {scale}");
        assert!(scale > 0.0);
    }

    #[test]
    fn attention_is_causal() {
        let config = LlamaConfig::preset("tiny").unwrap();
        let device = Default::default();
        let model = Llama::<Flex>::init(&config, 1, &device);
        let a = Tensor::<Flex, 2, Int>::from_ints([[1, 2, 3, 4]], &device);
        let b = Tensor::<Flex, 2, Int>::from_ints([[1, 2, 3, 9]], &device);
        let prefix = |t| -> Vec<f32> {
            model
                .forward(t)
                .narrow(1, 0, 3)
                .into_data()
                .to_vec()
                .unwrap()
        };
        assert_eq!(prefix(a), prefix(b));
    }
}
