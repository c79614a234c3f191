//! The Llama decoder with Megatron tensor parallelism (and optionally sequence parallelism),
//! built from burn-tensor-parallel's layers: the same blocks as [`Llama`], each matrix split
//! over the tensor-parallel group. It is made from a full [`Llama`] by slicing and gives one
//! back, so it starts and ends exactly where one device would.

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use burn_comm::parallel::CommBackend;
use burn_tensor_parallel::attention::{AttentionWeights, check_heads};
use burn_tensor_parallel::group::divisors;
use burn_tensor_parallel::{
    ColumnParallelLinear, ParallelAttention, ParallelSwiGlu, TensorParallel, TpBackend, TpError,
    VocabParallelEmbedding, vocab_parallel_cross_entropy,
};

use crate::config::LlamaConfig;
use crate::model::{Attention, Block, Llama, Mlp, Positions, RmsNorm, attend};

/// One block with its attention heads and MLP features split over the group.
#[derive(Module, Debug)]
pub struct TpBlock<B: Backend> {
    /// Norm before attention (every rank holds it whole).
    pub input_layernorm: RmsNorm<B>,
    /// Head-sharded attention.
    pub self_attn: ParallelAttention<B>,
    /// Norm before the MLP (every rank holds it whole).
    pub post_attention_layernorm: RmsNorm<B>,
    /// SwiGLU with its intermediate features split.
    pub mlp: ParallelSwiGlu<B>,
    #[module(skip)]
    tp: TensorParallel,
}

impl<B: CommBackend> TpBlock<B> {
    /// This rank's part of `block`, whose shape is `config`.
    pub fn from_full(
        block: Block<B>,
        config: &LlamaConfig,
        tp: &TensorParallel,
    ) -> Result<Self, TpError> {
        let attention = block.self_attn;
        let weights = AttentionWeights {
            q: attention.q_proj.val(),
            k: attention.k_proj.val(),
            v: attention.v_proj.val(),
            o: attention.o_proj.val(),
        };
        let (heads, kv_heads) = (config.num_attention_heads, config.num_key_value_heads);
        let mlp = block.mlp;
        Ok(Self {
            input_layernorm: block.input_layernorm,
            self_attn: ParallelAttention::from_full(weights, heads, kv_heads, tp)?,
            post_attention_layernorm: block.post_attention_layernorm,
            mlp: ParallelSwiGlu::from_full(
                mlp.gate_proj.val(),
                mlp.up_proj.val(),
                mlp.down_proj.val(),
                tp,
            )?,
            tp: tp.clone(),
        })
    }

    /// The whole block, gathered from the group (a collective).
    pub fn full(&self, config: &LlamaConfig) -> Result<Block<B>, TpError> {
        let attention = self.self_attn.full()?;
        let [gate, up, down] = self.mlp.full()?;
        Ok(Block {
            input_layernorm: self.input_layernorm.clone(),
            self_attn: Attention {
                q_proj: Param::from_tensor(attention.q),
                k_proj: Param::from_tensor(attention.k),
                v_proj: Param::from_tensor(attention.v),
                o_proj: Param::from_tensor(attention.o),
                heads: config.num_attention_heads,
                kv_heads: config.num_key_value_heads,
                rope: config.rope(),
            },
            post_attention_layernorm: self.post_attention_layernorm.clone(),
            mlp: Mlp {
                gate_proj: Param::from_tensor(gate),
                up_proj: Param::from_tensor(up),
                down_proj: Param::from_tensor(down),
            },
        })
    }

    /// Residual attention, then residual MLP; under SP `x` is this rank's part of the sequence.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        positions: &Positions<B>,
    ) -> Result<Tensor<B, 3>, TpError> {
        let normed = norm(&self.input_layernorm, x.clone(), &self.tp)?;
        let attended = self
            .self_attn
            .forward(normed, |q, k, v| attend(q, k, v, positions))?;
        let x = x + attended;
        let normed = norm(&self.post_attention_layernorm, x.clone(), &self.tp)?;
        Ok(x + self.mlp.forward(normed)?)
    }
}

/// A norm whose weight every rank holds; under SP its gradient is summed over the group.
fn norm<B: CommBackend>(
    norm: &RmsNorm<B>,
    x: Tensor<B, 3>,
    tp: &TensorParallel,
) -> Result<Tensor<B, 3>, TpError> {
    Ok(norm.forward_scaled(x, tp.replicated(norm.weight.val())?))
}

/// The head split by vocabulary: a column-parallel linear of its own, or tied to the
/// vocab-parallel embedding, whose rows (this rank's tokens) are the head's columns.
pub enum TpHead<'a, B: Backend> {
    /// Untied.
    Own(&'a ColumnParallelLinear<B>),
    /// Tied: the embedding's rows, transposed.
    Tied(&'a VocabParallelEmbedding<B>),
}

impl<'a, B: Backend> TpHead<'a, B> {
    /// The head of a part of the model holding `lm_head` and `embedding`: its own, or, when
    /// the model is tied, the embedding, which must then be on the same part.
    pub fn of(
        lm_head: Option<&'a ColumnParallelLinear<B>>,
        embedding: Option<&'a VocabParallelEmbedding<B>>,
    ) -> Result<Self, TpError> {
        match (lm_head, embedding) {
            (Some(lm_head), _) => Ok(Self::Own(lm_head)),
            (None, Some(embedding)) => Ok(Self::Tied(embedding)),
            (None, None) => Err(TpError::Config(crate::train::TIED_NOT_SPLIT.into())),
        }
    }
}

/// Mean next-token cross-entropy of `targets` (`[batch, seq]`) from the last block's output
/// `x`: the final norm, the vocab-parallel head, and the vocab-parallel cross-entropy, so the
/// logits are never gathered. The same on every rank of the group.
pub fn head_loss<B: TpBackend>(
    final_norm: &RmsNorm<B>,
    head: TpHead<'_, B>,
    x: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
    tp: &TensorParallel,
) -> Result<Tensor<B, 1>, TpError> {
    let [batch, seq] = targets.dims();
    let x = norm(final_norm, x, tp)?;
    let logits = match head {
        TpHead::Own(lm_head) => lm_head.forward(x)?,
        TpHead::Tied(embedding) => tp.enter_matmul(x, embedding.weight.val().transpose())?,
    };
    let vocab_part = logits.dims()[2];
    let losses = vocab_parallel_cross_entropy(
        logits.reshape([batch * seq, vocab_part]),
        targets.reshape([batch * seq]),
        tp,
    )?;
    Ok(losses.mean())
}

/// The Llama decoder split over a tensor-parallel group.
#[derive(Module, Debug)]
pub struct TpLlama<B: Backend> {
    /// The embedding, split by vocabulary.
    pub embed_tokens: VocabParallelEmbedding<B>,
    /// The blocks.
    pub layers: Vec<TpBlock<B>>,
    /// The final norm (every rank holds it whole).
    pub norm: RmsNorm<B>,
    /// The head, split by vocabulary: its logits go to the vocab-parallel cross-entropy
    /// without ever being gathered. None when tied to the embedding.
    pub lm_head: Option<ColumnParallelLinear<B>>,
    #[module(skip)]
    config: LlamaConfig,
    #[module(skip)]
    tp: TensorParallel,
}

/// Checks that `config` can be split over `tp` ranks (and, with `sequence_parallel`, sequences
/// of `seq_len` tokens too), with a sentence saying what to change.
pub fn check_split(
    config: &LlamaConfig,
    tp: usize,
    sequence_parallel: bool,
    seq_len: usize,
) -> Result<(), String> {
    // The hidden size is heads x head width, so it divides whenever the heads do.
    let must_divide = [
        ("num_attention_heads", config.num_attention_heads),
        ("intermediate_size", config.intermediate_size),
        ("vocab_size", config.vocab_size),
    ];
    for (name, value) in must_divide {
        if !value.is_multiple_of(tp) {
            return Err(format!(
                "--tp {tp} does not divide {name} {value}; choose --tp among {}",
                divisors(value)
            ));
        }
    }
    check_heads(config.num_attention_heads, config.num_key_value_heads, tp)
        .map_err(|e| format!("--tp {tp}: {e}"))?;
    if sequence_parallel && !seq_len.is_multiple_of(tp) {
        return Err(format!(
            "--sp splits each sequence over the {tp} tensor-parallel ranks, but --seq-len {seq_len} does not divide by {tp}; choose a --seq-len that is a multiple of {tp}"
        ));
    }
    Ok(())
}

impl<B: TpBackend> TpLlama<B> {
    /// This rank's part of `model`, whose shape is `config`. A collective over `tp`.
    pub fn from_full(
        model: Llama<B>,
        config: &LlamaConfig,
        tp: &TensorParallel,
    ) -> Result<Self, TpError> {
        check_split(config, tp.size(), false, 0).map_err(TpError::Config)?;
        let layers = model
            .layers
            .into_iter()
            .map(|block| TpBlock::from_full(block, config, tp))
            .collect::<Result<_, TpError>>()?;
        Ok(Self {
            embed_tokens: VocabParallelEmbedding::from_full(model.embed_tokens.val(), tp)?,
            layers,
            norm: model.norm,
            lm_head: model
                .lm_head
                .map(|head| ColumnParallelLinear::from_full(head.val(), None, tp, false))
                .transpose()?,
            config: config.clone(),
            tp: tp.clone(),
        })
    }

    /// Mean next-token cross-entropy (nats) of `targets` given `inputs`, both `[batch, seq]`,
    /// the same on every rank of the group.
    pub fn loss(
        &self,
        inputs: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
    ) -> Result<Tensor<B, 1>, TpError> {
        let seq = targets.dims()[1];
        let mut x = self.embed_tokens.forward(inputs)?;
        let positions = Positions::new(
            seq,
            self.config.head_dim(),
            &self.config.rope(),
            (&x.device(), x.dtype()),
        );
        for layer in &self.layers {
            x = layer.forward(x, &positions)?;
        }
        let head = TpHead::of(self.lm_head.as_ref(), Some(&self.embed_tokens))?;
        head_loss(&self.norm, head, x, targets, &self.tp)
    }

    /// The whole model, gathered from the group (a collective).
    pub fn full(&self) -> Result<Llama<B>, TpError> {
        let layers = self
            .layers
            .iter()
            .map(|block| block.full(&self.config))
            .collect::<Result<_, TpError>>()?;
        Ok(Llama {
            embed_tokens: Param::from_tensor(self.embed_tokens.full()?),
            layers,
            norm: self.norm.clone(),
            lm_head: self
                .lm_head
                .as_ref()
                .map(|head| head.full().map(|(weight, _)| Param::from_tensor(weight)))
                .transpose()?,
        })
    }
}
