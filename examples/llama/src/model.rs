//! The Llama decoder: token embedding, pre-norm blocks of grouped-query causal attention and a
//! SwiGLU MLP, a final RMSNorm and a head, untied or tied to the embedding.
//!
//! One type serves every layout. A [`Llama`] is the whole model, or a part of it: a pipeline
//! stage or ZeRO-3 unit is a range of blocks (the embedding only on the first, the final norm
//! and head only on the last), and under tensor parallelism each matrix holds this rank's
//! slice, as `parallel_plan.rs` cut it, with the group in its [`Part`]. The forward is the same
//! code either way: where the matrices are split, the activations enter and leave the
//! tensor-parallel regions (Megatron), and the embedding and loss are vocab-parallel.
//!
//! Weights are stored the burn way, `[in, out]` for matrices (`x.matmul(w)`); `hf.rs` transposes
//! to Hugging Face's `[out, in]` on export and back on import.
//!
//! The model computes in its parameters' dtype (fp32, or bf16/f16 under mixed precision), except
//! where 16 bits lose too much, as Hugging Face's Llama does: the norms' mean square, the
//! attention softmax and the loss run in fp32.

use std::ops::Range;

use burn::module::{Module, Param};
use burn::tensor::activation::{log_softmax, silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, ElementConversion, Int, Tensor, TensorData};
use burn_comm::parallel::copy_to_parallel_region;
use burn_expert_parallel::{ExpertParallel, Moe, MoeError};
use burn_pipeline::StageOutput;
use burn_tensor_parallel::context::{causal_mask, repeat_kv};
use burn_tensor_parallel::linear::matmul;
use burn_tensor_parallel::{
    ContextParallel, TensorParallel, TpBackend, TpError, vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};

use crate::config::LlamaConfig;
use crate::experts::PartExperts;
use crate::hf;
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

    /// Normalises the last dimension of `x`, whose rows are split over `tp` under sequence
    /// parallelism: every rank holds the weight whole, and its gradient is then summed over
    /// the group.
    pub fn forward_in<const D: usize>(
        &self,
        x: Tensor<B, D>,
        tp: Option<&TensorParallel>,
    ) -> Result<Tensor<B, D>, TpError>
    where
        B: TpBackend,
    {
        match tp {
            None => Ok(self.forward(x)),
            Some(tp) => Ok(self.forward_scaled(x, tp.replicated(self.weight.val())?)),
        }
    }

    /// Normalises the last dimension of `x` and multiplies by `scale`, this norm's weight as
    /// the caller wants it seen.
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

/// Grouped-query causal self-attention with rotary positions. Split over `tp` ranks, each
/// holds `heads / tp` query heads and their key/value heads (shared by `tp / kv_heads`
/// neighbouring ranks when there are fewer key/value heads than ranks).
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// `[hidden, heads * head_dim]`, column-parallel.
    pub q_proj: Param<Tensor<B, 2>>,
    /// `[hidden, kv_heads * head_dim]`, column-parallel.
    pub k_proj: Param<Tensor<B, 2>>,
    /// `[hidden, kv_heads * head_dim]`, column-parallel.
    pub v_proj: Param<Tensor<B, 2>>,
    /// `[heads * head_dim, hidden]`, row-parallel.
    pub o_proj: Param<Tensor<B, 2>>,
    /// Query heads of the whole model.
    pub heads: usize,
    /// Key/value heads of the whole model.
    pub kv_heads: usize,
    /// Rotary settings.
    pub rope: Rope,
}

/// What depends on position only, shared by every layer of one forward pass: the rotary
/// tables and the causal mask, or the context-parallel group that masks as it attends.
#[derive(Debug, Clone)]
pub struct Positions<B: Backend> {
    cos: Tensor<B, 4>,
    sin: Tensor<B, 4>,
    masking: Masking<B>,
}

/// How attention keeps a token from seeing later ones.
#[derive(Debug, Clone)]
enum Masking<B: Backend> {
    /// The whole sequence is here: the scores where this is true are hidden.
    Mask(Tensor<B, 4, Bool>),
    /// The sequence is split over this group, whose attention masks by true positions.
    Context(ContextParallel),
}

impl<B: Backend> Positions<B> {
    /// The rotary tables and causal mask of a model shaped `config` for sequences of `seq`
    /// tokens, on the device and in the dtype of the activations `x`; under context
    /// parallelism, the tables of this rank's tokens.
    pub fn new(
        config: &LlamaConfig,
        seq: usize,
        x: &Tensor<B, 3>,
        cp: Option<&ContextParallel>,
    ) -> Result<Self, TpError> {
        let (device, dtype) = (&x.device(), x.dtype());
        let (head_dim, rope) = (config.head_dim(), config.rope());
        let ((cos, sin), masking) = match cp {
            None => {
                let positions: Vec<usize> = (0..seq).collect();
                (
                    rope::tables::<B>(seq, head_dim, &rope, device),
                    Masking::Mask(causal_mask(&positions, &positions, device)),
                )
            }
            Some(cp) => (
                rope::tables_at::<B>(cp.positions(seq)?.into_iter(), head_dim, &rope, device),
                Masking::Context(cp.clone()),
            ),
        };
        Ok(Self {
            cos: in_dtype(cos, dtype),
            sin: in_dtype(sin, dtype),
            masking,
        })
    }
}

impl<B: TpBackend> Attention<B> {
    /// `x`: `[batch, seq, hidden]` to `[batch, seq, hidden]`; under sequence parallelism this
    /// rank's part of the sequence, whose whole the attention sees once it enters the region.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        positions: &Positions<B>,
        tp: Option<&TensorParallel>,
    ) -> Result<Tensor<B, 3>, TpError> {
        let ranks = tp.map_or(1, TensorParallel::size);
        let (heads, kv_heads) = (self.heads / ranks, (self.kv_heads / ranks).max(1));
        let head_dim = self.q_proj.dims()[1] / heads;
        // Key/value heads held by several ranks sum those ranks' gradients.
        let kv = |w: &Param<Tensor<B, 2>>| match tp {
            Some(tp) if self.kv_heads < ranks => Ok::<_, TpError>(copy_to_parallel_region(
                w.val(),
                &tp.replica_group(self.kv_heads)?,
            )?),
            _ => Ok(w.val()),
        };
        let [q, k, v] = enter_matmul_many(
            tp,
            x,
            [self.q_proj.val(), kv(&self.k_proj)?, kv(&self.v_proj)?],
        )?;
        let [batch, seq, _] = q.dims();
        let split = |y: Tensor<B, 3>, heads: usize| {
            y.reshape([batch, seq, heads, head_dim]).swap_dims(1, 2)
        };
        let context = attend(
            split(q, heads),
            split(k, kv_heads),
            split(v, kv_heads),
            positions,
        )?
        .swap_dims(1, 2)
        .reshape([batch, seq, heads * head_dim]);
        matmul_exit(tp, context, self.o_proj.val())
    }
}

/// `x @ w` for each of `weights`, `x` entering the tensor-parallel region once (when split).
fn enter_matmul_many<B: TpBackend, const N: usize>(
    tp: Option<&TensorParallel>,
    x: Tensor<B, 3>,
    weights: [Tensor<B, 2>; N],
) -> Result<[Tensor<B, 3>; N], TpError> {
    match tp {
        None => Ok(weights.map(|w| matmul(x.clone(), w))),
        Some(tp) => tp.enter_matmul_many(x, weights),
    }
}

/// `x @ w`, summed over the tensor-parallel group as it leaves the region (when split).
fn matmul_exit<B: TpBackend>(
    tp: Option<&TensorParallel>,
    x: Tensor<B, 3>,
    w: Tensor<B, 2>,
) -> Result<Tensor<B, 3>, TpError> {
    match tp {
        None => Ok(matmul(x, w)),
        Some(tp) => tp.matmul_exit(x, w),
    }
}

/// Causal attention of query heads `q` `[batch, heads, seq, head_dim]` over key/value heads
/// `k`, `v` `[batch, kv_heads, seq, head_dim]` (each shared by `heads / kv_heads` query heads),
/// with rotary positions; the context comes back shaped like `q`. The same for every head, so
/// tensor parallelism calls it on each rank's heads. Under context parallelism `seq` is this
/// rank's tokens, and the keys of the others are reached through its group.
pub fn attend<B: TpBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    positions: &Positions<B>,
) -> Result<Tensor<B, 4>, TpError> {
    let (cos, sin) = (&positions.cos, &positions.sin);
    let q = rope::apply(q, cos, sin);
    let k = rope::apply(k, cos, sin);
    let mask = match &positions.masking {
        Masking::Context(cp) => return cp.attention(q, k, v, true),
        Masking::Mask(mask) => mask,
    };
    let group = q.dims()[1] / k.dims()[1];
    let head_dim = q.dims()[3];
    let (k, v) = (repeat_kv(k, group), repeat_kv(v, group));
    let scores = q.matmul(k.swap_dims(2, 3)) / (head_dim as f64).sqrt();
    let scores = scores.mask_fill(mask.clone(), f32::NEG_INFINITY);
    let dtype = scores.dtype();
    Ok(in_dtype(softmax(in_dtype(scores, DType::F32), 3), dtype).matmul(v))
}

/// SwiGLU: `down(silu(gate(x)) * up(x))`; split over `tp` ranks, each holds `intermediate / tp`
/// features.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// `[hidden, intermediate]`, column-parallel.
    pub gate_proj: Param<Tensor<B, 2>>,
    /// `[hidden, intermediate]`, column-parallel.
    pub up_proj: Param<Tensor<B, 2>>,
    /// `[intermediate, hidden]`, row-parallel.
    pub down_proj: Param<Tensor<B, 2>>,
}

impl<B: TpBackend> Mlp<B> {
    /// `[batch, seq, hidden]` to `[batch, seq, hidden]` (under sequence parallelism, this rank's
    /// part of the sequence).
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        tp: Option<&TensorParallel>,
    ) -> Result<Tensor<B, 3>, TpError> {
        let [gate, up] = enter_matmul_many(tp, x, [self.gate_proj.val(), self.up_proj.val()])?;
        matmul_exit(tp, silu(gate) * up, self.down_proj.val())
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
    /// The SwiGLU MLP; none where a mixture of experts replaces it.
    pub mlp: Option<Mlp<B>>,
    /// The mixture of experts (router `[hidden, experts]`, this rank's experts stacked,
    /// Mixtral's SwiGLU experts), when the config has experts.
    pub moe: Option<Moe<B>>,
}

impl<B: TpBackend> Block<B> {
    /// Residual attention, then residual MLP (or mixture of experts, whose routers' losses come
    /// back beside the output, weighted). `experts` says how a mixture of experts is split and
    /// where it notes its figures (none: all here, unnoted); `index` is the block's place in
    /// the whole model.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        positions: &Positions<B>,
        tp: Option<&TensorParallel>,
        experts: Option<&PartExperts>,
        index: usize,
    ) -> Result<(Tensor<B, 3>, Option<Tensor<B, 1>>), TpError> {
        let normed = self.input_layernorm.forward_in(x.clone(), tp)?;
        let x = x + self.self_attn.forward(normed, positions, tp)?;
        let normed = self.post_attention_layernorm.forward_in(x.clone(), tp)?;
        match (&self.mlp, &self.moe) {
            (Some(mlp), None) => Ok((x + mlp.forward(normed, tp)?, None)),
            (None, Some(moe)) => {
                let [batch, seq, hidden] = normed.dims();
                let unsplit;
                let (ep, group) = match experts {
                    Some(experts) => (&experts.ep, experts.batch.as_ref()),
                    // Every expert here (a model cut by `ParallelPlan::shard`, say): still
                    // split over `tp` when the plan split it.
                    None => {
                        unsplit = ExpertParallel::unsplit(moe.config().experts)
                            .with_tensor_parallel(tp.map(|tp| tp.comm().clone()));
                        (&unsplit, None)
                    }
                };
                let out = moe
                    .forward_in(normed.reshape([batch * seq, hidden]), ep, group)
                    .map_err(moe_error)?;
                if let Some(experts) = experts
                    && moe.router.val().is_require_grad()
                {
                    experts
                        .record
                        .block(index, &out.aux_loss, &out.z_loss, out.stats);
                }
                let own = out.aux_loss + out.z_loss;
                Ok((x + out.output.reshape([batch, seq, hidden]), Some(own)))
            }
            _ => Err(TpError::Config(format!(
                "block {index} holds {} MLP and {} mixture of experts; it holds one of them",
                if self.mlp.is_some() { "an" } else { "no" },
                if self.moe.is_some() { "a" } else { "no" },
            ))),
        }
    }
}

/// A mixture of experts' failure as the model's.
fn moe_error(error: MoeError) -> TpError {
    match error {
        MoeError::Config(why) => TpError::Config(why),
        MoeError::Comm(error) => TpError::Comm(error),
    }
}

/// Which part of the whole model a [`Llama`] holds, and how.
#[derive(Debug, Clone)]
pub struct Part {
    /// The whole model's shape.
    pub config: LlamaConfig,
    /// The blocks of the whole model this part holds.
    pub layers: Range<usize>,
    /// The tensor-parallel group its matrices are split over; none when they are whole.
    pub tp: Option<TensorParallel>,
    /// The context-parallel group its sequences are split over; none when each is whole.
    pub cp: Option<ContextParallel>,
    /// How its mixtures of experts are split and where they note their figures; none: every
    /// expert here, nothing noted.
    pub experts: Option<PartExperts>,
}

impl Part {
    /// Where this part sits in the groups its parameters are split over.
    pub fn slices(&self) -> crate::parallel_plan::Slices<'_> {
        crate::parallel_plan::Slices {
            tp: self.tp.as_ref(),
            ep: self.experts.as_ref().map(|experts| &experts.ep),
        }
    }
}

/// The decoder, or a part of it (see [`Part`]).
#[derive(Module, Debug)]
pub struct Llama<B: Backend> {
    /// `[vocab, hidden]`, vocab-parallel; on the part holding the first block, and when the
    /// head is tied to it, a copy (same id) on the part holding the last block for the head,
    /// whose gradient the pipeline sums with the first's (Megatron's embedding group).
    pub embed_tokens: Option<Param<Tensor<B, 2>>>,
    /// Transformer blocks.
    pub layers: Vec<Block<B>>,
    /// Final norm; on the part holding the last block.
    pub norm: Option<RmsNorm<B>>,
    /// `[hidden, vocab]`, column-parallel, on the part holding the last block; none when the
    /// head is tied to the embedding, whose transpose it reads, so the one weight gets the
    /// gradients of both uses.
    pub lm_head: Option<Param<Tensor<B, 2>>>,
    #[module(skip)]
    part: Part,
}

impl<B: Backend> Llama<B> {
    /// Builds the model from `seed` alone: each matrix is drawn from its own generator, seeded by
    /// `seed` and the tensor's name, so the weights do not depend on the backend, the device,
    /// the order of construction or the parallel layout.
    pub fn init(config: &LlamaConfig, seed: u64, device: &B::Device) -> Self {
        let matrix =
            |name: &str, shape| Tensor::from_data(seeded_matrix(config, seed, name, shape), device);
        Self::build(config, device, matrix, |names, shape| {
            Tensor::stack(names.iter().map(|name| matrix(name, shape)).collect(), 0)
        })
    }

    /// The model's structure with empty matrices (its norms' ones), to fill part by part
    /// (`weights.rs`): a rank builds no matrix it does not hold.
    pub fn shell(config: &LlamaConfig, device: &B::Device) -> Self {
        Self::build(
            config,
            device,
            |_, _| Tensor::empty([0, 0], device),
            |_, _| Tensor::empty([0, 0, 0], device),
        )
    }

    /// The model's structure with zero matrices, to load weights into (drawing random ones
    /// first would take a minute for `llama-7b`).
    pub fn skeleton(config: &LlamaConfig, device: &B::Device) -> Self {
        Self::build(
            config,
            device,
            |_, shape| Tensor::zeros(shape, device),
            |names, [rows, columns]| Tensor::zeros([names.len(), rows, columns], device),
        )
    }

    /// Builds every block; `matrix(name, shape)` gives each matrix, named as Hugging Face names
    /// it, and `experts(names, shape)` the matrices of every expert of a block, one per name,
    /// stacked.
    fn build(
        config: &LlamaConfig,
        device: &B::Device,
        matrix: impl Fn(&str, [usize; 2]) -> Tensor<B, 2>,
        experts: impl Fn(&[String], [usize; 2]) -> Tensor<B, 3>,
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
                    mlp: (!config.is_moe()).then(|| Mlp {
                        gate_proj: normal(&name("mlp.gate_proj"), [h, f]),
                        up_proj: normal(&name("mlp.up_proj"), [h, f]),
                        down_proj: normal(&name("mlp.down_proj"), [f, h]),
                    }),
                    moe: config.is_moe().then(|| {
                        let stacked = |which: &str, shape| {
                            let path = format!("layers.{i}.moe.{which}");
                            let names: Vec<String> = (0..config.num_local_experts)
                                .map(|j| hf::expert_name(&path, j))
                                .collect();
                            Param::from_tensor(experts(&names, shape))
                        };
                        let router = normal(
                            &hf::name(&format!("layers.{i}.moe.router")),
                            [h, config.num_local_experts],
                        );
                        Moe::from_parts(
                            router,
                            [
                                stacked("gate", [h, f]),
                                stacked("up", [h, f]),
                                stacked("down", [f, h]),
                            ],
                            config.router(),
                        )
                    }),
                }
            })
            .collect();
        Self {
            embed_tokens: Some(normal("model.embed_tokens.weight", [v, h])),
            layers,
            norm: Some(norm()),
            lm_head: (!config.tie_word_embeddings).then(|| normal("lm_head.weight", [h, v])),
            part: Part {
                config: config.clone(),
                layers: 0..config.num_hidden_layers,
                tp: None,
                cp: None,
                experts: None,
            },
        }
    }

    /// Which part of the whole model this is.
    pub fn part(&self) -> &Part {
        &self.part
    }

    /// The whole model's shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.part.config
    }

    /// Whether this is the whole model, unsplit.
    pub fn is_whole(&self) -> bool {
        self.part.tp.is_none()
            && self.part.cp.is_none()
            && self.embed_tokens.is_some()
            && self.norm.is_some()
            && self.lm_head.is_some() != self.config().tie_word_embeddings
            && self.part.layers == (0..self.config().num_hidden_layers)
    }

    /// This part with its matrices split over `tp` (see `parallel_plan.rs`, which cuts them).
    pub(crate) fn with_tp(mut self, tp: Option<TensorParallel>) -> Self {
        self.part.tp = tp;
        self
    }

    /// This part with its sequences split over `cp`: it reads whole sequences and computes on
    /// this rank's tokens of them, its loss the mean over those tokens.
    pub fn with_cp(mut self, cp: Option<ContextParallel>) -> Self {
        self.part.cp = cp;
        self
    }

    /// The ids of this part's experts' weights (not the routers'): under expert parallelism,
    /// each held by some ranks only.
    pub fn expert_params(&self) -> Vec<burn::module::ParamId> {
        self.layers
            .iter()
            .filter_map(|block| block.moe.as_ref())
            .flat_map(|moe| [moe.gate.id, moe.up.id, moe.down.id])
            .collect()
    }

    /// This part with its mixtures of experts split and noting their figures as `experts`
    /// says (none: every expert here, nothing noted).
    pub fn with_experts(mut self, experts: Option<PartExperts>) -> Self {
        self.part.experts = experts;
        self
    }

    /// The parts of this whole model holding the blocks in `ranges`, in order: the first with
    /// the embedding, the last with the final norm and head (a copy of the embedding when the
    /// head is tied to it).
    pub fn cut(self, ranges: &[Range<usize>]) -> Vec<Self> {
        let tiles = ranges.first().map(|r| r.start) == Some(self.part.layers.start)
            && ranges.last().map(|r| r.end) == Some(self.part.layers.end)
            && ranges.windows(2).all(|w| w[0].end == w[1].start)
            && ranges.iter().all(|r| !r.is_empty());
        assert!(
            tiles,
            "the ranges {ranges:?} must cut the blocks {:?} into consecutive non-empty parts",
            self.part.layers
        );
        let last = ranges.len() - 1;
        let mut blocks = self.layers.into_iter();
        let tied_copy = self
            .embed_tokens
            .clone()
            .filter(|_| self.part.config.tie_word_embeddings && last > 0);
        let (mut embed_tokens, mut tied_copy, mut norm, mut lm_head) =
            (self.embed_tokens, tied_copy, self.norm, self.lm_head);
        ranges
            .iter()
            .enumerate()
            .map(|(s, range)| Self {
                embed_tokens: match s {
                    0 => embed_tokens.take(),
                    s if s == last => tied_copy.take(),
                    _ => None,
                },
                layers: blocks.by_ref().take(range.len()).collect(),
                norm: if s == last { norm.take() } else { None },
                lm_head: if s == last { lm_head.take() } else { None },
                part: Part {
                    layers: range.clone(),
                    ..self.part.clone()
                },
            })
            .collect()
    }

    /// The whole model from all its parts, in order (a tied head's copy of the embedding is
    /// dropped: it equals the first part's).
    pub fn join(parts: Vec<Self>) -> Self {
        let mut parts = parts.into_iter();
        let mut whole = parts.next().expect("a model has at least one part");
        for part in parts {
            assert_eq!(
                part.part.layers.start, whole.part.layers.end,
                "parts join in order"
            );
            whole.layers.extend(part.layers);
            whole.part.layers.end = part.part.layers.end;
            whole.norm = whole.norm.or(part.norm);
            whole.lm_head = whole.lm_head.or(part.lm_head);
        }
        whole
    }
}

impl<B: TpBackend> Llama<B> {
    /// This part's forward: the embedded `inputs` on the part holding the embedding, `input`
    /// (the previous part's activations) on every other; then its blocks; then, on the last,
    /// the mean next-token cross-entropy of `targets`. Both `[batch, seq]`, whole sequences;
    /// under context parallelism the part computes on, and averages the loss over, this rank's
    /// tokens of them.
    pub fn forward_part(
        &self,
        input: Option<Tensor<B, 3>>,
        inputs: &Tensor<B, 2, Int>,
        targets: &Tensor<B, 2, Int>,
    ) -> Result<StageOutput<B>, TpError> {
        let seq = targets.dims()[1];
        let (inputs, targets) = match &self.part.cp {
            None => (inputs.clone(), targets.clone()),
            Some(cp) => (cp.shard(inputs.clone(), 1)?, cp.shard(targets.clone(), 1)?),
        };
        let (inputs, targets) = (&inputs, &targets);
        let (x, own) = self.blocks_forward(input, inputs, seq)?;
        let Some(norm) = &self.norm else {
            return Ok(match own {
                Some(own) => StageOutput::ActivationAndLoss(x, own),
                None => StageOutput::Activation(x),
            });
        };
        let weight = self.head_weight()?;
        let loss = match self.part.tp.as_ref() {
            None => next_token_loss(head(norm, weight, x), targets.clone()),
            Some(tp) => {
                let logits = tp.enter_matmul(norm.forward_in(x, Some(tp))?, weight)?;
                let [batch, seq] = targets.dims();
                let vocab_part = logits.dims()[2];
                vocab_parallel_cross_entropy(
                    logits.reshape([batch * seq, vocab_part]),
                    targets.clone().reshape([batch * seq]),
                    tp,
                )?
                .mean()
            }
        };
        if let Some(experts) = &self.part.experts
            && norm.weight.val().is_require_grad()
        {
            experts
                .record
                .lm_loss(loss.clone().into_scalar().elem::<f64>());
        }
        Ok(StageOutput::Loss(match own {
            Some(own) => loss + own,
            None => loss,
        }))
    }

    /// This part up to its head: the embedded `inputs` on the part holding the embedding,
    /// `input` on every other, through its blocks, for sequences of `seq` tokens; and the
    /// losses its mixtures of experts add, if it has any.
    fn blocks_forward(
        &self,
        input: Option<Tensor<B, 3>>,
        inputs: &Tensor<B, 2, Int>,
        seq: usize,
    ) -> Result<(Tensor<B, 3>, Option<Tensor<B, 1>>), TpError> {
        let tp = self.part.tp.as_ref();
        let config = &self.part.config;
        // A later part's embedding is a tied head's copy, not the input's.
        let reads_tokens = self.part.layers.start == 0;
        let mut x = match (self.embed_tokens.as_ref().filter(|_| reads_tokens), input) {
            (Some(table), None) => match tp {
                None => embed(table, inputs.clone()),
                Some(tp) => {
                    vocab_parallel_embedding(table.val(), inputs.clone(), config.vocab_size, tp)?
                }
            },
            (None, Some(x)) => x,
            _ => {
                return Err(TpError::Config(
                    "a pipeline stage got an input it does not take: only the first stage reads tokens"
                        .into(),
                ));
            }
        };
        // The whole sequence: under sequence parallelism `x` holds this rank's part of it.
        let positions = Positions::new(config, seq, &x, self.part.cp.as_ref())?;
        let experts = self.part.experts.as_ref();
        let mut own: Option<Tensor<B, 1>> = None;
        for (index, layer) in self.part.layers.clone().zip(&self.layers) {
            let (y, added) = layer.forward(x, &positions, tp, experts, index)?;
            x = y;
            own = match (own, added) {
                (Some(sum), Some(added)) => Some(sum + added),
                (sum, added) => sum.or(added),
            };
        }
        Ok((x, own))
    }

    /// The training objective of `targets` given `inputs`, both `[batch, seq]`, of a model
    /// holding every block (split over a tensor-parallel group or not): the mean next-token
    /// cross-entropy (nats), plus the routers' losses of a mixture of experts; the same on
    /// every rank of the tensor-parallel group; under context parallelism, the mean over this
    /// rank's tokens.
    pub fn loss(
        &self,
        inputs: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
    ) -> Result<Tensor<B, 1>, TpError> {
        match self.forward_part(None, &inputs, &targets)? {
            StageOutput::Loss(loss) => Ok(loss),
            _ => Err(TpError::Config(
                "this part of the model ends before the head; the loss needs every block".into(),
            )),
        }
    }

    /// The head's weight `[hidden, vocab]` (this rank's columns when split): its own, or the
    /// embedding's transpose when the model is tied.
    pub(crate) fn head_weight(&self) -> Result<Tensor<B, 2>, TpError> {
        let tied = self.part.config.tie_word_embeddings;
        match (&self.lm_head, &self.embed_tokens) {
            (Some(lm_head), _) if !tied => Ok(lm_head.val()),
            (None, Some(table)) if tied => Ok(table.val().transpose()),
            (None, None) if tied => Err(TpError::Config(
                "the last part of a tied model holds no copy of the embedding for its head; cut the model with Llama::cut".into(),
            )),
            _ => Err(TpError::Config(format!(
                "the head of this part does not match the model: {} model, lm_head {}",
                if tied { "a tied" } else { "an untied" },
                if self.lm_head.is_some() {
                    "present"
                } else {
                    "missing"
                },
            ))),
        }
    }

    /// Logits `[batch, seq, vocab]` for `tokens` `[batch, seq]`, of the whole model held on
    /// one rank.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Result<Tensor<B, 3>, TpError> {
        if !self.is_whole() {
            return Err(TpError::Config(
                "logits come from the whole model on one rank; gather the model first".into(),
            ));
        }
        let seq = tokens.dims()[1];
        let (x, _) = self.blocks_forward(None, &tokens, seq)?;
        Ok(head(
            self.norm.as_ref().expect("whole"),
            self.head_weight()?,
            x,
        ))
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

/// The final norm and the head `weight` `[hidden, vocab]`: logits `[batch, seq, vocab]` of
/// the last hidden states.
pub fn head<B: Backend>(norm: &RmsNorm<B>, weight: Tensor<B, 2>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    matmul(norm.forward(x), weight)
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

/// The matrix `name` (Hugging Face's name), shaped `shape`, as `Llama::init` draws it from
/// `seed`: normal with the config's `initializer_range`, from a generator of its own.
pub(crate) fn seeded_matrix(
    config: &LlamaConfig,
    seed: u64,
    name: &str,
    shape: [usize; 2],
) -> TensorData {
    let mut rng = StdRng::seed_from_u64(seed ^ fnv1a(name.as_bytes()));
    let dist = Normal::new(0.0f32, config.initializer_range as f32).unwrap();
    let values: Vec<f32> = (0..shape[0] * shape[1])
        .map(|_| dist.sample(&mut rng))
        .collect();
    TensorData::new(values, shape)
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
        let loss: f32 = model
            .loss(tokens.clone(), tokens.clone())
            .unwrap()
            .into_scalar();
        assert!((loss - (256f32).ln()).abs() < 0.1, "loss {loss}");
        let again = Llama::<Flex>::init(&config, 7, &device);
        let loss_again: f32 = again.loss(tokens.clone(), tokens).unwrap().into_scalar();
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
        // The same weights untied (each drawn from its name): the head a copy of the
        // embedding's transpose.
        let mut untied =
            Llama::<A>::init(&config.clone().with_tie_word_embeddings(false), 5, &device);
        let table = |m: &Llama<A>| m.embed_tokens.clone().unwrap();
        let copy = table(&tied).val().transpose().into_data();
        untied.lm_head = Some(Param::from_tensor(Tensor::from_data(copy, &device)));
        let tokens = Tensor::<A, 2, Int>::from_ints([[1, 2, 3, 4], [5, 6, 7, 8]], &device);
        let loss = |m: &Llama<A>| m.loss(tokens.clone(), tokens.clone().flip([1])).unwrap();
        let (tied_loss, untied_loss) = (loss(&tied), loss(&untied));
        assert_eq!(
            tied_loss.clone().into_data(),
            untied_loss.clone().into_data()
        );
        let tied_grads = tied_loss.backward();
        let untied_grads = untied_loss.backward();
        let grad = |p: &Param<Tensor<A, 2>>, grads| p.val().grad(grads).unwrap();
        let want = grad(&table(&untied), &untied_grads)
            + grad(untied.lm_head.as_ref().unwrap(), &untied_grads).transpose();
        let got = grad(&table(&tied), &tied_grads);
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
                .unwrap()
                .narrow(1, 0, 3)
                .into_data()
                .to_vec()
                .unwrap()
        };
        assert_eq!(prefix(a), prefix(b));
    }
}
