//! The public handle of one rank in one group, and the collectives it offers.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, DType, Tensor, TensorCreationOptions};

use crate::call::{Call, Op, PointToPoint};
use crate::kernels;
use crate::stats::CommStats;
use crate::sync::{lock, panic_message};
use crate::transport::{
    Footprint, Memory, Payload, Retired, Stream, Transport, free, frees_inline,
};
use crate::{CommError, ReduceOp};

/// What the worker thread is asked to do.
enum Job {
    /// Run a call, after every call queued before it.
    Run(Box<dyn FnOnce(&mut Stream) + Send>),
    /// Free what a call that ran on its caller's thread is done with.
    Free(Vec<Retired>),
}

pub(crate) struct Inner {
    /// The transport that moves this group's data.
    pub(crate) transport: Arc<dyn Transport>,
    /// This rank's index in the group.
    pub(crate) rank: usize,
    jobs: Mutex<mpsc::Sender<Job>>,
    /// The stream's state; whoever runs a call (the worker, or a blocking caller while the
    /// stream is idle) holds it.
    stream: Arc<Mutex<Stream>>,
    /// Calls queued for the worker and not finished.
    queued: AtomicUsize,
    /// Calls and bytes issued through this handle and its clones.
    stats: Mutex<CommStats>,
}

/// One rank's handle on one group: the collectives of `torch.distributed` on burn tensors.
///
/// Cheap to clone; clones share one worker thread, the rank's communication "stream", so calls
/// run in the order they are issued and the `_async` forms overlap with computation. Every rank
/// of the group must issue the same collectives in the same order. Tensors of any burn backend
/// and kind (float, int) work; results come back on the device of the input.
#[derive(Clone)]
pub struct Communicator {
    pub(crate) inner: Arc<Inner>,
    /// Set on the handle that blocking calls use: they may run on the caller's thread.
    inline: bool,
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("group", &self.group_name())
            .field("rank", &self.rank())
            .field("size", &self.size())
            .finish()
    }
}

/// A communication in flight, or already done; [`Work::wait`] gives its result.
#[must_use = "a collective's result is only known after `wait`"]
pub struct Work<T> {
    state: WorkState<T>,
}

enum WorkState<T> {
    /// Ran on the caller's thread (a blocking call on an idle stream).
    Done(Result<T, CommError>),
    /// Queued for the stream's worker thread, which sends the result.
    Queued {
        result: mpsc::Receiver<Result<T, CommError>>,
        op: String,
        group: String,
        rank: usize,
    },
}

impl<T> Work<T> {
    /// Blocks until the communication has finished.
    pub fn wait(self) -> Result<T, CommError> {
        match self.state {
            WorkState::Done(result) => result,
            WorkState::Queued {
                result,
                op,
                group,
                rank,
            } => result.recv().unwrap_or_else(|_| {
                Err(CommError::PeerFailed {
                    rank,
                    group,
                    op,
                    reason: "lost its communication thread".to_string(),
                })
            }),
        }
    }
}

/// Runs `job` on `stream`; a panic in it becomes the error that names this rank and call.
fn guarded<T>(
    inner: &Inner,
    stream: &mut Stream,
    (op, rank): (&dyn fmt::Display, usize),
    job: impl FnOnce(&Inner, &mut Stream) -> Result<T, CommError>,
) -> Result<T, CommError> {
    catch_unwind(AssertUnwindSafe(|| job(inner, stream))).unwrap_or_else(|panic| {
        Err(CommError::PeerFailed {
            rank,
            group: inner.transport.name().to_string(),
            op: op.to_string(),
            reason: format!("panicked: {}", panic_message(panic.as_ref())),
        })
    })
}

impl Communicator {
    /// Rank `rank` of a group whose data `transport` moves.
    pub(crate) fn new(transport: Arc<dyn Transport>, rank: usize) -> Self {
        let (jobs, queue) = mpsc::channel::<Job>();
        let name = format!("comm-{}-{}", transport.name(), transport.members()[rank]);
        let stream = Arc::new(Mutex::new(Stream::new()));
        let worker_stream = stream.clone();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for job in queue {
                    let retired = match job {
                        Job::Run(call) => {
                            let mut stream = lock(&worker_stream);
                            call(&mut stream);
                            stream.take_retired().0
                        }
                        Job::Free(retired) => {
                            // Woken by a caller about to return its result: let it go first.
                            // Else, with no core free, unmapping 64 MiB here delayed its
                            // return by 2-5 ms (BENCHMARKS.md, the MPI transport).
                            std::thread::yield_now();
                            retired
                        }
                    };
                    free(retired);
                }
            })
            .expect("the OS refused to start a communication thread");
        Self {
            inner: Arc::new(Inner {
                transport,
                rank,
                jobs: Mutex::new(jobs),
                stream,
                queued: AtomicUsize::new(0),
                stats: Mutex::new(CommStats::default()),
            }),
            inline: false,
        }
    }

    /// This rank's index in the group, `0..size()`.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// The number of ranks in the group.
    pub fn size(&self) -> usize {
        self.inner.transport.members().len()
    }

    /// This rank's index in the launched world.
    pub fn global_rank(&self) -> usize {
        self.inner.transport.members()[self.inner.rank]
    }

    /// The global ranks of the group, in group-rank order.
    pub fn ranks(&self) -> &[usize] {
        self.inner.transport.members()
    }

    /// The group's name, as errors print it.
    pub fn group_name(&self) -> &str {
        self.inner.transport.name()
    }

    /// Calls and payload bytes issued on this group by this rank (all clones of this handle
    /// together), since it was made or last reset.
    pub fn stats(&self) -> CommStats {
        *lock(&self.inner.stats)
    }

    /// Starts counting [`Communicator::stats`] from zero.
    pub fn reset_stats(&self) {
        *lock(&self.inner.stats) = CommStats::default();
    }

    /// Whether NCCL moves this group's data (see [`Communicator::nccl`]); else a transport on
    /// host memory does (threads, MPI or TCP).
    pub fn is_nccl(&self) -> bool {
        self.inner.transport.memory() != Memory::Host
    }

    /// The same ranks on a host transport (threads, MPI or TCP), for what a host backend's tensors
    /// must do beside a group on NCCL (a checkpoint's agreement, say): this group itself when
    /// it is on one; for a group on NCCL, the group [`Communicator::nccl`] made it from. None
    /// for a group of [`Communicator::nccl_world`] or split from a group on NCCL.
    pub fn host(&self) -> Option<Communicator> {
        match self.inner.transport.memory() {
            Memory::Host => Some(self.clone()),
            #[cfg(feature = "cuda")]
            Memory::Cuda => self.inner.transport.host_twin(),
        }
    }

    /// The handle blocking calls use: their call may run on the caller's thread.
    fn blocking(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            inline: true,
        }
    }

    /// Runs `job` after every call issued before it: on the caller's thread when this is a
    /// blocking call and the stream is idle (two thread wake-ups fewer), else on the worker.
    /// `op` names the call in errors. A call run here writes it out only for an error, since
    /// formatting costs a small call's time; a queued one writes it out at once (its `Work`
    /// names it if the worker is lost).
    fn submit<T: Send + 'static>(
        &self,
        op: impl fmt::Display + Send + 'static,
        job: impl FnOnce(&Inner, &mut Stream) -> Result<T, CommError> + Send + 'static,
    ) -> Work<T> {
        let rank = self.global_rank();
        let transport = &self.inner.transport;
        let jobs = || lock(&self.inner.jobs);
        if self.inline {
            let mut stream = lock(&self.inner.stream);
            if self.inner.queued.load(Ordering::SeqCst) == 0 {
                transport.job_started(rank);
                let result = guarded(&self.inner, &mut stream, (&op, rank), job);
                let (retired, largest) = stream.take_retired();
                drop(stream);
                transport.job_finished(rank);
                if retired.is_empty() || frees_inline(largest) {
                    free(retired);
                } else {
                    // Freeing it may unmap memory: the worker does it, off this thread.
                    let _ = jobs().send(Job::Free(retired));
                }
                return Work {
                    state: WorkState::Done(result),
                };
            }
        }
        let (done, result) = mpsc::sync_channel(1);
        let work = Work {
            state: WorkState::Queued {
                result,
                op: op.to_string(),
                group: self.group_name().to_string(),
                rank,
            },
        };
        let inner = self.inner.clone();
        let call = Box::new(move |stream: &mut Stream| {
            let result = guarded(&inner, stream, (&op, rank), job);
            inner.queued.fetch_sub(1, Ordering::SeqCst);
            inner.transport.job_finished(rank);
            // Let go of the group before the caller learns the result: a process that then
            // ends (and finalises MPI) must not find a group still held here.
            drop(inner);
            let _ = done.send(result);
        });
        // Counted before it is queued: a blocking caller that then finds the count at 0 under
        // the stream's lock knows no earlier call is waiting to run.
        self.inner.queued.fetch_add(1, Ordering::SeqCst);
        transport.job_started(rank);
        // The worker catches every panic and lives as long as any handle, so this should not
        // fail; if it does, `wait` reports the lost thread and the job must not count as queued
        // or pending.
        if jobs().send(Job::Run(call)).is_err() {
            self.inner.queued.fetch_sub(1, Ordering::SeqCst);
            transport.job_finished(rank);
        }
        work
    }

    /// Submits a collective on `tensor`: every rank joins it even when `checked` refused its
    /// arguments (see [`refuse`]), and a single-rank group returns `tensor` as it is. `body`
    /// gives the transport the tensor (see [`Inner::payload`]) and returns what it gave back.
    fn collective<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        call: Call,
        checked: Result<(), CommError>,
        tensor: Tensor<B, D, K>,
        body: impl FnOnce(&Inner, &mut Stream, Call, Tensor<B, D, K>) -> Result<Payload, CommError>
        + Send
        + 'static,
    ) -> Work<Tensor<B, D, K>> {
        if checked.is_ok() {
            let bytes = call.shape.iter().product::<usize>() * call.dtype.map_or(0, |d| d.size());
            lock(&self.inner.stats).record(call.op, bytes as u64);
        }
        self.submit(call.clone(), move |inner, stream| {
            if let Err(error) = checked {
                return refuse(inner, stream, call, error);
            }
            if inner.transport.members().len() == 1 {
                return Ok(tensor);
            }
            let (device, dtype) = (tensor.device(), tensor.dtype());
            let out = body(inner, stream, call, tensor)?;
            Ok(tensor_of(out, &device, dtype))
        })
    }

    fn invalid(&self, op: impl fmt::Display, reason: String) -> CommError {
        CommError::InvalidArgument {
            op: op.to_string(),
            group: self.group_name().to_string(),
            reason,
        }
    }

    /// Quantized tensors carry scales beside their values; they are not moved as plain data.
    fn check_plain(&self, op: impl fmt::Display, dtype: DType) -> Result<(), CommError> {
        if let DType::QFloat(_) = dtype {
            return Err(self.invalid(
                op,
                "quantized tensors cannot be communicated; dequantize them first".to_string(),
            ));
        }
        Ok(())
    }

    fn check_dim<const D: usize>(&self, op: Op, dim: usize) -> Result<(), CommError> {
        if dim >= D {
            return Err(self.invalid(op, format!("dim {dim} is out of range for a {D}-d tensor")));
        }
        Ok(())
    }

    fn check_divisible(&self, op: Op, shape: &[usize], dim: usize) -> Result<(), CommError> {
        let size = self.size();
        if !shape[dim].is_multiple_of(size) {
            let padded = shape[dim].div_ceil(size) * size;
            return Err(self.invalid(
                op,
                format!(
                    "size {} along dim {dim} does not divide by the group size {size}; pad it to {padded}",
                    shape[dim]
                ),
            ));
        }
        Ok(())
    }

    fn check_reducible(&self, op: Op, dtype: DType, reduce: ReduceOp) -> Result<(), CommError> {
        kernels::check_reducible(dtype, reduce).map_err(|reason| self.invalid(op, reason))
    }

    /// Combines `tensor` element-wise across the group; every rank gets the same result,
    /// bit for bit.
    pub fn all_reduce<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        op: ReduceOp,
    ) -> Result<Tensor<B, D, K>, CommError> {
        self.blocking().all_reduce_async(tensor, op).wait()
    }

    /// [`Communicator::all_reduce`] without waiting.
    pub fn all_reduce_async<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        reduce: ReduceOp,
    ) -> Work<Tensor<B, D, K>> {
        let op = Op::AllReduce(reduce);
        let call = Call::new(op, tensor.dtype(), &tensor.dims());
        let checked = self.check_reducible(op, tensor.dtype(), reduce);
        self.collective(call, checked, tensor, move |inner, stream, call, tensor| {
            let data = inner.payload(&call, tensor)?;
            inner
                .transport
                .all_reduce(inner.rank, stream, call, data, reduce)
        })
    }

    /// Concatenates every rank's `tensor` along `dim`, in rank order. All ranks must bring the
    /// same shape.
    pub fn all_gather<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        dim: usize,
    ) -> Result<Tensor<B, D, K>, CommError> {
        self.blocking().all_gather_async(tensor, dim).wait()
    }

    /// [`Communicator::all_gather`] without waiting.
    pub fn all_gather_async<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        dim: usize,
    ) -> Work<Tensor<B, D, K>> {
        let op = Op::AllGather { dim };
        let call = Call::new(op, tensor.dtype(), &tensor.dims());
        let checked = self
            .check_plain(op, tensor.dtype())
            .and_then(|_| self.check_dim::<D>(op, dim));
        self.collective(call, checked, tensor, move |inner, stream, call, tensor| {
            let data = inner.payload(&call, tensor)?;
            inner
                .transport
                .all_gather(inner.rank, stream, call, data, dim)
        })
    }

    /// Reduces `tensor` across the group and gives rank `r` the `r`-th of `size()` equal parts
    /// along `dim`.
    pub fn reduce_scatter<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        op: ReduceOp,
        dim: usize,
    ) -> Result<Tensor<B, D, K>, CommError> {
        self.blocking().reduce_scatter_async(tensor, op, dim).wait()
    }

    /// [`Communicator::reduce_scatter`] without waiting.
    pub fn reduce_scatter_async<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        reduce: ReduceOp,
        dim: usize,
    ) -> Work<Tensor<B, D, K>> {
        let op = Op::ReduceScatter { op: reduce, dim };
        let dims = tensor.dims();
        let call = Call::new(op, tensor.dtype(), &dims);
        let checked = self
            .check_dim::<D>(op, dim)
            .and_then(|_| self.check_divisible(op, &dims, dim))
            .and_then(|_| self.check_reducible(op, tensor.dtype(), reduce));
        self.collective(call, checked, tensor, move |inner, stream, call, tensor| {
            let data = inner.payload(&call, tensor)?;
            inner
                .transport
                .reduce_scatter(inner.rank, stream, call, data, reduce, dim)
        })
    }

    /// Gives every rank the `tensor` of group rank `root`. Every rank passes a tensor of the
    /// same shape and dtype; the values of the non-root ones are ignored.
    pub fn broadcast<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        root: usize,
    ) -> Result<Tensor<B, D, K>, CommError> {
        self.blocking().broadcast_async(tensor, root).wait()
    }

    /// [`Communicator::broadcast`] without waiting.
    pub fn broadcast_async<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        root: usize,
    ) -> Work<Tensor<B, D, K>> {
        let op = Op::Broadcast { root };
        let call = Call::new(op, tensor.dtype(), &tensor.dims());
        let checked = self
            .check_plain(op, tensor.dtype())
            .and_then(|_| self.check_rank(op, root));
        self.collective(call, checked, tensor, move |inner, stream, call, tensor| {
            let data = if inner.rank == root || inner.transport.memory() != Memory::Host {
                Some(inner.payload(&call, tensor)?)
            } else {
                // Only its shape mattered: no copy to the host.
                stream.retire(tensor);
                None
            };
            inner
                .transport
                .broadcast(inner.rank, stream, call, data, root)
        })
    }

    /// Splits `tensor` into `size()` equal parts along `split_dim`, sends part `r` to rank `r`,
    /// and concatenates the parts received along `concat_dim`, in rank order.
    pub fn all_to_all<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        split_dim: usize,
        concat_dim: usize,
    ) -> Result<Tensor<B, D, K>, CommError> {
        self.blocking()
            .all_to_all_async(tensor, split_dim, concat_dim)
            .wait()
    }

    /// [`Communicator::all_to_all`] without waiting.
    pub fn all_to_all_async<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        split_dim: usize,
        concat_dim: usize,
    ) -> Work<Tensor<B, D, K>> {
        let op = Op::AllToAll {
            split_dim,
            concat_dim,
        };
        let dims = tensor.dims();
        let call = Call::new(op, tensor.dtype(), &dims);
        let checked = self
            .check_plain(op, tensor.dtype())
            .and_then(|_| self.check_dim::<D>(op, split_dim))
            .and_then(|_| self.check_dim::<D>(op, concat_dim))
            .and_then(|_| self.check_divisible(op, &dims, split_dim));
        self.collective(call, checked, tensor, move |inner, stream, call, tensor| {
            let data = inner.payload(&call, tensor)?;
            inner
                .transport
                .all_to_all(inner.rank, stream, call, data, split_dim, concat_dim)
        })
    }

    /// Waits until every rank of the group has reached the barrier.
    pub fn barrier(&self) -> Result<(), CommError> {
        self.blocking().barrier_async().wait()
    }

    /// [`Communicator::barrier`] without waiting.
    pub fn barrier_async(&self) -> Work<()> {
        let call = Call::bare(Op::Barrier);
        self.submit(call.clone(), move |inner, stream| {
            inner.transport.join(inner.rank, stream, call)
        })
    }

    /// Sends `tensor` to group rank `dst`. The message is buffered, so this never waits for
    /// the receiver; messages between two ranks arrive in the order they were sent.
    ///
    /// On NCCL the send returns once the tensor is complete on the device and queued for the
    /// pair's sending thread, which delivers it in the background: a delivery that failed (not
    /// received within the timeout) is reported by a later send to the same rank, if any.
    /// Where ranks are processes, dropping the communicator waits for the deliveries queued.
    pub fn send<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        dst: usize,
    ) -> Result<(), CommError> {
        self.blocking().send_async(tensor, dst).wait()
    }

    /// [`Communicator::send`] on the communication stream, without waiting.
    pub fn send_async<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        tensor: Tensor<B, D, K>,
        dst: usize,
    ) -> Work<()> {
        let op = PointToPoint::Send { to: dst };
        let checked = self
            .check_plain(&op, tensor.dtype())
            .and_then(|_| self.check_peer(&op, dst));
        if checked.is_ok() {
            let bytes = tensor.shape().num_elements() * tensor.dtype().size();
            lock(&self.inner.stats).record_send(bytes as u64);
        }
        self.submit(op.clone(), move |inner, _| {
            checked?;
            let data = inner.payload(&op, tensor)?;
            inner.transport.send(inner.rank, dst, data)
        })
    }

    /// Receives the next tensor that group rank `src` sent to this rank. `shape` and the dtype
    /// (from `options`, as in `Tensor::from_data`) must match what was sent.
    pub fn recv<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        src: usize,
        shape: [usize; D],
        options: impl Into<TensorCreationOptions<B>>,
    ) -> Result<Tensor<B, D, K>, CommError> {
        self.blocking().recv_async(src, shape, options).wait()
    }

    /// [`Communicator::recv`] without waiting.
    pub fn recv_async<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        src: usize,
        shape: [usize; D],
        options: impl Into<TensorCreationOptions<B>>,
    ) -> Work<Tensor<B, D, K>> {
        let options = options.into();
        // An empty tensor made as the received one will be: burn picks its dtype, from the
        // device's defaults when `options` names none.
        let like = Tensor::<B, D, K>::empty([0; D], options.clone());
        let dtype = like.dtype();
        let op = PointToPoint::Recv {
            from: src,
            dtype,
            shape: shape.to_vec(),
        };
        let checked = self.check_peer(&op, src);
        self.submit(op.clone(), move |inner, _| {
            checked?;
            let like = inner.payload(&op, like)?;
            let data = inner.transport.recv(inner.rank, src, &op, like, &shape)?;
            Ok(tensor_of(data, &options.device, dtype))
        })
    }

    /// Splits the group: ranks that pass the same `color` form a new group, ordered as in this
    /// one. Every rank of this group must call it, like any collective.
    pub fn split(&self, name: &str, color: usize) -> Result<Communicator, CommError> {
        let call = Call::bare(Op::Split);
        let name = name.to_string();
        self.submit(call.clone(), move |inner, stream| {
            let (transport, rank) = inner
                .transport
                .split(inner.rank, stream, call, name, color)?;
            Ok(Communicator::new(transport, rank))
        })
        .wait()
    }

    fn check_rank(&self, op: Op, root: usize) -> Result<(), CommError> {
        if root >= self.size() {
            return Err(self.invalid(
                op,
                format!("rank {root} is not in this group of {} ranks", self.size()),
            ));
        }
        Ok(())
    }

    fn check_peer(&self, op: &PointToPoint, peer: usize) -> Result<(), CommError> {
        if peer >= self.size() || peer == self.rank() {
            return Err(self.invalid(
                op,
                format!(
                    "the peer must be another rank of this group of {}, got {peer} on rank {}",
                    self.size(),
                    self.rank()
                ),
            ));
        }
        Ok(())
    }
}

impl<B: Backend, const D: usize, K: BasicOps<B>> Footprint for Tensor<B, D, K> {
    fn footprint(&self) -> usize {
        self.shape().num_elements() * self.dtype().size()
    }
}

/// Joins a call whose arguments this rank refused, so that every rank learns of it: ranks that
/// made the same call refused it too (the checks depend only on the call), and ranks that made
/// another call get a `Mismatch` naming both.
fn refuse<T>(
    inner: &Inner,
    stream: &mut Stream,
    call: Call,
    error: CommError,
) -> Result<T, CommError> {
    inner.transport.join(inner.rank, stream, call)?;
    Err(error)
}

impl Inner {
    /// `tensor` in the memory this group's transport moves; `op` names the call in the error
    /// of a tensor the transport cannot move (only a device transport refuses one).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn payload<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
        &self,
        op: &impl fmt::Display,
        tensor: Tensor<B, D, K>,
    ) -> Result<Payload, CommError> {
        match self.transport.memory() {
            Memory::Host => Ok(Payload::Host(tensor.into_data())),
            #[cfg(feature = "cuda")]
            Memory::Cuda => crate::nccl_tensor::to_cube(tensor)
                .map(Payload::from)
                .map_err(|reason| CommError::Transport {
                    op: op.to_string(),
                    group: self.transport.name().to_string(),
                    rank: self.transport.members()[self.rank],
                    reason,
                }),
        }
    }
}

/// The tensor of `B` and kind `K` a transport gave back, on `device` (host data is made a
/// tensor of `dtype`).
fn tensor_of<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
    payload: Payload,
    device: &B::Device,
    dtype: DType,
) -> Tensor<B, D, K> {
    match payload {
        Payload::Host(data) => Tensor::from_data(data, (device, dtype)),
        #[cfg(feature = "cuda")]
        Payload::Cuda(cube) => crate::nccl_tensor::from_cube(*cube),
    }
}
