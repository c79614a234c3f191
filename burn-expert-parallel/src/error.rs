use burn_comm::CommError;

/// What a Mixture-of-Experts layer can fail with.
#[derive(Debug, thiserror::Error)]
pub enum MoeError {
    /// A configuration or input that cannot work; the message says what to change.
    #[error("{0}")]
    Config(String),
    /// Communication within the expert-parallel group failed.
    #[error(transparent)]
    Comm(#[from] CommError),
}
