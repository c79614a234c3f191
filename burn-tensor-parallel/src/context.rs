//! Context parallelism: the sequence itself split over a group, so attention's activations
//! (and its scores, which grow with the square of the length) are split too. Everything outside
//! attention works token by token and needs nothing; attention needs every earlier key, which
//! it gets in one of two ways ([`CpAttention`]):
//!
//! - the ring (Ring Attention; Megatron-Core's and torchtitan's `context_parallel`): keys and
//!   values pass from rank to rank while each block is computed, and backward passes them
//!   around again with their gradients ([`burn_comm::parallel::ring_attention`]);
//! - all-gather (Llama 3's choice for grouped-query attention, whose keys and values are
//!   small): every rank gathers all keys and values and attends its own queries to them;
//!   backward reduce-scatters their gradients.
//!
//! Load-balanced (as the Llama example runs it), the sequence is cut into `2 x cp` chunks, rank
//! `r` holding chunks `r` and `2cp - 1 - r`, so under a causal mask every rank attends to as
//! many keys; otherwise into `cp` chunks in rank order. Either way rotary positions must be the
//! tokens' true positions, which [`ContextParallel::positions`] gives.

use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Bool, DType, Tensor, TensorData};
use burn_comm::Communicator;
use burn_comm::parallel::{
    CommBackend, ContextLayout, RingAttention, gather_from_sequence_parallel_region, ring_attention,
};

use crate::TpError;

/// How attention reaches the keys and values of other ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpAttention {
    /// Keys and values travel around the ring, overlapped with the blocks being computed.
    #[default]
    Ring,
    /// Keys and values are all-gathered, then each rank attends its queries to all of them.
    AllGather,
}

/// A context-parallel group and how the sequence is laid out over it.
#[derive(Debug, Clone)]
pub struct ContextParallel {
    comm: Communicator,
    layout: ContextLayout,
    attention: CpAttention,
}

impl ContextParallel {
    /// The sequence split over `comm`, load-balanced for a causal mask or not, attention by
    /// the ring.
    pub fn new(comm: Communicator, load_balanced: bool) -> Self {
        let layout = ContextLayout::new(comm.size(), load_balanced);
        Self {
            comm,
            layout,
            attention: CpAttention::Ring,
        }
    }

    /// Attention by `attention`.
    pub fn with_attention(mut self, attention: CpAttention) -> Self {
        self.attention = attention;
        self
    }

    /// The group.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// How the sequence is cut.
    pub fn layout(&self) -> ContextLayout {
        self.layout
    }

    /// How attention reaches other ranks' keys.
    pub fn attention_method(&self) -> CpAttention {
        self.attention
    }

    /// Checks that a sequence of `seq` tokens can be split, and gives the tokens per rank.
    pub fn local_len(&self, seq: usize) -> Result<usize, TpError> {
        let chunk = self.layout.chunk_len(seq).map_err(TpError::Config)?;
        Ok(chunk * self.layout.chunks_per_rank())
    }

    /// The positions in a sequence of `seq` tokens of this rank's tokens, in its order.
    pub fn positions(&self, seq: usize) -> Result<Vec<usize>, TpError> {
        self.layout
            .positions(self.rank(), seq)
            .map_err(TpError::Config)
    }

    /// This rank's tokens of a whole sequence `x` along `dim` (no communication: every rank
    /// holds the whole, as a data loader does).
    pub fn shard<B: Backend, const D: usize, K: BasicOps<B>>(
        &self,
        x: Tensor<B, D, K>,
        dim: usize,
    ) -> Result<Tensor<B, D, K>, TpError> {
        let len = self
            .layout
            .chunk_len(x.dims()[dim])
            .map_err(TpError::Config)?;
        let parts = self
            .layout
            .chunks_of(self.rank())
            .into_iter()
            .map(|chunk| x.clone().narrow(dim, chunk * len, len))
            .collect();
        Ok(Tensor::cat(parts, dim))
    }

    /// Attention of this rank's queries `q` `[batch, heads, local, head_dim]` over the keys
    /// and values `k`, `v` `[batch, kv_heads, local, head_dim]` of the whole sequence (each
    /// key/value head shared by `heads / kv_heads` query heads), scaled by `1/sqrt(head_dim)`;
    /// rotary positions are the caller's, applied at [`positions`](Self::positions). The
    /// context comes back shaped like `q`. Every rank of the group calls it.
    pub fn attention<B: CommBackend>(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        causal: bool,
    ) -> Result<Tensor<B, 4>, TpError> {
        let scale = 1.0 / (q.dims()[3] as f64).sqrt();
        match self.attention {
            CpAttention::Ring => {
                let attention = RingAttention {
                    layout: self.layout,
                    causal,
                    scale,
                };
                Ok(ring_attention(q, k, v, &self.comm, attention)?)
            }
            CpAttention::AllGather => self.gathered_attention(q, k, v, causal, scale),
        }
    }

    fn gathered_attention<B: CommBackend>(
        &self,
        q: Tensor<B, 4>,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
        causal: bool,
        scale: f64,
    ) -> Result<Tensor<B, 4>, TpError> {
        let [_, heads, local, _] = q.dims();
        let kv_heads = k.dims()[1];
        self.layout
            .check_attention(&q.dims(), &k.dims(), &v.dims())
            .map_err(|reason| {
                TpError::Config(format!(
                    "context-parallel attention of queries {:?}, keys {:?}, values {:?}: {reason}",
                    q.dims(),
                    k.dims(),
                    v.dims()
                ))
            })?;
        let seq = local * self.size();
        // Each rank's tokens, in rank order: the order the gather puts them in.
        let positions = (0..self.size())
            .map(|rank| self.layout.positions(rank, seq))
            .collect::<Result<Vec<_>, _>>()
            .map_err(TpError::Config)?;
        let group = heads / kv_heads;
        let k = repeat_kv(
            gather_from_sequence_parallel_region(k, &self.comm, 2)?,
            group,
        );
        let v = repeat_kv(
            gather_from_sequence_parallel_region(v, &self.comm, 2)?,
            group,
        );
        let scores = q.matmul(k.swap_dims(2, 3)) * scale;
        let scores = if causal {
            let hidden = causal_mask(
                &positions[self.rank()],
                &positions.concat(),
                &scores.device(),
            );
            scores.mask_fill(hidden, f32::NEG_INFINITY)
        } else {
            scores
        };
        let dtype = scores.dtype();
        let probs = in_dtype(softmax(in_dtype(scores, DType::F32), 3), dtype);
        Ok(probs.matmul(v))
    }
}

/// Repeats each key/value head for the `group` query heads that share it.
pub fn repeat_kv<B: Backend>(x: Tensor<B, 4>, group: usize) -> Tensor<B, 4> {
    if group == 1 {
        return x;
    }
    let [batch, kv_heads, seq, head_dim] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .repeat_dim(2, group)
        .reshape([batch, kv_heads * group, seq, head_dim])
}

/// `[1, 1, queries, keys]` for queries and keys at these positions: true where a key comes
/// after the query, the scores a causal mask hides (filled with `-inf`, which on burn's CPU
/// backend costs a quarter of adding a mask).
pub fn causal_mask<B: Backend>(
    queries: &[usize],
    keys: &[usize],
    device: &B::Device,
) -> Tensor<B, 4, Bool> {
    let values = queries
        .iter()
        .flat_map(|&q| keys.iter().map(move |&k| k > q))
        .collect::<Vec<_>>();
    Tensor::from_data(
        TensorData::new(values, [1, 1, queries.len(), keys.len()]),
        device,
    )
}

fn in_dtype<B: Backend, const D: usize>(x: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    if x.dtype() == dtype { x } else { x.cast(dtype) }
}
