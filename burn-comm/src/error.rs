//! The one error type of every communication call.

use std::time::Duration;

/// Why a communication call failed. Every variant names the operation and the group, so a
/// message read from one rank's log is enough to find the cause.
///
/// Ranks are always *global* ranks (their index in the launched world).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    /// A peer panicked, returned an error, or returned without joining this call.
    #[error("{op} on group '{group}' failed because rank {rank} {reason}")]
    PeerFailed {
        /// The peer that failed.
        rank: usize,
        /// The group of the interrupted call.
        group: String,
        /// The interrupted call.
        op: String,
        /// What happened to the peer.
        reason: String,
    },

    /// Some peers did not join the call in time.
    #[error(
        "{op} on group '{group}' timed out after {after:?} on rank {rank}: ranks {missing:?} never joined"
    )]
    Timeout {
        /// The call that timed out.
        op: String,
        /// Its group.
        group: String,
        /// The rank reporting the timeout.
        rank: usize,
        /// Ranks that never joined.
        missing: Vec<usize>,
        /// The timeout in force.
        after: Duration,
    },

    /// Peers called different operations, or the same one with different shapes or dtypes.
    #[error(
        "mismatched calls on group '{group}': rank {rank} called {mine} but rank {other_rank} called {theirs}"
    )]
    Mismatch {
        /// The group.
        group: String,
        /// One rank of the mismatch.
        rank: usize,
        /// Its call.
        mine: String,
        /// The other rank.
        other_rank: usize,
        /// Its call.
        theirs: String,
    },

    /// The arguments of a call cannot work (a dimension out of range, a size that does not
    /// divide by the group size, an unknown root, ...).
    #[error("{op} on group '{group}': {reason}")]
    InvalidArgument {
        /// The call.
        op: String,
        /// Its group.
        group: String,
        /// What to change.
        reason: String,
    },

    /// The device or its communication library failed the call (an NCCL error, a CUDA error,
    /// or a call that outlived the timeout and aborted the NCCL communicator).
    #[error("{op} on group '{group}' failed on rank {rank}: {reason}")]
    Transport {
        /// The call.
        op: String,
        /// Its group.
        group: String,
        /// The rank reporting it.
        rank: usize,
        /// What failed, and what to do about it.
        reason: String,
    },

    /// A wrong configuration, rejected when it is built (a mesh whose sizes do not multiply to
    /// the world size, an unknown mesh dimension, ...).
    #[error("{0}")]
    Config(String),

    /// An earlier call on this group failed; the group cannot be used any more, as an NCCL
    /// communicator is aborted after an error.
    #[error("group '{group}' is unusable after an earlier failure: {cause}")]
    GroupBroken {
        /// The group.
        group: String,
        /// The first failure on the group.
        cause: String,
    },
}
