//! Why a checkpoint could not be saved or read.

use std::path::PathBuf;

use burn_comm::CommError;

/// Every variant names the file or tensor concerned, so the message alone says what to look at.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file is not what the manifest says: truncated, corrupt, or not a checkpoint's.
    #[error("{}: {reason}; the checkpoint is damaged, so nothing was loaded from it", path.display())]
    Corrupt { path: PathBuf, reason: String },
    /// What was asked of the checkpoint, or handed to it, does not fit it.
    #[error("{0}")]
    Mismatch(String),
    /// A save in the background failed.
    #[error("the checkpoint after step {step}: {source}")]
    Background {
        step: u64,
        source: Box<CheckpointError>,
    },
    /// The ranks could not agree through their communicator.
    #[error(transparent)]
    Comm(#[from] CommError),
}

impl CheckpointError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }
}
