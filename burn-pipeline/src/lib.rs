//! # burn-pipeline
//!
//! Pipeline parallelism for burn. A schedule is data: for every rank, the ordered forwards,
//! backwards, sends and receives of one training step. Pure builders make GPipe, 1F1B,
//! interleaved 1F1B and zero-bubble ZB-H1; [`Schedule::validate`] proves a schedule complete
//! and deadlock-free, [`simulate`] times it and gives its bubble, and [`Timeline::to_svg`] draws
//! it, all before any model runs. [`balance`] cuts layers into stages of even cost, and
//! [`PipelineExecutor`] replays one rank's actions on real model chunks over burn-comm, with
//! optional activation recompute.
//!
//! ```
//! use burn_pipeline::{Costs, ScheduleKind, Schedule, simulate};
//!
//! let schedule = Schedule::new(ScheduleKind::OneFOneB, 4, 8, 1).unwrap();
//! let timeline = simulate(&schedule, &Costs::UNIT).unwrap();
//! // (p - 1) / (m + p - 1) = 3 / 11.
//! assert!((timeline.bubble() - 3.0 / 11.0).abs() < 1e-12);
//! ```

mod error;
pub mod executor;
mod gather;
pub mod gradients;
pub mod schedule;
pub mod simulate;
pub mod split;
mod svg;

pub use error::PipelineError;
pub use executor::{Message, PipelineExecutor, PipelineStage, StageOutput, StepOutput, StepRun};
pub use gradients::{Accumulate, GradientSink};
pub use schedule::{
    Action, Kind, Schedule, ScheduleKind, gpipe, interleaved_1f1b, one_f_one_b, zero_bubble_h1,
};
pub use simulate::{Costs, Span, Timeline, simulate};
pub use split::balance;
