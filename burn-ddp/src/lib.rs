//! # burn-ddp
//!
//! Data parallelism for burn:
//! - [`DistributedDataParallel`]: every rank holds the model; gradients are averaged in buckets
//!   whose all-reduce starts while backward is still running; `backward_no_sync` accumulates
//!   micro-batches without communicating.
//! - [`GradientSync`]: the bucketed, overlapped gradient averaging itself, without the module,
//!   for loops that own their module (burn-train's `Learner`); it also averages gradients
//!   computed elsewhere.
//! - [`ExpertGroup`]: a mixture of experts' expert weights, held by some ranks of the group
//!   only, reduced over those (expert parallelism).
//! - [`DataParallel`]: the parameter-server baseline (rank 0 gathers, steps and broadcasts).
//! - [`DistributedSampler`]: a disjoint, per-epoch shuffled shard of the dataset per rank.
//! - [`LinearScaling`]: the learning rate for a k-times larger batch, with gradual warmup.

mod bucket;
mod clip;
mod data_parallel;
mod ddp;
mod error;
mod experts;
mod hooks;
mod lr;
pub mod params;
pub mod reducer;
mod replica;
mod sampler;
mod sync;

pub use clip::{clip_coefficient, clip_grad_norm};
pub use data_parallel::DataParallel;
pub use ddp::DistributedDataParallel;
pub use error::{DdpError, MissingGradient};
pub use experts::ExpertGroup;
pub use hooks::{BackwardHooks, DepthHook};
pub use lr::LinearScaling;
pub use sampler::{DistributedSampler, per_rank_batch};
pub use sync::{DdpConfig, DdpStepStats, GradientSync, SyncStep};
