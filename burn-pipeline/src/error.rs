use burn_comm::CommError;

/// What pipeline parallelism can fail with.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// A layout that cannot work; the message says what to change.
    #[error("{0}")]
    Config(String),
    /// A schedule that is incomplete or would deadlock; the message names the first violation.
    #[error("invalid pipeline schedule: {0}")]
    Schedule(String),
    /// Sending or receiving between stages failed.
    #[error(transparent)]
    Comm(#[from] CommError),
}
