//! Ring attention: attention over a sequence split across a context-parallel group. Each rank
//! holds the queries, keys and values of its part of the sequence; the keys and values travel
//! around the ring (rank `r` sends to `r + 1`) while each rank attends its queries to the block
//! it holds, and the partial results merge by their log-sum-exp (the online softmax of flash
//! attention). Backward sends the keys and values around again, with their gradients
//! travelling beside them and summing each rank's part; a block's gradient goes straight back
//! to its owner from the last rank that needs it.
//!
//! With a causal mask the sequence may be cut into `2 x cp` chunks, rank `r` holding chunks
//! `r` and `2cp - 1 - r`, so every rank does the same work ([`ContextLayout::load_balanced`]).
//! A chunk pair wholly above the diagonal is neither computed nor sent to a rank that only
//! needs it for that: each step sends only the chunks some rank further along still needs.
//!
//! The scores, softmax and accumulators are fp32 whatever the inputs' dtype; keys and values
//! travel in their dtype, their gradients in fp32. Only `O(sequence)` is kept for backward:
//! the inputs, the output and the log-sum-exp of each query.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Bool, DType, Tensor, TensorData, TensorPrimitive};

use crate::{CommError, Communicator, Work};

/// How a sequence is cut over a context-parallel group of `size` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextLayout {
    /// Ranks in the group.
    pub size: usize,
    /// `2 x size` chunks, rank `r` holding chunks `r` and `2 size - 1 - r`, so that under a
    /// causal mask every rank attends to as many keys; otherwise `size` chunks, one per rank.
    pub load_balanced: bool,
}

impl ContextLayout {
    /// `size` ranks, load-balanced or not.
    pub fn new(size: usize, load_balanced: bool) -> Self {
        Self {
            size,
            load_balanced,
        }
    }

    /// Chunks a rank holds: 2 when load-balanced, else 1.
    pub fn chunks_per_rank(&self) -> usize {
        if self.load_balanced { 2 } else { 1 }
    }

    /// The chunks the sequence is cut into.
    pub fn chunk_count(&self) -> usize {
        self.size * self.chunks_per_rank()
    }

    /// The chunks `rank` holds, in the order its tokens are laid out.
    pub fn chunks_of(&self, rank: usize) -> Vec<usize> {
        if self.load_balanced {
            vec![rank, 2 * self.size - 1 - rank]
        } else {
            vec![rank]
        }
    }

    /// The tokens of one chunk of a sequence of `seq`, or why it cannot be cut.
    pub fn chunk_len(&self, seq: usize) -> Result<usize, String> {
        let chunks = self.chunk_count();
        if self.size == 0 {
            return Err("a context-parallel group needs at least one rank".into());
        }
        if seq == 0 || !seq.is_multiple_of(chunks) {
            let how = if self.load_balanced {
                format!(
                    "2 x {} chunks (load-balanced for the causal mask)",
                    self.size
                )
            } else {
                format!("{chunks} chunks, one per rank")
            };
            return Err(format!(
                "a sequence of {seq} tokens cannot be cut into {how}; use a sequence length that is a positive multiple of {chunks}"
            ));
        }
        Ok(seq / chunks)
    }

    /// Checks queries `q` `[batch, heads, local, head_dim]` and keys and values `k`, `v`
    /// `[batch, kv_heads, local, head_dim]` of one rank of this layout: a sentence saying what
    /// to change when they cannot be attended.
    pub fn check_attention(
        &self,
        q: &[usize; 4],
        k: &[usize; 4],
        v: &[usize; 4],
    ) -> Result<(), String> {
        if k != v {
            return Err("the keys and values must have one shape".into());
        }
        let [batch, heads, local, head_dim] = *q;
        let [kv_batch, kv_heads, kv_local, kv_dim] = *k;
        if (kv_batch, kv_local, kv_dim) != (batch, local, head_dim) {
            return Err(
                "the keys and values must have the queries' batch, tokens and head width".into(),
            );
        }
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(format!(
                "{heads} query heads cannot share {kv_heads} key/value heads; the query heads must be a positive multiple of the key/value heads"
            ));
        }
        let per_rank = self.chunks_per_rank();
        if local == 0 || !local.is_multiple_of(per_rank) {
            return Err(format!(
                "this rank holds {local} tokens, which cannot be its {per_rank} equal chunk(s) of the sequence; the sequence length must be a positive multiple of {}",
                self.chunk_count()
            ));
        }
        Ok(())
    }

    /// The positions in the whole sequence of `seq` tokens of the tokens `rank` holds, in its
    /// order (for rotary positions and masks).
    pub fn positions(&self, rank: usize, seq: usize) -> Result<Vec<usize>, String> {
        let len = self.chunk_len(seq)?;
        Ok(self
            .chunks_of(rank)
            .into_iter()
            .flat_map(|chunk| chunk * len..(chunk + 1) * len)
            .collect())
    }
}

/// What [`ring_attention`] computes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RingAttention {
    /// How the sequence is cut; its `size` must be the group's.
    pub layout: ContextLayout,
    /// Whether a query sees only the keys at or before its position.
    pub causal: bool,
    /// What the scores are multiplied by, usually `1 / sqrt(head_dim)`.
    pub scale: f64,
}

/// Attention of this rank's queries `q` `[batch, heads, local, head_dim]` over the keys and
/// values `k`, `v` `[batch, kv_heads, local, head_dim]` of the whole sequence, whose `local`
/// tokens per rank are laid out by `attention.layout`; each key/value head is shared by
/// `heads / kv_heads` query heads. Rotary positions, if any, are the caller's, applied with
/// each token's true position. Returns the context shaped like `q`; on `Autodiff` the keys and
/// values travel the ring again in backward, their gradients beside them (a query's gradient
/// stays on its rank). Every rank of `comm` calls it.
pub fn ring_attention<B: crate::parallel::CommBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    comm: &Communicator,
    attention: RingAttention,
) -> Result<Tensor<B, 4>, CommError> {
    B::ring_attention(q, k, v, comm, attention)
}

/// Who holds what at each step of the ring, the same on every rank.
#[derive(Debug, Clone)]
struct Plan {
    layout: ContextLayout,
    causal: bool,
    scale: f64,
    rank: usize,
    /// Tokens per chunk.
    chunk: usize,
}

/// Whether the queries of one chunk see none, all or the lower triangle of another's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Visibility {
    Hidden,
    Full,
    Diagonal,
}

impl Plan {
    fn new(
        q: &[usize; 4],
        k: &[usize; 4],
        v: &[usize; 4],
        comm: &Communicator,
        attention: &RingAttention,
    ) -> Result<Self, CommError> {
        let invalid = |reason: String| CommError::InvalidArgument {
            op: format!("ring_attention of queries {q:?}, keys {k:?}, values {v:?}"),
            group: comm.group_name().to_string(),
            reason,
        };
        let layout = attention.layout;
        if layout.size != comm.size() {
            return Err(invalid(format!(
                "the layout is for {} ranks but the group has {}",
                layout.size,
                comm.size()
            )));
        }
        layout.check_attention(q, k, v).map_err(invalid)?;
        Ok(Self {
            layout,
            causal: attention.causal,
            scale: attention.scale,
            rank: comm.rank(),
            chunk: q[2] / layout.chunks_per_rank(),
        })
    }

    fn size(&self) -> usize {
        self.layout.size
    }

    /// The rank whose block `rank` holds at `step`.
    fn block_at(&self, rank: usize, step: usize) -> usize {
        (rank + self.size() - step % self.size()) % self.size()
    }

    /// The rank holding `block` at `step`.
    fn holder(&self, block: usize, step: usize) -> usize {
        (block + step) % self.size()
    }

    fn visibility(&self, query_chunk: usize, key_chunk: usize) -> Visibility {
        if !self.causal || query_chunk > key_chunk {
            Visibility::Full
        } else if query_chunk == key_chunk {
            Visibility::Diagonal
        } else {
            Visibility::Hidden
        }
    }

    fn needs(&self, rank: usize, key_chunk: usize) -> bool {
        self.layout
            .chunks_of(rank)
            .into_iter()
            .any(|q| self.visibility(q, key_chunk) != Visibility::Hidden)
    }

    /// Which of `block`'s chunks (by their index in it) are held at `step`: those that rank or
    /// a later holder needs.
    fn carried(&self, block: usize, step: usize) -> Vec<usize> {
        if step >= self.size() {
            return Vec::new();
        }
        let chunks = self.layout.chunks_of(block);
        (0..chunks.len())
            .filter(|&i| (step..self.size()).any(|s| self.needs(self.holder(block, s), chunks[i])))
            .collect()
    }
}

/// A block of keys and values as it travels: which of its owner's chunks it holds, stacked
/// `[2, batch, kv_heads, chunks * chunk, head_dim]` (keys, then values).
struct Held<B: Backend> {
    block: usize,
    chunks: Vec<usize>,
    kv: Tensor<B, 5>,
}

/// The chunks `wanted` (indices into `have`, all present) of a stacked block, in order.
fn select<B: Backend>(
    kv: &Tensor<B, 5>,
    have: &[usize],
    wanted: &[usize],
    len: usize,
) -> Tensor<B, 5> {
    if have == wanted {
        return kv.clone();
    }
    let parts = wanted
        .iter()
        .map(|w| {
            let at = have
                .iter()
                .position(|h| h == w)
                .expect("a wanted chunk is held");
            kv.clone().narrow(3, at * len, len)
        })
        .collect();
    Tensor::cat(parts, 3)
}

fn float<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    in_dtype(x, DType::F32)
}

/// Repeats each key/value head for the `group` query heads that share it.
fn repeat_heads<B: Backend>(x: Tensor<B, 4>, group: usize) -> Tensor<B, 4> {
    if group == 1 {
        return x;
    }
    let [batch, kv_heads, len, dim] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .repeat_dim(2, group)
        .reshape([batch, kv_heads * group, len, dim])
}

/// The gradient of [`repeat_heads`]: the sum over each group of query heads.
fn sum_heads<B: Backend>(x: Tensor<B, 4>, group: usize) -> Tensor<B, 4> {
    if group == 1 {
        return x;
    }
    let [batch, heads, len, dim] = x.dims();
    x.reshape([batch, heads / group, group, len, dim])
        .sum_dim(2)
        .reshape([batch, heads / group, len, dim])
}

/// The keys one query chunk attends to in a held block, with the scores to hide (`None` when
/// every key is visible). Empty when none is.
struct Keys<B: Backend> {
    /// Indices into the held chunks.
    at: Vec<usize>,
    /// `[1, 1, chunk, keys]`: true where a key comes after the query.
    hidden: Option<Tensor<B, 4, Bool>>,
}

fn keys_for<B: Backend>(
    plan: &Plan,
    query_chunk: usize,
    held: &Held<B>,
    device: &B::Device,
) -> Keys<B> {
    let owner_chunks = plan.layout.chunks_of(held.block);
    let seen: Vec<(usize, Visibility)> = held
        .chunks
        .iter()
        .enumerate()
        .map(|(at, &i)| (at, plan.visibility(query_chunk, owner_chunks[i])))
        .filter(|(_, seen)| *seen != Visibility::Hidden)
        .collect();
    // A filled mask costs a quarter of an added one on burn's CPU backend.
    let hidden = seen
        .iter()
        .any(|(_, v)| *v == Visibility::Diagonal)
        .then(|| {
            let n = plan.chunk;
            let values: Vec<bool> = (0..n)
                .flat_map(|query| {
                    seen.iter().flat_map(move |(_, v)| {
                        (0..n).map(move |key| *v == Visibility::Diagonal && key > query)
                    })
                })
                .collect();
            let shape = [1, 1, n, n * seen.len()];
            Tensor::from_data(TensorData::new(values, shape), device)
        });
    Keys {
        at: seen.into_iter().map(|(at, _)| at).collect(),
        hidden,
    }
}

/// Keys or values of the chunks `at` of a held stack (0 keys, 1 values), fp32, as many heads as
/// the queries.
fn gather_chunks<B: Backend>(
    kv: &Tensor<B, 5>,
    which: usize,
    at: &[usize],
    len: usize,
    group: usize,
) -> Tensor<B, 4> {
    let [_, batch, heads, _, dim] = kv.dims();
    let one = kv
        .clone()
        .narrow(0, which, 1)
        .reshape([batch, heads, kv.dims()[3], dim]);
    let parts: Vec<_> = at
        .iter()
        .map(|&a| one.clone().narrow(2, a * len, len))
        .collect();
    repeat_heads(float(Tensor::cat(parts, 2)), group)
}

/// Scores of queries `q`, already scaled, against keys `k` (fp32), masked.
fn scores<B: Backend>(q: Tensor<B, 4>, k: Tensor<B, 4>, keys: &Keys<B>) -> Tensor<B, 4> {
    let s = q.matmul(k.swap_dims(2, 3));
    match &keys.hidden {
        Some(hidden) => s.mask_fill(hidden.clone(), f32::NEG_INFINITY),
        None => s,
    }
}

/// One query chunk's running result: the normalised context and the log-sum-exp of its scores.
struct Partial<B: Backend> {
    out: Tensor<B, 4>,
    lse: Tensor<B, 4>,
}

impl<B: Backend> Partial<B> {
    fn merge(self, other: Partial<B>) -> Partial<B> {
        let max = self.lse.clone().max_pair(other.lse.clone());
        let (a, b) = (
            (self.lse - max.clone()).exp(),
            (other.lse - max.clone()).exp(),
        );
        let total = a.clone() + b.clone();
        Partial {
            out: (self.out * a + other.out * b) / total.clone(),
            lse: max + total.log(),
        }
    }
}

/// The queries of chunk `index` of this rank, `[batch, heads, chunk, dim]`.
fn query_chunk<B: Backend>(q: &Tensor<B, 4>, index: usize, len: usize) -> Tensor<B, 4> {
    q.clone().narrow(2, index * len, len)
}

/// A step's traffic: the held block sent on (the chunks of it that the next rank or a later
/// holder needs, if any) and the next step's block on its way in (likewise).
struct Passing<B: Backend> {
    send: Option<Work<()>>,
    recv: Option<Arriving<B>>,
}

/// A block being received.
struct Arriving<B: Backend> {
    block: usize,
    chunks: Vec<usize>,
    work: Work<Tensor<B, 5>>,
}

impl<B: Backend> Arriving<B> {
    fn wait(self) -> Result<Held<B>, CommError> {
        let kv = self.work.wait()?;
        Ok(Held {
            block: self.block,
            chunks: self.chunks,
            kv,
        })
    }
}

/// Sends on the chunks of the held block that the next rank or a later holder needs, and
/// receives the block for the next step,
/// stacks shaped `stack` (but for their tokens) of `dtype`.
fn pass<B: Backend>(
    plan: &Plan,
    comm: &Communicator,
    step: usize,
    held: Option<&Held<B>>,
    stack: [usize; 5],
    dtype: DType,
    device: &B::Device,
) -> Passing<B> {
    let size = plan.size();
    let next_rank = (plan.rank + 1) % size;
    let prev_rank = (plan.rank + size - 1) % size;
    let send = held.and_then(|held| {
        let next = plan.carried(held.block, step + 1);
        (!next.is_empty())
            .then(|| comm.send_async(select(&held.kv, &held.chunks, &next, plan.chunk), next_rank))
    });
    let block = plan.block_at(plan.rank, step + 1);
    let chunks = plan.carried(block, step + 1);
    let recv = (!chunks.is_empty()).then(|| {
        let mut shape = stack;
        shape[3] = chunks.len() * plan.chunk;
        let work = comm.recv_async(prev_rank, shape, (device, dtype));
        Arriving {
            block,
            chunks,
            work,
        }
    });
    Passing { send, recv }
}

/// The forward: the context (fp32) and the log-sum-exp of each query, chunk after chunk along
/// the first dimension (`[chunks * batch, heads, chunk, 1]`, so that a chunk's is contiguous:
/// broadcasting a strided view takes burn's CPU backend's slow path, at 2.5 times the cost).
fn forward<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    comm: &Communicator,
    plan: &Plan,
) -> Result<(Tensor<B, 4>, Tensor<B, 4>), CommError> {
    let device = q.device();
    let group = q.dims()[1] / k.dims()[1];
    let own = plan.layout.chunks_of(plan.rank);
    // Scaled once here rather than every block's scores.
    let q = float(q) * plan.scale;
    let kv = Tensor::stack::<5>(vec![k, v], 0);
    let (stack, dtype) = (kv.dims(), kv.dtype());
    let mut held = Some(Held {
        block: plan.rank,
        chunks: (0..own.len()).collect(),
        kv,
    });
    let mut partial: Vec<Option<Partial<B>>> = own.iter().map(|_| None).collect();
    for step in 0..plan.size() {
        let passing = pass(plan, comm, step, held.as_ref(), stack, dtype, &device);
        if let Some(held) = &held {
            for (index, &chunk) in own.iter().enumerate() {
                let keys = keys_for(plan, chunk, held, &device);
                if keys.at.is_empty() {
                    continue;
                }
                let k = gather_chunks(&held.kv, 0, &keys.at, plan.chunk, group);
                let v = gather_chunks(&held.kv, 1, &keys.at, plan.chunk, group);
                let s = scores(query_chunk(&q, index, plan.chunk), k, &keys);
                let max = s.clone().max_dim(3);
                let e = (s - max.clone()).exp();
                let sum = e.clone().sum_dim(3);
                let block = Partial {
                    out: e.matmul(v) / sum.clone(),
                    lse: max + sum.log(),
                };
                partial[index] = Some(match partial[index].take() {
                    Some(acc) => acc.merge(block),
                    None => block,
                });
            }
        }
        if let Some(send) = passing.send {
            send.wait()?;
        }
        held = passing.recv.map(Arriving::wait).transpose()?;
    }
    let (out, lse): (Vec<_>, Vec<_>) = partial
        .into_iter()
        .map(|p| p.expect("every query chunk sees its own keys"))
        .map(|p| (p.out, p.lse))
        .unzip();
    Ok((Tensor::cat(out, 2), Tensor::cat(lse, 0)))
}

/// What backward keeps: the inputs, the context and the log-sum-exp (as [`forward`] lays it
/// out).
struct Saved<B: Backend> {
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    out: Tensor<B, 4>,
    lse: Tensor<B, 4>,
}

/// The gradients of `q`, `k` and `v` (in their dtypes) from the context's `grad`. Each step
/// sends the held keys and values on before computing with them, then their gradients so far
/// once this rank's part is added.
fn backward<B: Backend>(
    saved: Saved<B>,
    grad: Tensor<B, 4>,
    comm: &Communicator,
    plan: &Plan,
) -> Result<[Tensor<B, 4>; 3], CommError> {
    let Saved { q, k, v, out, lse } = saved;
    let device = q.device();
    let dtypes = [q.dtype(), k.dtype(), v.dtype()];
    let [batch, kv_heads, _, dim] = k.dims();
    let group = q.dims()[1] / kv_heads;
    let own = plan.layout.chunks_of(plan.rank);
    let len = plan.chunk;
    // The queries scaled once, as the forward's scores saw them.
    let (q, grad) = (float(q) * plan.scale, float(grad));
    // Per query chunk, contiguous (see `forward`): the log-sum-exp, and D = rowsum(dO * O), the
    // softmax backward's correction.
    let out = float(out);
    let (lse, delta): (Vec<_>, Vec<_>) = (0..own.len())
        .map(|i| {
            let lse = lse.clone().narrow(0, i * batch, batch);
            let of = |x: &Tensor<B, 4>| query_chunk(x, i, len);
            (lse, (of(&grad) * of(&out)).sum_dim(3))
        })
        .unzip();
    let kv = Tensor::stack::<5>(vec![k, v], 0);
    let (stack, dtype) = (kv.dims(), kv.dtype());
    let mut held_grad = float(kv.zeros_like());
    let mut held = Some(Held {
        block: plan.rank,
        chunks: (0..own.len()).collect(),
        kv,
    });
    let mut grad_q: Vec<Option<Tensor<B, 4>>> = own.iter().map(|_| None).collect();
    let mut finals: Vec<Option<Tensor<B, 5>>> = own.iter().map(|_| None).collect();
    let mut sends = Vec::new();
    for step in 0..plan.size() {
        let passing = pass(plan, comm, step, held.as_ref(), stack, dtype, &device);
        sends.extend(passing.send);
        let mut with_grads = None;
        if let Some(current) = held.take() {
            let mut grad_kv = held_grad.clone();
            for (index, &chunk) in own.iter().enumerate() {
                let keys = keys_for(plan, chunk, &current, &device);
                if keys.at.is_empty() {
                    continue;
                }
                let k = gather_chunks(&current.kv, 0, &keys.at, len, group);
                let v = gather_chunks(&current.kv, 1, &keys.at, len, group);
                let (q, grad) = (query_chunk(&q, index, len), query_chunk(&grad, index, len));
                let s = scores(q.clone(), k.clone(), &keys);
                let p = (s - lse[index].clone()).exp();
                let grad_v = p.clone().swap_dims(2, 3).matmul(grad.clone());
                let grad_p = grad.matmul(v.swap_dims(2, 3));
                let grad_s = p * (grad_p - delta[index].clone());
                let gq = grad_s.clone().matmul(k) * plan.scale;
                let grad_k = grad_s.swap_dims(2, 3).matmul(q);
                grad_q[index] = Some(match grad_q[index].take() {
                    Some(acc) => acc + gq,
                    None => gq,
                });
                let (grad_k, grad_v) = (sum_heads(grad_k, group), sum_heads(grad_v, group));
                for (n, &at) in keys.at.iter().enumerate() {
                    let range = at * len..(at + 1) * len;
                    let piece = Tensor::stack::<5>(
                        vec![
                            grad_k.clone().narrow(2, n * len, len),
                            grad_v.clone().narrow(2, n * len, len),
                        ],
                        0,
                    );
                    let sum = grad_kv.clone().narrow(3, range.start, len) + piece;
                    grad_kv =
                        grad_kv.slice_assign([0..2, 0..batch, 0..kv_heads, range, 0..dim], sum);
                }
            }
            // Chunks no later rank needs have their whole gradient: back to their owner.
            let next = plan.carried(current.block, step + 1);
            let done: Vec<usize> = current
                .chunks
                .iter()
                .copied()
                .filter(|c| !next.contains(c))
                .collect();
            if !done.is_empty() {
                let grads = select(&grad_kv, &current.chunks, &done, len);
                if current.block == plan.rank {
                    for (n, &c) in done.iter().enumerate() {
                        finals[c] = Some(grads.clone().narrow(3, n * len, len));
                    }
                } else {
                    sends.push(comm.send_async(grads, current.block));
                }
            }
            with_grads = Some(Held {
                block: current.block,
                chunks: current.chunks,
                kv: grad_kv,
            });
        }
        // The gradients, fp32, shaped as the keys and values they travel beside.
        let grads = pass(
            plan,
            comm,
            step,
            with_grads.as_ref(),
            stack,
            DType::F32,
            &device,
        );
        sends.extend(grads.send);
        held = passing.recv.map(Arriving::wait).transpose()?;
        if let Some(arriving) = grads.recv {
            held_grad = arriving.wait()?.kv;
        }
    }
    // This rank's chunks whose gradients finished elsewhere, one message per last holder.
    let mut pending: Vec<usize> = (0..own.len()).filter(|&c| finals[c].is_none()).collect();
    while let Some(&first) = pending.first() {
        let last = last_holder(plan, first);
        let from: Vec<usize> = pending
            .iter()
            .copied()
            .filter(|&c| last_holder(plan, c) == last)
            .collect();
        let grads: Tensor<B, 5> = comm.recv(
            last,
            [2, batch, kv_heads, from.len() * len, dim],
            (&device, DType::F32),
        )?;
        for (n, &c) in from.iter().enumerate() {
            finals[c] = Some(grads.clone().narrow(3, n * len, len));
        }
        pending.retain(|c| !from.contains(c));
    }
    for send in sends {
        send.wait()?;
    }
    let grad_q = grad_q
        .into_iter()
        .map(|g| g.expect("every query chunk sees its own keys"))
        .collect();
    let grad_kv = finals
        .into_iter()
        .map(|g| g.expect("every chunk's gradient came back"))
        .collect();
    let grad_kv = Tensor::cat(grad_kv, 3);
    let part = |i: usize| {
        grad_kv
            .clone()
            .narrow(0, i, 1)
            .reshape([batch, kv_heads, own.len() * len, dim])
    };
    Ok([
        in_dtype(Tensor::cat(grad_q, 2), dtypes[0]),
        in_dtype(part(0), dtypes[1]),
        in_dtype(part(1), dtypes[2]),
    ])
}

fn in_dtype<B: Backend, const D: usize>(x: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    if x.dtype() == dtype { x } else { x.cast(dtype) }
}

/// The rank at which chunk `index` of this rank's block finishes travelling.
fn last_holder(plan: &Plan, index: usize) -> usize {
    let chunk = plan.layout.chunks_of(plan.rank)[index];
    let last = (0..plan.size())
        .rev()
        .find(|&s| plan.needs(plan.holder(plan.rank, s), chunk))
        .unwrap_or(0);
    plan.holder(plan.rank, last)
}

/// Ring attention on any backend, without recording a graph.
pub(crate) fn forward_only<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    comm: &Communicator,
    attention: RingAttention,
) -> Result<Tensor<B, 4>, CommError> {
    let plan = Plan::new(&q.dims(), &k.dims(), &v.dims(), comm, &attention)?;
    let dtype = q.dtype();
    let (out, _) = forward(q, k, v, comm, &plan)?;
    Ok(in_dtype(out, dtype))
}

/// The backward step of ring attention.
#[derive(Debug)]
struct RingAttentionBackward;

impl<B: Backend> Backward<B, 3> for RingAttentionBackward {
    /// The group, the plan, then the queries, keys, values, context and log-sum-exp.
    type State = (Communicator, PlanState, [FloatTensor<B>; 5]);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (comm, PlanState(plan), [q, k, v, out, lse]) = ops.state;
        let float = |t| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(t));
        let grad = float(grads.consume::<B>(&ops.node));
        let saved = Saved {
            q: float(q),
            k: float(k),
            v: float(v),
            out: float(out),
            lse: float(lse),
        };
        // Every rank runs the ring, whichever of its inputs want a gradient, or its peers
        // would wait for it.
        let computed = match backward(saved, grad, &comm, &plan) {
            Ok(grads) => grads,
            Err(error) => panic!("backward of ring attention failed: {error}"),
        };
        for (node, grad) in ops.parents.into_iter().zip(computed) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad.into_primitive().tensor());
            }
        }
    }
}

/// The plan, as autodiff state (it must be `Clone + Send + Debug`).
#[derive(Debug, Clone)]
struct PlanState(Plan);

/// Ring attention on `Autodiff`: the forward on the inner backend, recording the backward.
pub(crate) fn autodiff<B: Backend, C: CheckpointStrategy>(
    q: Tensor<Autodiff<B, C>, 4>,
    k: Tensor<Autodiff<B, C>, 4>,
    v: Tensor<Autodiff<B, C>, 4>,
    comm: &Communicator,
    attention: RingAttention,
) -> Result<Tensor<Autodiff<B, C>, 4>, CommError> {
    let plan = Plan::new(&q.dims(), &k.dims(), &v.dims(), comm, &attention)?;
    let dtype = q.dtype();
    let [q, k, v] = [q, k, v].map(|x| x.into_primitive().tensor());
    let inner = |x: FloatTensor<B>| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(x));
    let (out, lse) = forward(
        inner(q.primitive.clone()),
        inner(k.primitive.clone()),
        inner(v.primitive.clone()),
        comm,
        &plan,
    )?;
    let out = in_dtype(out, dtype);
    let output = match RingAttentionBackward
        .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let state = (
                comm.clone(),
                PlanState(plan),
                [
                    q.primitive,
                    k.primitive,
                    v.primitive,
                    out.clone().into_primitive().tensor(),
                    lse.into_primitive().tensor(),
                ],
            );
            prep.finish(state, out.into_primitive().tensor())
        }
        OpsKind::UnTracked(prep) => prep.finish(out.into_primitive().tensor()),
    };
    Ok(Tensor::from_primitive(TensorPrimitive::Float(output)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(size: usize, rank: usize, load_balanced: bool, causal: bool) -> Plan {
        Plan {
            layout: ContextLayout::new(size, load_balanced),
            causal,
            scale: 1.0,
            rank,
            chunk: 1,
        }
    }

    #[test]
    fn layouts_cut_the_sequence_in_balanced_chunks() {
        let balanced = ContextLayout::new(2, true);
        assert_eq!(balanced.positions(0, 8).unwrap(), [0, 1, 6, 7]);
        assert_eq!(balanced.positions(1, 8).unwrap(), [2, 3, 4, 5]);
        let plain = ContextLayout::new(3, false);
        assert_eq!(plain.positions(2, 6).unwrap(), [4, 5]);
        let error = balanced.chunk_len(6).unwrap_err();
        assert!(error.contains("multiple of 4"), "{error}");
    }

    #[test]
    fn only_what_a_later_rank_needs_travels() {
        // Unbalanced and causal, block 0 is needed by every rank, block 2 of 3 by rank 2 only.
        let p = plan(3, 0, false, true);
        assert_eq!(p.carried(0, 2), [0]);
        assert!(p.carried(2, 1).is_empty());
        assert!(p.carried(1, 2).is_empty());
        // Balanced: block 0's second chunk (the last of the sequence) is needed by rank 0
        // alone, so only its first chunk leaves it.
        let p = plan(4, 0, true, true);
        assert_eq!(p.carried(0, 0), [0, 1]);
        assert_eq!(p.carried(0, 1), [0]);
        assert_eq!(p.carried(3, 1), [0, 1]);
        // Without a mask everything goes everywhere.
        let p = plan(4, 0, true, false);
        assert_eq!(p.carried(0, 3), [0, 1]);
    }
}
