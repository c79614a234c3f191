//! The local transport: ranks are threads of one process and exchange data through shared
//! memory.
//!
//! A collective is a rendezvous in two phases. In the first, every rank posts its call and,
//! as the operation needs, a pointer to its input or a result buffer it provides for all; the
//! last to arrive checks that all ranks made the same call. In the second, every rank
//! does its own share of the work on its peers' buffers directly (for an all-reduce: its own
//! slice of every input, reduced in rank order and written back to all of them), then waits
//! until all shares are done. Failures are decided under the group's lock before any buffer is shared,
//! so a rank that gives up never leaves a peer reading freed memory.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::tensor::TensorData;

use crate::call::Call;
use crate::kernels::{self, Region};
use crate::shared::SharedBuffer;
use crate::sync::{lock, panic_message};
use crate::transport::{Payload, Stream, Transport, describe_message, message_mismatch};
use crate::world::{RankStatus, Watcher, World};
use crate::{CommError, ReduceOp};

/// A group being formed by a split: (parent group id, call number, colour).
type SplitKey = (u64, u64, usize);

/// The groups split from one root group: their ids, and those being formed.
#[derive(Default)]
struct Splits {
    next_id: AtomicU64,
    /// Groups being built by a `split`, until every member has picked its handle up.
    forming: Mutex<HashMap<SplitKey, (Arc<Group>, usize)>>,
}

/// A rank's contribution to one collective, as its peers see it.
#[derive(Debug, Clone)]
pub(crate) struct Post {
    pub call: Call,
    /// Per-rank value that may differ across ranks (the colour of a split).
    pub color: usize,
    /// The rank's input; peers only read it, unless it was posted [`Post::in_place`].
    pub input: *const u8,
    /// A result buffer this rank provides for the whole group.
    pub shared: Option<SharedBuffer>,
}

// SAFETY: `input` is only accessed (read, or written for `Post::in_place`) during the second
// phase of a rendezvous, while its owner is blocked in the same rendezvous and keeps the buffer
// alive.
unsafe impl Send for Post {}

impl Post {
    /// A post whose input peers read.
    pub fn read_only(call: Call, data: &TensorData) -> Self {
        Self {
            input: data.bytes.as_ptr(),
            ..Self::bare(call)
        }
    }

    /// A post whose input peers may also write (in-place all-reduce): the pointer comes from a
    /// mutable borrow, so writing through it is allowed.
    pub fn in_place(call: Call, data: &mut TensorData) -> Self {
        Self {
            input: data.bytes.as_mut_ptr(),
            ..Self::bare(call)
        }
    }

    /// A post without an input (barrier, split, a refused call, a shared result).
    pub fn bare(call: Call) -> Self {
        Self {
            call,
            color: 0,
            input: std::ptr::null(),
            shared: None,
        }
    }
}

/// One collective in flight. Two slots suffice: a rank can start call `seq + 1` only after every
/// rank has joined call `seq`, which they do only after leaving call `seq - 1`.
struct Slot {
    seq: Option<u64>,
    posts: Vec<Option<Post>>,
    arrived: usize,
    ready: bool,
    /// A rank's share panicked: the call failed on every rank.
    failed: Option<CommError>,
    done: usize,
    left: usize,
}

impl Slot {
    fn new(size: usize) -> Self {
        Self {
            seq: None,
            posts: vec![None; size],
            arrived: 0,
            ready: false,
            failed: None,
            done: 0,
            left: size,
        }
    }

    fn is_free(&self) -> bool {
        self.left == self.posts.len()
    }
}

struct Message {
    data: TensorData,
}

struct GroupState {
    /// The first failure; every later call fails with it.
    broken: Option<CommError>,
    /// Which group ranks have already been told of `broken`.
    told: Vec<bool>,
    slots: [Slot; 2],
    /// Point-to-point messages by (source, destination), in the order they were sent.
    mailboxes: HashMap<(usize, usize), VecDeque<Message>>,
}

/// The shared side of one group of ranks.
pub(crate) struct Group {
    id: u64,
    name: String,
    /// Global ranks, in group-rank order.
    members: Vec<usize>,
    world: Arc<World>,
    /// Shared with every group split from the same root.
    splits: Arc<Splits>,
    state: Mutex<GroupState>,
    changed: Condvar,
}

impl Watcher for Group {
    fn status_changed(&self) {
        // Taking the lock orders this wake-up after any waiter's last check.
        let _state = lock(&self.state);
        self.changed.notify_all();
    }
}

impl Group {
    /// The group of every rank of `world`, named `name`, whose splits are its own.
    pub fn root(world: &Arc<World>, name: String, members: Vec<usize>) -> Arc<Group> {
        Self::create(world, Arc::default(), name, members)
    }

    fn create(
        world: &Arc<World>,
        splits: Arc<Splits>,
        name: String,
        members: Vec<usize>,
    ) -> Arc<Group> {
        let size = members.len();
        let group = Arc::new(Group {
            id: splits.next_id.fetch_add(1, Ordering::Relaxed),
            name,
            members,
            world: world.clone(),
            splits,
            state: Mutex::new(GroupState {
                broken: None,
                told: vec![false; size],
                slots: [Slot::new(size), Slot::new(size)],
                mailboxes: HashMap::new(),
            }),
            changed: Condvar::new(),
        });
        let watcher: Arc<dyn Watcher> = group.clone();
        world.watch(Arc::downgrade(&watcher));
        group
    }

    /// The group that `members` form after split number `seq` of this group: the first member
    /// to ask creates it, the others get the same one.
    fn join_split(&self, seq: u64, color: usize, name: String, members: Vec<usize>) -> Arc<Group> {
        let mut forming = lock(&self.splits.forming);
        let key = (self.id, seq, color);
        let (group, waiting) = forming.entry(key).or_insert_with(|| {
            let size = members.len();
            let group = Self::create(&self.world, self.splits.clone(), name, members);
            (group, size)
        });
        let group = group.clone();
        *waiting -= 1;
        if *waiting == 0 {
            forming.remove(&key);
        }
        group
    }

    /// The error group rank `me` gets from a broken group. The first time, a peer failure is
    /// reported as itself, and so is any failure of a call that `me` had `joined`; after that,
    /// and for calls started later, it is `GroupBroken`.
    fn failure(&self, state: &mut GroupState, me: usize, joined: bool) -> CommError {
        let cause = state.broken.clone().expect("only called on a broken group");
        let first = !std::mem::replace(&mut state.told[me], true);
        match cause {
            CommError::PeerFailed { .. } if first => cause,
            CommError::Timeout {
                op,
                group,
                missing,
                after,
                ..
            } if first && joined => CommError::Timeout {
                op,
                group,
                rank: self.members[me],
                missing,
                after,
            },
            _ if first && joined => cause,
            _ => CommError::GroupBroken {
                group: self.name.clone(),
                cause: cause.to_string(),
            },
        }
    }

    /// Breaks the group with `error`, which rank `me` reports itself.
    fn break_with(&self, state: &mut GroupState, me: usize, error: CommError) -> CommError {
        Self::release_unready(state);
        state.broken = Some(error.clone());
        state.told[me] = true;
        self.changed.notify_all();
        error
    }

    /// Why group rank `me` cannot wait any longer for the peers in `pending`, if it cannot.
    fn peer_failure(
        &self,
        op: &dyn fmt::Display,
        pending: impl Iterator<Item = usize>,
    ) -> Option<CommError> {
        for local in pending {
            let rank = self.members[local];
            let reason = match self.world.status_of(rank) {
                RankStatus::Running => continue,
                RankStatus::Failed(reason) => format!("failed: {reason}"),
                RankStatus::Returned => {
                    "returned from its function without joining this call".to_string()
                }
            };
            return Some(CommError::PeerFailed {
                rank,
                group: self.name.clone(),
                op: op.to_string(),
                reason,
            });
        }
        None
    }

    /// Drops the posts of calls that will never run (the group broke before they were ready).
    fn release_unready(state: &mut GroupState) {
        for slot in state.slots.iter_mut().filter(|s| !s.ready) {
            slot.posts.iter_mut().for_each(|p| *p = None);
        }
    }

    /// The timeout of group rank `me`'s call `op` once `deadline` has passed, naming the group
    /// ranks in `missing` by their global ranks.
    fn timeout_if_due(
        &self,
        op: &dyn fmt::Display,
        me: usize,
        deadline: Option<Instant>,
        missing: impl Iterator<Item = usize>,
    ) -> Option<CommError> {
        deadline
            .is_some_and(|d| Instant::now() >= d)
            .then(|| CommError::Timeout {
                op: op.to_string(),
                group: self.name.clone(),
                rank: self.members[me],
                missing: missing.map(|r| self.members[r]).collect(),
                after: self.world.timeout(),
            })
    }

    /// Runs one collective: posts `post` as group rank `me`'s contribution to call number
    /// `seq`, waits for every peer, then runs `work` with all posts (in group-rank order).
    pub fn rendezvous<R>(
        &self,
        me: usize,
        seq: u64,
        post: Post,
        work: impl FnOnce(&[Post]) -> R,
    ) -> Result<R, CommError> {
        let size = self.members.len();
        let slot_index = (seq % 2) as usize;
        // Written out only in an error: formatting costs a small call's time.
        let op = post.call.clone();
        let deadline = Instant::now().checked_add(self.world.timeout());

        let mut state = lock(&self.state);
        // Join the slot (phase 1).
        loop {
            if state.broken.is_some() {
                return Err(self.failure(&mut state, me, false));
            }
            let slot = &mut state.slots[slot_index];
            if slot.seq == Some(seq) {
                break;
            }
            if slot.is_free() {
                *slot = Slot::new(size);
                slot.seq = Some(seq);
                slot.left = 0;
                break;
            }
            state = self.wait(state, deadline);
        }
        {
            let slot = &mut state.slots[slot_index];
            slot.posts[me] = Some(post);
            slot.arrived += 1;
            if slot.arrived == size {
                let posts: Vec<&Post> = slot.posts.iter().flatten().collect();
                match posts.iter().position(|p| p.call != posts[0].call) {
                    None => slot.ready = true,
                    Some(other) => {
                        let mismatch = CommError::Mismatch {
                            group: self.name.clone(),
                            rank: self.members[0],
                            mine: posts[0].call.to_string(),
                            other_rank: self.members[other],
                            theirs: posts[other].call.to_string(),
                        };
                        Self::release_unready(&mut state);
                        state.broken = Some(mismatch);
                    }
                }
                self.changed.notify_all();
            }
        }
        let posts = loop {
            let slot = &state.slots[slot_index];
            if slot.ready {
                break slot.posts.iter().flatten().cloned().collect::<Vec<_>>();
            }
            if state.broken.is_some() {
                return Err(self.failure(&mut state, me, true));
            }
            let missing = || (0..size).filter(|&r| slot.posts[r].is_none());
            let failure = self
                .peer_failure(&op, missing())
                .or_else(|| self.timeout_if_due(&op, me, deadline, missing()));
            if let Some(error) = failure {
                return Err(self.break_with(&mut state, me, error));
            }
            state = self.wait(state, deadline);
        };
        drop(state);

        // Do this rank's share (phase 2). A panic must still count as done, or peers would
        // wait forever; it breaks the group instead.
        let outcome = catch_unwind(AssertUnwindSafe(|| work(&posts)));

        let mut state = lock(&self.state);
        if let Err(panic) = &outcome {
            let error = CommError::PeerFailed {
                rank: self.members[me],
                group: self.name.clone(),
                op: op.to_string(),
                reason: format!(
                    "panicked inside the transport: {}",
                    panic_message(panic.as_ref())
                ),
            };
            state.slots[slot_index].failed = Some(error.clone());
            state.broken = Some(error);
        }
        state.slots[slot_index].done += 1;
        self.changed.notify_all();
        while state.slots[slot_index].done < size {
            // Every share ends (a panic counts too), so this wait is bounded by the work.
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(|poison| poison.into_inner());
        }
        let slot = &mut state.slots[slot_index];
        slot.left += 1;
        if slot.is_free() {
            // Release the posts now: they may hold result buffers the pool wants back.
            slot.posts.iter_mut().for_each(|p| *p = None);
        }
        // Only a failure of this very call fails it; later breaks are for later calls.
        let failed = state.slots[slot_index].failed.clone();
        if failed.is_some() {
            state.told[me] = true;
        }
        drop(state);
        self.changed.notify_all();
        match (outcome, failed) {
            (Ok(result), None) => Ok(result),
            (_, Some(error)) => Err(error),
            (Err(_), None) => unreachable!("a panicking share records its failure"),
        }
    }

    /// The group that ranks of the same colour form, after a split rendezvous numbered `seq`.
    fn split_group(&self, seq: u64, name: String, posts: &[Post], me: usize) -> Arc<Group> {
        let color = posts[me].color;
        let members = posts
            .iter()
            .zip(&self.members)
            .filter(|(post, _)| post.color == color)
            .map(|(_, &rank)| rank)
            .collect();
        self.join_split(seq, color, name, members)
    }

    /// Takes the next message from group rank `from` to group rank `me`, waiting for it.
    fn take_message(
        &self,
        me: usize,
        from: usize,
        op: &dyn fmt::Display,
    ) -> Result<TensorData, CommError> {
        let deadline = Instant::now().checked_add(self.world.timeout());
        let mut state = lock(&self.state);
        loop {
            if let Some(message) = state
                .mailboxes
                .get_mut(&(from, me))
                .and_then(VecDeque::pop_front)
            {
                return Ok(message.data);
            }
            if state.broken.is_some() {
                return Err(self.failure(&mut state, me, true));
            }
            let failure = self
                .peer_failure(op, std::iter::once(from))
                .or_else(|| self.timeout_if_due(op, me, deadline, std::iter::once(from)));
            if let Some(error) = failure {
                return Err(self.break_with(&mut state, me, error));
            }
            state = self.wait(state, deadline);
        }
    }

    /// Waits for a change, or until `deadline` (none: a timeout too long to represent).
    fn wait<'a>(
        &self,
        state: MutexGuard<'a, GroupState>,
        deadline: Option<Instant>,
    ) -> MutexGuard<'a, GroupState> {
        let left = deadline.map_or(Duration::from_secs(3600), |d| {
            d.saturating_duration_since(Instant::now())
        });
        // Wake up at the deadline at the latest, so the timeout is reported on time.
        let wait = left.max(Duration::from_millis(1));
        self.changed
            .wait_timeout(state, wait)
            .unwrap_or_else(|poison| poison.into_inner())
            .0
    }
}

impl Transport for Group {
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
        let dtype = data.dtype;
        let size = self.members.len();
        let (len, elem) = (data.num_elements(), dtype.size());
        let post = Post::in_place(call, &mut data);
        self.rendezvous(me, stream.next_seq(), post, |posts| {
            // Reduce this rank's slice of every input, in rank order, and write it back to all
            // of them: every rank ends with the same bits, in its own buffer.
            // (Measured faster than reducing into one shared output: see BENCHMARKS.md.)
            let mine = kernels::partition(len, size, me, kernels::SLICE_ALIGN);
            let at = |p: &Post| p.input.wrapping_add(mine.start * elem);
            let srcs: Vec<*const u8> = posts.iter().map(at).collect();
            let dsts: Vec<*mut u8> = srcs.iter().map(|&p| p as *mut u8).collect();
            // SAFETY: every rank owns a disjoint slice of all inputs until `done`, and in-place
            // posts carry pointers that may be written through.
            unsafe { kernels::reduce(dtype, reduce, &srcs, &dsts, mine.len()) };
        })?;
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
        // Rank 0 provides the one output buffer; each rank writes its own part of it.
        let mut post = Post::bare(call);
        if me == 0 {
            let bytes = out_shape.iter().product::<usize>() * dtype.size();
            post.shared = Some(SharedBuffer::uninit(bytes));
        }
        let out = self.rendezvous(me, stream.next_seq(), post, |posts| {
            let out = posts[0].shared.clone().expect("rank 0 shares the output");
            let dst = (out.ptr(), out_shape.as_slice());
            // SAFETY: each rank writes only its own part of the shared output.
            unsafe {
                kernels::copy_to_part(data.bytes.as_ptr(), &shape, dst, (dim, me), dtype.size())
            };
            out
        })?;
        stream.retire(data);
        Ok(out.view(out_shape, dtype).into())
    }

    fn reduce_scatter(
        &self,
        me: usize,
        stream: &mut Stream,
        call: Call,
        data: Payload,
        reduce: ReduceOp,
        dim: usize,
    ) -> Result<Payload, CommError> {
        let data = data.into_host();
        let (dtype, dims) = (data.dtype, data.shape.clone());
        let size = self.members.len();
        let mut out_shape = dims.clone();
        out_shape[dim] /= size;
        let out = SharedBuffer::uninit(out_shape.iter().product::<usize>() * dtype.size());
        // Rows of the [outer, dims[dim] * inner] view; this rank reduces part `me` of each.
        let outer: usize = dims[..dim].iter().product();
        let row: usize = dims[dim..].iter().product();
        let part = row / size;
        let post = Post::read_only(call, &data);
        let elem = dtype.size();
        self.rendezvous(me, stream.next_seq(), post, |posts| {
            for o in 0..outer {
                let offset = (o * row + me * part) * elem;
                let srcs: Vec<*const u8> =
                    posts.iter().map(|p| p.input.wrapping_add(offset)).collect();
                let dst = out.ptr().wrapping_add(o * part * elem);
                // SAFETY: peers' inputs are read-only during the call; `out` is ours.
                unsafe { kernels::reduce(dtype, reduce, &srcs, &[dst], part) };
            }
        })?;
        stream.retire(data);
        Ok(out.view(out_shape, dtype).into())
    }

    fn broadcast(
        &self,
        me: usize,
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
        // The root shares its buffer as it is: the transport copies nothing.
        let mut post = Post::bare(call);
        post.shared = data.map(SharedBuffer::from_data);
        let out = self.rendezvous(me, stream.next_seq(), post, |posts| {
            posts[root]
                .shared
                .clone()
                .expect("the root shares its tensor")
        })?;
        Ok(out.view(shape, dtype).into())
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
        let (dtype, dims) = (data.dtype, data.shape.clone());
        let size = self.members.len();
        let mut part = dims.clone();
        part[split_dim] /= size;
        let mut out_shape = part.clone();
        out_shape[concat_dim] *= size;
        let out = SharedBuffer::uninit(out_shape.iter().product::<usize>() * dtype.size());
        let post = Post::read_only(call, &data);
        self.rendezvous(me, stream.next_seq(), post, |posts| {
            let (mut from, mut to) = (vec![0; dims.len()], vec![0; dims.len()]);
            from[split_dim] = me * part[split_dim];
            for (k, p) in posts.iter().enumerate() {
                to[concat_dim] = k * part[concat_dim];
                // SAFETY: peers' inputs are read-only during the call; `out` is ours.
                unsafe {
                    kernels::copy_box(
                        Region {
                            ptr: p.input,
                            shape: &dims,
                            start: &from,
                        },
                        Region {
                            ptr: out.ptr(),
                            shape: &out_shape,
                            start: &to,
                        },
                        &part,
                        dtype.size(),
                    )
                };
            }
        })?;
        stream.retire(data);
        Ok(out.view(out_shape, dtype).into())
    }

    fn join(&self, me: usize, stream: &mut Stream, call: Call) -> Result<(), CommError> {
        self.rendezvous(me, stream.next_seq(), Post::bare(call), |_| ())
    }

    fn send(&self, me: usize, to: usize, data: Payload) -> Result<(), CommError> {
        let data = data.into_host();
        let mut state = lock(&self.state);
        if state.broken.is_some() {
            return Err(self.failure(&mut state, me, false));
        }
        state
            .mailboxes
            .entry((me, to))
            .or_default()
            .push_back(Message { data });
        self.changed.notify_all();
        Ok(())
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
        let data = self.take_message(me, from, op)?;
        if (dtype, shape) == (data.dtype, data.shape.as_slice()) {
            return Ok(data.into());
        }
        let sent = describe_message(data.dtype, data.shape.as_slice());
        Err(message_mismatch(self, me, from, op, &sent))
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
        let post = Post {
            color,
            ..Post::bare(call)
        };
        let group = self.rendezvous(me, seq, post, |posts| {
            self.split_group(seq, name, posts, me)
        })?;
        let rank = group
            .members()
            .iter()
            .position(|&r| r == self.members[me])
            .expect("a rank is a member of the group of its own colour");
        Ok((group, rank))
    }

    fn world(&self) -> Option<&Arc<World>> {
        Some(&self.world)
    }
}
