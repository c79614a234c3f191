//! cubecl kernels for the strategies, each with a plain-burn fallback: a kernel runs when a
//! backend's tensors live on a cubecl runtime this build has (feature `cuda`, or `wgpu` where
//! the kernels are tested without an NVIDIA GPU); every other backend takes the fallback.

pub mod adamw;
pub mod backend;
pub mod cross_entropy;
pub mod pack;

#[cfg(feature = "cubecl")]
mod cube;
#[cfg(feature = "cubecl")]
use cube::on_cube;

/// Without a cubecl runtime, every call takes its fallback.
#[cfg(not(feature = "cubecl"))]
macro_rules! on_cube {
    ($($anything:tt)*) => {};
}
#[cfg(not(feature = "cubecl"))]
use on_cube;

pub use adamw::{AdamWStep, FusedAdamW};
pub use backend::{CrossEntropyStats, KernelBackend};
pub use cross_entropy::{RowStats, row_stats, row_stats_backward};
pub use pack::pack;

use burn::tensor::backend::Backend;

/// Whether `B`'s float tensors live on a cubecl runtime this build has kernels for (else the
/// fallbacks run).
pub fn has_kernels<B: Backend>() -> bool {
    on_cube!(B, cube::holds());
    false
}
