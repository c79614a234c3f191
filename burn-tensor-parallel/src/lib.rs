//! # burn-tensor-parallel
//!
//! Megatron-LM's tensor parallelism for burn: the matrices of a Transformer layer are split
//! over a tensor-parallel group, so each rank holds and multiplies `1/tp` of them, with two
//! all-reduces per layer forward and two backward. With sequence parallelism the residual
//! stream, the norms and the dropouts are split along the sequence too, and each all-reduce
//! becomes an all-gather before a column-parallel linear and a reduce-scatter after a
//! row-parallel one: the same bytes, fewer activations per rank.
//!
//! Every layer is built from the full weight by slicing (so training starts exactly where one
//! device starts), gives the full weight back for export, and is generic over any
//! [`CommBackend`](burn_comm::parallel::CommBackend): on `Autodiff<_>` the communication is
//! differentiated, on a plain backend only the forward runs. The cross-entropy also needs
//! [`KernelBackend`] for its fused statistics; [`TpBackend`] names the two together.
//!
//! | file | what |
//! |---|---|
//! | [`group`] | the tensor-parallel group, entering and leaving a parallel region |
//! | [`linear`] | [`ColumnParallelLinear`], [`RowParallelLinear`] |
//! | [`embedding`] | [`VocabParallelEmbedding`] |
//! | [`cross_entropy`] | [`vocab_parallel_cross_entropy`] |
//! | [`attention`] | [`ParallelAttention`], heads split over the group |
//! | [`context`] | [`ContextParallel`]: the sequence split over a group, ring or all-gather attention |
//! | [`mlp`] | [`ParallelSwiGlu`] |

pub mod attention;
pub mod context;
pub mod cross_entropy;
pub mod embedding;
mod error;
pub mod group;
pub mod linear;
pub mod mlp;

pub use attention::ParallelAttention;
pub use context::{ContextParallel, CpAttention};
pub use cross_entropy::vocab_parallel_cross_entropy;
pub use embedding::{VocabParallelEmbedding, vocab_parallel_embedding};
pub use error::TpError;
pub use group::{SEQ_DIM, TensorParallel};
pub use linear::{ColumnParallelLinear, RowParallelLinear};
pub use mlp::ParallelSwiGlu;

use burn_comm::parallel::CommBackend;
use burn_kernels::KernelBackend;

/// A backend the whole of tensor parallelism runs on: the region operations of
/// [`CommBackend`] and the fused cross-entropy of [`KernelBackend`]. Every backend that has
/// both has it.
pub trait TpBackend: CommBackend + KernelBackend {}

impl<B: CommBackend + KernelBackend> TpBackend for B {}
