//! # burn-zero
//!
//! ZeRO (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion
//! Parameter Models") for burn: the model state of data parallelism sharded over the group.
//! - [`FlatLayout`]: parameters packed into flat buffers ("units") of one dtype, each padded
//!   to split into one equal part per rank, with views back to every parameter.
//! - [`ShardedDataParallel`]: stages 1 (optimizer state) and 2 (and gradients, reduce-scattered
//!   during backward).
//! - [`FullyShardedDataParallel`]: stage 3 (and parameters): each unit is gathered just before
//!   its forward and its backward, and let go after.
//! - [`estimate`]: the paper's bytes per rank for every stage; every engine reports what it
//!   holds ([`ModelStateBytes`]).

mod error;
mod flat;
mod fully_sharded;
mod memory;
mod optimizer;
mod reducer;
mod sharded;

pub use error::ZeroError;
pub use flat::{FlatLayout, FlatUnit};
pub use fully_sharded::FullyShardedDataParallel;
pub use memory::{ModelStateBytes, Precision, ZeroStage, estimate};
pub use optimizer::ShardedAdamW;
pub use sharded::{ShardedDataParallel, ZeroConfig, ZeroStepStats};
