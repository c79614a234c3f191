//! # burn-zero
//!
//! ZeRO (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion
//! Parameter Models") for burn: the model state of data parallelism sharded over the group.
//! - [`FlatLayout`]: parameters packed into flat buffers ("units") of one dtype, each padded
//!   to split into one equal part per rank, with views back to every parameter.
//! - [`ShardedDataParallel`]: stages 1 (optimizer state) and 2 (and gradients, reduce-scattered
//!   during backward).
//! - [`ZeroAdamW`]: stage 1 as a burn `Optimizer` (PyTorch's `ZeroRedundancyOptimizer`), for
//!   loops that average gradients themselves, such as burn-train's under burn-parallel-train.
//! - [`FullyShardedDataParallel`]: stage 3 (and parameters): each unit is gathered just before
//!   its forward and its backward, and let go after.
//! - [`MixedPrecision`]: bf16 or f16 parameters and gradients, fp32 master weights in each
//!   rank's shard, dynamic loss scaling for f16 ([`StepOutcome`] says when a step is skipped).
//! - [`ZeroConfig::max_grad_norm`]: clipping by the global norm of the whole gradient, from
//!   each rank's part of it.
//! - [`estimate`]: the paper's bytes per rank for every stage; every engine reports what it
//!   holds ([`ModelStateBytes`]).

mod clip;
mod error;
mod flat;
mod fully_sharded;
mod memory;
mod optimizer;
mod precision;
mod redundancy;
mod sharded;
mod state;

pub use error::ZeroError;
pub use flat::{FlatLayout, FlatUnit};
pub use fully_sharded::FullyShardedDataParallel;
pub use memory::{ModelStateBytes, Precision, ZeroStage, estimate};
pub use optimizer::ShardedAdamW;
pub use precision::{LossScaleConfig, MixedPrecision, StepOutcome};
pub use redundancy::{ZeroAdamW, ZeroAdamWRecord, gradient_sharding_steps};
pub use sharded::{ShardedDataParallel, ZeroConfig, ZeroStepStats};
pub use state::{LossScaleState, ParamRange, ShardState, StateTensor};
