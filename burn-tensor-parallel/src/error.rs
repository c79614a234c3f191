use burn_comm::CommError;

/// What tensor parallelism can fail with.
#[derive(Debug, thiserror::Error)]
pub enum TpError {
    /// A shape or layout that cannot be split as asked; the message says what to change.
    #[error("{0}")]
    Config(String),
    /// Communication within the tensor-parallel group failed.
    #[error(transparent)]
    Comm(#[from] CommError),
}
