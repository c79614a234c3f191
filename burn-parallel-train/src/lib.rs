//! # burn-parallel-train
//!
//! burn-train's `SupervisedTraining` run data-parallel by adding this crate: each rank (a thread
//! under `burn_comm::launch`) builds its usual `SupervisedTraining` and `Learner`, reads its
//! share of the data through [`DistributedDataLoader`], and adds one line:
//!
//! ```ignore
//! SupervisedTraining::new(dir, train, valid)
//!     .num_epochs(3)
//!     .data_parallel(ctx.world().clone(), device)
//!     .launch(Learner::new(model, optim, lr))
//! ```
//!
//! - [`DataParallelStrategy`]: the learning strategy (burn-train's `SupervisedLearningStrategy`);
//! - [`backward`]: in a `TrainStep`, backward with the all-reduce overlapped;
//! - [`DataParallelTraining`]: `.data_parallel(..)` on `SupervisedTraining`;
//! - [`DistributedDataLoader`]: burn's `DataLoader` over burn-ddp's `DistributedSampler`;
//! - [`QuietRenderer`], [`QuietLogger`]: what the ranks other than the lead show and write.

mod agree;
mod backward;
mod loader;
mod quiet;
mod strategy;
mod training;

pub use backward::{backward, last_sync_stats};
pub use burn_ddp::{BackwardHooks, DdpConfig, DdpStepStats, per_rank_batch};
pub use loader::DistributedDataLoader;
pub use quiet::{QuietLogger, QuietRenderer};
pub use strategy::DataParallelStrategy;
pub use training::{DataParallelTraining, rank_directory};
