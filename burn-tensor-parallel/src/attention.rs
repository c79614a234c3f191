//! Self-attention with its heads split over the group: each rank projects, attends and
//! projects back for `heads / tp` query heads. The query, key and value projections are
//! column-parallel and the output projection row-parallel, so the whole block costs one
//! entry (copy or sequence all-gather) and one exit (all-reduce or reduce-scatter).
//!
//! With grouped-query attention the key/value heads are split too when there are at least as
//! many as ranks; when there are fewer, each is held by the `tp / kv_heads` ranks whose query
//! heads use it, and their gradients are summed (two more all-reduces per layer in backward,
//! of the key and value weights, within each such subgroup).

use burn::module::Module;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_comm::parallel::CommBackend;

use crate::{ColumnParallelLinear, RowParallelLinear, TensorParallel, TpError};

/// Head-sharded attention. What happens between the projections (positions, mask, softmax) is
/// the caller's: [`forward`](Self::forward) hands it this rank's heads.
#[derive(Module, Debug)]
pub struct ParallelAttention<B: Backend> {
    /// Query projection, this rank's heads.
    pub q_proj: ColumnParallelLinear<B>,
    /// Key projection, this rank's key/value heads.
    pub k_proj: ColumnParallelLinear<B>,
    /// Value projection, this rank's key/value heads.
    pub v_proj: ColumnParallelLinear<B>,
    /// Output projection, this rank's rows.
    pub o_proj: RowParallelLinear<B>,
    /// Query heads on this rank.
    pub local_heads: usize,
    /// Key/value heads on this rank.
    pub local_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    #[module(skip)]
    tp: TensorParallel,
}

/// The full projections of an attention layer, `[in, out]` each.
#[derive(Debug, Clone)]
pub struct AttentionWeights<B: Backend> {
    /// `[hidden, heads * head_dim]`.
    pub q: Tensor<B, 2>,
    /// `[hidden, kv_heads * head_dim]`.
    pub k: Tensor<B, 2>,
    /// `[hidden, kv_heads * head_dim]`.
    pub v: Tensor<B, 2>,
    /// `[heads * head_dim, hidden]`.
    pub o: Tensor<B, 2>,
}

/// Checks that `heads` query heads and `kv_heads` key/value heads can be split over `tp` ranks.
pub fn check_heads(heads: usize, kv_heads: usize, tp: usize) -> Result<(), TpError> {
    if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(TpError::Config(format!(
            "{heads} query heads cannot share {kv_heads} key/value heads; the query heads must be a positive multiple of the key/value heads"
        )));
    }
    if !heads.is_multiple_of(tp) {
        return Err(TpError::Config(format!(
            "the {heads} attention heads do not divide by the tensor-parallel size {tp}; choose a tensor-parallel size that divides {heads}"
        )));
    }
    if !kv_heads.is_multiple_of(tp) && !tp.is_multiple_of(kv_heads) {
        return Err(TpError::Config(format!(
            "the {kv_heads} key/value heads can neither be split over nor shared by {tp} ranks; choose a tensor-parallel size that divides {kv_heads} or is a multiple of it"
        )));
    }
    Ok(())
}

impl<B: CommBackend> ParallelAttention<B> {
    /// This rank's heads of the full projections. A collective when key/value heads are shared
    /// (fewer than ranks): every rank of the group calls it.
    pub fn from_full(
        weights: AttentionWeights<B>,
        heads: usize,
        kv_heads: usize,
        tp: &TensorParallel,
    ) -> Result<Self, TpError> {
        check_heads(heads, kv_heads, tp.size())?;
        let head_dim = weights.q.dims()[1] / heads;
        let shapes = [&weights.q, &weights.k, &weights.v, &weights.o].map(|w| w.dims());
        let hidden = shapes[0][0];
        let expected = [
            [hidden, heads * head_dim],
            [hidden, kv_heads * head_dim],
            [hidden, kv_heads * head_dim],
            [heads * head_dim, hidden],
        ];
        if head_dim == 0 || shapes != expected {
            return Err(TpError::Config(format!(
                "attention weights shaped q {:?}, k {:?}, v {:?}, o {:?} do not fit {heads} query and {kv_heads} key/value heads; expected {expected:?} ([in, out] each)",
                shapes[0], shapes[1], shapes[2], shapes[3]
            )));
        }
        let size = tp.size();
        let kv = |w: Tensor<B, 2>| {
            if kv_heads >= size {
                ColumnParallelLinear::from_full(w, None, tp, false)
            } else {
                ColumnParallelLinear::from_full_replicated(w, None, tp, kv_heads)
            }
        };
        Ok(Self {
            q_proj: ColumnParallelLinear::from_full(weights.q, None, tp, false)?,
            k_proj: kv(weights.k)?,
            v_proj: kv(weights.v)?,
            o_proj: RowParallelLinear::from_full(weights.o, None, tp, true)?,
            local_heads: heads / size,
            local_kv_heads: (kv_heads / size).max(1),
            head_dim,
            tp: tp.clone(),
        })
    }

    /// `x`: `[batch, seq, hidden]` (under SP, this rank's part of the sequence) to the same
    /// shape. `attend(q, k, v)` gets this rank's heads, `q` `[batch, local_heads, seq,
    /// head_dim]` and `k`, `v` `[batch, local_kv_heads, seq, head_dim]` over the whole
    /// sequence, and returns the context `[batch, local_heads, seq, head_dim]`.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        attend: impl FnOnce(Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) -> Tensor<B, 4>,
    ) -> Result<Tensor<B, 3>, TpError> {
        let projections = [&self.q_proj, &self.k_proj, &self.v_proj];
        let [q, k, v] = ColumnParallelLinear::forward_many(projections, x)?;
        // The whole sequence: under SP, entering the region gathered it.
        let [batch, seq, _] = q.dims();
        let heads = |y: Tensor<B, 3>, count: usize| {
            y.reshape([batch, seq, count, self.head_dim])
                .swap_dims(1, 2)
        };
        let (q, k, v) = (
            heads(q, self.local_heads),
            heads(k, self.local_kv_heads),
            heads(v, self.local_kv_heads),
        );
        let context =
            attend(q, k, v)
                .swap_dims(1, 2)
                .reshape([batch, seq, self.local_heads * self.head_dim]);
        self.o_proj.forward(context)
    }

    /// The full projections, gathered from the group (a collective).
    pub fn full(&self) -> Result<AttentionWeights<B>, TpError> {
        Ok(AttentionWeights {
            q: self.q_proj.full()?.0,
            k: self.k_proj.full()?.0,
            v: self.v_proj.full()?.0,
            o: self.o_proj.full()?.0,
        })
    }
}
