//! What a ZeRO engine can fail with.

use burn_comm::CommError;
use burn_ddp::MissingGradient;
use burn_pipeline::PipelineError;

/// The one error of burn-zero.
#[derive(Debug, thiserror::Error)]
pub enum ZeroError {
    /// A configuration or call that cannot work.
    #[error("{0}")]
    Config(String),
    /// Communication failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Trainable parameters that got no gradient: ZeRO steps every element of its shard, so an
    /// unused parameter would still be decayed.
    #[error(
        "no gradient for {}; use every trainable parameter in the loss or freeze it (ZeRO steps every parameter of its shard)",
        MissingGradient::describe_all(.0)
    )]
    MissingGradients(Vec<MissingGradient>),
    /// A unit's forward (ZeRO-3) failed in the pipeline-stage contract.
    #[error(transparent)]
    Stage(#[from] PipelineError),
}
