//! The TCP transport: ranks are processes started with torchrun's variables (`burn-launch`,
//! torchrun, or a scheduler that sets them), which find each other through the job's store and
//! then keep one TCP connection per pair, over which every group of the job travels (each frame
//! names its group), as gloo does for PyTorch. It is the host group of a job whose tensors move
//! on NCCL (a checkpoint's agreement, a timeline's gather), and runs CPU jobs without MPI.
//!
//! Every pair exchanges its data directly. An all-reduce is a reduce-scatter (each rank reduces
//! its slice of every input, in group-rank order, with this crate's kernels) and an all-gather
//! of the slices, so every rank gets the same bits as on the local transport. Each frame of a
//! collective carries its call's number, digest and text: a peer that made another call is a
//! [`CommError::Mismatch`] naming both. A reader thread per connection files the frames by
//! group as they come, so a send never waits for its receiver; a peer whose frame does not
//! come within the group's timeout is named in a [`CommError::Timeout`], and one whose
//! connection ends in a [`CommError::PeerFailed`] that gives the cause its process sent, if it
//! could send one (see [`Links::abort`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use burn::tensor::{Bytes, DType, TensorData};

use crate::call::{Call, PointToPoint, digest_of};
use crate::kernels::{self, Region};
use crate::shared::SharedBuffer;
use crate::store::{Store, deadline};
use crate::sync::lock;
use crate::transport::{
    FirstFailure, Payload, Stream, Transport, describe_message, message_digest, message_mismatch,
};
use crate::world::World;
use crate::{CommError, ProcessEnv, ReduceOp};

/// Opens every connection, so that a stray one (a port scanner) is told apart.
const HELLO: u64 = u64::from_le_bytes(*b"burn-tcp");
/// The version of the frames' layout, part of every call's digest.
const WIRE: u64 = 1;
/// A frame's header: group, kind, call number, digest, text length, data length.
const HEADER: usize = 8 + 1 + 8 + 8 + 4 + 8;
/// Up to this many bytes, a frame is written with one system call.
const COALESCE: usize = 64 << 10;
/// How long a connection's first bytes (its greeting) may take: a stray that says nothing is
/// dropped after it.
const GREETING: Duration = Duration::from_secs(5);
/// How long a write that failed waits for the peer's reader to file why its connection ended.
const SAID_WHY: Duration = Duration::from_secs(1);
/// How long a failing process tries to tell a peer why, before it exits anyway.
const ABORT_WRITE: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    /// One rank's part of a round of a collective.
    Collective = 0,
    /// A point-to-point message.
    Message = 1,
    /// The sender's process ends because its rank failed; the text says how.
    Abort = 2,
}

impl Kind {
    fn from_code(code: u8) -> io::Result<Self> {
        match code {
            0 => Ok(Kind::Collective),
            1 => Ok(Kind::Message),
            2 => Ok(Kind::Abort),
            _ => Err(invalid(format!("a frame of unknown kind {code}"))),
        }
    }
}

fn invalid(reason: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, reason)
}

/// A frame as its receiver holds it.
struct Frame {
    /// A collective's call number (0 for a message).
    seq: u64,
    /// The call's digest, or the message's.
    digest: u64,
    /// The call, the message's dtype and shape, or an abort's cause, as errors print it.
    text: String,
    data: Bytes,
}

/// What the sender of a frame says about it.
struct Label<'a> {
    group: u64,
    kind: Kind,
    seq: u64,
    digest: u64,
    text: &'a str,
}

fn write_frame(writer: &mut impl Write, label: &Label, data: &[u8]) -> io::Result<()> {
    let text = label.text.as_bytes();
    let mut head = Vec::with_capacity(HEADER + text.len() + data.len().min(COALESCE));
    head.extend_from_slice(&label.group.to_le_bytes());
    head.push(label.kind as u8);
    head.extend_from_slice(&label.seq.to_le_bytes());
    head.extend_from_slice(&label.digest.to_le_bytes());
    head.extend_from_slice(&(text.len() as u32).to_le_bytes());
    head.extend_from_slice(&(data.len() as u64).to_le_bytes());
    head.extend_from_slice(text);
    if data.len() <= COALESCE {
        head.extend_from_slice(data);
        return writer.write_all(&head);
    }
    writer.write_all(&head)?;
    writer.write_all(data)
}

/// The next frame and the group it is for.
fn read_frame(reader: &mut impl Read) -> io::Result<(u64, Kind, Frame)> {
    let mut head = [0u8; HEADER];
    reader.read_exact(&mut head)?;
    let word = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"));
    let kind = Kind::from_code(head[8])?;
    let text_len = u32::from_le_bytes(head[25..29].try_into().expect("4 bytes"));
    let data_len = word(29);
    let mut text = Vec::with_capacity(text_len as usize);
    reader.take(text_len.into()).read_to_end(&mut text)?;
    if text.len() < text_len as usize {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    // Aligned for any dtype (the kernels read it as elements, and a tensor views it until it
    // is written), and pooled, as the frames of a training step repeat their sizes.
    let mut data = usize::try_from(data_len)
        .ok()
        .and_then(SharedBuffer::try_uninit)
        .ok_or_else(|| {
            invalid(format!(
                "a frame of {data_len} bytes does not fit in memory"
            ))
        })?;
    // SAFETY: the buffer is new, and no one else has it yet.
    reader.read_exact(unsafe { data.bytes_mut() })?;
    let frame = Frame {
        seq: word(9),
        digest: word(17),
        text: String::from_utf8_lossy(&text).into_owned(),
        data: data.view([data.len()], DType::U8).bytes,
    };
    Ok((word(0), kind, frame))
}

/// Why frames a call waits for are not there.
enum Missing {
    /// The group broke: its frames are dropped, so none will come.
    Broken,
    /// The connection to this global rank ended, for this reason.
    Lost { rank: usize, reason: String },
    /// These global ranks sent nothing in time.
    Late(Vec<usize>),
}

/// The frames that came, filed by (group, sender's global rank, kind), and the peers whose
/// connection ended, with why.
#[derive(Default)]
struct Inbox {
    state: Mutex<InboxState>,
    arrived: Condvar,
}

#[derive(Default)]
struct InboxState {
    frames: HashMap<(u64, usize, Kind), VecDeque<Frame>>,
    lost: HashMap<usize, String>,
    /// Groups broken here, whose frames are dropped as they come.
    broken: HashSet<u64>,
}

impl Inbox {
    fn file(&self, group: u64, from: usize, kind: Kind, frame: Frame) {
        let mut state = lock(&self.state);
        if state.broken.contains(&group) {
            return;
        }
        state
            .frames
            .entry((group, from, kind))
            .or_default()
            .push_back(frame);
        self.arrived.notify_all();
    }

    /// Records that the connection to `peer` ended; the first reason given is kept.
    fn lose(&self, peer: usize, reason: String) {
        lock(&self.state).lost.entry(peer).or_insert(reason);
        self.arrived.notify_all();
    }

    /// Drops the frames of a group broken here, those that came and those to come: its calls
    /// never take them.
    fn forget(&self, group: u64) {
        let mut state = lock(&self.state);
        state.broken.insert(group);
        state.frames.retain(|&(g, _, _), _| g != group);
        // A call waiting on it fails now.
        self.arrived.notify_all();
    }

    fn reason(&self, peer: usize) -> Option<String> {
        lock(&self.state).lost.get(&peer).cloned()
    }

    /// Why the connection to `peer` ended, waiting up to `wait` for its reader to say.
    fn reason_within(&self, peer: usize, wait: Duration) -> Option<String> {
        let until = deadline(wait);
        let mut state = lock(&self.state);
        loop {
            if let Some(reason) = state.lost.get(&peer) {
                return Some(reason.clone());
            }
            let now = Instant::now();
            if now >= until {
                return None;
            }
            state = self
                .arrived
                .wait_timeout(state, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The next frame of `kind` on `group` from each of the global ranks `from`, once all are
    /// there: frames that came before a connection ended are still taken.
    fn take(
        &self,
        group: u64,
        kind: Kind,
        from: &[usize],
        until: Instant,
    ) -> Result<Vec<Frame>, Missing> {
        let mut state = lock(&self.state);
        loop {
            if state.broken.contains(&group) {
                return Err(Missing::Broken);
            }
            let waiting: Vec<usize> = from
                .iter()
                .copied()
                .filter(|&p| {
                    state
                        .frames
                        .get(&(group, p, kind))
                        .is_none_or(VecDeque::is_empty)
                })
                .collect();
            if waiting.is_empty() {
                let mut take = |p: usize| {
                    let key = (group, p, kind);
                    let queue = state.frames.get_mut(&key).expect("checked above");
                    let frame = queue.pop_front().expect("checked above");
                    // Groups come and go: an empty queue is not kept.
                    if queue.is_empty() {
                        state.frames.remove(&key);
                    }
                    frame
                };
                return Ok(from.iter().map(|&p| take(p)).collect());
            }
            if let Some((&rank, reason)) = waiting
                .iter()
                .find_map(|p| state.lost.get(p).map(|r| (p, r)))
            {
                let reason = reason.clone();
                return Err(Missing::Lost { rank, reason });
            }
            let now = Instant::now();
            if now >= until {
                return Err(Missing::Late(waiting));
            }
            state = self
                .arrived
                .wait_timeout(state, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// One connection's writing end, which writes one frame at a time: a writer waits for its turn
/// only until its own deadline.
struct Writer {
    stream: TcpStream,
    busy: Mutex<bool>,
    freed: Condvar,
}

/// A writer's turn on its connection, handed on when dropped.
struct Turn<'a>(&'a Writer);

impl Writer {
    fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            busy: Mutex::new(false),
            freed: Condvar::new(),
        }
    }

    /// The turn to write, once the frame being written (if any) is done; none by `until`.
    fn turn(&self, until: Instant) -> Option<Turn<'_>> {
        let mut busy = lock(&self.busy);
        while *busy {
            let now = Instant::now();
            if now >= until {
                return None;
            }
            busy = self
                .freed
                .wait_timeout(busy, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *busy = true;
        Some(Turn(self))
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        *lock(&self.0.busy) = false;
        self.0.freed.notify_one();
    }
}

/// A connection whose every write gives up at `until`: a frame's writes share its deadline.
struct WriteUntil<'a> {
    stream: &'a TcpStream,
    until: Instant,
}

impl Write for WriteUntil<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.stream.set_write_timeout(Some(left))?;
        let mut stream = self.stream;
        stream.write(bytes)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Why a frame was not written.
enum Unsent {
    /// The connection to the peer ended, for this reason.
    Lost(String),
    /// The peer took no data within the call's timeout.
    Late,
}

/// This process's connections to every other of the job, shared by all its groups.
pub(crate) struct Links {
    /// One connection per peer (none to itself).
    writers: Vec<Option<Writer>>,
    inbox: Arc<Inbox>,
}

impl Links {
    /// Connects this process to every other of its job: each listens on the interface through
    /// which it reaches the store, says where in the store, connects to the ranks below it,
    /// and is connected to by those above, within `timeout`.
    fn connect(
        env: &ProcessEnv,
        store: &mut Store,
        timeout: Duration,
    ) -> Result<Arc<Self>, String> {
        let (rank, size) = (env.rank, env.world_size);
        let until = deadline(timeout);
        let ip = store.local_ip().map_err(|e| {
            format!("cannot tell this machine's address from its connection to the store: {e}")
        })?;
        if ip.is_loopback() && env.local_world_size < size {
            return Err(format!(
                "this machine reaches the store at {} through its loopback interface ({ip}), which the job's other machines cannot reach: set MASTER_ADDR to an address of rank 0's machine that they reach",
                store.addr()
            ));
        }
        let listener =
            TcpListener::bind((ip, 0)).map_err(|e| format!("cannot listen on {ip}: {e}"))?;
        let here = listener.local_addr().map_err(|e| e.to_string())?;
        let key = |r: usize| format!("burn-comm/tcp/{r}");
        store
            .set(&key(rank), here.to_string().as_bytes())
            .map_err(|e| e.to_string())?;
        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        for (peer, slot) in streams.iter_mut().enumerate().take(rank) {
            let value = store.get(&key(peer)).map_err(|e| e.to_string())?;
            let addr = String::from_utf8_lossy(&value).into_owned();
            let mut stream = addr
                .parse()
                .map_err(|_| format!("rank {peer} listens at `{addr}`, which is no address"))
                .and_then(|at| {
                    let left = until.saturating_duration_since(Instant::now());
                    TcpStream::connect_timeout(&at, left.max(Duration::from_millis(1)))
                        .map_err(|e| format!("cannot connect to rank {peer} at {addr}: {e}"))
                })?;
            let hello = [HELLO, rank as u64, size as u64]
                .map(u64::to_le_bytes)
                .concat();
            stream
                .write_all(&hello)
                .map_err(|e| format!("cannot greet rank {peer} at {addr}: {e}"))?;
            *slot = Some(stream);
        }
        accept_peers(&listener, rank, size, &mut streams, until)?;
        let inbox = Arc::new(Inbox::default());
        let mut writers = Vec::with_capacity(size);
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                writers.push(None);
                continue;
            };
            // Each write sets its own timeout: its call's deadline.
            let setup = |stream: &TcpStream| -> io::Result<TcpStream> {
                stream.set_nodelay(true)?;
                stream.set_read_timeout(None)?;
                stream.try_clone()
            };
            let reading = setup(&stream).map_err(|e| format!("rank {peer}'s connection: {e}"))?;
            let inbox = inbox.clone();
            thread::Builder::new()
                .name(format!("burn-comm-tcp-{peer}"))
                .spawn(move || read_frames(peer, reading, &inbox))
                .map_err(|e| format!("cannot start a thread to read from rank {peer}: {e}"))?;
            writers.push(Some(Writer::new(stream)));
        }
        Ok(Arc::new(Self { writers, inbox }))
    }

    /// Writes one frame to global rank `peer`, which must take it by `until`.
    fn send(&self, peer: usize, label: &Label, data: &[u8], until: Instant) -> Result<(), Unsent> {
        let writer = self.writers[peer].as_ref().expect("a peer, not this rank");
        // Another call's frame to the same peer may be going: this one waits no longer than
        // its own deadline.
        let Some(turn) = writer.turn(until) else {
            return Err(Unsent::Late);
        };
        if let Some(reason) = self.inbox.reason(peer) {
            return Err(Unsent::Lost(reason));
        }
        let stream = &writer.stream;
        let written = write_frame(&mut WriteUntil { stream, until }, label, data);
        drop(turn);
        let Err(e) = written else {
            return Ok(());
        };
        let late = matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        );
        let reason = match late {
            true => "took no data in time (its process stalled or froze)".to_string(),
            // A peer whose process ended may have said why: its reader files that first.
            false => match self.inbox.reason_within(peer, SAID_WHY) {
                Some(reason) => return Err(Unsent::Lost(reason)),
                None => format!("stopped taking data ({e})"),
            },
        };
        // Part of a frame may have gone: nothing more can follow it.
        self.inbox.lose(peer, reason.clone());
        let _ = stream.shutdown(Shutdown::Both);
        Err(match late {
            true => Unsent::Late,
            false => Unsent::Lost(reason),
        })
    }

    /// Tells every peer that this process ends because its rank failed (`reason` says how:
    /// "panicked: ..."), so that their calls fail naming the cause, not a lost connection.
    /// A peer that cannot be told at once (its connection busy or stuck) sees the connection
    /// end instead.
    pub(crate) fn abort(&self, reason: &str) {
        let label = Label {
            group: 0,
            kind: Kind::Abort,
            seq: 0,
            digest: 0,
            text: reason,
        };
        for writer in self.writers.iter().flatten() {
            // At once or not at all: a frame going there now may never end.
            if let Some(_turn) = writer.turn(Instant::now()) {
                let (stream, until) = (&writer.stream, deadline(ABORT_WRITE));
                let _ = write_frame(&mut WriteUntil { stream, until }, &label, &[]);
                let _ = writer.stream.shutdown(Shutdown::Write);
            }
        }
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        // The readers end on the peers' side, and here.
        for writer in self.writers.iter().flatten() {
            let _ = writer.stream.shutdown(Shutdown::Both);
        }
    }
}

/// Accepts a connection from every rank above `rank`, each greeting with its rank.
fn accept_peers(
    listener: &TcpListener,
    rank: usize,
    size: usize,
    streams: &mut [Option<TcpStream>],
    until: Instant,
) -> Result<(), String> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let absent = |streams: &[Option<TcpStream>]| -> Vec<usize> {
        (rank + 1..size).filter(|&r| streams[r].is_none()).collect()
    };
    while !absent(streams).is_empty() {
        match listener.accept() {
            Ok((mut stream, _)) => {
                let left = until.saturating_duration_since(Instant::now());
                let greeted = stream
                    .set_nonblocking(false)
                    .and_then(|()| {
                        let wait = left.min(GREETING).max(Duration::from_millis(1));
                        stream.set_read_timeout(Some(wait))
                    })
                    .and_then(|()| {
                        let mut hello = [0u8; 24];
                        stream.read_exact(&mut hello)?;
                        Ok(hello)
                    });
                let Ok(hello) = greeted else { continue };
                let word = |i: usize| {
                    u64::from_le_bytes(hello[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
                };
                let peer = word(1) as usize;
                // Anything else is a stray connection, dropped.
                if word(0) == HELLO && word(2) == size as u64 && peer > rank && peer < size {
                    streams[peer].get_or_insert(stream);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= until {
                    return Err(format!(
                        "ranks {:?} did not connect in time",
                        absent(streams)
                    ));
                }
                thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(format!("cannot accept the connections of ranks above: {e}")),
        }
    }
    Ok(())
}

/// Files every frame from global rank `peer` until its connection ends, then records why.
fn read_frames(peer: usize, stream: TcpStream, inbox: &Inbox) {
    let mut reader = BufReader::with_capacity(64 << 10, stream);
    let reason = loop {
        match read_frame(&mut reader) {
            Ok((_, Kind::Abort, frame)) => break frame.text,
            Ok((group, kind, frame)) => inbox.file(group, peer, kind, frame),
            // A process that ends with data unread resets its connections rather than closing them.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::UnexpectedEof
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionAborted
                ) =>
            {
                break "ended its connection (its process exited or was killed)".to_string();
            }
            Err(e) => break format!("could not be read from ({e})"),
        }
    };
    inbox.lose(peer, reason);
}

/// One group of the job on the TCP transport, as one process sees it.
pub(crate) struct TcpGroup {
    name: String,
    /// Global ranks, in group-rank order.
    members: Vec<usize>,
    /// Names the group in every frame: alike on its members, unlike any other group's.
    id: u64,
    links: Arc<Links>,
    world: Arc<World>,
    /// The first failure of a collective: the ranks' calls are out of step after it.
    failure: FirstFailure,
}

impl TcpGroup {
    /// The world of the job `env` describes, whose processes meet in `store`. The connections
    /// are returned too: a failing process tells its peers why through them.
    pub(crate) fn world(
        env: &ProcessEnv,
        store: &mut Store,
        timeout: Duration,
    ) -> Result<(Arc<Self>, Arc<Links>), CommError> {
        let size = env.world_size;
        let links = Links::connect(env, store, timeout).map_err(|reason| CommError::Transport {
            op: "connecting the ranks".to_string(),
            group: "world".to_string(),
            rank: env.rank,
            reason,
        })?;
        // On CUDA, NCCL's point-to-point pairs hand their ids over in the store.
        #[cfg(feature = "cuda")]
        let world = World::of_processes(size, timeout, store.addr());
        #[cfg(not(feature = "cuda"))]
        let world = World::new(size, timeout);
        let group = Self {
            name: "world".to_string(),
            members: (0..size).collect(),
            id: digest_of(&"world"),
            links: links.clone(),
            world,
            failure: FirstFailure::default(),
        };
        Ok((Arc::new(group), links))
    }

    fn usable(&self) -> Result<(), CommError> {
        self.failure.check(&self.name)
    }

    fn break_with(&self, error: CommError) -> CommError {
        let error = self.failure.record(error);
        self.links.inbox.forget(self.id);
        error
    }

    fn peer_failed(&self, op: String, rank: usize, reason: String) -> CommError {
        CommError::PeerFailed {
            rank,
            group: self.name.clone(),
            op,
            reason,
        }
    }

    /// The error of group rank `me`'s call `op` whose frames are `missing`.
    fn missing(&self, me: usize, op: String, missing: Missing) -> CommError {
        match missing {
            Missing::Lost { rank, reason } => self.peer_failed(op, rank, reason),
            // Its failure is kept before its frames are dropped, so `usable` names it.
            Missing::Broken => self
                .usable()
                .err()
                .unwrap_or_else(|| CommError::GroupBroken {
                    group: self.name.clone(),
                    cause: "an earlier call on it failed".to_string(),
                }),
            Missing::Late(missing) => CommError::Timeout {
                op,
                group: self.name.clone(),
                rank: self.members[me],
                missing,
                after: self.world.timeout(),
            },
        }
    }

    /// The error of group rank `me`'s call `op` whose frame to global rank `peer` went unsent.
    fn unsent(&self, me: usize, op: String, peer: usize, unsent: Unsent) -> CommError {
        match unsent {
            Unsent::Lost(reason) => self.peer_failed(op, peer, reason),
            Unsent::Late => self.missing(me, op, Missing::Late(vec![peer])),
        }
    }

    /// One round of call `seq`: sends each `(r, bytes)` of `sends` to group rank `r`, then
    /// takes one frame from each group rank of `from`, which must be of the same call and of
    /// `len(r)` bytes. The frames come back by group rank. A failure breaks the group.
    fn round(
        &self,
        me: usize,
        seq: u64,
        call: &Call,
        sends: &[(usize, &[u8])],
        from: &[usize],
        len: impl Fn(usize) -> usize,
    ) -> Result<Vec<Option<Frame>>, CommError> {
        self.usable()?;
        let text = call.to_string();
        let label = Label {
            group: self.id,
            kind: Kind::Collective,
            seq,
            digest: call.digest(WIRE),
            text: &text,
        };
        let op = || format!("{call} (call {seq})");
        let until = deadline(self.world.timeout());
        for &(r, bytes) in sends {
            let peer = self.members[r];
            if let Err(unsent) = self.links.send(peer, &label, bytes, until) {
                return Err(self.break_with(self.unsent(me, op(), peer, unsent)));
            }
        }
        let globals: Vec<usize> = from.iter().map(|&r| self.members[r]).collect();
        let frames = self
            .links
            .inbox
            .take(self.id, Kind::Collective, &globals, until)
            .map_err(|missing| self.break_with(self.missing(me, op(), missing)))?;
        let mut by_rank: Vec<Option<Frame>> = (0..self.members.len()).map(|_| None).collect();
        for (&r, frame) in from.iter().zip(frames) {
            let same_call = (frame.seq, frame.digest) == (seq, label.digest);
            if !same_call || frame.data.len() != len(r) {
                let (mine, theirs) = match frame.seq == seq {
                    true => (text.clone(), frame.text),
                    false => (op(), format!("{} (call {})", frame.text, frame.seq)),
                };
                // Same call, other length: a digest collision, or a peer of another build.
                let theirs = match same_call {
                    true => format!("{theirs} with {} bytes of data", frame.data.len()),
                    false => theirs,
                };
                return Err(self.break_with(CommError::Mismatch {
                    group: self.name.clone(),
                    rank: self.members[me],
                    mine,
                    other_rank: self.members[r],
                    theirs,
                }));
            }
            by_rank[r] = Some(frame);
        }
        Ok(by_rank)
    }

    /// A round in which `me` sends `bytes(r)` to every peer `r` and takes a frame of `len(r)`
    /// bytes from each (see [`TcpGroup::round`]).
    fn round_with_peers<'a>(
        &self,
        me: usize,
        seq: u64,
        call: &Call,
        bytes: impl Fn(usize) -> &'a [u8],
        len: impl Fn(usize) -> usize,
    ) -> Result<Vec<Option<Frame>>, CommError> {
        let peers = self.peers(me);
        let sends: Vec<(usize, &[u8])> = peers.iter().map(|&r| (r, bytes(r))).collect();
        self.round(me, seq, call, &sends, &peers, len)
    }

    /// Every group rank but `me`.
    fn peers(&self, me: usize) -> Vec<usize> {
        (0..self.members.len()).filter(|&r| r != me).collect()
    }
}

/// Part `r` of `data` along `dim` as contiguous bytes: a slice of it when the dimensions before
/// `dim` are all 1, else a copy.
enum Part<'a> {
    Slice(&'a [u8]),
    Packed(SharedBuffer),
}

impl Part<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Part::Slice(bytes) => bytes,
            // SAFETY: a packed part is written whole before it is made into a `Part`.
            Part::Packed(buffer) => unsafe {
                std::slice::from_raw_parts(buffer.ptr(), buffer.len())
            },
        }
    }
}

/// The `parts` equal parts of `data` along `dim`, each as contiguous bytes.
fn parts_along<'a>(data: &'a TensorData, dim: usize, parts: usize) -> Vec<Part<'a>> {
    let dims = data.shape.as_slice();
    let elem = data.dtype.size();
    let mut part = dims.to_vec();
    part[dim] /= parts;
    let bytes = part.iter().product::<usize>() * elem;
    let outer: usize = dims[..dim].iter().product();
    (0..parts)
        .map(|r| match outer {
            1 => Part::Slice(&data.as_bytes()[r * bytes..(r + 1) * bytes]),
            _ => {
                let buffer = SharedBuffer::uninit(bytes);
                let whole = (data.bytes.as_ptr(), dims);
                // SAFETY: `data` holds every part; the buffer holds one and is ours.
                unsafe { kernels::copy_from_part(whole, (dim, r), buffer.ptr(), &part, elem) };
                Part::Packed(buffer)
            }
        })
        .collect()
}

impl Transport for TcpGroup {
    fn name(&self) -> &str {
        &self.name
    }

    fn members(&self) -> &[usize] {
        &self.members
    }

    fn world(&self) -> Option<&Arc<World>> {
        Some(&self.world)
    }

    fn all_reduce(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: Payload,
        op: ReduceOp,
    ) -> Result<Payload, CommError> {
        let mut data = data.into_host();
        let (dtype, len, elem) = (data.dtype, data.num_elements(), data.dtype.size());
        let size = self.members.len();
        let seq = stream.next_seq();
        let slice = |r: usize| -> Range<usize> {
            let elems = kernels::partition(len, size, r, kernels::SLICE_ALIGN);
            elems.start * elem..elems.end * elem
        };
        let mine = slice(me);
        // Rank r reduces slice r of every input, in rank order...
        let input = data.as_bytes();
        let received =
            self.round_with_peers(me, seq, &call, |r| &input[slice(r)], |_| mine.len())?;
        let own = data.bytes.as_mut_ptr().wrapping_add(mine.start);
        let srcs: Vec<*const u8> = received
            .iter()
            .map(|frame| frame.as_ref().map_or(own as *const u8, |f| f.data.as_ptr()))
            .collect();
        // SAFETY: every source holds this rank's slice, and the destination (its own slice,
        // also a source) is written only after each block is read.
        unsafe { kernels::reduce(dtype, op, &srcs, &[own], mine.len() / elem) };
        drop(received);
        // ...and every rank gets every reduced slice.
        let reduced = &data.as_bytes()[mine.clone()];
        let received = self.round_with_peers(me, seq, &call, |_| reduced, |r| slice(r).len())?;
        let out = data.bytes.as_mut_ptr();
        for (r, frame) in received.iter().enumerate() {
            if let Some(frame) = frame {
                let at = slice(r).start;
                // SAFETY: slice r lies inside `data`, and the frame holds it.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        frame.data.as_ptr(),
                        out.add(at),
                        frame.data.len(),
                    )
                };
            }
        }
        Ok(data.into())
    }

    fn all_gather(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: Payload,
        dim: usize,
    ) -> Result<Payload, CommError> {
        let data = data.into_host();
        let (dtype, shape) = (data.dtype, data.shape.clone());
        let mut out_shape = shape.clone();
        out_shape[dim] *= self.members.len();
        let (input, seq) = (data.as_bytes(), stream.next_seq());
        let received = self.round_with_peers(me, seq, &call, |_| input, |_| input.len())?;
        let out = SharedBuffer::uninit(out_shape.iter().product::<usize>() * dtype.size());
        for (r, frame) in received.iter().enumerate() {
            let src = frame
                .as_ref()
                .map_or(data.bytes.as_ptr(), |f| f.data.as_ptr());
            let dst = (out.ptr(), out_shape.as_slice());
            // SAFETY: every part holds `shape`; the output holds them all and is ours.
            unsafe { kernels::copy_to_part(src, &shape, dst, (dim, r), dtype.size()) };
        }
        stream.retire(data);
        Ok(out.view(out_shape, dtype).into())
    }

    fn reduce_scatter(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: Payload,
        op: ReduceOp,
        dim: usize,
    ) -> Result<Payload, CommError> {
        let data = data.into_host();
        let dtype = data.dtype;
        let size = self.members.len();
        let mut part_shape = data.shape.clone();
        part_shape[dim] /= size;
        let parts = parts_along(&data, dim, size);
        let (bytes, seq) = (parts[me].bytes().len(), stream.next_seq());
        let received = self.round_with_peers(me, seq, &call, |r| parts[r].bytes(), |_| bytes)?;
        let srcs: Vec<*const u8> = received
            .iter()
            .map(|frame| {
                frame
                    .as_ref()
                    .map_or(parts[me].bytes().as_ptr(), |f| f.data.as_ptr())
            })
            .collect();
        let out = SharedBuffer::uninit(bytes);
        // SAFETY: every source holds this rank's part; the output is ours.
        unsafe { kernels::reduce(dtype, op, &srcs, &[out.ptr()], bytes / dtype.size()) };
        drop(parts);
        stream.retire(data);
        Ok(out.view(part_shape, dtype).into())
    }

    fn broadcast(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: Option<Payload>,
        root: usize,
    ) -> Result<Payload, CommError> {
        let (shape, dtype) = (
            call.shape.clone(),
            call.dtype.expect("a broadcast carries a tensor"),
        );
        let bytes = shape.num_elements() * dtype.size();
        let seq = stream.next_seq();
        // The others send the root their call alone, so that every rank checks the root's.
        if me == root {
            let data = data.expect("the root brings its tensor").into_host();
            let peers = self.peers(me);
            let sends: Vec<(usize, &[u8])> = peers.iter().map(|&r| (r, data.as_bytes())).collect();
            self.round(me, seq, &call, &sends, &peers, |_| 0)?;
            return Ok(data.into());
        }
        let mut received = self.round(me, seq, &call, &[(root, &[][..])], &[root], |_| bytes)?;
        let frame = received[root].take().expect("the root's frame");
        Ok(TensorData::from_bytes(frame.data, shape, dtype).into())
    }

    fn all_to_all(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: Payload,
        split_dim: usize,
        concat_dim: usize,
    ) -> Result<Payload, CommError> {
        let data = data.into_host();
        let dtype = data.dtype;
        let size = self.members.len();
        let mut part_shape = data.shape.clone();
        part_shape[split_dim] /= size;
        let mut out_shape = part_shape.clone();
        out_shape[concat_dim] *= size;
        let parts = parts_along(&data, split_dim, size);
        let (bytes, seq) = (parts[me].bytes().len(), stream.next_seq());
        let received = self.round_with_peers(me, seq, &call, |r| parts[r].bytes(), |_| bytes)?;
        let out = SharedBuffer::uninit(out_shape.iter().product::<usize>() * dtype.size());
        let zeros = vec![0; part_shape.len()];
        for (r, frame) in received.iter().enumerate() {
            let src = frame
                .as_ref()
                .map_or(parts[me].bytes().as_ptr(), |f| f.data.as_ptr());
            let mut at = zeros.clone();
            at[concat_dim] = r * part_shape[concat_dim];
            // SAFETY: every part holds `part_shape`; the output holds them all and is ours.
            unsafe {
                kernels::copy_box(
                    Region {
                        ptr: src,
                        shape: &part_shape,
                        start: &zeros,
                    },
                    Region {
                        ptr: out.ptr(),
                        shape: &out_shape,
                        start: &at,
                    },
                    &part_shape,
                    dtype.size(),
                )
            };
        }
        drop(parts);
        stream.retire(data);
        Ok(out.view(out_shape, dtype).into())
    }

    fn join(&self, me: usize, stream: &mut Stream, call: Call) -> Result<(), CommError> {
        self.round_with_peers(me, stream.next_seq(), &call, |_| &[], |_| 0)
            .map(drop)
    }

    fn send(&self, me: usize, to: usize, data: Payload) -> Result<(), CommError> {
        self.usable()?;
        let data = data.into_host();
        let shape = data.shape.as_slice();
        let text = describe_message(data.dtype, shape);
        let label = Label {
            group: self.id,
            kind: Kind::Message,
            seq: 0,
            digest: message_digest(data.dtype, shape),
            text: &text,
        };
        let (peer, until) = (self.members[to], deadline(self.world.timeout()));
        self.links
            .send(peer, &label, data.as_bytes(), until)
            .map_err(|unsent| {
                let op = PointToPoint::Send { to }.to_string();
                self.break_with(self.unsent(me, op, peer, unsent))
            })
    }

    fn recv(
        &self,
        me: usize,
        from: usize,
        op: &dyn std::fmt::Display,
        like: Payload,
        shape: &[usize],
    ) -> Result<Payload, CommError> {
        self.usable()?;
        let dtype = like.dtype();
        let until = deadline(self.world.timeout());
        let frame = self
            .links
            .inbox
            .take(self.id, Kind::Message, &[self.members[from]], until)
            .map_err(|missing| self.break_with(self.missing(me, op.to_string(), missing)))?
            .pop()
            .expect("one frame");
        let bytes = shape.iter().product::<usize>() * dtype.size();
        if frame.digest != message_digest(dtype, shape) || frame.data.len() != bytes {
            return Err(message_mismatch(self, me, from, op, &frame.text));
        }
        Ok(TensorData::from_bytes(frame.data, shape.to_vec(), dtype).into())
    }

    fn split(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        name: String,
        color: usize,
    ) -> Result<(Arc<dyn Transport>, usize), CommError> {
        let seq = stream.next_seq();
        let mine = (color as u64).to_le_bytes();
        let received = self.round_with_peers(me, seq, &call, |_| &mine, |_| 8)?;
        let colors: Vec<usize> = received
            .iter()
            .map(|frame| match frame {
                Some(f) => u64::from_le_bytes(f.data[..8].try_into().expect("8 bytes")) as usize,
                None => color,
            })
            .collect();
        let members = (0..colors.len())
            .filter(|&r| colors[r] == color)
            .map(|r| self.members[r])
            .collect();
        let rank = colors[..me].iter().filter(|&&c| c == color).count();
        let group = TcpGroup {
            name,
            members,
            id: digest_of(&(self.id, seq, color as u64)),
            links: self.links.clone(),
            world: self.world.clone(),
            failure: FirstFailure::default(),
        };
        Ok((Arc::new(group), rank))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(seq: u64) -> Frame {
        Frame {
            seq,
            digest: 0,
            text: String::new(),
            data: Bytes::from_bytes_vec(Vec::new()),
        }
    }

    fn seq_of(taken: Result<Vec<Frame>, Missing>) -> u64 {
        match taken {
            Ok(frames) => frames[0].seq,
            Err(_) => panic!("a frame was there"),
        }
    }

    #[test]
    fn the_inbox_hands_frames_over_in_order_and_names_what_is_missing() {
        let inbox = Inbox::default();
        let soon = || Instant::now() + Duration::from_millis(20);
        inbox.file(1, 0, Kind::Collective, frame(0));
        inbox.file(1, 0, Kind::Collective, frame(1));
        inbox.file(2, 0, Kind::Collective, frame(7));
        inbox.file(1, 0, Kind::Message, frame(9));
        // Rank 2 sent nothing: the call names it, and takes nothing from rank 0.
        match inbox.take(1, Kind::Collective, &[0, 2], soon()) {
            Err(Missing::Late(ranks)) => assert_eq!(ranks, vec![2]),
            _ => panic!("rank 2 is late"),
        }
        assert_eq!(seq_of(inbox.take(1, Kind::Collective, &[0], soon())), 0);
        inbox.lose(0, "ended".to_string());
        inbox.lose(0, "later".to_string());
        // What came before the connection ended is still taken; then the first reason is given.
        assert_eq!(seq_of(inbox.take(1, Kind::Collective, &[0], soon())), 1);
        match inbox.take(1, Kind::Collective, &[0], soon()) {
            Err(Missing::Lost { rank, reason }) => {
                assert_eq!((rank, reason.as_str()), (0, "ended"))
            }
            _ => panic!("rank 0 is lost"),
        }
        // A broken group's frames go, those that came and those to come; the others stay.
        inbox.forget(2);
        inbox.file(2, 0, Kind::Collective, frame(8));
        assert_eq!(seq_of(inbox.take(1, Kind::Message, &[0], soon())), 9);
        // Empty queues are not kept.
        assert!(lock(&inbox.state).frames.is_empty());
    }

    #[test]
    fn a_call_on_a_group_that_broke_fails_at_once_and_others_go_on() {
        let inbox = Inbox::default();
        inbox.file(4, 1, Kind::Message, frame(1));
        inbox.forget(4);
        // Its frames, those that came and those to come, are dropped.
        inbox.file(4, 1, Kind::Message, frame(2));
        let started = Instant::now();
        let taken = inbox.take(4, Kind::Message, &[1], started + Duration::from_secs(30));
        assert!(matches!(taken, Err(Missing::Broken)));
        assert!(started.elapsed() < Duration::from_secs(10));
        // Another group's calls go on.
        inbox.file(5, 1, Kind::Message, frame(1));
        let taken = inbox.take(5, Kind::Message, &[1], Instant::now());
        assert_eq!(seq_of(taken), 1);
    }

    #[test]
    fn a_frame_reads_back_as_written() {
        let label = Label {
            group: 7,
            kind: Kind::Message,
            seq: 3,
            digest: 0xfeed,
            text: "F32 [2]",
        };
        for len in [0, 8, COALESCE + 8] {
            let data: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let mut wire = Vec::new();
            write_frame(&mut wire, &label, &data).unwrap();
            let (group, kind, frame) = read_frame(&mut wire.as_slice()).unwrap();
            assert_eq!(
                (group, kind, frame.seq, frame.digest),
                (7, Kind::Message, 3, 0xfeed)
            );
            assert_eq!(frame.text, "F32 [2]");
            assert_eq!(&frame.data[..], &data[..]);
            // A frame cut short is an end of the connection, not a frame.
            let cut = &wire[..wire.len() - 1];
            let error = read_frame(&mut &cut[..])
                .err()
                .expect("a short frame fails");
            assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof);
            // A frame of the same length read into a pooled buffer (likely the first's) holds
            // its own bytes, each of them.
            drop(frame);
            let other: Vec<u8> = data.iter().map(|b| !b).collect();
            let mut wire = Vec::new();
            write_frame(&mut wire, &label, &other).unwrap();
            let again = read_frame(&mut wire.as_slice()).unwrap().2;
            assert_eq!(&again.data[..], &other[..]);
            assert_eq!(again.data.as_ptr() as usize % 16, 0);
        }
    }

    #[test]
    fn a_frame_longer_than_memory_is_refused_not_allocated() {
        let label = Label {
            group: 1,
            kind: Kind::Message,
            seq: 0,
            digest: 0,
            text: "",
        };
        let mut wire = Vec::new();
        write_frame(&mut wire, &label, &[]).unwrap();
        // The data length is the header's last word.
        for len in [1u64 << 62, u64::MAX] {
            wire[HEADER - 8..HEADER].copy_from_slice(&len.to_le_bytes());
            let error = read_frame(&mut wire.as_slice())
                .err()
                .expect("no such frame fits");
            assert_eq!(error.kind(), io::ErrorKind::InvalidData, "{error}");
        }
    }
}
