//! The parallel planner: given a model, a cluster and a batch, the layouts `llama train` can
//! run (of the dimensions it searches), with their memory per device and predicted step time,
//! best first.
//!
//! - [`cluster`]: devices and links (presets of GPU nodes);
//! - [`calibrate`]: this machine measured, as a cluster of thread ranks;
//! - [`step_time`]: the cost model of one step, which the published runs validate
//!   (`tests/planner_validation.rs`);
//! - [`search`]: the layouts, sized by `llama plan`'s memory estimate and ranked;
//! - [`torch_memory`]: a PyTorch FSDP2 run's peak memory, a model of its own that published
//!   torchtitan runs check (burn's estimate is checked against this repository's runs).

pub mod calibrate;
pub mod cluster;
pub mod search;
pub mod step_time;
pub mod torch_memory;

pub use calibrate::{Calibration, calibrate};
pub use cluster::{CLUSTER_PRESETS, Cluster, Link};
pub use search::{Candidate, Dtype, Found, Request, burn_parallel, search};
pub use step_time::{Engine, Recompute, Shape, StepLayout, StepTime, step_time};
pub use torch_memory::{FsdpRun, TorchMemory, fsdp_peak_memory};
