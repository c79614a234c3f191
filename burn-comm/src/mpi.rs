//! The MPI transport: ranks are processes, on one machine or many, and MPI moves the bytes.
//!
//! MPI only moves bytes here. Every reduction is done by this crate's kernels, in group-rank
//! order, so an all-reduce gives every rank the same bits as the local transport does, whatever
//! algorithm MPI picks, and works on every dtype the kernels know (bf16 and f16 included).
//!
//! MPI neither times out nor checks that ranks make the same call, so every collective starts
//! with a header exchange: each rank sends every peer a short header naming its call (its
//! number and a digest; the calls' text follows only when headers differ), point to point, and
//! waits for theirs. A peer whose header does not come within the group's timeout is named in a
//! [`CommError::Timeout`]; a peer that called something else gets a
//! [`CommError::Mismatch`] naming both calls. Only then do the ranks start the collective itself,
//! with MPI's blocking call under a watchdog that ends the job if it outlives the timeout. A
//! small call's data (up to [`CARRIED`] bytes to each peer) goes after the header, in the
//! headers' round, and is used only once the headers show every rank made the same call: one
//! round instead of two.
//!
//! Each group has three communicators, so that the headers, the collectives and the user's
//! point-to-point messages never match each other's messages.

use std::any::Any;
use std::ffi::c_int;
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mpi::ffi;
use smallvec::SmallVec;

use crate::call::{Call, PointToPoint};
use crate::kernels;
use crate::shared::SharedBuffer;
use crate::sync::lock;
use crate::transport::{
    FirstFailure, Payload, Stream, Transport, describe_message, frees_inline, message_digest,
    message_mismatch,
};
use crate::{CommError, ReduceOp};

/// Bytes of a call's header: the call number and the call's digest.
const HEADER: usize = 16;
/// Bytes of a call's or a message's description: a number and text (cut short if longer).
const TEXT: usize = 256;
/// How this build frames a call's opening round, digested into every call's header and sent
/// in its text when headers differ: builds that digest calls otherwise may go on together,
/// builds that frame them otherwise may not. Raise it with any change to the framing. (A
/// build from before this check sends its call's digest in the text's place of it, and only
/// the newer rank refuses; that ends the job all the same.)
const WIRE: u64 = 2;
/// Tags on the control communicator: call headers, then, only when they differ, the calls'
/// descriptions (the point-to-point tags below are on another communicator).
const TAG_CALL: c_int = 0;
const TAG_CALL_TEXT: c_int = 1;
/// The tag of an all-reduce's second half, point to point on the collectives' communicator
/// (where it cannot match a collective's messages).
const TAG_ALL_REDUCE: c_int = 3;
/// Tags on the point-to-point communicator: a message's header, then its payload.
const TAG_HEADER: c_int = 1;
const TAG_PAYLOAD: c_int = 2;
/// Up to this many bytes of a call's data go to each peer in the same round as its header:
/// a small collective then takes one round instead of two. The header and the data make a
/// peer's frame, sent in messages of at most [`EAGER`] bytes (the header in the first, so a
/// call carrying up to `EAGER - HEADER` bytes takes one message a peer, as a bare header does).
const CARRIED: usize = 2 * EAGER - HEADER;
/// The most a message of the opening round holds: what Open MPI sends at once, without waiting
/// for its receiver, under its shared-memory transport's eager limit (4 KiB with MPI's own
/// header, the smallest of its transports'). A 4 KiB message would wait for its receiver.
const EAGER: usize = 4096 - 64;
/// The tag of a frame's messages after its first (which is tagged [`TAG_CALL`]) on the control
/// communicator.
const TAG_CARRIED: c_int = 2;
/// A send up to this large that MPI did not finish at once waits in the group's deferred list,
/// completed by the group's next call (unless the send thread is sweeping them then) or by
/// that thread's sweep every [`SWEEP`], instead of by waking that thread for each (which cost a
/// 4 KiB send/recv at 4 processes on 2 cores half its time). The receiver of such a send may
/// still need this process's MPI to move it on (Open MPI's shared memory without single copy
/// sends about 4 KiB at once and the rest as the sender progresses): the sweep bounds that
/// wait. Larger sends go to the thread, which tests them as its waits do
/// ([`Backoff::background`]), some in the deferred list (see [`POLLED`]).
const DEFERRED: usize = 32 * 1024 - 128;
/// A send from this large (malloc maps such buffers until its threshold rises past them) whose
/// freeing unmaps nothing waits in the deferred list too, polled: tested by the send thread as
/// its waits do, and by the caller at the end of its next receive or call opening, which frees it
/// if done, before the caller allocates again. Freed by the thread alone, it went up to one of
/// the wait's 100 µs sleeps late: after the caller had allocated its next tensor of that size,
/// which malloc then gave fresh memory (1.7x the time of a 16 MiB send/recv at 2 processes, in
/// page faults). Others the thread holds and frees off the caller's thread.
const POLLED: usize = 128 * 1024;
/// At most this many sends wait so; more go to the send thread.
const DEFERRED_COUNT: usize = 64;
/// How often the send thread tests the deferred sends while there are any: where a receiver
/// does need this process to move a send on (a transport without single copy), it waits at
/// most about this long for a caller that makes no MPI call meanwhile.
const SWEEP: Duration = Duration::from_millis(1);
/// Up to this many bytes, an all-reduce gathers every rank's whole tensor and reduces it on
/// every rank: one data round instead of two.
const SMALL_ALL_REDUCE: usize = 32 * 1024;

/// An MPI communicator handle. With `MPI_THREAD_MULTIPLE`, any thread may use it.
#[derive(Clone, Copy)]
struct Comm(ffi::MPI_Comm);

// SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE; a group's calls are ordered by its
// stream, and each of its sends is tested by one thread at a time (the sender's, or the
// group's send thread; deferred sends under their list's lock).
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    fn dup(self) -> Comm {
        let mut out = std::mem::MaybeUninit::uninit();
        // SAFETY: a valid communicator; MPI writes the new one.
        check(
            unsafe { ffi::MPI_Comm_dup(self.0, out.as_mut_ptr()) },
            "MPI_Comm_dup",
        );
        Comm(unsafe { out.assume_init() })
    }

    /// Frees the communicator; the caller holds [`FINALIZED`]'s read lock and saw `false`.
    fn free(mut self) {
        // SAFETY: a communicator this group made and nobody uses any more.
        unsafe { ffi::MPI_Comm_free(&mut self.0) };
    }
}

/// Whether MPI has been finalised. Finalising takes the write lock; whatever may call MPI
/// outside a collective (a group's drop, its send thread) holds the read lock meanwhile, so
/// MPI is never called after `MPI_Finalize`.
static FINALIZED: RwLock<bool> = RwLock::new(false);

/// MPI for this process, initialised with `MPI_THREAD_MULTIPLE` and finalised on drop.
pub(crate) struct Session {
    universe: ManuallyDrop<mpi::environment::Universe>,
}

impl Session {
    pub fn init() -> Result<Self, String> {
        use mpi::Threading;
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or("MPI is already initialised in this process; make one Process per process")?;
        if threading != Threading::Multiple {
            return Err(format!(
                "this MPI library provides only {threading:?} threading, and burn-comm calls MPI from several threads (MPI_THREAD_MULTIPLE); use an MPI built with thread support, such as Debian's Open MPI"
            ));
        }
        Ok(Self {
            universe: ManuallyDrop::new(universe),
        })
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let mut finalized = FINALIZED.write().unwrap_or_else(|e| e.into_inner());
        *finalized = true;
        // SAFETY: dropped once, here; the universe's drop calls MPI_Finalize.
        unsafe { ManuallyDrop::drop(&mut self.universe) };
    }
}

/// MPI's return codes are errors only with MPI_ERRORS_RETURN; the default handler aborts the
/// job first, printing MPI's own message. This catches what gets through.
/// It ends the job rather than panic: MPI may still use buffers of requests posted before, which
/// unwinding would free.
fn check(code: c_int, what: &str) {
    if code != 0 {
        abort(&format!("{what} failed with MPI error code {code}"));
    }
}

/// How a collective moving `total` bytes of `elem`-byte elements counts: in bytes while they fit
/// MPI's `int` (MPI's fastest path), else in elements of a contiguous datatype, so a message may
/// hold up to 2^31 - 1 elements. Returns the bytes per count and the datatype.
fn units(total: usize, elem: usize) -> (usize, ffi::MPI_Datatype) {
    match c_int::try_from(total) {
        Ok(_) => (1, byte()),
        Err(_) => (elem, unit(elem)),
    }
}

/// An MPI datatype of `elem` contiguous bytes, made once per size.
fn unit(elem: usize) -> ffi::MPI_Datatype {
    struct Units(Mutex<Vec<(usize, ffi::MPI_Datatype)>>);
    // SAFETY: datatype handles are plain values, usable from any thread under
    // MPI_THREAD_MULTIPLE.
    unsafe impl Sync for Units {}
    unsafe impl Send for Units {}
    static UNITS: Units = Units(Mutex::new(Vec::new()));
    let mut units = lock(&UNITS.0);
    if let Some(&(_, unit)) = units.iter().find(|(size, _)| *size == elem) {
        return unit;
    }
    let mut unit = std::mem::MaybeUninit::uninit();
    // SAFETY: MPI is initialised; the new type is committed before use.
    let unit = unsafe {
        check(
            ffi::MPI_Type_contiguous(elem as c_int, byte(), unit.as_mut_ptr()),
            "MPI_Type_contiguous",
        );
        let mut unit = unit.assume_init();
        check(ffi::MPI_Type_commit(&mut unit), "MPI_Type_commit");
        unit
    };
    units.push((elem, unit));
    unit
}

fn byte() -> ffi::MPI_Datatype {
    // SAFETY: a constant of the MPI library.
    unsafe { ffi::RSMPI_UINT8_T }
}

/// Requests in flight and the buffers they use, which must outlive them.
struct InFlight {
    requests: SmallVec<[ffi::MPI_Request; INLINE_REQUESTS]>,
    /// Which peer (group rank) each request waits for, to name it on a timeout.
    peers: SmallVec<[usize; INLINE_REQUESTS]>,
    buffers: Vec<Box<dyn Any + Send>>,
}

/// Requests an [`InFlight`] holds without allocating: a small call's opening round at up to 3
/// ranks (a message each way per peer).
const INLINE_REQUESTS: usize = 4;

// SAFETY: requests are plain handles; only one thread tests them at a time.
unsafe impl Send for InFlight {}

impl InFlight {
    fn new() -> Self {
        Self {
            requests: SmallVec::new(),
            peers: SmallVec::new(),
            buffers: Vec::new(),
        }
    }

    fn push(&mut self, peer: usize, start: impl FnOnce(*mut ffi::MPI_Request) -> c_int) {
        let mut request = std::mem::MaybeUninit::uninit();
        check(start(request.as_mut_ptr()), "starting an MPI request");
        // SAFETY: MPI wrote the request.
        self.requests.push(unsafe { request.assume_init() });
        self.peers.push(peer);
    }

    /// Posts a send of `count` units of `ty` at `buf` to `peer`, tagged `tag` on `comm`.
    ///
    /// # Safety
    /// `buf` must hold them and outlive the request (or be leaked with it).
    unsafe fn isend(
        &mut self,
        peer: usize,
        (buf, count, ty): (*const u8, c_int, ffi::MPI_Datatype),
        (tag, comm): (c_int, Comm),
    ) {
        // SAFETY: as the caller guarantees.
        self.push(peer, |r| unsafe {
            ffi::MPI_Isend(buf.cast(), count, ty, peer as c_int, tag, comm.0, r)
        });
    }

    /// Posts a receive of `count` units of `ty` into `buf` from `peer`, tagged `tag` on `comm`.
    ///
    /// # Safety
    /// `buf` must hold them and outlive the request (or be leaked with it).
    unsafe fn irecv(
        &mut self,
        peer: usize,
        (buf, count, ty): (*mut u8, c_int, ffi::MPI_Datatype),
        (tag, comm): (c_int, Comm),
    ) {
        // SAFETY: as the caller guarantees.
        self.push(peer, |r| unsafe {
            ffi::MPI_Irecv(buf.cast(), count, ty, peer as c_int, tag, comm.0, r)
        });
    }

    /// Tests the requests once, as one (a single round of MPI's progress); whether all are
    /// complete. Until they all are, none is freed.
    fn test(&mut self) -> bool {
        let count = c_int::try_from(self.requests.len()).expect("a request per peer");
        let mut flag: c_int = 0;
        // SAFETY: live requests (or null ones, which MPI skips).
        check(
            unsafe {
                ffi::MPI_Testall(
                    count,
                    self.requests.as_mut_ptr(),
                    &mut flag,
                    ffi::RSMPI_STATUSES_IGNORE,
                )
            },
            "MPI_Testall",
        );
        flag != 0
    }

    /// Tests every request on its own, so that each one complete is freed.
    fn test_each(&mut self) {
        let null = unsafe { ffi::RSMPI_REQUEST_NULL };
        for request in self.requests.iter_mut().filter(|r| **r != null) {
            let mut flag: c_int = 0;
            // SAFETY: a live request (MPI sets it to null once complete).
            check(
                unsafe { ffi::MPI_Test(request, &mut flag, ffi::RSMPI_STATUS_IGNORE) },
                "MPI_Test",
            );
        }
    }

    /// Blocks until every request is complete (MPI_Waitall), for a phase that must not
    /// return while MPI may use its buffers; returns MPI's code.
    fn wait_all(mut self) -> c_int {
        let count = c_int::try_from(self.requests.len()).expect("a request per peer");
        // SAFETY: live requests (or null ones, which MPI skips).
        unsafe {
            ffi::MPI_Waitall(
                count,
                self.requests.as_mut_ptr(),
                ffi::RSMPI_STATUSES_IGNORE,
            )
        }
    }

    /// The peers of the requests not freed: not complete, or not yet found complete on their
    /// own (see [`test_each`](Self::test_each)).
    fn pending(&self) -> Vec<usize> {
        let null = unsafe { ffi::RSMPI_REQUEST_NULL };
        let mut peers: Vec<usize> = self
            .requests
            .iter()
            .zip(&self.peers)
            .filter(|(r, _)| **r != null)
            .map(|(_, &p)| p)
            .collect();
        peers.dedup();
        peers
    }

    /// Polls until every request is complete, pausing as `backoff` says, or until `deadline()`
    /// has passed (asked at every poll once `backoff` has spun: most of the caller's waits end
    /// before): then the requests and their buffers are abandoned (MPI may still use them) and
    /// the peers still pending are returned.
    fn wait(
        mut self,
        mut backoff: Backoff,
        deadline: impl Fn() -> Instant,
    ) -> Result<(), Vec<usize>> {
        loop {
            if self.test() {
                return Ok(());
            }
            if backoff.spun() && Instant::now() >= deadline() {
                // The last requests may have completed since they were tested together.
                self.test_each();
                let pending = self.pending();
                return match pending.is_empty() {
                    true => Ok(()),
                    false => Err(pending),
                };
            }
            backoff.pause();
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // MPI may still read or write the buffers of requests not complete: leak them rather
        // than free memory MPI uses.
        if !self.pending().is_empty() {
            std::mem::forget(std::mem::take(&mut self.buffers));
        }
    }
}

/// How a polling thread waits between tests: spins first (a collective among processes on one
/// machine takes microseconds; the caller's waits only), then yields, then sleeps, so a long
/// wait leaves the cores to the computation.
struct Backoff {
    spins: u32,
    /// When it first yielded.
    yielding_since: Option<Instant>,
}

impl Backoff {
    const SPINS: u32 = 64;

    /// For the caller's own waits.
    fn new() -> Self {
        Self {
            spins: 0,
            yielding_since: None,
        }
    }

    /// For the send thread's, which yield from the first test: the caller is often inside MPI
    /// meanwhile, and the two threads' tests back to back slow each other, likely on MPI's
    /// locks (the 64 spins cost send/recv at 2 processes a few percent from 64 KiB to 4 MiB;
    /// BENCHMARKS.md).
    fn background() -> Self {
        Self {
            spins: Self::SPINS,
            yielding_since: None,
        }
    }

    /// Whether the spins are over: the clock has not been read before.
    fn spun(&self) -> bool {
        self.spins >= Self::SPINS
    }

    fn pause(&mut self) {
        if !self.spun() {
            self.spins += 1;
            std::hint::spin_loop();
            return;
        }
        let since = *self.yielding_since.get_or_insert_with(Instant::now);
        if since.elapsed() < Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// Whether the parts of a tensor of `dims` along `dim` are whole consecutive blocks of its
/// row-major buffer: nothing but ones comes before `dim`.
fn parts_are_blocks(dims: &[usize], dim: usize) -> bool {
    dims[..dim].iter().all(|&d| d == 1)
}

/// A call's deadline: its timeout counted from when a wait first asks for it, once that wait's
/// first spins are over. Most calls end before, and never read the clock for it.
struct Deadline {
    timeout: Duration,
    at: std::cell::OnceCell<Instant>,
}

impl Deadline {
    fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            at: std::cell::OnceCell::new(),
        }
    }

    fn get(&self) -> Instant {
        *self.at.get_or_init(|| deadline_after(self.timeout))
    }
}

/// Now plus `timeout`, or a year from now for a timeout too long to represent.
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
}

/// Counts and displacements of a `v` collective, as MPI takes them (`int`s); an error gives the
/// end of the part that does not fit.
fn counts(parts: impl Iterator<Item = (usize, usize)>) -> Result<(Vec<c_int>, Vec<c_int>), usize> {
    let mut counts = Vec::new();
    let mut displs = Vec::new();
    for (start, len) in parts {
        let end = start + len;
        let fit = |v: usize| c_int::try_from(v).map_err(|_| end);
        counts.push(fit(len)?);
        displs.push(fit(start)?);
    }
    Ok((counts, displs))
}

/// What a call sends each peer in its opening round, besides its header.
#[derive(Clone, Copy)]
enum Carry<'a> {
    /// Nothing: the data follows in a phase of its own.
    Nothing,
    /// The same bytes to every peer.
    Same(&'a [u8]),
    /// Block `p` (the `block` bytes at `p * block`) to peer `p`.
    Blocks(&'a [u8], usize),
}

impl Carry<'_> {
    /// Bytes carried to each peer.
    fn per_peer(&self) -> usize {
        match *self {
            Carry::Nothing => 0,
            Carry::Same(bytes) => bytes.len(),
            Carry::Blocks(_, block) => block,
        }
    }
}

/// Which peers send this rank data in a call's opening round.
#[derive(Clone, Copy)]
enum Carriers {
    None,
    /// Every peer, each as many bytes as this rank carries to each.
    All,
    /// A broadcast's root, this many bytes.
    Rank(usize, usize),
}

impl Carriers {
    fn include(self, peer: usize) -> bool {
        match self {
            Carriers::None => false,
            Carriers::All => true,
            Carriers::Rank(rank, _) => rank == peer,
        }
    }

    /// Bytes each carrier sends this rank, when this rank carries `carry`.
    fn bytes(self, carry: Carry) -> usize {
        match self {
            Carriers::None => 0,
            Carriers::All => carry.per_peer(),
            Carriers::Rank(_, bytes) => bytes,
        }
    }
}

/// The bytes of a peer's frame in a call's opening round (its header, then `carried` bytes)
/// that each message carries: [`EAGER`] bytes each but the last.
fn frame_messages(carried: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let len = HEADER + carried;
    (0..len.div_ceil(EAGER)).map(move |m| m * EAGER..len.min((m + 1) * EAGER))
}

/// Every rank's frame of a call's opening round, each in a slot of `slot` bytes: each peer's
/// as it came (its header, then what it carried), and this rank's header, followed by what it
/// carries when every peer gets the same bytes.
struct Frames {
    buffer: SharedBuffer,
    slot: usize,
}

impl Frames {
    /// The group's ranks, a slot each.
    fn ranks(&self) -> usize {
        self.buffer.len() / self.slot
    }

    fn header(&self, r: usize) -> [u8; HEADER] {
        // SAFETY: slot `r` lies inside the buffer, its header written (by this rank, or by MPI
        // once peer r's first message came).
        unsafe { std::ptr::read_unaligned(self.buffer.ptr().add(r * self.slot).cast()) }
    }

    /// What rank `r` carried.
    fn carried(&self, r: usize) -> *const u8 {
        self.buffer
            .ptr()
            .wrapping_add(r * self.slot + HEADER)
            .cast_const()
    }
}

/// Bytes of a frame's slot, when at most `most` bytes are carried to or from a peer: room for
/// a whole message of [`EAGER`] bytes at each message's start (a peer that made another call
/// may send more than this call expects, which must not end the job in MPI), in whole
/// multiples of 16 bytes, so that every slot's data is as aligned as the buffer.
fn slot_for(most: usize) -> usize {
    (HEADER + most).div_ceil(EAGER) * EAGER
}

/// A call every rank has joined: its number, and every rank's frame.
struct Opened {
    seq: u64,
    frames: Frames,
}

impl Opened {
    /// Rank `r`'s block: this rank's `own`, or what peer `r` carried. The calls are the same,
    /// so each carried as many bytes as this rank's call expects.
    fn block(&self, r: usize, me: usize, own: *const u8) -> *const u8 {
        match r == me {
            true => own,
            false => self.frames.carried(r),
        }
    }

    /// Every rank's [`block`](Self::block), in group-rank order.
    fn blocks(&self, me: usize, own: *const u8) -> Vec<*const u8> {
        (0..self.frames.ranks())
            .map(|r| self.block(r, me, own))
            .collect()
    }
}

/// A call's opening round once every header came: the frames' later messages may still be in
/// flight. Dropped without [`complete`](Self::complete) (the calls differ, or an error came
/// first), it gives the frames up: a peer may never send what was expected, so what MPI may
/// still use is leaked.
struct CarriedInFlight {
    flight: Option<InFlight>,
    /// This rank's frame for each peer, when each gets its own block: the caller's tensor may
    /// go while MPI still reads them.
    outgoing: Option<SharedBuffer>,
    frames: Option<Frames>,
}

impl CarriedInFlight {
    fn frames(&self) -> &Frames {
        self.frames.as_ref().expect("not yet completed")
    }

    /// Every rank's header, in group-rank order.
    fn headers(&self) -> Vec<[u8; HEADER]> {
        let frames = self.frames();
        (0..frames.ranks()).map(|r| frames.header(r)).collect()
    }

    /// Waits for every peer's data (the headers matched: each sends what was expected); on a
    /// timeout, the peers that sent nothing.
    fn complete(mut self, deadline: &Deadline) -> Result<Frames, Vec<usize>> {
        let flight = self.flight.take().expect("completed once");
        match flight.wait(Backoff::new(), || deadline.get()) {
            Ok(()) => Ok(self.frames.take().expect("completed once")),
            Err(missing) => {
                std::mem::forget((self.outgoing.take(), self.frames.take()));
                Err(missing)
            }
        }
    }
}

impl Drop for CarriedInFlight {
    fn drop(&mut self) {
        if let Some(mut flight) = self.flight.take()
            && !flight.test()
        {
            std::mem::forget((self.outgoing.take(), self.frames.take()));
        }
    }
}

/// One group of processes, as this process sees it.
pub(crate) struct MpiGroup {
    name: String,
    /// Global ranks, in group-rank order.
    members: Vec<usize>,
    /// This process's rank in the group.
    me: usize,
    /// The collectives' data.
    data: Comm,
    /// The headers that open every collective.
    control: Comm,
    /// The user's sends and receives.
    p2p: Comm,
    timeout: Duration,
    /// The first failure; every later call fails with it.
    failure: FirstFailure,
    /// The thread that completes this group's sends MPI did not finish at once, started by the
    /// first such.
    sender: Mutex<Option<Sender>>,
    /// Sends MPI has not finished that are not the send thread's alone (see [`DEFERRED`]),
    /// completed by this group's calls or by the send thread.
    deferred: Arc<DeferredSends>,
}

/// A group's deferred sends, shared with its send thread.
#[derive(Default)]
struct DeferredSends {
    sends: Mutex<Deferred>,
    /// Whether `sends` holds any: every call reads it, the lock only then. Written under the
    /// lock; a stale `false` only leaves the sends to the next call or the sweep.
    any: AtomicBool,
    /// Whether `sends` holds a polled one ([`POLLED`]), kept as `any` is.
    has_polled: AtomicBool,
}

impl DeferredSends {
    /// Runs `f` on the sends under their lock.
    fn with<R>(&self, f: impl FnOnce(&mut Deferred) -> R) -> R {
        self.run_locked(lock(&self.sends), f)
    }

    /// Sweeps the sends, unless the send thread holds them: it is sweeping them then, and a
    /// caller that waited for it would wait longer still on cores it shares with the thread.
    fn sweep_unless_busy(&self) {
        let sends = match self.sends.try_lock() {
            Ok(sends) => sends,
            Err(TryLockError::Poisoned(poison)) => poison.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        self.run_locked(sends, sweep);
    }

    /// Runs `f` on the locked sends, then brings the flags up to date.
    fn run_locked<R>(
        &self,
        mut sends: MutexGuard<Deferred>,
        f: impl FnOnce(&mut Deferred) -> R,
    ) -> R {
        let result = f(&mut sends);
        self.any.store(!sends.flights.is_empty(), Ordering::Release);
        self.has_polled.store(sends.any_polled(), Ordering::Release);
        result
    }
}

/// A group's deferred sends.
#[derive(Default)]
struct Deferred {
    flights: Vec<DeferredSend>,
    /// Whether the send thread sweeps them: it stops only when its sweep finds none, and is
    /// woken by the next one deferred (and by the first polled one while it sweeps slowly).
    swept: bool,
}

impl Deferred {
    /// Whether the send thread tests them as its waits do, not every [`SWEEP`].
    fn any_polled(&self) -> bool {
        self.flights.iter().any(|send| send.polled)
    }
}

struct DeferredSend {
    flight: InFlight,
    /// When it is given up (not received in time: the receiver reports it).
    until: Instant,
    /// A large send ([`POLLED`]).
    polled: bool,
}

/// What the send thread is given.
enum ToSend {
    /// A send to complete, in order.
    Flight(InFlight),
    /// Deferred sends to sweep until none is left: every [`SWEEP`], or as the thread's waits
    /// test theirs while a polled one is among them.
    Sweep,
}

struct Sender {
    queue: mpsc::Sender<ToSend>,
    thread: JoinHandle<()>,
    /// Set when the group is dropped: every send still queued must be done by then.
    drain: Arc<OnceLock<Instant>>,
}

impl MpiGroup {
    /// The world of this process's MPI job (MPI is initialised).
    pub(crate) fn world(timeout: Duration) -> Arc<Self> {
        // SAFETY: a constant of the MPI library.
        let world = Comm(unsafe { ffi::RSMPI_COMM_WORLD });
        let (mut rank, mut size) = (0, 0);
        // SAFETY: MPI is initialised.
        unsafe {
            ffi::MPI_Comm_rank(world.0, &mut rank);
            ffi::MPI_Comm_size(world.0, &mut size);
        }
        Arc::new(Self::over(
            "world".to_string(),
            (0..size as usize).collect(),
            rank as usize,
            world.dup(),
            timeout,
        ))
    }

    fn over(name: String, members: Vec<usize>, me: usize, data: Comm, timeout: Duration) -> Self {
        Self {
            name,
            members,
            me,
            control: data.dup(),
            p2p: data.dup(),
            data,
            timeout,
            failure: FirstFailure::default(),
            sender: Mutex::new(None),
            deferred: Arc::default(),
        }
    }

    /// This process's rank in the group.
    pub(crate) fn rank(&self) -> usize {
        self.me
    }

    pub(crate) fn size(&self) -> usize {
        self.members.len()
    }

    fn deadline(&self) -> Deadline {
        Deadline::new(self.timeout)
    }

    /// Keeps `flight` among the deferred sends, unless there are too many; has the send thread
    /// sweep them if it was not, or poll them if `polled` and it was not.
    fn defer(&self, flight: InFlight, polled: bool) -> Result<(), InFlight> {
        let until = deadline_after(self.timeout);
        let wake = self.deferred.with(|deferred| {
            if deferred.flights.len() >= DEFERRED_COUNT {
                return Err(flight);
            }
            let starts_polling = polled && !deferred.any_polled();
            deferred.flights.push(DeferredSend {
                flight,
                until,
                polled,
            });
            Ok(!std::mem::replace(&mut deferred.swept, true) || starts_polling)
        })?;
        if wake {
            // The thread sweeps until it finds none left: one wake-up for a run of sends.
            let _ = self.sender().send(ToSend::Sweep);
        }
        Ok(())
    }

    /// Frees the deferred sends MPI has finished.
    fn complete_deferred(&self) {
        if self.deferred.any.load(Ordering::Acquire) {
            self.deferred.sweep_unless_busy();
        }
    }

    /// Frees the deferred sends MPI has finished if a polled one is among them: at the end of a
    /// call, before the caller allocates again, so it waits for the lock. (Small ones wait for
    /// the next call: testing them sooner frees no memory malloc would not serve again from its
    /// bins.)
    fn complete_polled(&self) {
        if self.deferred.has_polled.load(Ordering::Acquire) {
            self.deferred.with(sweep);
        }
    }

    fn broken(&self) -> Result<(), CommError> {
        self.failure.check(&self.name)
    }

    /// Records `error` as the group's failure and returns it.
    fn break_with(&self, error: CommError) -> CommError {
        self.failure.record(error)
    }

    fn timeout_error(&self, op: String, missing: Vec<usize>) -> CommError {
        self.break_with(CommError::Timeout {
            op,
            group: self.name.clone(),
            rank: self.members[self.me],
            missing: missing.into_iter().map(|r| self.members[r]).collect(),
            after: self.timeout,
        })
    }

    /// Opens call `seq`: sends `call`'s header to every peer and checks theirs. On return every
    /// rank of the group is in the same call.
    fn open(&self, stream: &mut Stream, call: &Call) -> Result<u64, CommError> {
        self.open_carrying(stream, call, Carry::Nothing, Carriers::None)
            .map(|opened| opened.seq)
    }

    /// Opens a call as [`open`](Self::open) does, sending each peer `carry` in the same round
    /// and receiving what `carriers` send. Once it returns, every peer made this same call, so
    /// what each carried is what this rank's call expects of it.
    fn open_carrying(
        &self,
        stream: &mut Stream,
        call: &Call,
        carry: Carry,
        carriers: Carriers,
    ) -> Result<Opened, CommError> {
        self.broken()?;
        self.complete_deferred();
        let seq = stream.next_seq();
        // The framing's version is digested with the call, so ranks of builds that frame calls
        // otherwise compare their calls' text, which tells them apart.
        let digest = call.digest(WIRE);
        let mut mine = [0u8; HEADER];
        mine[..8].copy_from_slice(&seq.to_le_bytes());
        mine[8..].copy_from_slice(&digest.to_le_bytes());
        let deadline = self.deadline();
        let op_name = |phase: &str| format!("{call} (call {seq}{phase})");
        let data = self.swap_opening(mine, carry, carriers, &deadline, || op_name(""))?;
        let complete = |data: CarriedInFlight| {
            let frames = data
                .complete(&deadline)
                .map_err(|missing| self.timeout_error(op_name(""), missing))?;
            // Every peer has made this call since this process's last sends: most are done.
            self.complete_polled();
            Ok(Opened { seq, frames })
        };
        if (0..self.size()).all(|r| data.frames().header(r) == mine) {
            return complete(data);
        }
        // Another call, or the same one digested otherwise (another build): the calls' text
        // tells, within what is left of the call's deadline (a whole timeout if no wait has
        // asked for it yet).
        let text = Described::encode(seq, WIRE, &call.to_string());
        let texts = self.swap(text, TAG_CALL_TEXT, &deadline, || {
            op_name(", comparing calls")
        });
        // On an error or a mismatch, `data` is given up as it drops.
        let texts: Vec<Described> = texts?.iter().map(Described::decode).collect();
        if let Some(other) = other_build(&texts) {
            return Err(self.break_with(CommError::Transport {
                op: op_name(""),
                group: self.name.clone(),
                rank: self.members[self.me],
                reason: format!(
                    "group rank {other} runs a build of burn-comm that frames its calls \
                     otherwise: every rank must run the same build"
                ),
            }));
        }
        let Some(other) = other_call(&data.headers(), &texts) else {
            return complete(data);
        };
        Err(self.break_with(CommError::Mismatch {
            group: self.name.clone(),
            rank: self.members[0],
            mine: texts[0].to_string(),
            other_rank: self.members[other],
            theirs: texts[other].to_string(),
        }))
    }

    /// Sends every peer its frame: `header` and what `carry` gives it; and receives every
    /// peer's frame into its slot (a header only, unless `carriers` include it), on the control
    /// communicator. Returns once every peer's header came (a peer whose header does not come
    /// by `deadline` is named in a timeout of `op`), with the rest of the frames, which may
    /// still be in flight.
    fn swap_opening(
        &self,
        header: [u8; HEADER],
        carry: Carry,
        carriers: Carriers,
        deadline: &Deadline,
        op: impl FnOnce() -> String,
    ) -> Result<CarriedInFlight, CommError> {
        let (size, me) = (self.size(), self.me);
        let (block, incoming) = (carry.per_peer(), carriers.bytes(carry));
        let most = block.max(incoming);
        assert!(
            most <= CARRIED,
            "{most} bytes carried to or from a peer, beyond {CARRIED}"
        );
        let slot = slot_for(most);
        let frames = SharedBuffer::uninit(size * slot);
        let own = frames.ptr().wrapping_add(me * slot);
        let frame = HEADER + block;
        // SAFETY: this rank's slot lies inside `frames`, which is not shared yet, and holds a
        // frame; so does each peer's in `outgoing`.
        let outgoing = unsafe {
            std::ptr::copy_nonoverlapping(header.as_ptr(), own, HEADER);
            match carry {
                Carry::Nothing => None,
                Carry::Same(bytes) => {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), own.add(HEADER), block);
                    None
                }
                // A frame per peer, from a copy: the caller's tensor may go while MPI still
                // reads them.
                Carry::Blocks(bytes, _) => {
                    let outgoing = SharedBuffer::uninit(size * frame);
                    for peer in (0..size).filter(|&p| p != me) {
                        let at = outgoing.ptr().add(peer * frame);
                        std::ptr::copy_nonoverlapping(header.as_ptr(), at, HEADER);
                        let part = bytes[peer * block..].as_ptr();
                        std::ptr::copy_nonoverlapping(part, at.add(HEADER), block);
                    }
                    Some(outgoing)
                }
            }
        };
        let (mut first, mut rest) = (InFlight::new(), InFlight::new());
        for peer in (0..size).filter(|&p| p != me) {
            let on = |m: usize| match m {
                0 => (TAG_CALL, self.control),
                _ => (TAG_CARRIED, self.control),
            };
            let expected = if carriers.include(peer) { incoming } else { 0 };
            let sent = match &outgoing {
                Some(outgoing) => outgoing.ptr().wrapping_add(peer * frame),
                None => own,
            };
            // SAFETY: every message lies inside its frame, in `frames` or `outgoing`, neither of
            // which is freed until its requests complete (they are leaked with them otherwise).
            unsafe {
                for (m, message) in frame_messages(expected).enumerate() {
                    let into = frames.ptr().add(peer * slot + message.start);
                    let flight = if m == 0 { &mut first } else { &mut rest };
                    // Room for a whole message each (see `slot`).
                    flight.irecv(peer, (into, EAGER as c_int, byte()), on(m));
                }
                for (m, message) in frame_messages(block).enumerate() {
                    let from = sent.add(message.start).cast_const();
                    let flight = if m == 0 { &mut first } else { &mut rest };
                    flight.isend(peer, (from, message.len() as c_int, byte()), on(m));
                }
            }
        }
        let frames_in_flight = CarriedInFlight {
            flight: Some(rest),
            outgoing,
            frames: Some(Frames {
                buffer: frames,
                slot,
            }),
        };
        if let Err(missing) = first.wait(Backoff::new(), || deadline.get()) {
            // The headers' requests use the frames too.
            std::mem::forget(frames_in_flight);
            return Err(self.timeout_error(op(), missing));
        }
        Ok(frames_in_flight)
    }

    /// Sends `mine` to every peer on the control communicator, tagged `tag`, and returns every
    /// rank's in group-rank order. A peer that sends nothing by `deadline` is named in a
    /// timeout of `op`.
    fn swap<const N: usize>(
        &self,
        mine: [u8; N],
        tag: c_int,
        deadline: &Deadline,
        op: impl FnOnce() -> String,
    ) -> Result<Vec<[u8; N]>, CommError> {
        // Boxed: on a timeout they are leaked with the requests that use them.
        let mine = Box::new(mine);
        let mut all = vec![*mine; self.size()];
        let base = all.as_mut_ptr();
        let mut flight = InFlight::new();
        for peer in (0..self.size()).filter(|&p| p != self.me) {
            // SAFETY: inside `all`, which is not touched again until the requests complete.
            let buf = unsafe { base.add(peer) }.cast::<u8>();
            // SAFETY: `all` and `mine` outlive the requests.
            unsafe { flight.irecv(peer, (buf, N as c_int, byte()), (tag, self.control)) };
            unsafe {
                flight.isend(
                    peer,
                    (mine.as_ptr(), N as c_int, byte()),
                    (tag, self.control),
                )
            };
        }
        if let Err(missing) = flight.wait(Backoff::new(), || deadline.get()) {
            std::mem::forget(mine);
            std::mem::forget(all);
            return Err(self.timeout_error(op(), missing));
        }
        Ok(all)
    }

    /// Runs the data phase of call `seq`, blocking (MPI's own collectives, faster than its
    /// non-blocking ones for small messages, or a wait for point-to-point requests, as in the
    /// large all-reduce's second half). Every rank joined the call (their headers came),
    /// so it can only outlive the timeout if a peer died or froze inside it; MPI may then
    /// still write to this rank's buffers, so the watchdog ends the job instead.
    fn exchange(&self, op: &Call, seq: u64, run: impl FnOnce() -> c_int) -> Result<(), CommError> {
        freeze_if_asked(self.members[self.me]);
        // Written only if the watchdog needs it: formatting it costs a small call's time.
        let (call, group, members, me, after) = (
            op.clone(),
            self.name.clone(),
            self.members.clone(),
            self.me,
            self.timeout,
        );
        let message = move || {
            let error = CommError::Timeout {
                op: format!("{call} (call {seq}, data exchange)"),
                group,
                rank: members[me],
                missing: (0..members.len())
                    .filter(|&r| r != me)
                    .map(|r| members[r])
                    .collect(),
                after,
            };
            format!("rank {} ends the job: {error}", members[me])
        };
        check(
            watchdog::watch(deadline_after(self.timeout), Box::new(message), run),
            "an MPI collective",
        );
        Ok(())
    }

    fn too_large(&self, call: &Call, elems: usize) -> CommError {
        CommError::InvalidArgument {
            op: call.to_string(),
            group: self.name.clone(),
            reason: format!(
                "a message of {elems} elements is beyond what MPI can count in one call (2^31 - 1); split the tensor"
            ),
        }
    }

    /// Every rank's `len` elements of `elem` bytes at `src`, concatenated in rank order at `dst`.
    fn all_gather_elems(
        &self,
        call: &Call,
        seq: u64,
        (src, len): (*const u8, usize),
        dst: *mut u8,
        elem: usize,
    ) -> Result<(), CommError> {
        let (per, ty) = units(self.size() * len * elem, elem);
        let count = c_int::try_from(len * elem / per).map_err(|_| self.too_large(call, len))?;
        // SAFETY: `src` holds `len` elements and `dst` `size * len`, both alive until the call
        // ends (a call that outlives the timeout ends the job, see `exchange`).
        self.exchange(call, seq, || unsafe {
            ffi::MPI_Allgather(src.cast(), count, ty, dst.cast(), count, ty, self.data.0)
        })
    }

    /// Block `r` of `send` (`block` elements of `elem` bytes each) to rank `r`; block `r` of
    /// `recv` from rank `r`.
    fn all_to_all_elems(
        &self,
        call: &Call,
        seq: u64,
        (send, block): (*const u8, usize),
        recv: *mut u8,
        elem: usize,
    ) -> Result<(), CommError> {
        let (per, ty) = units(self.size() * block * elem, elem);
        let count = c_int::try_from(block * elem / per).map_err(|_| self.too_large(call, block))?;
        // SAFETY: both buffers hold `size * block` elements and outlive the call.
        self.exchange(call, seq, || unsafe {
            ffi::MPI_Alltoall(send.cast(), count, ty, recv.cast(), count, ty, self.data.0)
        })
    }

    fn sender(&self) -> mpsc::Sender<ToSend> {
        let mut sender = lock(&self.sender);
        let sender = sender.get_or_insert_with(|| {
            let (queue, inbox) = mpsc::channel::<ToSend>();
            let timeout = self.timeout;
            let drain = Arc::new(OnceLock::new());
            let deadline = drain.clone();
            let deferred = self.deferred.clone();
            let thread = std::thread::Builder::new()
                .name(format!("mpi-send-{}", self.name))
                .spawn(move || complete_sends(inbox, timeout, &deadline, &deferred))
                .expect("the OS refused to start a thread");
            Sender {
                queue,
                thread,
                drain,
            }
        });
        sender.queue.clone()
    }
}

/// Completes in the background a group's sends that MPI did not finish at once, in the order
/// they were queued (MPI needs the sender to make progress on large messages), and sweeps its
/// deferred sends while there are any: every [`SWEEP`], or as its waits test their requests
/// while a polled one is among them. Gives up on a send after `timeout`, or at the `drain`
/// deadline the group's drop sets.
fn complete_sends(
    inbox: mpsc::Receiver<ToSend>,
    timeout: Duration,
    drain: &OnceLock<Instant>,
    deferred: &DeferredSends,
) {
    let mut sweeping = false;
    // While a polled send is deferred, how the thread waits between sweeps.
    let mut polling: Option<Backoff> = None;
    loop {
        let next = match (&mut polling, sweeping) {
            (Some(backoff), _) => {
                backoff.pause();
                inbox.try_recv().map_err(|e| match e {
                    mpsc::TryRecvError::Empty => mpsc::RecvTimeoutError::Timeout,
                    mpsc::TryRecvError::Disconnected => mpsc::RecvTimeoutError::Disconnected,
                })
            }
            (None, true) => inbox.recv_timeout(SWEEP),
            (None, false) => inbox
                .recv()
                .map_err(|_| mpsc::RecvTimeoutError::Disconnected),
        };
        let flight = match next {
            Ok(ToSend::Flight(flight)) => flight,
            Ok(ToSend::Sweep) => {
                sweeping = true;
                // A new polled send: tested from the next yield on, as the thread's waits are.
                if deferred.has_polled.load(Ordering::Acquire) {
                    polling = Some(Backoff::background());
                }
                continue;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let polled;
                (sweeping, polled) = deferred.with(|deferred| {
                    sweep(deferred);
                    // None left: stop until a deferred send wakes this thread again.
                    deferred.swept = !deferred.flights.is_empty();
                    (deferred.swept, deferred.any_polled())
                });
                polling = match polled {
                    true => polling.or_else(|| Some(Backoff::background())),
                    false => None,
                };
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        };
        let finalized = FINALIZED.read().unwrap_or_else(|e| e.into_inner());
        if *finalized {
            // A group that outlived MPI: its sends can no longer complete.
            std::mem::forget(flight);
            continue;
        }
        let own = deadline_after(timeout);
        // A send not received in time: the receiver reports the timeout.
        let _ = flight.wait(Backoff::background(), || {
            drain.get().map_or(own, |&d| d.min(own))
        });
    }
}

/// Tests the deferred sends (which also moves them on in MPI), frees those finished and gives
/// up those past their time.
fn sweep(deferred: &mut Deferred) {
    if deferred.flights.is_empty() {
        return;
    }
    let finalized = FINALIZED.read().unwrap_or_else(|e| e.into_inner());
    if *finalized {
        // A group that outlived MPI: its sends can no longer complete.
        std::mem::forget(std::mem::take(&mut deferred.flights));
        return;
    }
    let now = Instant::now();
    // A flight given up while pending leaks its buffers as it drops (MPI may still use them).
    deferred
        .flights
        .retain_mut(|send| !send.flight.test() && now < send.until);
}

impl Drop for MpiGroup {
    fn drop(&mut self) {
        // Deliver what is queued, deferred sends last, before the communicators go, within
        // one timeout in all. A deferred send started the thread, so it is there to take them
        // (dropped otherwise, a pending flight leaks its buffers).
        let deferred = self
            .deferred
            .with(|deferred| std::mem::take(&mut deferred.flights));
        if let Some(sender) = lock(&self.sender).take() {
            let _ = sender.drain.set(deadline_after(self.timeout));
            for send in deferred {
                let _ = sender.queue.send(ToSend::Flight(send.flight));
            }
            drop(sender.queue);
            let _ = sender.thread.join();
        }
        let finalized = FINALIZED.read().unwrap_or_else(|e| e.into_inner());
        if !*finalized {
            for comm in [self.data, self.control, self.p2p] {
                comm.free();
            }
        }
    }
}

/// The first rank whose build frames calls otherwise than this one's, given every rank's
/// call as text (whose digest field holds its build's [`WIRE`]).
fn other_build(texts: &[Described]) -> Option<usize> {
    texts.iter().position(|text| text.digest != WIRE)
}

/// The rank (not 0) whose call differs from rank 0's, given every rank's header and, since
/// those differ, every rank's call as text; None when the texts show the calls are the same
/// (another build digests them otherwise). A text cut short shows nothing: then the first rank
/// whose header differs from rank 0's is named.
fn other_call(headers: &[[u8; HEADER]], texts: &[Described]) -> Option<usize> {
    let call = |d: &Described| (d.number, d.text.clone(), d.cut);
    let first = call(&texts[0]);
    if let Some(other) = (1..texts.len()).find(|&r| call(&texts[r]) != first) {
        return Some(other);
    }
    match first.2 {
        true => (1..headers.len()).find(|&r| headers[r] != headers[0]),
        false => None,
    }
}

/// A number, a digest and a text, sent as `TEXT` bytes: a call's number, its build's [`WIRE`]
/// and text when headers differ, or a message's length, digest and description before its
/// payload.
struct Described {
    number: u64,
    digest: u64,
    text: String,
    /// Whether the text was longer than the block holds (then only its start was sent).
    cut: bool,
}

impl Described {
    /// Where the text starts, after the number, the digest and the text's length.
    const TEXT_AT: usize = 18;

    fn encode(number: u64, digest: u64, text: &str) -> [u8; TEXT] {
        let mut out = [0u8; TEXT];
        out[..8].copy_from_slice(&number.to_le_bytes());
        out[8..16].copy_from_slice(&digest.to_le_bytes());
        let len = u16::try_from(text.len()).unwrap_or(u16::MAX);
        out[16..18].copy_from_slice(&len.to_le_bytes());
        let text = &text.as_bytes()[..text.len().min(TEXT - Self::TEXT_AT)];
        out[Self::TEXT_AT..Self::TEXT_AT + text.len()].copy_from_slice(text);
        out
    }

    fn decode(bytes: &[u8; TEXT]) -> Self {
        let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let len = u16::from_le_bytes([bytes[16], bytes[17]]) as usize;
        let kept = len.min(TEXT - Self::TEXT_AT);
        Self {
            number: word(0),
            digest: word(8),
            text: String::from_utf8_lossy(&bytes[Self::TEXT_AT..Self::TEXT_AT + kept]).into_owned(),
            cut: kept < len,
        }
    }
}

/// As a call is named in errors.
impl fmt::Display for Described {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let more = if self.cut { "..." } else { "" };
        write!(f, "{}{more} (call {})", self.text, self.number)
    }
}

impl Transport for MpiGroup {
    fn name(&self) -> &str {
        &self.name
    }

    fn members(&self) -> &[usize] {
        &self.members
    }

    fn all_reduce(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: Payload,
        reduce: ReduceOp,
    ) -> Result<Payload, CommError> {
        let mut data = data.into_host();
        let (dtype, size) = (data.dtype, self.size());
        let (len, elem) = (data.num_elements(), dtype.size());
        let bytes = len * elem;
        if bytes <= CARRIED {
            // One round: the whole tensor goes with the header, and every rank reduces all of
            // them in rank order, in place in its own.
            let opened =
                self.open_carrying(stream, &call, Carry::Same(&data.bytes), Carriers::All)?;
            let own = data.bytes.as_mut_ptr();
            let srcs = opened.blocks(me, own.cast_const());
            // SAFETY: the frames hold the peers' tensors, `own` this rank's; the kernel reads
            // each element before it writes it, so `own` may be both.
            unsafe { kernels::reduce(dtype, reduce, &srcs, &[own], len) };
            return Ok(data.into());
        }
        let seq = self.open(stream, &call)?;
        if bytes <= SMALL_ALL_REDUCE {
            let all = SharedBuffer::uninit(size * bytes);
            self.all_gather_elems(&call, seq, (data.bytes.as_ptr(), len), all.ptr(), elem)?;
            let srcs: Vec<*const u8> = (0..size)
                .map(|r| all.ptr().wrapping_add(r * bytes).cast_const())
                .collect();
            // SAFETY: `all` holds every rank's tensor; `data` is ours.
            unsafe { kernels::reduce(dtype, reduce, &srcs, &[data.bytes.as_mut_ptr()], len) };
            stream.retire(all);
            return Ok(data.into());
        }
        // Reduce-scatter (each rank reduces its slice of every rank's tensor, in rank order),
        // then all-gather the reduced slices. The rank's own slice never moves: it is reduced
        // in place in `data` and sent from there, which spares two copies of it.
        let slices: Vec<_> = (0..size)
            .map(|r| kernels::partition(len, size, r, kernels::SLICE_ALIGN))
            .collect();
        let mine = slices[me].clone();
        let part = mine.len() * elem;
        // The peers' copies of this rank's slice, in rank order without this rank.
        let received = SharedBuffer::uninit((size - 1) * part);
        let slot = |r: usize| r - usize::from(r > me);
        // In counts of `per` bytes, chosen from the largest buffer any rank uses (every rank
        // computes the same slices).
        let largest = slices.iter().map(|s| s.len()).max().unwrap_or(0);
        let (per, ty) = units((len + size * largest) * elem, elem);
        let scale = elem / per;
        // Nothing to or from this rank itself.
        let peer_only = |r: usize, count: usize| if r == me { 0 } else { count };
        let (send_counts, send_displs) = counts((0..size).map(|r| {
            (
                slices[r].start * scale,
                peer_only(r, slices[r].len() * scale),
            )
        }))
        .map_err(|_| self.too_large(&call, len))?;
        let (recv_counts, recv_displs) = counts((0..size).map(|r| {
            (
                slot(r) * mine.len() * scale,
                peer_only(r, mine.len() * scale),
            )
        }))
        .map_err(|_| self.too_large(&call, len))?;
        let own_count =
            c_int::try_from(mine.len() * scale).map_err(|_| self.too_large(&call, len))?;
        // Every pointer into `data` comes from this one.
        let base = data.bytes.as_mut_ptr();
        // SAFETY: the buffers outlive the call; counts and displacements stay inside them.
        self.exchange(&call, seq, || unsafe {
            ffi::MPI_Alltoallv(
                base.cast_const().cast(),
                send_counts.as_ptr(),
                send_displs.as_ptr(),
                ty,
                received.ptr().cast(),
                recv_counts.as_ptr(),
                recv_displs.as_ptr(),
                ty,
                self.data.0,
            )
        })?;
        let own = base.wrapping_add(mine.start * elem);
        let srcs: Vec<*const u8> = (0..size)
            .map(|r| match r == me {
                true => own.cast_const(),
                false => received.ptr().wrapping_add(slot(r) * part).cast_const(),
            })
            .collect();
        // SAFETY: `received` holds the peers' copies of this slice and `own` this rank's; the
        // kernel reads each block before it writes it, so `own` may be both.
        unsafe { kernels::reduce(dtype, reduce, &srcs, &[own], mine.len()) };
        stream.retire(received);
        // Every peer's reduced slice, straight into its place in `data`. Point to point, since
        // MPI's all-gather would need this rank's slice outside `data` (no MPI_IN_PLACE here).
        let mut flight = InFlight::new();
        for peer in (0..size).filter(|&r| r != me) {
            // Checked above, as what this rank sent the peer: nothing may fail once the first
            // request is posted.
            let their_count = send_counts[peer];
            let at = base.wrapping_add(slices[peer].start * elem);
            // SAFETY: the slices of `data` are disjoint: MPI reads this rank's and writes the
            // peers', each inside `data`, which outlives the requests (`exchange` ends the job
            // rather than return while they may run).
            unsafe { flight.irecv(peer, (at, their_count, ty), (TAG_ALL_REDUCE, self.data)) };
            unsafe {
                flight.isend(
                    peer,
                    (own.cast_const(), own_count, ty),
                    (TAG_ALL_REDUCE, self.data),
                )
            };
        }
        self.exchange(&call, seq, || flight.wait_all())?;
        Ok(data.into())
    }

    fn all_gather(
        &self,
        _me: usize,
        stream: &mut Stream,
        call: Call,
        data: Payload,
        dim: usize,
    ) -> Result<Payload, CommError> {
        let data = data.into_host();
        let (dtype, shape) = (data.dtype, data.shape.clone());
        let size = self.size();
        let bytes = data.bytes.len();
        let mut out_shape = shape.clone();
        out_shape[dim] *= size;
        let elem = dtype.size();
        let len = data.num_elements();
        // Rank r's tensor, `block(r)`, as part r of the output.
        let place = |block: &dyn Fn(usize) -> *const u8| {
            let out = SharedBuffer::uninit(size * bytes);
            for r in 0..size {
                // SAFETY: `block(r)` holds rank r's tensor; part r lies inside `out`.
                unsafe {
                    kernels::copy_to_part(block(r), &shape, (out.ptr(), &out_shape), (dim, r), elem)
                };
            }
            out
        };
        if bytes <= CARRIED {
            // The tensor goes with the header.
            let opened =
                self.open_carrying(stream, &call, Carry::Same(&data.bytes), Carriers::All)?;
            let out = place(&|r| opened.block(r, self.me, data.bytes.as_ptr()));
            return Ok(out.view(out_shape, dtype).into());
        }
        let seq = self.open(stream, &call)?;
        let gathered = SharedBuffer::uninit(size * bytes);
        self.all_gather_elems(&call, seq, (data.bytes.as_ptr(), len), gathered.ptr(), elem)?;
        stream.retire(data);
        if parts_are_blocks(&shape, dim) {
            // Rank blocks are already the concatenation along `dim`.
            return Ok(gathered.view(out_shape, dtype).into());
        }
        let out = place(&|r| gathered.ptr().wrapping_add(r * bytes).cast_const());
        stream.retire(gathered);
        Ok(out.view(out_shape, dtype).into())
    }

    fn reduce_scatter(
        &self,
        _me: usize,
        stream: &mut Stream,
        call: Call,
        data: Payload,
        reduce: ReduceOp,
        dim: usize,
    ) -> Result<Payload, CommError> {
        let data = data.into_host();
        let (dtype, dims) = (data.dtype, data.shape.clone());
        let (size, elem) = (self.size(), dtype.size());
        let mut out_shape = dims.clone();
        out_shape[dim] /= size;
        // Rows of the [outer, dims[dim] * inner] view; rank r reduces part r of each.
        let outer: usize = dims[..dim].iter().product();
        let row: usize = dims[dim..].iter().product();
        let part = row / size;
        // Rank r's block: part r of every row.
        let block = outer * part * elem;
        let packed;
        let send = if outer == 1 {
            data.bytes.as_ptr()
        } else {
            packed = SharedBuffer::uninit(size * block);
            for r in 0..size {
                for o in 0..outer {
                    // SAFETY: inside `data` and inside `packed`, which do not overlap.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            data.bytes.as_ptr().add((o * row + r * part) * elem),
                            packed.ptr().add(r * block + o * part * elem),
                            part * elem,
                        )
                    };
                }
            }
            packed.ptr().cast_const()
        };
        let out = SharedBuffer::uninit(block);
        let reduce_into_out = |srcs: &[*const u8]| {
            // SAFETY: `srcs` hold every rank's block for this rank; `out` is ours.
            unsafe { kernels::reduce(dtype, reduce, srcs, &[out.ptr()], outer * part) };
        };
        if block <= CARRIED {
            // Each peer's block goes with the header.
            // SAFETY: `send` holds `size` blocks, written above or the input's own bytes.
            let blocks = unsafe { std::slice::from_raw_parts(send, size * block) };
            let opened =
                self.open_carrying(stream, &call, Carry::Blocks(blocks, block), Carriers::All)?;
            reduce_into_out(&opened.blocks(self.me, send.wrapping_add(self.me * block)));
            stream.retire(data);
            return Ok(out.view(out_shape, dtype).into());
        }
        let seq = self.open(stream, &call)?;
        let received = SharedBuffer::uninit(size * block);
        self.all_to_all_elems(&call, seq, (send, block / elem), received.ptr(), elem)?;
        let srcs: Vec<*const u8> = (0..size)
            .map(|r| received.ptr().wrapping_add(r * block).cast_const())
            .collect();
        reduce_into_out(&srcs);
        stream.retire(data);
        stream.retire(received);
        Ok(out.view(out_shape, dtype).into())
    }

    fn broadcast(
        &self,
        _me: usize,
        stream: &mut Stream,
        call: Call,
        data: Option<Payload>,
        root: usize,
    ) -> Result<Payload, CommError> {
        let data = data.map(Payload::into_host);
        let (shape, dtype) = (
            call.shape.clone(),
            call.dtype.expect("a broadcast carries a tensor"),
        );
        let (elems, elem) = (shape.iter().product::<usize>(), dtype.size());
        let bytes = elems * elem;
        if bytes <= CARRIED {
            // The root's tensor goes with its header.
            let (carry, carriers) = match &data {
                Some(data) => (Carry::Same(&data.bytes), Carriers::None),
                None => (Carry::Nothing, Carriers::Rank(root, bytes)),
            };
            let opened = self.open_carrying(stream, &call, carry, carriers)?;
            if let Some(data) = data {
                return Ok(data.into());
            }
            let out = SharedBuffer::uninit(bytes);
            let from = opened.frames.carried(root);
            // SAFETY: the root carried its `bytes` bytes; `out` holds as many.
            unsafe { std::ptr::copy_nonoverlapping(from, out.ptr(), bytes) };
            return Ok(out.view(shape, dtype).into());
        }
        let seq = self.open(stream, &call)?;
        let (per, ty) = units(bytes, elem);
        let count = c_int::try_from(bytes / per).map_err(|_| self.too_large(&call, elems))?;
        // The root sends its own buffer, which MPI only reads; the others receive into a fresh
        // one (the error side, as an either).
        let buffer = match data {
            Some(data) => Ok(data),
            None => Err(SharedBuffer::uninit(bytes)),
        };
        let buf = match &buffer {
            Ok(data) => data.bytes.as_ptr().cast_mut(),
            Err(fresh) => fresh.ptr(),
        };
        // SAFETY: `buf` holds `bytes` bytes and outlives the call.
        self.exchange(&call, seq, || unsafe {
            ffi::MPI_Bcast(buf.cast(), count, ty, root as c_int, self.data.0)
        })?;
        Ok(buffer
            .unwrap_or_else(|fresh| fresh.view(shape, dtype))
            .into())
    }

    fn all_to_all(
        &self,
        _me: usize,
        stream: &mut Stream,
        call: Call,
        data: Payload,
        split_dim: usize,
        concat_dim: usize,
    ) -> Result<Payload, CommError> {
        let data = data.into_host();
        let (dtype, dims) = (data.dtype, data.shape.clone());
        let (size, elem) = (self.size(), dtype.size());
        let mut part = dims.clone();
        part[split_dim] /= size;
        let mut out_shape = part.clone();
        out_shape[concat_dim] *= size;
        let block = part.iter().product::<usize>() * elem;
        // Part r of the input is block r of what is sent: the input itself when its parts are
        // whole blocks of it (nothing before `split_dim` but ones), else a packed copy.
        let packed = (!parts_are_blocks(&dims, split_dim)).then(|| {
            let send = SharedBuffer::uninit(size * block);
            for r in 0..size {
                let input = (data.bytes.as_ptr(), dims.as_slice());
                // SAFETY: part r lies inside `data`; block r of `send` holds it.
                unsafe {
                    kernels::copy_from_part(
                        input,
                        (split_dim, r),
                        send.ptr().add(r * block),
                        &part,
                        elem,
                    )
                };
            }
            send
        });
        let sent = match &packed {
            Some(send) => send.ptr().cast_const(),
            None => data.bytes.as_ptr(),
        };
        // Likewise the parts received land in the output itself when they are whole blocks of
        // it, else in a buffer they are unpacked from.
        let out = SharedBuffer::uninit(size * block);
        let unpacked = !parts_are_blocks(&out_shape, concat_dim);
        if block <= CARRIED {
            // Each peer's part goes with the header.
            // SAFETY: `sent` holds `size` blocks, written above or the input's own bytes.
            let blocks = unsafe { std::slice::from_raw_parts(sent, size * block) };
            let opened =
                self.open_carrying(stream, &call, Carry::Blocks(blocks, block), Carriers::All)?;
            for r in 0..size {
                let from = opened.block(r, self.me, sent.wrapping_add(self.me * block));
                let dst = (out.ptr(), &out_shape[..]);
                // SAFETY: `from` holds rank r's part; part r lies inside `out`.
                unsafe { kernels::copy_to_part(from, &part, dst, (concat_dim, r), elem) };
            }
            stream.retire(data);
            return Ok(out.view(out_shape, dtype).into());
        }
        let seq = self.open(stream, &call)?;
        let received = match unpacked {
            true => SharedBuffer::uninit(size * block),
            false => out.clone(),
        };
        self.all_to_all_elems(&call, seq, (sent, block / elem), received.ptr(), elem)?;
        if unpacked {
            for r in 0..size {
                let from = received.ptr().wrapping_add(r * block).cast_const();
                let dst = (out.ptr(), out_shape.as_slice());
                // SAFETY: block r of `received` is rank r's part; part r lies inside `out`.
                unsafe { kernels::copy_to_part(from, &part, dst, (concat_dim, r), elem) };
            }
            stream.retire(received);
        }
        stream.retire(data);
        if let Some(send) = packed {
            stream.retire(send);
        }
        Ok(out.view(out_shape, dtype).into())
    }

    fn join(&self, _me: usize, stream: &mut Stream, call: Call) -> Result<(), CommError> {
        // Every rank has sent its header and received every peer's: a barrier.
        self.open(stream, &call).map(|_| ())
    }

    fn send(&self, _me: usize, to: usize, data: Payload) -> Result<(), CommError> {
        let data = data.into_host();
        self.broken()?;
        self.complete_deferred();
        let bytes = data.bytes.len();
        let op = || PointToPoint::Send { to }.to_string();
        let count = c_int::try_from(bytes).map_err(|_| CommError::InvalidArgument {
            op: op(),
            group: self.name.clone(),
            reason: format!(
                "a message of {bytes} bytes is beyond what MPI can count in one call (2^31 - 1 bytes); split the tensor"
            ),
        })?;
        // Boxed: MPI reads it after this function returns.
        let (dtype, shape) = (data.dtype, data.shape.as_slice());
        let head = Box::new(Described::encode(
            bytes as u64,
            message_digest(dtype, shape),
            &describe_message(dtype, shape),
        ));
        let mut flight = InFlight::new();
        // SAFETY: `head` and `data` move into `flight`, which lives until the sends complete.
        unsafe {
            flight.isend(
                to,
                (head.as_ptr(), TEXT as c_int, byte()),
                (TAG_HEADER, self.p2p),
            )
        };
        unsafe {
            flight.isend(
                to,
                (data.bytes.as_ptr(), count, byte()),
                (TAG_PAYLOAD, self.p2p),
            )
        };
        flight.buffers.push(head);
        flight.buffers.push(Box::new(data));
        // A message MPI sends at once (a small one, by its eager protocol) needs no thread woken
        // to complete it. Its buffers are then freed here, unless that may unmap memory, which
        // the thread does instead, as for retired buffers.
        let frees_here = frees_inline(bytes);
        if frees_here && flight.test() {
            return Ok(());
        }
        // Small sends wait among the deferred ones, and so do large ones whose freeing unmaps
        // nothing, polled (see [`POLLED`]).
        let polled = bytes >= POLLED && frees_here;
        let flight = match bytes <= DEFERRED || polled {
            true => match self.defer(flight, polled) {
                Ok(()) => return Ok(()),
                Err(flight) => flight,
            },
            false => flight,
        };
        self.sender()
            .send(ToSend::Flight(flight))
            .map_err(|_| CommError::Transport {
                op: op(),
                group: self.name.clone(),
                rank: self.members[self.me],
                reason: "the thread that completes sends is gone".to_string(),
            })
    }

    fn recv(
        &self,
        me: usize,
        from: usize,
        op: &dyn fmt::Display,
        like: Payload,
        shape: &[usize],
    ) -> Result<Payload, CommError> {
        let dtype = like.dtype();
        self.broken()?;
        self.complete_deferred();
        let mut head = Box::new([0u8; TEXT]);
        let mut flight = InFlight::new();
        let buf = head.as_mut_ptr();
        // SAFETY: `head` outlives the request (leaked with it on a timeout).
        unsafe { flight.irecv(from, (buf, TEXT as c_int, byte()), (TAG_HEADER, self.p2p)) };
        let deadline = self.deadline();
        if let Err(missing) = flight.wait(Backoff::new(), || deadline.get()) {
            std::mem::forget(head);
            return Err(self.timeout_error(op.to_string(), missing));
        }
        let sent = Described::decode(&head);
        // A send refuses what MPI cannot count, so a larger length is not one of ours: the
        // messages from `from` can no longer be told apart.
        let Ok(count) = c_int::try_from(sent.number) else {
            return Err(self.break_with(CommError::Transport {
                op: op.to_string(),
                group: self.name.clone(),
                rank: self.members[me],
                reason: format!(
                    "group rank {from} announced a message of {} bytes, more than a send allows",
                    sent.number
                ),
            }));
        };
        let bytes = count as usize;
        let payload = SharedBuffer::uninit(bytes);
        let mut flight = InFlight::new();
        // SAFETY: `payload` holds the `bytes` bytes the sender announced and outlives the call.
        unsafe {
            flight.irecv(
                from,
                (payload.ptr(), count, byte()),
                (TAG_PAYLOAD, self.p2p),
            )
        };
        if let Err(missing) = flight.wait(Backoff::new(), || deadline.get()) {
            std::mem::forget(payload);
            return Err(self.timeout_error(op.to_string(), missing));
        }
        // This process's sends done meanwhile go back to malloc before the caller allocates.
        self.complete_polled();
        // The payload was taken even when it is not what was expected, so the next message
        // from `from` is read correctly. Digests decide; texts only between builds that digest
        // otherwise.
        let fits = bytes == shape.iter().product::<usize>() * dtype.size();
        let same = sent.digest == message_digest(dtype, shape)
            || (!sent.cut && sent.text == describe_message(dtype, shape));
        if !(fits && same) {
            let more = if sent.cut { "..." } else { "" };
            let theirs = format!("{}{more}", sent.text);
            return Err(message_mismatch(self, me, from, op, &theirs));
        }
        Ok(payload.view(shape.to_vec(), dtype).into())
    }

    fn split(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        name: String,
        color: usize,
    ) -> Result<(Arc<dyn Transport>, usize), CommError> {
        let seq = self.open(stream, &call)?;
        let size = self.size();
        let mine = (color as u64).to_le_bytes();
        let mut colors = vec![0u8; 8 * size];
        self.all_gather_elems(&call, seq, (mine.as_ptr(), 1), colors.as_mut_ptr(), 8)?;
        let colors: Vec<u64> = colors
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let members: Vec<usize> = (0..size)
            .filter(|&r| colors[r] == color as u64)
            .map(|r| self.members[r])
            .collect();
        let rank = colors[..me].iter().filter(|&&c| c == color as u64).count();
        // MPI's colours are non-negative ints; ours are any usize, so split by the index of
        // the first rank of each colour instead.
        let mpi_color = colors
            .iter()
            .position(|&c| c == color as u64)
            .expect("my colour") as c_int;
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: every rank of the group is in this call (its header came).
        check(
            unsafe { ffi::MPI_Comm_split(self.data.0, mpi_color, me as c_int, comm.as_mut_ptr()) },
            "MPI_Comm_split",
        );
        let comm = Comm(unsafe { comm.assume_init() });
        Ok((
            Arc::new(Self::over(name, members, rank, comm, self.timeout)),
            rank,
        ))
    }
}

/// Fault injection for burn-comm's own tests: the process of the global rank named by
/// `BURN_COMM_FREEZE_IN_EXCHANGE` stops itself (SIGSTOP) as it enters a collective's data
/// exchange, after every rank's header has come, where only the watchdog can end the job.
fn freeze_if_asked(rank: usize) {
    static FROZEN_RANK: OnceLock<Option<usize>> = OnceLock::new();
    let frozen = FROZEN_RANK.get_or_init(|| {
        std::env::var("BURN_COMM_FREEZE_IN_EXCHANGE")
            .ok()?
            .parse()
            .ok()
    });
    if *frozen == Some(rank) {
        let pid = std::process::id().to_string();
        let _ = std::process::Command::new("kill")
            .args(["-STOP", &pid])
            .status();
    }
}

/// Ends the job when a blocking MPI call outlives its deadline: the caller cannot return while
/// MPI may still write to its buffers, so a thread of its own watches.
mod watchdog {
    use std::sync::{Mutex, Once};
    use std::time::{Duration, Instant};

    use crate::sync::lock;

    /// What to print if a call outlives its deadline, written only then.
    pub type Message = Box<dyn FnOnce() -> String + Send>;

    struct Watched {
        next_id: u64,
        /// Calls in progress: id, deadline, what to print if it passes.
        calls: Vec<(u64, Instant, Message)>,
    }

    static WATCHED: Mutex<Watched> = Mutex::new(Watched {
        next_id: 0,
        calls: Vec::new(),
    });
    static PATROL: Once = Once::new();

    /// Runs `run`; if it has not returned by `deadline`, prints `message` and ends the job.
    pub fn watch<R>(deadline: Instant, message: Message, run: impl FnOnce() -> R) -> R {
        PATROL.call_once(|| {
            std::thread::Builder::new()
                .name("mpi-watchdog".into())
                .spawn(patrol)
                .expect("the OS refused to start a thread");
        });
        let id = {
            let mut watched = lock(&WATCHED);
            let id = watched.next_id;
            watched.next_id += 1;
            watched.calls.push((id, deadline, message));
            id
        };
        let result = run();
        lock(&WATCHED).calls.retain(|call| call.0 != id);
        result
    }

    fn patrol() {
        loop {
            std::thread::sleep(Duration::from_millis(200));
            let now = Instant::now();
            let overdue = {
                let mut watched = lock(&WATCHED);
                let late = watched.calls.iter().position(|call| call.1 <= now);
                late.map(|at| watched.calls.swap_remove(at).2)
            };
            if let Some(message) = overdue {
                super::abort(&message());
            }
        }
    }
}

/// Prints `message` and ends every process of the job (MPI_Abort), with exit code 1.
pub(crate) fn abort(message: &str) -> ! {
    eprintln!("{message}");
    // SAFETY: callable from any thread once MPI is initialised; it does not return.
    unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
    std::process::exit(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_goes_in_messages_of_at_most_eager_bytes_its_header_in_the_first() {
        let messages = |carried| {
            frame_messages(carried)
                .map(|m| (m.start, m.end))
                .collect::<Vec<_>>()
        };
        assert_eq!(messages(0), [(0, HEADER)]);
        assert_eq!(messages(1), [(0, HEADER + 1)]);
        assert_eq!(messages(100), [(0, HEADER + 100)]);
        assert_eq!(messages(EAGER - HEADER - 1), [(0, EAGER - 1)]);
        assert_eq!(messages(EAGER - HEADER), [(0, EAGER)]);
        assert_eq!(
            messages(EAGER - HEADER + 1),
            [(0, EAGER), (EAGER, EAGER + 1)]
        );
        assert_eq!(messages(EAGER), [(0, EAGER), (EAGER, EAGER + HEADER)]);
        assert_eq!(messages(4096), [(0, EAGER), (EAGER, HEADER + 4096)]);
        assert_eq!(messages(CARRIED - 1), [(0, EAGER), (EAGER, 2 * EAGER - 1)]);
        assert_eq!(messages(CARRIED), [(0, EAGER), (EAGER, 2 * EAGER)]);
    }

    #[test]
    fn a_slot_has_room_for_a_whole_message_at_each_message_start() {
        for most in [0, 1, EAGER - HEADER, EAGER - HEADER + 1, EAGER, CARRIED] {
            let slot = slot_for(most);
            assert!(
                frame_messages(most).all(|m| m.start + EAGER <= slot),
                "{most}"
            );
            assert!(slot <= 2 * EAGER && slot.is_multiple_of(16), "{most}");
        }
    }

    #[test]
    fn a_description_comes_back_as_sent_and_says_when_it_was_cut() {
        let short = Described::decode(&Described::encode(7, 42, "all_gather(dim 0) on F32 [4]"));
        assert_eq!((short.number, short.digest), (7, 42));
        assert_eq!(short.text, "all_gather(dim 0) on F32 [4]");
        assert!(!short.cut);
        assert_eq!(short.to_string(), "all_gather(dim 0) on F32 [4] (call 7)");

        let fits = "x".repeat(TEXT - Described::TEXT_AT);
        assert!(!Described::decode(&Described::encode(1, 0, &fits)).cut);
        let long = format!("{fits}y");
        let cut = Described::decode(&Described::encode(1, 0, &long));
        assert!(cut.cut);
        assert_eq!(cut.text, fits);
        assert_eq!(cut.to_string(), format!("{fits}... (call 1)"));
    }

    #[test]
    fn equal_texts_let_a_call_go_on_unless_cut_short() {
        let header = |number: u64, digest: u64| {
            let mut header = [0u8; HEADER];
            header[..8].copy_from_slice(&number.to_le_bytes());
            header[8..].copy_from_slice(&digest.to_le_bytes());
            header
        };
        let text = |number: u64, digest: u64, text: &str| {
            Described::decode(&Described::encode(number, digest, text))
        };
        // The same call digested otherwise (another build of the same framing) goes on.
        let headers = [header(7, 1), header(7, 2)];
        let same = [text(7, WIRE, "barrier"), text(7, WIRE, "barrier")];
        assert_eq!(other_build(&same), None);
        assert_eq!(other_call(&headers, &same), None);
        // Another call, or the same one under another number, is named.
        let headers = [header(7, 1), header(7, 1), header(7, 2)];
        let split = [
            text(7, WIRE, "barrier"),
            text(7, WIRE, "barrier"),
            text(7, WIRE, "split"),
        ];
        assert_eq!(other_build(&split), None);
        assert_eq!(other_call(&headers, &split), Some(2));
        let later = [text(7, WIRE, "barrier"), text(8, WIRE, "barrier")];
        assert_eq!(other_call(&[header(7, 1), header(8, 1)], &later), Some(1));
        // Texts that differ only past the cut read the same: the headers name the other.
        let long = |end: &str| format!("{}{end}", "x".repeat(TEXT));
        let cut = [
            text(7, WIRE, &long("a")),
            text(7, WIRE, &long("a")),
            text(7, WIRE, &long("b")),
        ];
        assert_eq!(other_call(&headers, &cut), Some(2));
    }

    #[test]
    fn a_build_that_frames_calls_otherwise_is_refused_and_digests_them_otherwise() {
        let call = Call::bare(crate::call::Op::Barrier);
        // Its headers differ, so the texts are compared...
        assert_ne!(call.digest(WIRE), call.digest(WIRE + 1));
        // ...where a build from before the check sends its call's digest in WIRE's place.
        let older = [
            Described::decode(&Described::encode(7, WIRE, "barrier")),
            Described::decode(&Described::encode(
                7,
                crate::call::digest_of(&call),
                "barrier",
            )),
        ];
        assert_eq!(other_build(&older), Some(1));
    }
}
