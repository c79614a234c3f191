//! The token dispatcher: each token's copies go to the ranks holding their experts and come back
//! weighted, Megatron's `MoEAlltoAllTokenDispatcher`. Per rank, in order:
//!
//! 1. the routing decisions come to the host (as Megatron's do, for the all-to-all's sizes);
//!    with a capacity, an expert keeps the first `capacity` of this rank's tokens routed to it
//!    and drops the rest (Megatron's "position" policy);
//! 2. the kept copies are sorted by expert, and the counts per expert exchanged with an equal
//!    all-to-all, so each rank learns how many rows it will receive from each other;
//! 3. the rows travel by an all-to-all of uneven parts ([`all_to_all_split`]), or padded to the
//!    capacity by an equal one ([`Dispatch::Padded`]); each local expert runs on all its rows;
//! 4. the outputs travel back the same way, are weighted by the router's probabilities and
//!    summed into their tokens.
//!
//! Every step is differentiated: backward is the mirror (the gathers become scatter-adds and
//! the all-to-alls run the other way), so the tokens, the weights and the experts all get
//! their gradients.

use std::ops::Range;

use burn::tensor::IndexingUpdateOp;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_comm::Communicator;
use burn_comm::parallel::{
    CommBackend, SplitSizes, all_to_all_split, copy_to_parallel_region, reduce_from_parallel_region,
};

use crate::MoeError;

/// How the rows travel between the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dispatch {
    /// Each rank sends exactly the rows its experts' peers need (dropless, or after dropping
    /// what a capacity leaves out): an all-to-all of uneven parts.
    #[default]
    Unpadded,
    /// Every expert's rows from every rank padded to the capacity with zeros, so every part has
    /// one size (GShard's layout, for backends that want fixed shapes). Needs a capacity.
    Padded,
}

/// The experts of a layer and the ranks they are split over (the expert-parallel group, each
/// rank holding `experts / size` consecutive experts), or all of them on this rank; and,
/// optionally, the ranks each expert's linears are split over (Megatron's expert tensor
/// parallelism).
#[derive(Debug, Clone)]
pub struct ExpertParallel {
    comm: Option<Communicator>,
    experts: usize,
    tensor_parallel: Option<Communicator>,
}

impl ExpertParallel {
    /// `experts` experts split over `comm` (none: all on this rank).
    pub fn new(experts: usize, comm: Option<Communicator>) -> Result<Self, MoeError> {
        let size = comm.as_ref().map_or(1, Communicator::size);
        if experts == 0 || !experts.is_multiple_of(size) {
            return Err(MoeError::Config(format!(
                "{experts} experts cannot be split evenly over {size} expert-parallel ranks; use an expert count that is a positive multiple of {size}"
            )));
        }
        Ok(Self {
            comm,
            ..Self::unsplit(experts)
        })
    }

    /// All `experts` on this rank, unsplit.
    pub fn unsplit(experts: usize) -> Self {
        Self {
            comm: None,
            experts,
            tensor_parallel: None,
        }
    }

    /// Splits each expert's linears over `tp` as Megatron splits an MLP: gate and up by
    /// columns, down by rows. Every rank of `tp` must hold the same tokens (tensor parallelism
    /// without sequence parallelism), so they route alike and exchange the same rows with
    /// their own expert-parallel peers; the rows enter the experts through Megatron's `f`
    /// (identity forward, gradient summed over `tp` backward) and their outputs leave through
    /// `g` (summed forward), once for all the local experts.
    pub fn with_tensor_parallel(mut self, tp: Option<Communicator>) -> Self {
        self.tensor_parallel = tp.filter(|tp| tp.size() > 1);
        self
    }

    /// The ranks each expert's linears are split over, if they are.
    pub fn tensor_parallel(&self) -> Option<&Communicator> {
        self.tensor_parallel.as_ref()
    }

    /// Ranks each expert's linears are split over (1 when whole).
    pub fn tensor_parallel_size(&self) -> usize {
        self.tensor_parallel.as_ref().map_or(1, Communicator::size)
    }

    /// This rank's index among the ranks splitting each expert's linears.
    pub fn tensor_parallel_rank(&self) -> usize {
        self.tensor_parallel.as_ref().map_or(0, Communicator::rank)
    }

    /// Experts in the layer.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Ranks the experts are split over.
    pub fn size(&self) -> usize {
        self.comm.as_ref().map_or(1, Communicator::size)
    }

    /// This rank's index in the expert-parallel group.
    pub fn rank(&self) -> usize {
        self.comm.as_ref().map_or(0, Communicator::rank)
    }

    /// The expert-parallel group, if the experts are split.
    pub fn comm(&self) -> Option<&Communicator> {
        self.comm.as_ref()
    }

    /// Experts on one rank.
    pub fn local_count(&self) -> usize {
        self.experts / self.size()
    }

    /// The experts this rank holds.
    pub fn local_experts(&self) -> Range<usize> {
        let n = self.local_count();
        self.rank() * n..(self.rank() + 1) * n
    }
}

/// The router's decisions for `tokens` tokens: `experts` `[tokens, k]` (each token's k
/// experts) and `weights` `[tokens, k]` (what each expert's output is multiplied by).
#[derive(Debug, Clone)]
pub struct Routing<B: Backend> {
    /// Each token's experts.
    pub experts: Tensor<B, 2, Int>,
    /// Each token's weight for each of its experts.
    pub weights: Tensor<B, 2>,
}

/// What a dispatch did on this rank, for metrics.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DispatchStats {
    /// Copies of this rank's tokens each expert received (after dropping), all experts.
    pub tokens_per_expert: Vec<usize>,
    /// Copies of this rank's tokens dropped for capacity.
    pub dropped: usize,
}

/// `x` `[tokens, hidden]` through the experts `routing` chose: every kept copy of a token goes
/// to its expert's rank, where `expert(j, rows)` runs local expert `j` (index into
/// [`ExpertParallel::local_experts`]) on all the rows it received, `[rows, hidden]` to
/// `[rows, hidden]` (every local expert, even on no rows: burn's autodiff loses an empty
/// output's gradient on its way back, so a caller that needs every expert's weights to get
/// one ties those outputs into its loss, as [`crate::Moe`] does; with expert tensor
/// parallelism, its partial product from this rank's slice); the outputs come back, are multiplied by their routing weights and summed
/// per token: `[tokens, hidden]`. With `capacity`, each expert keeps at most that many copies of
/// this rank's tokens. Every rank of the expert-parallel group calls it, with the same `hidden`
/// (and, padded, the same `capacity`: the size of every part); sizes that disagree fail on the
/// rank that receives them, with a sentence naming the shapes.
pub fn dispatch_combine<B: CommBackend>(
    x: Tensor<B, 2>,
    routing: &Routing<B>,
    ep: &ExpertParallel,
    capacity: Option<usize>,
    dispatch: Dispatch,
    mut expert: impl FnMut(usize, Tensor<B, 2>) -> Result<Tensor<B, 2>, MoeError>,
) -> Result<(Tensor<B, 2>, DispatchStats), MoeError> {
    let [tokens, hidden] = x.dims();
    let [routed, k] = routing.experts.dims();
    if routed != tokens || routing.weights.dims() != [tokens, k] {
        return Err(MoeError::Config(format!(
            "{tokens} tokens but routing for {routed} ({:?} experts, {:?} weights); route every token once",
            routing.experts.dims(),
            routing.weights.dims()
        )));
    }
    let padded_capacity = match (dispatch, capacity) {
        (Dispatch::Unpadded, _) => None,
        (Dispatch::Padded, Some(capacity)) => Some(capacity),
        (Dispatch::Padded, None) => {
            return Err(MoeError::Config(
                "padded dispatch pads every expert's rows to its capacity; give a capacity".into(),
            ));
        }
    };
    // The rows' buffers take the input's dtype (bf16 or f16 under mixed precision).
    let (device, dtype) = (x.device(), x.dtype());
    let chosen: Vec<i64> = routing
        .experts
        .to_data()
        .convert::<i64>()
        .into_vec()
        .map_err(|e| MoeError::Config(format!("the routing's expert ids: {e:?}")))?;
    let plan = Plan::new(&chosen, k, ep, capacity)?;
    let (rows, unpadded) = plan.exchange_counts::<B>(ep, &device)?;
    let ids = |values: &[usize]| {
        let values: Vec<i64> = values.iter().map(|&v| v as i64).collect();
        let n = values.len();
        Tensor::<B, 1, Int>::from_data(TensorData::new(values, [n]), &device)
    };
    // Every rank takes part in every exchange and keeps each in its graph, even with no copy to
    // send or none received (its parts are empty): its backward then runs the reverse exchanges
    // its peers wait for.
    // 2. This rank's kept copies, sorted by expert (padded: each in its expert's slots).
    let kept_tokens = plan.kept_tokens();
    let slots = padded_capacity.map(|capacity| plan.padded_slots(capacity));
    let sorted = gather_rows(&x, &kept_tokens, &ids);
    let (sent, sizes) = match (padded_capacity, &slots) {
        (Some(capacity), Some(slots)) => {
            let padded = Tensor::<B, 2>::zeros([ep.experts() * capacity, hidden], (&device, dtype))
                .select_assign(0, ids(slots), sorted, IndexingUpdateOp::Add);
            let part = vec![ep.local_count() * capacity; ep.size()];
            let sizes = SplitSizes {
                send: part.clone(),
                recv: part,
            };
            (padded, sizes)
        }
        _ => (sorted, unpadded),
    };
    // 3. To the experts' ranks, through them, and back.
    let received = exchange(sent, &sizes, ep)?;
    let received = match ep.tensor_parallel() {
        Some(tp) => copy_to_parallel_region(received, tp)?,
        None => received,
    };
    let outputs = run_experts(received, &rows, padded_capacity, ep, &ids, &mut expert)?;
    let outputs = match ep.tensor_parallel() {
        Some(tp) => reduce_from_parallel_region(outputs, tp)?,
        None => outputs,
    };
    let back = exchange(outputs, &sizes.reversed(), ep)?;
    let back = match &slots {
        None => back,
        Some(slots) => gather_rows(&back, slots, &ids),
    };
    // 4. Weighted, and summed into their tokens.
    let combined = Tensor::<B, 2>::zeros([tokens, hidden], (&device, dtype));
    let weights = routing.weights.clone().reshape([tokens * k]);
    let weights = weights
        .select(0, ids(&plan.kept))
        .reshape([plan.kept.len(), 1]);
    let combined =
        combined.select_assign(0, ids(&kept_tokens), back * weights, IndexingUpdateOp::Add);
    Ok((combined, plan.stats()))
}

/// Rows `at` of `x` (none: `[0, width]`, still in `x`'s graph).
fn gather_rows<B: Backend>(
    x: &Tensor<B, 2>,
    at: &[usize],
    ids: &impl Fn(&[usize]) -> Tensor<B, 1, Int>,
) -> Tensor<B, 2> {
    x.clone().select(0, ids(at))
}

/// The all-to-all of `rows` over the expert-parallel group, or the rows themselves alone.
fn exchange<B: CommBackend>(
    rows: Tensor<B, 2>,
    sizes: &SplitSizes,
    ep: &ExpertParallel,
) -> Result<Tensor<B, 2>, MoeError> {
    match ep.comm() {
        Some(comm) => Ok(all_to_all_split(rows, 0, sizes, comm)?),
        None => Ok(rows),
    }
}

/// Runs each local expert on all the rows it received (none too), and puts the outputs back
/// in the order they came in (by source rank, then expert; padded: every block `capacity`
/// rows).
fn run_experts<B: Backend>(
    received: Tensor<B, 2>,
    rows: &ReceivedRows,
    padded_capacity: Option<usize>,
    ep: &ExpertParallel,
    ids: &impl Fn(&[usize]) -> Tensor<B, 1, Int>,
    expert: &mut impl FnMut(usize, Tensor<B, 2>) -> Result<Tensor<B, 2>, MoeError>,
) -> Result<Tensor<B, 2>, MoeError> {
    let [total, hidden] = received.dims();
    let local = ep.local_count();
    // Where each (source, expert) block sits in `received`.
    let block = |source: usize, j: usize| -> Range<usize> {
        let (start, len) = match padded_capacity {
            None => (
                rows.source_start[source] + rows.counts[source][..j].iter().sum::<usize>(),
                rows.counts[source][j],
            ),
            Some(capacity) => ((source * local + j) * capacity, capacity),
        };
        start..start + len
    };
    let mut outputs = Vec::new();
    let mut order = Vec::new();
    for j in 0..local {
        let at: Vec<usize> = (0..ep.size()).flat_map(|s| block(s, j)).collect();
        let output = expert(j, received.clone().select(0, ids(&at)))?;
        if output.dims() != [at.len(), hidden] {
            return Err(MoeError::Config(format!(
                "expert {j} turned {} rows of {hidden} into {:?}; an expert keeps its rows' shape",
                at.len(),
                output.dims()
            )));
        }
        outputs.push(output);
        order.extend(at);
    }
    debug_assert_eq!(
        order.len(),
        total,
        "every row received belongs to one local expert"
    );
    if total == 0 {
        // Nothing came, nothing goes back: the received (empty) rows themselves, which keep
        // the exchanges in this rank's graph (burn's autodiff drops an empty `cat`).
        return Ok(received);
    }
    // Row `order[i]` of the received is row `i` of the outputs: put them back in place.
    let mut inverse = vec![0; total];
    for (i, &at) in order.iter().enumerate() {
        inverse[at] = i;
    }
    Ok(Tensor::cat(outputs, 0).select(0, ids(&inverse)))
}

/// This rank's routing decisions, on the host.
struct Plan {
    /// Top-k slots.
    k: usize,
    /// Flat indices (`token * k + slot`) of the kept copies, sorted by expert, then token.
    kept: Vec<usize>,
    /// Each kept copy's expert, in `kept`'s order.
    kept_experts: Vec<usize>,
    /// Kept copies per expert.
    counts: Vec<usize>,
    dropped: usize,
}

/// How many rows each source rank sends this rank, per local expert, and where each source's
/// part starts in what is received.
struct ReceivedRows {
    counts: Vec<Vec<usize>>,
    source_start: Vec<usize>,
}

impl Plan {
    fn new(
        chosen: &[i64],
        k: usize,
        ep: &ExpertParallel,
        capacity: Option<usize>,
    ) -> Result<Self, MoeError> {
        let experts = ep.experts();
        let mut per_expert: Vec<Vec<usize>> = vec![Vec::new(); experts];
        let mut dropped = 0;
        for (flat, &e) in chosen.iter().enumerate() {
            let e = usize::try_from(e)
                .ok()
                .filter(|&e| e < experts)
                .ok_or_else(|| {
                    MoeError::Config(format!(
                        "token {} is routed to expert {e}, but the layer has {experts}",
                        flat / k.max(1)
                    ))
                })?;
            if capacity.is_some_and(|c| per_expert[e].len() >= c) {
                dropped += 1;
            } else {
                per_expert[e].push(flat);
            }
        }
        let counts = per_expert.iter().map(Vec::len).collect();
        let kept_experts = per_expert
            .iter()
            .enumerate()
            .flat_map(|(e, copies)| std::iter::repeat_n(e, copies.len()))
            .collect();
        Ok(Self {
            k,
            kept: per_expert.concat(),
            kept_experts,
            counts,
            dropped,
        })
    }

    /// The token of each kept copy.
    fn kept_tokens(&self) -> Vec<usize> {
        self.kept.iter().map(|&flat| flat / self.k).collect()
    }

    /// Each kept copy's row in the padded layout: `expert * capacity + its place among the
    /// expert's copies`.
    fn padded_slots(&self, capacity: usize) -> Vec<usize> {
        let mut next = vec![0; self.counts.len()];
        self.kept_experts
            .iter()
            .map(|&e| {
                let slot = e * capacity + next[e];
                next[e] += 1;
                slot
            })
            .collect()
    }

    /// Exchanges the counts: every rank learns how many rows each other sends it per local
    /// expert. Returns those and the all-to-all's sizes (unpadded).
    fn exchange_counts<B: Backend>(
        &self,
        ep: &ExpertParallel,
        device: &B::Device,
    ) -> Result<(ReceivedRows, SplitSizes), MoeError> {
        let (size, local) = (ep.size(), ep.local_count());
        let send: Vec<usize> = self.counts.chunks(local).map(|c| c.iter().sum()).collect();
        let received: Vec<usize> = match ep.comm() {
            None => self.counts.clone(),
            Some(comm) => {
                let counts: Vec<i64> = self.counts.iter().map(|&c| c as i64).collect();
                let counts =
                    Tensor::<B, 1, Int>::from_data(TensorData::new(counts, [ep.experts()]), device);
                comm.all_to_all(counts, 0, 0)?
                    .to_data()
                    .convert::<i64>()
                    .into_vec::<i64>()
                    .map_err(|e| MoeError::Config(format!("the exchanged counts: {e:?}")))?
                    .into_iter()
                    .map(|c| c as usize)
                    .collect()
            }
        };
        let counts: Vec<Vec<usize>> = received.chunks(local).map(<[usize]>::to_vec).collect();
        let recv: Vec<usize> = counts.iter().map(|c| c.iter().sum()).collect();
        let source_start = recv
            .iter()
            .scan(0, |start, &n| {
                let here = *start;
                *start += n;
                Some(here)
            })
            .collect();
        debug_assert_eq!(counts.len(), size);
        Ok((
            ReceivedRows {
                counts,
                source_start,
            },
            SplitSizes { send, recv },
        ))
    }

    fn stats(&self) -> DispatchStats {
        DispatchStats {
            tokens_per_expert: self.counts.clone(),
            dropped: self.dropped,
        }
    }
}
