//! The seam between the [`Communicator`](crate::Communicator), which owns the API, the argument
//! checks, the streams, the stats and the errors, and the transports that move the bytes.
//!
//! A transport is one group of ranks as seen by one process: the local transport (ranks are
//! threads, `local.rs`), MPI and TCP (ranks are processes, `mpi.rs`, `tcp.rs`) move tensors'
//! data through host memory; NCCL (`nccl.rs`) moves CUDA tensors in device memory. The communicator hands each a
//! [`Payload`] in the memory it names, and makes the tensor of the result.

use std::any::Any;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use burn::tensor::{DType, TensorData};

use crate::call::Call;
use crate::world::World;
use crate::{CommError, ReduceOp};

/// Where a transport takes its data from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Memory {
    /// A tensor's data on the host, of any burn backend.
    Host,
    /// The device memory of a tensor of burn's CUDA backend.
    #[cfg(feature = "cuda")]
    Cuda,
}

/// A tensor as a transport moves it, in the [`Memory`] the transport names.
pub(crate) enum Payload {
    Host(TensorData),
    #[cfg(feature = "cuda")]
    Cuda(Box<CudaTensor>),
}

#[cfg(feature = "cuda")]
type CudaTensor = burn_cubecl::tensor::CubeTensor<burn_cubecl::cubecl::cuda::CudaRuntime>;

impl Payload {
    pub fn dtype(&self) -> DType {
        match self {
            Payload::Host(data) => data.dtype,
            #[cfg(feature = "cuda")]
            Payload::Cuda(tensor) => tensor.dtype,
        }
    }

    /// The data given to a transport on host memory.
    pub fn into_host(self) -> TensorData {
        match self {
            Payload::Host(data) => data,
            #[cfg(feature = "cuda")]
            Payload::Cuda(_) => unreachable!("a host transport is given host data"),
        }
    }
}

impl From<TensorData> for Payload {
    fn from(data: TensorData) -> Self {
        Payload::Host(data)
    }
}

#[cfg(feature = "cuda")]
impl From<CudaTensor> for Payload {
    fn from(tensor: CudaTensor) -> Self {
        Payload::Cuda(Box::new(tensor))
    }
}

/// Something a call is done with, freed after its caller has the result (see
/// [`Stream::retire`]).
pub(crate) type Retired = Box<dyn Any + Send>;

/// Frees what calls are done with. A backend's drop may panic too; the stream must outlive it.
pub(crate) fn free(value: impl Send) {
    let _ = catch_unwind(AssertUnwindSafe(move || drop(value)));
}

/// Whether a blocking call frees the buffers it retired itself, the largest of `largest` bytes;
/// else the stream's worker frees them, off the caller's thread. Waking the worker cost about
/// 5 µs a call at 2 MPI processes on 2 cores, far more with processes sharing cores, and a
/// third of a 1 MiB all-to-all (BENCHMARKS.md, the MPI transport); unmapping memory can cost
/// more than that, so the worker does it. Below glibc's default mmap threshold (requests from
/// 128 KiB less 23 bytes are mapped) a free unmaps nothing. Above it, glibc raises the
/// threshold to the size of each mapped block freed, up to 32 MiB, so once a buffer this large
/// has been freed, the next ones come from its heap: the first of each size still goes to the
/// worker. Where the threshold cannot rise (another C library, or one set by the user), the
/// default is the limit.
pub(crate) fn frees_inline(largest: usize) -> bool {
    /// The largest buffer below the largest threshold freed, or handed to be freed, so far.
    static FREED: AtomicUsize = AtomicUsize::new(0);
    let freed = match largest < BELOW_LARGEST_THRESHOLD {
        true => FREED.fetch_max(largest, Ordering::Relaxed),
        false => FREED.load(Ordering::Relaxed),
    };
    heap_frees(largest, freed, threshold_rises())
}

/// glibc's default mmap threshold and the largest it rises to, less a margin for malloc's own
/// header and rounding.
const BELOW_DEFAULT_THRESHOLD: usize = 128 * 1024 - 64;
const BELOW_LARGEST_THRESHOLD: usize = 32 * 1024 * 1024 - 64;

/// Whether freeing a buffer of `largest` bytes gives memory back to malloc's heap without
/// unmapping it, once buffers up to `freed` bytes were freed (see [`frees_inline`]).
fn heap_frees(largest: usize, freed: usize, threshold_rises: bool) -> bool {
    largest < BELOW_DEFAULT_THRESHOLD
        || (threshold_rises && largest < BELOW_LARGEST_THRESHOLD && largest <= freed)
}

/// Whether malloc's mmap threshold rises as mapped blocks are freed: glibc's does, unless it was
/// set (`MALLOC_MMAP_THRESHOLD_`, or the `glibc.malloc.mmap_threshold` tunable).
fn threshold_rises() -> bool {
    static RISES: OnceLock<bool> = OnceLock::new();
    *RISES.get_or_init(|| {
        let set = std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some()
            || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("mmap_threshold"));
        cfg!(all(target_os = "linux", target_env = "gnu")) && !set
    })
}

/// A process's group's first failure. After it the ranks' calls are out of step, so each later
/// call fails at once, naming it (the local transport, whose ranks share one state, keeps its
/// own). A flag spares every call the lock.
#[derive(Default)]
pub(crate) struct FirstFailure {
    cause: std::sync::Mutex<Option<String>>,
    failed: AtomicBool,
}

impl FirstFailure {
    /// `GroupBroken`, naming the first failure, once there was one.
    pub fn check(&self, group: &str) -> Result<(), CommError> {
        if !self.failed.load(Ordering::Acquire) {
            return Ok(());
        }
        match &*crate::sync::lock(&self.cause) {
            Some(cause) => Err(CommError::GroupBroken {
                group: group.to_string(),
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Keeps `error` if it is the first, and gives it back.
    pub fn record(&self, error: CommError) -> CommError {
        crate::sync::lock(&self.cause).get_or_insert_with(|| error.to_string());
        self.failed.store(true, Ordering::Release);
        error
    }
}

/// The bytes a retired buffer holds.
pub(crate) trait Footprint {
    fn footprint(&self) -> usize;
}

impl Footprint for TensorData {
    fn footprint(&self) -> usize {
        self.bytes.len()
    }
}

/// A stream's state, held by whoever runs its next call (the worker, or a blocking caller while
/// the stream is idle): calls are numbered in the order they run.
pub(crate) struct Stream {
    pub(crate) seq: u64,
    /// Buffers a call is done with, freed after its caller has the result.
    retired: Vec<Retired>,
    /// The bytes of the largest of them.
    largest_retired: usize,
}

impl Stream {
    pub fn new() -> Self {
        Self {
            seq: 0,
            retired: Vec::new(),
            largest_retired: 0,
        }
    }

    /// The buffers retired since last asked, and the bytes of the largest.
    pub fn take_retired(&mut self) -> (Vec<Retired>, usize) {
        let bytes = std::mem::take(&mut self.largest_retired);
        (std::mem::take(&mut self.retired), bytes)
    }

    /// The number of the call about to run.
    pub fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq - 1
    }

    /// Frees `data` once the call's caller has its result: off the caller's thread when the
    /// call's retired buffers are large (freeing a large buffer unmaps it). One below malloc's
    /// default mmap threshold goes at once, which costs less than keeping it (a small call's
    /// time goes to its allocations).
    pub fn retire(&mut self, data: impl Footprint + Send + 'static) {
        let bytes = data.footprint();
        if bytes < BELOW_DEFAULT_THRESHOLD {
            free(data);
            return;
        }
        self.largest_retired = self.largest_retired.max(bytes);
        self.retired.push(Box::new(data));
    }
}

/// One group's data paths. `me` is the calling rank's index in the group; every call that
/// joins the group is given the `call` every rank must agree on, and a transport reports ranks
/// that disagree with [`CommError::Mismatch`] naming both calls (NCCL cannot, and documents
/// what it does instead). A call never waits longer than the group's timeout for a peer that
/// does not join. Payloads come in the transport's [`Transport::memory`], and go back in it.
pub(crate) trait Transport: Send + Sync {
    /// The group's name, as errors print it.
    fn name(&self) -> &str;

    /// Global ranks, in group-rank order.
    fn members(&self) -> &[usize];

    /// Where the data it moves lives.
    fn memory(&self) -> Memory {
        Memory::Host
    }

    /// What the ranks of the launch share, for transports that keep it in this process: thread
    /// ranks, TCP and NCCL (the timeout, and NCCL's pair ids). MPI keeps nothing of the kind.
    fn world(&self) -> Option<&Arc<World>> {
        None
    }

    /// For a transport on device memory, the same ranks on a host transport, when the group was
    /// made from one (what must go through host memory, such as a checkpoint's agreement, goes
    /// there).
    #[cfg(feature = "cuda")]
    fn host_twin(&self) -> Option<crate::Communicator> {
        None
    }

    /// A communication job of global rank `rank` was queued (the thread launcher waits for a
    /// returning rank's jobs, so that peers do not see it leave mid-call).
    fn job_started(&self, rank: usize) {
        if let Some(world) = self.world() {
            world.job_started(rank);
        }
    }

    /// A job counted by [`Transport::job_started`] has ended.
    fn job_finished(&self, rank: usize) {
        if let Some(world) = self.world() {
            world.job_finished(rank);
        }
    }

    /// Element-wise reduction in group-rank order; every rank gets the same bits.
    fn all_reduce(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: Payload,
        op: ReduceOp,
    ) -> Result<Payload, CommError>;

    /// Every rank's `data` concatenated along `dim` in rank order.
    fn all_gather(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: Payload,
        dim: usize,
    ) -> Result<Payload, CommError>;

    /// The reduction's part `me` of `size` equal parts along `dim` (the size divides).
    fn reduce_scatter(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: Payload,
        op: ReduceOp,
        dim: usize,
    ) -> Result<Payload, CommError>;

    /// Group rank `root`'s data, whose shape and dtype are the call's. A transport on the host
    /// is given the root's data only; one on a device, every rank's tensor (to hold the result).
    fn broadcast(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: Option<Payload>,
        root: usize,
    ) -> Result<Payload, CommError>;

    /// Part `r` of `data` along `split_dim` to rank `r`; the parts received concatenated along
    /// `concat_dim` in rank order.
    fn all_to_all(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: Payload,
        split_dim: usize,
        concat_dim: usize,
    ) -> Result<Payload, CommError>;

    /// Joins a call that moves no data: a barrier, or a call whose arguments were refused (so
    /// that every rank learns of it).
    fn join(&self, me: usize, stream: &mut Stream, call: Call) -> Result<(), CommError>;

    /// Queues `data` for group rank `to`; never waits for the receiver, and messages between
    /// two ranks arrive in the order they were sent.
    fn send(&self, me: usize, to: usize, data: Payload) -> Result<(), CommError>;

    /// The next message from group rank `from`, which must be of `shape` and of the dtype of
    /// `like` (else [`message_mismatch`]); `op` names the receive in errors. `like` is an empty
    /// tensor of the kind to receive, in the transport's memory: a device transport receives
    /// onto its device.
    fn recv(
        &self,
        me: usize,
        from: usize,
        op: &dyn fmt::Display,
        like: Payload,
        shape: &[usize],
    ) -> Result<Payload, CommError>;

    /// The group of the ranks that pass the same `color`, and `me`'s rank in it.
    fn split(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        name: String,
        color: usize,
    ) -> Result<(Arc<dyn Transport>, usize), CommError>;
}

/// A digest of a point-to-point message's dtype and shape, alike in every process of one
/// build, which receivers compare before anything is written out.
pub(crate) fn message_digest(dtype: DType, shape: &[usize]) -> u64 {
    crate::call::digest_of(&(dtype, shape))
}

/// How a point-to-point message is named in a mismatch: its dtype and shape.
pub(crate) fn describe_message(dtype: DType, shape: &[usize]) -> String {
    format!("{dtype:?} {shape:?}")
}

/// The error of group rank `me`'s receive `op` when rank `from` sent a message described as
/// `sent` (see [`describe_message`]) instead of the one `op` expects.
pub(crate) fn message_mismatch(
    transport: &dyn Transport,
    me: usize,
    from: usize,
    op: &dyn fmt::Display,
    sent: &str,
) -> CommError {
    let members = transport.members();
    CommError::Mismatch {
        group: transport.name().to_string(),
        rank: members[me],
        mine: op.to_string(),
        other_rank: members[from],
        theirs: format!("send of {sent}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_buffers_malloc_keeps_in_its_heap_are_freed_inline() {
        let (kib, mib) = (1024, 1024 * 1024);
        // Below glibc's default threshold, always.
        assert!(heap_frees(100 * kib, 0, false));
        // Above it, only once one as large was freed, and only where the threshold rises.
        assert!(!heap_frees(mib, 0, true));
        assert!(!heap_frees(mib, mib - 1, true));
        assert!(heap_frees(mib, mib, true));
        assert!(heap_frees(mib, 16 * mib, true));
        assert!(!heap_frees(mib, 16 * mib, false));
        // From 32 MiB, never: glibc always maps those.
        assert!(!heap_frees(32 * mib, 64 * mib, true));
    }
}
