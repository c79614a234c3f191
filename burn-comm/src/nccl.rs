//! The NCCL transport (feature `cuda`): the collectives run in the device memory of burn's CUDA
//! tensors, so gradients and shards never leave the GPU.
//!
//! Ordering against burn's own work: before a call, the calling thread's cubecl stream is made
//! to wait for the input's writer and is synchronised, so the input is complete; NCCL then runs
//! on this communicator's own CUDA stream, and the result is handed back once that stream is
//! done. A blocking call therefore costs one host synchronisation; the `_async` forms run on
//! the communicator's thread, which is what lets them overlap the caller's computation.
//!
//! A call that does not finish within the group's timeout (a peer died, or called another
//! collective) aborts the NCCL communicator, as torch's watchdog does: the call and every
//! later one on the group fail instead of hanging.

use std::ffi::{CStr, c_void};
use std::fmt;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::backend::cuda::CudaDevice;
use burn::tensor::{DType, Int, Shape, Tensor, TensorMetadata};
use burn_cubecl::cubecl::Runtime;
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::cubecl::future::block_on;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::permute;
use burn_cubecl::tensor::CubeTensor;
use cudarc::driver::result as cu;
use cudarc::driver::sys::{CUcontext, CUdevice, CUresult, CUstream, cuStreamQuery};
use cudarc::nccl::sys::{self, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t};

use crate::call::{Call, Op, PointToPoint};
use crate::device_layout::{concat_blocks, result_shape, swap};
use crate::nccl_p2p::Peers;
use crate::nccl_tensor::{Cuda, from_cube, to_cube};
use crate::store::Store;
use crate::sync::lock;
use crate::transport::{Memory, Payload, Stream, Transport};
use crate::world::World;
use crate::{CommError, Communicator, ProcessEnv, ReduceOp};

impl Communicator {
    /// This group on NCCL: a new handle on the same ranks, whose collectives run in the device
    /// memory of burn's CUDA tensors (`Cuda`, with or without fusion and `Autodiff`) on
    /// `device`, instead of through host memory. Like a collective, every rank of the group
    /// calls it, each with the GPU it drives; two ranks may share one GPU when
    /// `NCCL_MULTI_RANK_GPU_ENABLE=1` is set.
    ///
    /// [`Communicator::split`] and the device mesh work on the new handle as on this one, and
    /// so do `send` and `recv` (see the `nccl_p2p` module for how they stay buffered).
    pub fn nccl(&self, device: &CudaDevice) -> Result<Communicator, CommError> {
        if self.is_nccl() {
            return Ok(self.clone());
        }
        let failed = |reason: String| CommError::Transport {
            op: "nccl".to_string(),
            group: self.group_name().to_string(),
            rank: self.global_rank(),
            reason,
        };
        // Thread ranks share their launch's bookkeeping, and TCP processes its store (for the
        // pairs' ids); MPI processes have none.
        let Some(world) = self.inner.transport.world().cloned() else {
            return Err(failed(
                "this group's ranks are MPI processes; start a job of processes on GPUs with burn-launch (torchrun's variables), whose world over TCP goes on NCCL with this call".to_string(),
            ));
        };
        // NCCL's start-up waits for every rank, so all agree first that they can start it: each
        // posts a readiness flag, rank 0 also its id, and everyone sees everyone's.
        let mine = check_device(device).and_then(|()| match self.rank() {
            0 => unique_id(),
            _ => Ok([0; 128]),
        });
        let mut message = vec![i64::from(mine.is_ok())];
        message.extend(mine.as_ref().map_or([0; 128], |id| *id).map(i64::from));
        let message = Tensor::<burn::backend::Flex, 1, Int>::from_data(
            burn::tensor::TensorData::new(message, [129]),
            &Default::default(),
        );
        let all = self.all_gather(message, 0)?.into_data().convert::<i64>();
        let all = all.as_slice::<i64>().expect("converted to i64");
        let unready: Vec<usize> = (0..self.size()).filter(|r| all[r * 129] == 0).collect();
        if let Err(reason) = mine {
            return Err(failed(reason));
        }
        if !unready.is_empty() {
            return Err(failed(format!(
                "group ranks {unready:?} could not start NCCL (their errors say why)"
            )));
        }
        let id = std::array::from_fn(|i| all[i + 1] as u8);
        let nccl =
            Nccl::init(device, id, self.rank(), self.size(), world.timeout()).map_err(failed)?;
        let group = NcclGroup {
            name: self.group_name().to_string(),
            members: self.ranks().to_vec(),
            world,
            nccl,
            host: Some(self.clone()),
        };
        Ok(Communicator::new(Arc::new(group), self.rank()))
    }

    /// The world of a multi-process job on NCCL, one process per rank as `burn-launch` (or
    /// torchrun) starts them: rank 0 makes NCCL's id and hands it out through the job's
    /// `store` (see [`ProcessEnv::rendezvous`]). Every process calls it once, with the GPU it
    /// drives (usually `CudaDevice::new(env.local_rank)`). Calls time out after the store's
    /// timeout. `send`/`recv` hand their pairs' ids over in the store, so it must be served
    /// (the `Rendezvous` kept) until the job's last send.
    pub fn nccl_world(
        env: &ProcessEnv,
        store: &mut Store,
        device: &CudaDevice,
    ) -> Result<Communicator, CommError> {
        const KEY: &str = "burn-comm/nccl-id/world";
        let failed = |reason: String| CommError::Transport {
            op: "nccl_world".to_string(),
            group: "world".to_string(),
            rank: env.rank,
            reason,
        };
        let store_failed = |e: crate::StoreError| failed(e.to_string());
        // As in `nccl`: every rank says whether it can start NCCL before any waits in it.
        let ready = check_device(device);
        let flag: &[u8] = if ready.is_ok() { b"ok" } else { b"failed" };
        store
            .set(&format!("{KEY}/ready/{}", env.rank), flag)
            .map_err(store_failed)?;
        ready.map_err(failed)?;
        for rank in 0..env.world_size {
            let flag = store
                .get(&format!("{KEY}/ready/{rank}"))
                .map_err(store_failed)?;
            if flag != b"ok" {
                return Err(failed(format!(
                    "rank {rank} could not start NCCL (its error says why)"
                )));
            }
        }
        let id = if env.rank == 0 {
            match unique_id() {
                Ok(id) => {
                    store.set(KEY, &id).map_err(store_failed)?;
                    id
                }
                Err(reason) => {
                    // Anything but 128 bytes tells the others that rank 0 failed.
                    store.set(KEY, b"failed").map_err(store_failed)?;
                    return Err(failed(reason));
                }
            }
        } else {
            let value = store.get(KEY).map_err(store_failed)?;
            <[u8; 128]>::try_from(value.as_slice()).map_err(|_| {
                failed("rank 0 could not start NCCL (its error says why)".to_string())
            })?
        };
        let timeout = store.timeout();
        let nccl = Nccl::init(device, id, env.rank, env.world_size, timeout).map_err(failed)?;
        // Point-to-point pairs hand their ids over in the store, so it must outlive the job.
        let group = NcclGroup {
            name: "world".to_string(),
            members: (0..env.world_size).collect(),
            world: World::of_processes(env.world_size, timeout, store.addr()),
            nccl,
            host: None,
        };
        Ok(Communicator::new(Arc::new(group), env.rank))
    }
}

/// One group on NCCL, as one rank sees it: its collectives, sends and receives run in the
/// device memory of burn's CUDA tensors.
pub(crate) struct NcclGroup {
    name: String,
    /// Global ranks, in group-rank order.
    members: Vec<usize>,
    /// The launch's bookkeeping: thread ranks' jobs, and where send/recv pairs hand ids over.
    pub(crate) world: Arc<World>,
    pub(crate) nccl: Nccl,
    /// The group on a host transport it was made from, if it was (see
    /// [`Communicator::host`]).
    host: Option<Communicator>,
}

impl NcclGroup {
    /// The error of group rank `me`'s call `op` that failed on NCCL.
    pub(crate) fn error(&self, me: usize, op: &impl fmt::Display, failure: Failure) -> CommError {
        match failure {
            Failure::Now(reason) => CommError::Transport {
                op: op.to_string(),
                group: self.name.clone(),
                rank: self.members[me],
                reason,
            },
            Failure::Earlier(cause) => CommError::GroupBroken {
                group: self.name.clone(),
                cause,
            },
        }
    }

    /// Runs `call` on `data`, as group rank `me`.
    fn collective(&self, me: usize, call: &Call, data: Payload) -> Result<Payload, CommError> {
        self.nccl
            .collective(call.op, self.members.len(), cuda_tensor(data))
            .map(Payload::from)
            .map_err(|failure| self.error(me, call, failure))
    }
}

/// The CUDA tensor the communicator gives a transport on [`Memory::Cuda`].
pub(crate) fn cuda_tensor(data: Payload) -> CubeTensor<CudaRuntime> {
    match data {
        Payload::Cuda(cube) => *cube,
        Payload::Host(_) => unreachable!("NCCL is given CUDA tensors"),
    }
}

impl Transport for NcclGroup {
    fn name(&self) -> &str {
        &self.name
    }

    fn members(&self) -> &[usize] {
        &self.members
    }

    fn memory(&self) -> Memory {
        Memory::Cuda
    }

    fn world(&self) -> Option<&Arc<World>> {
        Some(&self.world)
    }

    fn host_twin(&self) -> Option<Communicator> {
        self.host.clone()
    }

    fn all_reduce(
        &self,
        me: usize,
        _: &mut Stream,
        call: Call,
        data: Payload,
        _: ReduceOp,
    ) -> Result<Payload, CommError> {
        self.collective(me, &call, data)
    }

    fn all_gather(
        &self,
        me: usize,
        _: &mut Stream,
        call: Call,
        data: Payload,
        _: usize,
    ) -> Result<Payload, CommError> {
        self.collective(me, &call, data)
    }

    fn reduce_scatter(
        &self,
        me: usize,
        _: &mut Stream,
        call: Call,
        data: Payload,
        _: ReduceOp,
        _: usize,
    ) -> Result<Payload, CommError> {
        self.collective(me, &call, data)
    }

    fn broadcast(
        &self,
        me: usize,
        _: &mut Stream,
        call: Call,
        data: Option<Payload>,
        _: usize,
    ) -> Result<Payload, CommError> {
        let data = data.expect("a device transport is given every rank's tensor");
        self.collective(me, &call, data)
    }

    fn all_to_all(
        &self,
        me: usize,
        _: &mut Stream,
        call: Call,
        data: Payload,
        _: usize,
        _: usize,
    ) -> Result<Payload, CommError> {
        self.collective(me, &call, data)
    }

    /// A barrier. NCCL has no way to post a bare call, so a call whose arguments were refused
    /// joins nothing: every rank that made the same call refuses it alike.
    fn join(&self, me: usize, _: &mut Stream, call: Call) -> Result<(), CommError> {
        match call.op {
            Op::Barrier => self
                .nccl
                .barrier(self.members.len())
                .map_err(|failure| self.error(me, &call, failure)),
            _ => Ok(()),
        }
    }

    fn send(&self, me: usize, to: usize, data: Payload) -> Result<(), CommError> {
        crate::nccl_p2p::send(self, me, to, cuda_tensor(data))
            .map_err(|failure| self.error(me, &PointToPoint::Send { to }, failure))
    }

    fn recv(
        &self,
        me: usize,
        from: usize,
        op: &dyn fmt::Display,
        like: Payload,
        shape: &[usize],
    ) -> Result<Payload, CommError> {
        crate::nccl_p2p::recv(self, me, from, op, cuda_tensor(like), shape).map(Payload::from)
    }

    /// The ranks learn each other's colours (to know the members of their new group), then
    /// NCCL splits its communicator.
    fn split(
        &self,
        me: usize,
        _: &mut Stream,
        call: Call,
        name: String,
        color: usize,
    ) -> Result<(Arc<dyn Transport>, usize), CommError> {
        let failed = |failure| self.error(me, &call, failure);
        let colors = self
            .nccl
            .all_gather_value(color, self.members.len())
            .map_err(failed)?;
        let members = colors
            .iter()
            .zip(&self.members)
            .filter(|(c, _)| **c == color)
            .map(|(_, &rank)| rank)
            .collect();
        let rank = colors[..me].iter().filter(|&&c| c == color).count();
        let nccl = self.nccl.split(color, me).map_err(failed)?;
        let group = NcclGroup {
            name,
            members,
            world: self.world.clone(),
            nccl,
            host: None,
        };
        Ok((Arc::new(group), rank))
    }
}

/// Why an NCCL call failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// This call failed (the reason).
    Now(String),
    /// An earlier call failed and aborted the communicator (its reason).
    Earlier(String),
}

impl From<Failure> for String {
    fn from(failure: Failure) -> Self {
        let (Failure::Now(reason) | Failure::Earlier(reason)) = failure;
        reason
    }
}

/// One rank's NCCL communicator, with the CUDA stream its calls run on.
pub(crate) struct Nccl {
    comm: ncclComm_t,
    stream: CUstream,
    device: CudaDevice,
    cu_device: CUdevice,
    context: CUcontext,
    timeout: Duration,
    /// Why the communicator was aborted, once it has been.
    aborted: Mutex<Option<String>>,
    /// Names this communicator alike on all its ranks (point-to-point pairs are keyed by it).
    key: String,
    /// Splits made of it so far: numbers its children's keys.
    splits: AtomicU64,
    /// The pairs its sends and receives run on.
    pub(crate) peers: Peers,
}

// SAFETY: the handles are plain pointers that NCCL and CUDA allow to be used from any thread;
// the communicator's stream lock lets only one thread issue calls at a time.
unsafe impl Send for Nccl {}
unsafe impl Sync for Nccl {}

/// A CUDA context or NCCL communicator handed between the start-up thread and its caller.
struct Shared<T>(T);

// SAFETY: CUDA contexts and NCCL communicators may be used from any thread; each is used by
// one thread at a time (the start-up thread, then whoever receives it).
unsafe impl Send for Shared<CUcontext> {}
// SAFETY: as above.
unsafe impl Send for Shared<ncclComm_t> {}

impl<T: Copy> Shared<T> {
    /// The handle (a method, so that a closure takes the whole `Shared`, not its field).
    fn get(&self) -> T {
        self.0
    }
}

/// A fresh NCCL unique id (rank 0 makes it; every rank of the new communicator needs it).
pub(crate) fn unique_id() -> Result<[u8; 128], String> {
    check_libraries()?;
    let id = cudarc::nccl::result::get_uniqueid()
        .map_err(|e| format!("ncclGetUniqueId failed: {}", describe(e.0)))?;
    Ok(id.internal.map(|c| c as u8))
}

/// A 64-bit hash of `bytes` that every process computes alike.
fn fnv1a(bytes: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut hasher = crate::call::Fnv1a::new();
    hasher.write(bytes);
    hasher.finish()
}

/// Whether NCCL can start on `device`: the libraries load and the driver knows the device.
fn check_device(device: &CudaDevice) -> Result<(), String> {
    check_libraries()?;
    let cuda = |e: cudarc::driver::DriverError| format!("CUDA on {device:?}: {e:?}");
    cu::init().map_err(cuda)?;
    let count = cu::device::get_count().map_err(cuda)?;
    if device.index >= count as usize {
        return Err(format!(
            "{device:?} does not exist: this machine has {count} CUDA device(s)"
        ));
    }
    Ok(())
}

/// The libraries are loaded at run time: say how to provide them instead of panicking inside
/// cudarc.
fn check_libraries() -> Result<(), String> {
    // SAFETY: only tries to load the libraries.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda.so) could not be loaded: this machine needs an NVIDIA driver, and the directory holding libcuda.so on LD_LIBRARY_PATH".into());
    }
    // SAFETY: as above.
    if !unsafe { sys::is_culib_present() } {
        return Err("the NCCL library could not be loaded: install NCCL (the nvidia-nccl-cu13 pip package or the libnccl2 system package) and put the directory holding it on LD_LIBRARY_PATH; the loader looks for libnccl.so, so where only libnccl.so.2 exists, link it as libnccl.so there".into());
    }
    Ok(())
}

fn describe(result: ncclResult_t) -> String {
    // SAFETY: NCCL returns a static string for every result code.
    let text = unsafe { CStr::from_ptr(sys::ncclGetErrorString(result)) };
    format!("{result:?} ({})", text.to_string_lossy())
}

impl Nccl {
    /// Joins the communicator of `size` ranks named by `id`, as `rank`, on `device`. Every rank
    /// must call it: it returns once all have.
    pub fn init(
        device: &CudaDevice,
        id: [u8; 128],
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<Self, String> {
        // `check_device` has loaded the libraries and initialised the driver.
        let cu_device = cu::device::get(device.index as i32)
            .map_err(|e| format!("CUDA on {device:?}: {e:?}"))?;
        let key = format!("{:016x}", fnv1a(&id));
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let join = move |comm: *mut ncclComm_t| {
            // SAFETY: the context is current; NCCL writes `comm` on success.
            let joined = unsafe { sys::ncclCommInitRank(comm, size as i32, id, rank as i32) };
            match joined {
                ncclResult_t::ncclSuccess => Ok(()),
                _ => Err(format!(
                    "ncclCommInitRank (rank {rank} of {size}) failed: {}. Several ranks on one GPU need NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL 2.30 or later, at most 2 ranks per GPU); NCCL_DEBUG=INFO says more",
                    describe(joined)
                )),
            }
        };
        Self::create(device, cu_device, timeout, key, |context| {
            start_up_timed(context, cu_device, timeout, join)
        })
    }

    /// The communicator of the ranks that pass the same `color`, ordered by `key`. Every rank of
    /// this communicator must call it.
    pub fn split(&self, color: usize, key: usize) -> Result<Self, Failure> {
        self.usable()?;
        let color = i32::try_from(color)
            .map_err(|_| Failure::Now(format!("colour {color} does not fit NCCL's int")))?;
        let child = format!(
            "{}.{}.{color}",
            self.key,
            self.splits.fetch_add(1, Ordering::Relaxed)
        );
        // Not timed as a start-up is: a thread left inside `ncclCommSplit` would still use the
        // parent, which this rank goes on using. The ranks have just met in an all-gather.
        Self::create(&self.device, self.cu_device, self.timeout, child, |_| {
            let mut comm = MaybeUninit::uninit();
            // SAFETY: a live communicator; a null config inherits the parent's.
            let split = unsafe {
                sys::ncclCommSplit(
                    self.comm,
                    color,
                    key as i32,
                    comm.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            match split {
                // SAFETY: NCCL initialised it.
                ncclResult_t::ncclSuccess => Ok(unsafe { comm.assume_init() }),
                _ => Err(StartUp::Failed(format!(
                    "ncclCommSplit: {}",
                    describe(split)
                ))),
            }
        })
        .map_err(Failure::Now)
    }

    /// A communicator on `device` with its own stream, in the primary context (burn's CUDA
    /// runtime works there, so must NCCL), made by `start` once the context is current; what was
    /// acquired is released when any step fails (but a start-up that timed out keeps its
    /// context: see [`start_up_timed`]).
    fn create(
        device: &CudaDevice,
        cu_device: CUdevice,
        timeout: Duration,
        key: String,
        start: impl FnOnce(CUcontext) -> Result<ncclComm_t, StartUp>,
    ) -> Result<Self, String> {
        let cuda = |e: cudarc::driver::DriverError| format!("CUDA on {device:?}: {e:?}");
        // SAFETY: `cu_device` is a device the driver handed out; each retain is released by
        // the drop of the communicator it makes, or below.
        let context = unsafe { cu::primary_ctx::retain(cu_device) }.map_err(cuda)?;
        let release = || {
            // SAFETY: retained above, released once on a failure path.
            let _ = unsafe { cu::primary_ctx::release(cu_device) };
        };
        // SAFETY: the context was just retained.
        if let Err(e) = unsafe { cu::ctx::set_current(context) } {
            release();
            return Err(cuda(e));
        }
        let comm = match start(context) {
            Ok(comm) => comm,
            Err(StartUp::Failed(reason)) => {
                release();
                return Err(reason);
            }
            Err(StartUp::Abandoned(reason)) => return Err(reason),
        };
        let stream = match cu::stream::create(cu::stream::StreamKind::NonBlocking) {
            Ok(stream) => stream,
            Err(e) => {
                // SAFETY: made above and used by nothing else.
                unsafe { sys::ncclCommDestroy(comm) };
                release();
                return Err(cuda(e));
            }
        };
        Ok(Self {
            comm,
            stream,
            device: device.clone(),
            cu_device,
            context,
            timeout,
            aborted: Mutex::new(None),
            key,
            splits: AtomicU64::new(0),
            peers: Peers::default(),
        })
    }

    /// The name this communicator has alike on all its ranks.
    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    pub fn usable(&self) -> Result<(), Failure> {
        match lock(&self.aborted).as_ref() {
            Some(cause) => Err(Failure::Earlier(cause.clone())),
            None => Ok(()),
        }
    }

    fn make_current(&self) -> Result<(), Failure> {
        // SAFETY: the context is retained for this communicator's life.
        unsafe { cu::ctx::set_current(self.context) }
            .map_err(|e| Failure::Now(format!("cuCtxSetCurrent: {e:?}")))
    }

    /// Runs collective `op` of this communicator's `size` ranks on `input`.
    pub fn collective(
        &self,
        op: Op,
        size: usize,
        input: CubeTensor<CudaRuntime>,
    ) -> Result<CubeTensor<CudaRuntime>, Failure> {
        self.usable()?;
        let dims = input.shape().to_vec();
        if input.shape().num_elements() == 0 {
            // Nothing to move: only the result's shape depends on the call.
            let shape = Shape::from(result_shape(op, &dims, size));
            return Ok(empty_contiguous(&input.device, shape, input.dtype));
        }
        let rank = dims.len();
        // NCCL concatenates and splits flat buffers along their first dim: the dim a call
        // concatenates or splits is brought to the front, and back again.
        let swapped = |tensor, dim| permute(tensor, &swap(rank, 0, dim));
        let (comm, stream) = (self.comm, self.stream as sys::cudaStream_t);
        match op {
            Op::AllReduce(reduce) => {
                let (dtype, count) = (reducible(input.dtype)?, input.shape().num_elements());
                self.launch(input, Shape::from(dims), |src, dst| unsafe {
                    sys::ncclAllReduce(src, dst, count, dtype, red_op(reduce), comm, stream)
                })
            }
            Op::AllGather { dim } => {
                let input = swapped(input, dim);
                let bytes = byte_len(&input);
                let mut out = input.shape();
                out[0] *= size;
                let out = self.launch(input, out, |src, dst| unsafe {
                    sys::ncclAllGather(src, dst, bytes, ncclDataType_t::ncclUint8, comm, stream)
                })?;
                Ok(swapped(out, dim))
            }
            Op::ReduceScatter { op: reduce, dim } => {
                let input = swapped(input, dim);
                let dtype = reducible(input.dtype)?;
                let mut out = input.shape();
                out[0] /= size;
                let count = out.num_elements();
                let out = self.launch(input, out, |src, dst| unsafe {
                    sys::ncclReduceScatter(src, dst, count, dtype, red_op(reduce), comm, stream)
                })?;
                Ok(swapped(out, dim))
            }
            Op::Broadcast { root } => {
                let bytes = byte_len(&input);
                self.launch(input, Shape::from(dims), |src, dst| unsafe {
                    sys::ncclBroadcast(
                        src,
                        dst,
                        bytes,
                        ncclDataType_t::ncclUint8,
                        root as i32,
                        comm,
                        stream,
                    )
                })
            }
            Op::AllToAll {
                split_dim,
                concat_dim,
            } => {
                // Part k of the input (along `split_dim`, brought to the front) goes to rank k;
                // the part from rank k lands in block k of the output.
                let input = swapped(input, split_dim);
                let (chunk, shape) = (byte_len(&input) / size, input.shape());
                let out = self.launch(input, shape, |src, dst| unsafe {
                    let status = sys::ncclGroupStart();
                    if status != ncclResult_t::ncclSuccess {
                        return status;
                    }
                    for peer in 0..size {
                        let offset = peer * chunk;
                        let (from, to) = (
                            src.cast::<u8>().add(offset).cast(),
                            dst.cast::<u8>().add(offset).cast(),
                        );
                        let u8 = ncclDataType_t::ncclUint8;
                        let sent = sys::ncclSend(from, chunk, u8, peer as i32, comm, stream);
                        if sent != ncclResult_t::ncclSuccess {
                            sys::ncclGroupEnd();
                            return sent;
                        }
                        let got = sys::ncclRecv(to, chunk, u8, peer as i32, comm, stream);
                        if got != ncclResult_t::ncclSuccess {
                            sys::ncclGroupEnd();
                            return got;
                        }
                    }
                    sys::ncclGroupEnd()
                })?;
                if concat_dim == split_dim {
                    return Ok(swapped(out, split_dim));
                }
                // Laid out by reading contiguous buffers in new shapes, never by reshaping a
                // strided view (burn-cubecl's stride rule can split a dim wrongly there).
                let layout = concat_blocks(&dims, split_dim, concat_dim, size);
                let parts = permute(read_as(out, layout.view), &layout.axes);
                Ok(read_as(into_contiguous(parts), layout.out))
            }
            Op::Barrier | Op::Split => unreachable!("{op} is not a data collective"),
        }
    }

    /// Waits until every rank of the communicator's `size` has called it.
    pub fn barrier(&self, size: usize) -> Result<(), Failure> {
        let token = Tensor::<Cuda<f32>, 1, Int>::zeros([1], &self.device);
        let token = to_cube(token).map_err(Failure::Now)?;
        self.collective(Op::AllReduce(ReduceOp::Sum), size, token)
            .map(drop)
    }

    /// Every rank's `value`, in rank order.
    pub fn all_gather_value(&self, value: usize, size: usize) -> Result<Vec<usize>, Failure> {
        let mine = Tensor::<Cuda<f32>, 1, Int>::from_data([value as i64], &self.device);
        let mine = to_cube(mine).map_err(Failure::Now)?;
        let all = self.collective(Op::AllGather { dim: 0 }, size, mine)?;
        let values = from_cube::<Cuda<f32>, 1, Int>(all)
            .into_data()
            .convert::<i64>()
            .into_vec::<i64>()
            .map_err(|e| Failure::Now(format!("{e:?}")))?;
        Ok(values.into_iter().map(|v| v as usize).collect())
    }

    /// Runs `call(input, output)` on this communicator's stream, into a new contiguous tensor of
    /// `out_shape`, once `input` is complete; returns when the call has finished.
    fn launch(
        &self,
        input: CubeTensor<CudaRuntime>,
        out_shape: Shape,
        call: impl FnOnce(*const c_void, *mut c_void) -> ncclResult_t,
    ) -> Result<CubeTensor<CudaRuntime>, Failure> {
        let output = empty_contiguous(&input.device, out_shape, input.dtype);
        let [src, dst] = self.bind([input, output])?;
        let (from, to) = (src.ptr as *const c_void, dst.ptr as *mut c_void);
        if let Err(failure) = self.run(|_, _| issued(call(from, to), "the call")) {
            src.leak();
            dst.leak();
            return Err(failure);
        }
        drop(src);
        Ok(dst.tensor)
    }

    /// `tensors` (on this communicator's device) made contiguous, bound and complete: the
    /// calling thread's cubecl stream has finished what writes them.
    pub fn bind<const N: usize>(
        &self,
        tensors: [CubeTensor<CudaRuntime>; N],
    ) -> Result<[Bound; N], Failure> {
        let cubecl = |e: &dyn std::fmt::Debug| Failure::Now(format!("cubecl: {e:?}"));
        let mut bound = Vec::with_capacity(N);
        for tensor in tensors {
            let tensor = self.on_device(tensor)?;
            let resource = tensor
                .client
                .get_resource(tensor.handle.clone())
                .map_err(|e| cubecl(&e))?;
            let ptr = resource.resource().ptr;
            bound.push(Bound {
                tensor,
                ptr,
                _resource: Box::new(resource),
            });
        }
        if let Some(first) = bound.first() {
            // The resources' stream now waits for the writers; finishing it finishes them.
            block_on(first.tensor.client.sync()).map_err(|e| cubecl(&e))?;
        }
        Ok(bound
            .try_into()
            .unwrap_or_else(|_| unreachable!("one bound tensor per tensor")))
    }

    /// `tensor` in contiguous form, refused when it is on another device.
    fn on_device(
        &self,
        tensor: CubeTensor<CudaRuntime>,
    ) -> Result<CubeTensor<CudaRuntime>, Failure> {
        if tensor.device != self.device {
            return Err(Failure::Now(format!(
                "the tensor is on {:?}, but this communicator drives {:?}",
                tensor.device, self.device
            )));
        }
        Ok(if tensor.is_contiguous() {
            tensor
        } else {
            into_contiguous(tensor)
        })
    }

    /// Runs `issue`, which queues work on this communicator's stream (given with its
    /// communicator), and waits until the stream has done it. A failure aborts the communicator:
    /// buffers the work used must then never be given back (see [`Bound::leak`]).
    pub fn run(
        &self,
        issue: impl FnOnce(ncclComm_t, CUstream) -> Result<(), String>,
    ) -> Result<(), Failure> {
        self.usable()?;
        self.make_current()?;
        match issue(self.comm, self.stream) {
            Ok(()) => self.finish(),
            Err(reason) => Err(Failure::Now(self.abort(reason))),
        }
    }

    /// Waits for this communicator's stream, aborting the communicator when NCCL reports an
    /// error or the call outlives the timeout.
    fn finish(&self) -> Result<(), Failure> {
        let started = Instant::now();
        let mut polls = 0u32;
        loop {
            // SAFETY: the stream lives as long as `self`.
            match unsafe { cuStreamQuery(self.stream) } {
                CUresult::CUDA_SUCCESS => return Ok(()),
                CUresult::CUDA_ERROR_NOT_READY => {}
                error => {
                    return Err(Failure::Now(
                        self.abort(format!("the CUDA stream failed: {error:?}")),
                    ));
                }
            }
            let mut state = ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator.
            unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
            if !matches!(
                state,
                ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress
            ) {
                return Err(Failure::Now(self.abort(format!(
                    "NCCL reported {}: {}",
                    describe(state),
                    self.last_error()
                ))));
            }
            if started.elapsed() > self.timeout {
                return Err(Failure::Now(self.abort(format!(
                    "the call did not finish within {:?}: a peer failed, is stuck, or called another collective; the NCCL communicator was aborted",
                    self.timeout
                ))));
            }
            // Short calls finish within microseconds: poll hot first, then back off.
            polls += 1;
            if polls < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    fn last_error(&self) -> String {
        // SAFETY: NCCL returns a string it owns, valid until its next call on this thread.
        let text = unsafe { sys::ncclGetLastError(self.comm) };
        if text.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }

    /// Aborts this rank's communicator (its pending calls end; peers stop at their own
    /// timeout) and remembers why; returns the reason.
    pub fn abort(&self, reason: String) -> String {
        let mut aborted = lock(&self.aborted);
        if aborted.is_none() {
            // SAFETY: a live communicator, aborted once.
            unsafe { sys::ncclCommAbort(self.comm) };
            *aborted = Some(reason.clone());
        }
        reason
    }
}

/// Why a communicator was not made.
enum StartUp {
    /// It failed; its caller releases the context.
    Failed(String),
    /// It did not finish in time; the start-up thread still holds the context and releases it.
    Abandoned(String),
}

/// Runs NCCL's start-up `make` on a thread of its own and waits for it at most `timeout`: it
/// returns only once every rank has joined, so a rank that never joins costs an error, not a
/// hang. A start-up that finishes after its caller gave up aborts the communicator it made and
/// releases the context (`cu_device`'s primary context, retained by the caller).
fn start_up_timed(
    context: CUcontext,
    cu_device: CUdevice,
    timeout: Duration,
    make: impl FnOnce(*mut ncclComm_t) -> Result<(), String> + Send + 'static,
) -> Result<ncclComm_t, StartUp> {
    let (done, outcome) = std::sync::mpsc::channel();
    let current = Shared(context);
    let started = std::thread::Builder::new()
        .name("nccl-start-up".into())
        .spawn(move || {
            // SAFETY: the context stays retained while this thread may use it.
            let made = unsafe { cu::ctx::set_current(current.get()) }
                .map_err(|e| format!("cuCtxSetCurrent: {e:?}"))
                .and_then(|()| {
                    let mut comm = MaybeUninit::uninit();
                    // SAFETY: NCCL initialised it when `make` succeeded.
                    make(comm.as_mut_ptr()).map(|()| Shared(unsafe { comm.assume_init() }))
                });
            if let Err(std::sync::mpsc::SendError(late)) = done.send(made) {
                // SAFETY: nobody else holds this communicator or this retain any more.
                unsafe {
                    if let Ok(comm) = late {
                        sys::ncclCommAbort(comm.get());
                    }
                    let _ = cu::primary_ctx::release(cu_device);
                }
            }
        })
        .map_err(|e| StartUp::Failed(format!("could not start NCCL's start-up thread: {e}")))?;
    match outcome.recv_timeout(timeout) {
        Ok(made) => made.map(|comm| comm.get()).map_err(StartUp::Failed),
        Err(RecvTimeoutError::Timeout) => {
            if let Ok(made) = outcome.try_recv() {
                return made.map(|comm| comm.get()).map_err(StartUp::Failed);
            }
            // Dropping the receiver tells the thread to clean up whenever it finishes.
            drop(outcome);
            Err(StartUp::Abandoned(format!(
                "NCCL's start-up did not finish within {timeout:?}: a rank of the group did not join (it failed, is stuck, or called something else)"
            )))
        }
        Err(RecvTimeoutError::Disconnected) => {
            let _ = started.join();
            Err(StartUp::Failed("NCCL's start-up thread panicked".into()))
        }
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: each handle is released once; an aborted communicator is already freed.
        unsafe {
            let _ = cu::ctx::set_current(self.context);
            if lock(&self.aborted).is_none() {
                sys::ncclCommDestroy(self.comm);
            }
            let _ = cu::stream::destroy(self.stream);
            let _ = cu::primary_ctx::release(self.cu_device);
        }
    }
}

fn red_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
    }
}

/// NCCL's type for reducing `dtype`; moves that do not reduce go as bytes.
fn reducible(dtype: DType) -> Result<ncclDataType_t, Failure> {
    use ncclDataType_t::*;
    Ok(match dtype {
        DType::F64 => ncclFloat64,
        DType::F32 | DType::Flex32 => ncclFloat32,
        DType::F16 => ncclFloat16,
        DType::BF16 => ncclBfloat16,
        DType::I64 => ncclInt64,
        DType::I32 => ncclInt32,
        DType::I8 => ncclInt8,
        DType::U64 => ncclUint64,
        DType::U32 => ncclUint32,
        DType::U8 => ncclUint8,
        other => {
            return Err(Failure::Now(format!(
                "NCCL cannot reduce {other:?} tensors; cast them to a 32-bit type first"
            )));
        }
    })
}

/// A contiguous tensor of `shape` and `dtype` on `device`, its memory not initialised:
/// cubecl's own memory, like any tensor's (see [`Nccl::bind`]).
pub(crate) fn empty_contiguous(
    device: &CudaDevice,
    shape: Shape,
    dtype: DType,
) -> CubeTensor<CudaRuntime> {
    let client = CudaRuntime::client(device);
    let memory = client.empty(shape.num_elements() * dtype.size());
    CubeTensor::new_contiguous(client, device.clone(), shape, memory, dtype)
}

/// The contiguous `tensor` read in `shape`, of as many elements: no data moves.
fn read_as(tensor: CubeTensor<CudaRuntime>, shape: Vec<usize>) -> CubeTensor<CudaRuntime> {
    debug_assert!(tensor.is_contiguous());
    let CubeTensor {
        client,
        handle,
        device,
        dtype,
        ..
    } = tensor;
    CubeTensor::new_contiguous(client, device, Shape::from(shape), handle, dtype)
}

pub(crate) fn byte_len(tensor: &CubeTensor<CudaRuntime>) -> usize {
    tensor.shape().num_elements() * tensor.dtype.size()
}

/// What NCCL returned for `what`, as a result.
pub(crate) fn issued(result: ncclResult_t, what: &str) -> Result<(), String> {
    match result {
        ncclResult_t::ncclSuccess => Ok(()),
        _ => Err(format!("{what}: {}", describe(result))),
    }
}

/// A contiguous CUDA tensor whose contents are complete, with its memory held for NCCL.
pub(crate) struct Bound {
    pub tensor: CubeTensor<CudaRuntime>,
    /// Its device address.
    pub ptr: u64,
    /// Keeps the allocation bound while NCCL uses it.
    _resource: Box<dyn Send>,
}

impl Bound {
    pub fn bytes(&self) -> usize {
        byte_len(&self.tensor)
    }

    /// Never gives the memory back to cubecl: an aborted NCCL kernel may still touch it.
    pub fn leak(self) {
        std::mem::forget(self);
    }
}
