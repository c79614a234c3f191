//! `send` and `recv` on the NCCL transport, with the local transport's meaning: a send is
//! buffered (its caller does not wait for the receiver), the messages from one rank to another
//! arrive in the order they were sent, and a receive of another dtype or shape is refused and
//! consumes the message.
//!
//! An NCCL send waits for its receive (beyond NCCL's small eager buffer), and one communicator
//! runs its calls one after another, so on the group's communicator two ranks that each send
//! before they receive (a pipeline's steady state) would wait on each other. Instead every
//! ordered pair of ranks (a → b) gets a two-rank communicator of its own, made at a's first send
//! to b; on it a only sends and b only receives. a's sends to b are issued in order by a thread
//! of their own, which keeps each buffer until NCCL is done with it; b's receives from a match
//! them in order. a makes the pair's NCCL id and hands it to b through the world's
//! [`PairIds`](crate::pair_ids::PairIds).
//!
//! Each message is a header (the data's length, and the send's dtype and shape) and then the
//! data: the receiver checks the header before it receives the data.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use burn::backend::cuda::CudaDevice;
use burn::tensor::{DType, Int, Shape, Tensor, TensorData, TensorMetadata};
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::tensor::CubeTensor;
use cudarc::driver::sys::CUstream;
use cudarc::nccl::sys::{self, ncclDataType_t};

use crate::CommError;
use crate::nccl::{Bound, Failure, Nccl, NcclGroup, byte_len, empty_contiguous, issued, unique_id};
use crate::nccl_tensor::{Cuda, from_cube, to_cube};
use crate::pair_ids::PairIds;
use crate::sync::lock;
use crate::world::World;

/// Bytes of a message's header: the data's length (8 bytes), the length of the description
/// (2 bytes) and the description, as a mismatch error prints it, zero-padded.
const HEADER: usize = 256;

/// Device buffers of whole 4-byte words (headers, and the scratch a refused message is
/// received into): cubecl's own memory like any tensor, since a raw allocation or free could
/// wait on the whole device, where other ranks' kernels may be waiting on this rank.
type Words = Tensor<Cuda<f32>, 1, Int>;

/// The point-to-point side of one rank's NCCL communicator: a pair per peer and direction,
/// each made on first use.
#[derive(Default)]
pub(crate) struct Peers {
    /// To each destination (group rank).
    outgoing: Mutex<HashMap<usize, Outgoing>>,
    /// From each source (group rank).
    incoming: Mutex<HashMap<usize, Pair>>,
}

/// The sending side of a pair: the queue of the thread that issues its sends. Where ranks are
/// processes, dropping it waits until the messages queued are delivered (each within the
/// timeout), so a process that exits after its last send does not lose it; thread ranks leave
/// the thread to finish, as the process outlives them.
struct Outgoing {
    queue: Option<mpsc::Sender<Message>>,
    /// The thread, when dropping waits for it.
    thread: Option<JoinHandle<()>>,
    /// Why the pair failed, once it has: later sends report it.
    failed: Arc<Mutex<Option<String>>>,
}

/// A message on its way: its header and its data (none when empty), held until sent.
struct Message {
    header: Bound,
    data: Option<Bound>,
}

/// Where a receive's data goes: nowhere, for an empty tensor.
enum Destination {
    Empty(CubeTensor<CudaRuntime>),
    Memory(Bound),
}

/// Aborts a pair whose message was left half received (its header taken, its data not), on
/// any way out, a panic included: the next receive would meet the data where it expects a
/// header.
struct HalfRead<'a>(Option<&'a Pair>);

impl HalfRead<'_> {
    fn finished(mut self) {
        self.0 = None;
    }
}

impl Drop for HalfRead<'_> {
    fn drop(&mut self) {
        if let Some(pair) = self.0 {
            pair.nccl
                .abort("a receive stopped between a message's header and its data".into());
        }
    }
}

/// A two-rank communicator on which rank 0 only sends and rank 1 only receives.
struct Pair {
    nccl: Nccl,
}

/// Queues `data` from group rank `me` for group rank `dst`; returns once it is complete on the
/// device and queued, without waiting for the receiver.
pub(crate) fn send(
    group: &NcclGroup,
    me: usize,
    dst: usize,
    data: CubeTensor<CudaRuntime>,
) -> Result<(), Failure> {
    let nccl = &group.nccl;
    nccl.usable()?;
    check_ids()?;
    let description = description(data.dtype, &data.shape());
    let bytes = byte_len(&data);
    let header = header(bytes, &description)?;
    let header = Words::from_data(header, (nccl.device(), DType::I32));
    let header = to_cube(header).map_err(Failure::Now)?;
    let (header, data) = match bytes {
        0 => {
            let [header] = nccl.bind([header])?;
            (header, None)
        }
        _ => {
            let [header, data] = nccl.bind([header, data])?;
            (header, Some(data))
        }
    };
    let mut outgoing = lock(&nccl.peers.outgoing);
    let pair = match outgoing.entry(dst) {
        Entry::Occupied(pair) => pair.into_mut(),
        Entry::Vacant(slot) => slot.insert(Outgoing::start(
            nccl,
            group.world.clone(),
            pair_key(nccl, me, dst),
        )?),
    };
    let stopped = |pair: &Outgoing| {
        let reason = lock(&pair.failed).clone();
        Failure::Now(format!(
            "an earlier send to group rank {dst} failed: {}",
            reason.unwrap_or_else(|| "its sending thread stopped".into())
        ))
    };
    if lock(&pair.failed).is_some() {
        return Err(stopped(pair));
    }
    let queue = pair.queue.as_ref().expect("taken only by drop");
    queue
        .send(Message { header, data })
        .map_err(|_| stopped(pair))
}

/// Receives, as group rank `me`, the next message from group rank `src` as a tensor of `shape`
/// and of `like`'s dtype and device; a message of another dtype or shape is consumed and
/// refused with a `Mismatch` naming the receive `op`.
pub(crate) fn recv(
    group: &NcclGroup,
    me: usize,
    src: usize,
    op: &dyn std::fmt::Display,
    like: CubeTensor<CudaRuntime>,
    shape: &[usize],
) -> Result<CubeTensor<CudaRuntime>, CommError> {
    let nccl = &group.nccl;
    let failed = |failure| group.error(me, &op, failure);
    nccl.usable().map_err(failed)?;
    // Made and bound before anything is received, so that no error can leave a message half
    // read: on the device the receive asked for, which `bind` refuses when this communicator
    // does not drive it.
    let wanted = description(like.dtype, shape);
    let out = empty_contiguous(&like.device, Shape::from(shape.to_vec()), like.dtype);
    let out = match out.shape().num_elements() {
        0 => Destination::Empty(out),
        _ => Destination::Memory(nccl.bind([out]).map(|[out]| out).map_err(failed)?),
    };
    check_ids().map_err(failed)?;
    let mut incoming = lock(&nccl.peers.incoming);
    let pair = match incoming.entry(src) {
        Entry::Occupied(pair) => pair.into_mut(),
        Entry::Vacant(slot) => {
            let key = pair_key(nccl, src, me);
            let pair = Pair::join_as_receiver(nccl, &group.world, &key)
                .map_err(|reason| failed(Failure::Now(reason)))?;
            slot.insert(pair)
        }
    };
    let from_src = |failure: Failure| {
        let reason = String::from(failure);
        failed(Failure::Now(format!(
            "the messages from group rank {src}: {reason}"
        )))
    };
    let pair = &*pair;
    let (bytes, theirs) = pair.recv_header().map_err(from_src)?;
    let half_read = HalfRead(Some(pair));
    let wanted_bytes = match &out {
        Destination::Empty(_) => 0,
        Destination::Memory(out) => out.bytes(),
    };
    if theirs != wanted || bytes != wanted_bytes {
        pair.drain(bytes).map_err(from_src)?;
        half_read.finished();
        let members = crate::transport::Transport::members(group);
        return Err(CommError::Mismatch {
            group: crate::transport::Transport::name(group).to_string(),
            rank: members[me],
            mine: op.to_string(),
            other_rank: members[src],
            theirs,
        });
    }
    let out = match out {
        Destination::Empty(out) => out,
        Destination::Memory(out) => pair.recv(out, bytes).map_err(from_src)?.tensor,
    };
    half_read.finished();
    Ok(out)
}

impl Outgoing {
    /// The sending side of the pair named `key`, on `nccl`'s device: its thread joins the pair,
    /// then sends what it is given in order, each message once the previous one was received.
    fn start(nccl: &Nccl, world: Arc<World>, key: String) -> Result<Self, Failure> {
        let (queue, messages) = mpsc::channel::<Message>();
        let failed = Arc::new(Mutex::new(None));
        let failure = failed.clone();
        let device = nccl.device().clone();
        let timeout = nccl.timeout();
        let flush_on_drop = matches!(world.pair_ids(), PairIds::Processes { .. });
        let thread = std::thread::Builder::new()
            .name("nccl-send".into())
            .spawn(move || {
                let pair = match Pair::join_as_sender(&device, &world, &key, timeout) {
                    Ok(pair) => pair,
                    // The messages queued so far were never issued: dropping them is safe.
                    Err(reason) => return *lock(&failure) = Some(reason),
                };
                for message in messages {
                    if let Err(error) = pair.send(&message) {
                        *lock(&failure) = Some(error.into());
                        // NCCL may still touch this message's buffers; the later ones were
                        // never issued.
                        std::mem::forget(message);
                        return;
                    }
                }
            })
            .map_err(|e| Failure::Now(format!("could not start a sending thread: {e}")))?;
        Ok(Self {
            queue: Some(queue),
            thread: flush_on_drop.then_some(thread),
            failed,
        })
    }
}

impl Drop for Outgoing {
    fn drop(&mut self) {
        // Closing the queue lets the thread end once it has sent what was queued.
        drop(self.queue.take());
        match self.thread.take() {
            // A panicking rank reports its failure first.
            Some(thread) if !std::thread::panicking() => drop(thread.join()),
            _ => {}
        }
    }
}

impl Pair {
    /// Joins the pair named `key`, on `nccl`'s device, as its receiver, with the id its sender
    /// posted.
    fn join_as_receiver(nccl: &Nccl, world: &World, key: &str) -> Result<Self, String> {
        let id = world.pair_ids().take(key, nccl.timeout())?;
        Self::with_id(nccl.device(), id, 1, nccl.timeout())
    }

    /// Makes the pair named `key` and joins it as its sender.
    fn join_as_sender(
        device: &CudaDevice,
        world: &World,
        key: &str,
        timeout: Duration,
    ) -> Result<Self, String> {
        let id = unique_id()?;
        world.pair_ids().post(key, id)?;
        Self::with_id(device, id, 0, timeout)
    }

    fn with_id(
        device: &CudaDevice,
        id: [u8; 128],
        rank: usize,
        timeout: Duration,
    ) -> Result<Self, String> {
        Nccl::init(device, id, rank, 2, timeout).map(|nccl| Self { nccl })
    }

    fn send(&self, message: &Message) -> Result<(), Failure> {
        let (header, data) = (&message.header, &message.data);
        self.nccl.run(|comm, stream| {
            transfer(comm, stream, header.ptr, header.bytes(), true)?;
            match data {
                Some(data) => transfer(comm, stream, data.ptr, data.bytes(), true),
                None => Ok(()),
            }
        })
    }

    /// The next message's data length and description.
    fn recv_header(&self) -> Result<(usize, String), Failure> {
        self.nccl.usable()?;
        let header = self.recv(self.words(HEADER / 4)?, HEADER)?;
        let words = from_cube::<Cuda<f32>, 1, Int>(header.tensor).into_data();
        read_header(&words).map_err(|reason| Failure::Now(self.nccl.abort(reason)))
    }

    /// Receives a refused message's `bytes` of data into scratch memory, so that the next
    /// receive gets the next message.
    fn drain(&self, bytes: usize) -> Result<(), Failure> {
        if bytes == 0 {
            return Ok(());
        }
        self.recv(self.words(bytes.div_ceil(4))?, bytes).map(drop)
    }

    /// `count` words of device memory to receive into, bound.
    fn words(&self, count: usize) -> Result<Bound, Failure> {
        let words = Words::empty([count], (self.nccl.device(), DType::I32));
        let [words] = self.nccl.bind([to_cube(words).map_err(Failure::Now)?])?;
        Ok(words)
    }

    /// Receives `bytes` into `data`, and gives it back; on a failure `data` is leaked (see
    /// [`Bound::leak`]).
    fn recv(&self, data: Bound, bytes: usize) -> Result<Bound, Failure> {
        match self
            .nccl
            .run(|comm, stream| transfer(comm, stream, data.ptr, bytes, false))
        {
            Ok(()) => Ok(data),
            Err(failure) => {
                data.leak();
                Err(failure)
            }
        }
    }
}

/// Pairs need ids of their own; `NCCL_COMM_ID` gives every communicator the same one, so the
/// pairs would join each other.
fn check_ids() -> Result<(), Failure> {
    match std::env::var_os("NCCL_COMM_ID") {
        Some(_) => Err(Failure::Now(
            "NCCL_COMM_ID is set: send/recv on NCCL need an id of their own per pair of ranks; unset it".into(),
        )),
        None => Ok(()),
    }
}

/// Issues the send (rank 0) or receive (rank 1) of `bytes` at `ptr` on a pair.
fn transfer(
    comm: sys::ncclComm_t,
    stream: CUstream,
    ptr: u64,
    bytes: usize,
    send: bool,
) -> Result<(), String> {
    let (u8, stream) = (ncclDataType_t::ncclUint8, stream as sys::cudaStream_t);
    // SAFETY: `ptr` is bound device memory of at least `bytes` bytes, kept until the stream is
    // done.
    let result = unsafe {
        match send {
            true => sys::ncclSend(ptr as *const c_void, bytes, u8, 1, comm, stream),
            false => sys::ncclRecv(ptr as *mut c_void, bytes, u8, 0, comm, stream),
        }
    };
    issued(result, if send { "ncclSend" } else { "ncclRecv" })
}

/// Where the pair from group rank `from` to `to` of `nccl`'s group hands its id over.
fn pair_key(nccl: &Nccl, from: usize, to: usize) -> String {
    format!("burn-comm/nccl-pair/{}/{from}->{to}", nccl.key())
}

/// What a receive compares: the send's dtype and shape.
fn description(dtype: DType, shape: &[usize]) -> String {
    format!("send of {dtype:?} {shape:?}")
}

/// A send's header, as words: the data's length, the description's length and the description.
fn header(bytes: usize, description: &str) -> Result<TensorData, Failure> {
    let len = description.len();
    if len > HEADER - 10 {
        return Err(Failure::Now(format!(
            "a {description} is too long to describe in a message header of {HEADER} bytes"
        )));
    }
    let mut header = [0u8; HEADER];
    header[..8].copy_from_slice(&(bytes as u64).to_le_bytes());
    header[8..10].copy_from_slice(&(len as u16).to_le_bytes());
    header[10..10 + len].copy_from_slice(description.as_bytes());
    let words: Vec<i32> = header
        .chunks_exact(4)
        .map(|word| i32::from_le_bytes(word.try_into().expect("4 bytes")))
        .collect();
    Ok(TensorData::new(words, [HEADER / 4]))
}

/// The data's length and the description in a header.
fn read_header(words: &TensorData) -> Result<(usize, String), String> {
    let garbled = || "the message header is garbled".to_string();
    let words = words.as_slice::<i32>().map_err(|_| garbled())?;
    let header: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    if header.len() != HEADER {
        return Err(garbled());
    }
    let bytes = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
    let len = usize::from(u16::from_le_bytes([header[8], header[9]]));
    let description = header
        .get(10..10 + len)
        .and_then(|text| std::str::from_utf8(text).ok())
        .ok_or_else(garbled)?;
    Ok((bytes as usize, description.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_reads_back_as_the_length_and_description() {
        let header = header(56, "send of BF16 [2, 0, 7]").unwrap();
        assert_eq!(header.shape.as_slice(), [HEADER / 4]);
        let (bytes, description) = read_header(&header).unwrap();
        assert_eq!(
            (bytes, description.as_str()),
            (56, "send of BF16 [2, 0, 7]")
        );
    }

    #[test]
    fn a_description_too_long_for_a_header_is_refused() {
        let long = description(DType::F32, &[1; 90]);
        assert!(header(4, &long).is_err());
        let garbled = TensorData::new(vec![i32::MAX; HEADER / 4], [HEADER / 4]);
        assert!(read_header(&garbled).is_err());
    }
}
