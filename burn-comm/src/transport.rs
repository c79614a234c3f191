//! The seam between the [`Communicator`](crate::Communicator), which owns the API, the argument
//! checks, the streams, the stats and the errors, and the transports that move the bytes.
//!
//! A transport is one group of ranks as seen by one process: the local transport (ranks are
//! threads, `local.rs`) and MPI (ranks are processes, `mpi.rs`) implement [`Transport`] on host
//! memory. NCCL (`nccl.rs`) moves device memory instead and is taken before the host path.

use std::any::Any;
use std::sync::Arc;

use burn::tensor::{DType, TensorData};

use crate::call::Call;
use crate::{CommError, ReduceOp};

/// Something a call is done with, freed later, off the caller's critical path.
pub(crate) type Retired = Box<dyn Any + Send>;

/// A stream's state, held by whoever runs its next call (the worker, or a blocking caller while
/// the stream is idle): calls are numbered in the order they run.
pub(crate) struct Stream {
    pub(crate) seq: u64,
    /// Buffers a call is done with, freed after its caller has the result.
    pub(crate) retired: Vec<Retired>,
}

impl Stream {
    pub fn new() -> Self {
        Self {
            seq: 0,
            retired: Vec::new(),
        }
    }

    /// The number of the call about to run.
    pub fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq - 1
    }

    /// Frees `data` later, off the caller's critical path (freeing a large buffer unmaps it).
    pub fn retire(&mut self, data: impl Send + 'static) {
        self.retired.push(Box::new(data));
    }
}

/// One group's data paths on host memory. `me` is the calling rank's index in the group; every
/// call that joins the group is given the `call` every rank must agree on, and a transport
/// reports ranks that disagree with [`CommError::Mismatch`] naming both calls. A call never
/// waits longer than the group's timeout for a peer that does not join.
pub(crate) trait Transport: Send + Sync {
    /// The group's name, as errors print it.
    fn name(&self) -> &str;

    /// Global ranks, in group-rank order.
    fn members(&self) -> &[usize];

    /// A communication job of global rank `rank` was queued (the thread launcher waits for a
    /// returning rank's jobs, so that peers do not see it leave mid-call).
    fn job_started(&self, _rank: usize) {}

    /// A job counted by [`Transport::job_started`] has ended.
    fn job_finished(&self, _rank: usize) {}

    /// Element-wise reduction in group-rank order; every rank gets the same bits.
    fn all_reduce(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: TensorData,
        op: ReduceOp,
    ) -> Result<TensorData, CommError>;

    /// Every rank's `data` concatenated along `dim` in rank order.
    fn all_gather(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: TensorData,
        dim: usize,
    ) -> Result<TensorData, CommError>;

    /// The reduction's part `me` of `size` equal parts along `dim` (the size divides).
    fn reduce_scatter(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: TensorData,
        op: ReduceOp,
        dim: usize,
    ) -> Result<TensorData, CommError>;

    /// Group rank `root`'s data, whose shape and dtype are the call's; only the root gives it.
    fn broadcast(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: Option<TensorData>,
        root: usize,
    ) -> Result<TensorData, CommError>;

    /// Part `r` of `data` along `split_dim` to rank `r`; the parts received concatenated along
    /// `concat_dim` in rank order.
    fn all_to_all(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: TensorData,
        split_dim: usize,
        concat_dim: usize,
    ) -> Result<TensorData, CommError>;

    /// Joins a call that moves no data: a barrier, or a call whose arguments were refused (so
    /// that every rank learns of it).
    fn join(&self, me: usize, stream: &mut Stream, call: Call) -> Result<(), CommError>;

    /// Queues `data` for group rank `to`; never waits for the receiver, and messages between
    /// two ranks arrive in the order they were sent.
    fn send(&self, me: usize, to: usize, data: TensorData) -> Result<(), CommError>;

    /// The next message from group rank `from`, which must be of `dtype` and `shape` (else
    /// [`mismatched_message`]); `op` names the receive in errors.
    fn recv(
        &self,
        me: usize,
        from: usize,
        op: &str,
        dtype: DType,
        shape: &[usize],
    ) -> Result<TensorData, CommError>;

    /// The group of the ranks that pass the same `color`, and `me`'s rank in it.
    fn split(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        name: String,
        color: usize,
    ) -> Result<(Arc<dyn Transport>, usize), CommError>;

    /// For the NCCL transport, which keeps its bookkeeping on a local group.
    #[cfg(feature = "cuda")]
    fn as_any(&self) -> &dyn Any;
}

/// How a point-to-point message is named in a mismatch: its dtype and shape.
pub(crate) fn describe_message(dtype: DType, shape: &[usize]) -> String {
    format!("{dtype:?} {shape:?}")
}

/// The error of group rank `me`'s receive `op` when rank `from` sent a message described as
/// `sent` (see [`describe_message`]) instead of the `expected` one, if it did.
pub(crate) fn mismatched_message(
    transport: &dyn Transport,
    me: usize,
    from: usize,
    op: &str,
    expected: &str,
    sent: &str,
) -> Result<(), CommError> {
    if expected == sent {
        return Ok(());
    }
    let members = transport.members();
    Err(CommError::Mismatch {
        group: transport.name().to_string(),
        rank: members[me],
        mine: op.to_string(),
        other_rank: members[from],
        theirs: format!("send of {sent}"),
    })
}
