//! The parallel planner: given a model, a cluster and a batch, every layout `llama train` can
//! run, with its memory per device and its predicted step time, best first.
//!
//! - [`cluster`]: devices and links (presets of GPU nodes);
//! - [`step_time`]: the cost model of one step, which the published runs validate
//!   (`tests/planner_validation.rs`);
//! - [`search`]: the layouts, sized by `llama plan`'s memory estimate and ranked.

pub mod calibrate;
pub mod cluster;
pub mod search;
pub mod step_time;

pub use calibrate::{Calibration, calibrate};
pub use cluster::{CLUSTER_PRESETS, Cluster, Link};
pub use search::{Candidate, Dtype, Found, Request, burn_parallel, search};
pub use step_time::{Engine, Recompute, Shape, StepLayout, StepTime, step_time};
