//! The one gradient reducer of data parallelism, shared by DDP ([`crate::GradientSync`]),
//! ZeRO-1 and ZeRO-2 (burn-zero) and a pipeline's replicas (burn-pipeline, through
//! `GradientSync`): gradients packed into buckets, each bucket averaged over the group as soon
//! as its last gradient is in and every earlier bucket has started, so every rank issues the
//! same collectives in the same order while backward goes on. A bucket is all-reduced (DDP,
//! ZeRO-1) or reduce-scattered so each rank keeps its part (ZeRO-2; ZeRO-3 starts its own units'
//! [`Reduction`]s as its chain of units goes backward).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::module::{AutodiffModule, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};
use burn_comm::{CommError, Communicator, ReduceOp, Work};

use crate::MissingGradient;
pub use crate::bucket::Buckets;
use crate::experts::ExpertGroup;
use crate::hooks::BackwardHooks;
use crate::params::{self, ParamSlot};

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// What each rank keeps of a bucket's averaged gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// The whole buffer (all-reduce).
    Whole,
    /// Its own part (reduce-scatter); the buffer's length divides by the group's size.
    Part,
}

impl Reduction {
    /// Starts averaging `flat` over `comm`, cast to `dtype` first when given.
    pub fn start<B: Backend>(
        self,
        comm: &Communicator,
        flat: Tensor<B, 1>,
        dtype: Option<DType>,
    ) -> Work<Tensor<B, 1>> {
        let flat = match dtype {
            Some(dtype) if flat.dtype() != dtype => flat.cast(dtype),
            _ => flat,
        };
        match self {
            Reduction::Whole => comm.all_reduce_async(flat, ReduceOp::Avg),
            Reduction::Part => comm.reduce_scatter_async(flat, ReduceOp::Avg, 0),
        }
    }
}

/// What a finished reduction gives.
pub struct Reduced<B: AutodiffBackend> {
    /// The parameters reduced, in the reducer's order (their `take` perhaps rebound by
    /// [`Reducer::track`]).
    pub slots: Vec<ParamSlot<B>>,
    /// Each bucket's averaged buffer: the whole of it, or this rank's part.
    pub buffers: Vec<Tensor<Inner<B>, 1>>,
    /// For each parameter, the ranks that had no gradient for it (agreed by every rank).
    pub lacking: Vec<Vec<usize>>,
    /// Parameters some rank got a part for after taking them: they wait for the end of the
    /// next backwards.
    pub late: Vec<bool>,
    /// The order this rank's gradients came in.
    pub ready_order: Vec<usize>,
    /// Buckets started while backward was still running.
    pub overlapped: usize,
    /// Gradient bytes this rank sent into the buckets' collectives.
    pub bytes: usize,
}

impl<B: AutodiffBackend> Reduced<B> {
    /// The parameters some rank had no gradient for, each with those ranks.
    pub fn missing(&self) -> Vec<MissingGradient> {
        self.lacking
            .iter()
            .zip(&self.slots)
            .filter(|(ranks, _)| !ranks.is_empty())
            .map(|(ranks, slot)| MissingGradient {
                name: slot.name.clone(),
                ranks: ranks.clone(),
            })
            .collect()
    }
}

/// One reduction in progress: which gradients are in, which buckets are in flight.
pub struct Reducer<B: AutodiffBackend> {
    slots: Vec<ParamSlot<B>>,
    index_of: HashMap<ParamId, usize>,
    buckets: Arc<Buckets>,
    bucket_of: Vec<usize>,
    reduction: Reduction,
    reduce_dtype: Option<DType>,
    comm: Communicator,
    /// Where the experts' buckets are reduced (see [`ExpertGroup`]), and which buckets they are.
    experts: Option<ExpertBuckets>,
    /// Parameters known to get late parts: taken only after backward.
    known_late: Vec<bool>,
    /// Gradients summed locally, added to the parameter's when it is taken.
    accumulated: Vec<Option<Tensor<Inner<B>, 1>>>,
    grads: Vec<Option<Tensor<Inner<B>, 1>>>,
    taken: Vec<bool>,
    has_grad: Vec<bool>,
    late_parts: Vec<Option<Tensor<Inner<B>, 1>>>,
    ready_order: Vec<usize>,
    waiting: Vec<usize>,
    next_bucket: usize,
    in_flight: Vec<Work<Tensor<Inner<B>, 1>>>,
    overlapped: usize,
    bytes: usize,
}

impl<B: AutodiffBackend> Reducer<B> {
    /// A reduction of the gradients of `slots`, packed into `buckets` (every parameter in
    /// exactly one, one dtype each, each buffer at least as long as its parameters), over
    /// `comm`.
    pub fn new(
        slots: Vec<ParamSlot<B>>,
        buckets: Arc<Buckets>,
        reduction: Reduction,
        comm: Communicator,
    ) -> Result<Self, CommError> {
        let n = slots.len();
        let bucket_of = check_buckets(&slots, &buckets)?;
        Ok(Self {
            waiting: buckets.members.iter().map(Vec::len).collect(),
            bucket_of,
            buckets,
            reduction,
            reduce_dtype: None,
            comm,
            experts: None,
            known_late: vec![false; n],
            accumulated: vec![None; n],
            grads: vec![None; n],
            taken: vec![false; n],
            has_grad: vec![false; n],
            late_parts: vec![None; n],
            ready_order: Vec::with_capacity(n),
            next_bucket: 0,
            in_flight: Vec::new(),
            overlapped: 0,
            bytes: 0,
            index_of: slots.iter().enumerate().map(|(i, s)| (s.id, i)).collect(),
            slots,
        })
    }

    /// Reduces in `dtype` (mixed precision's reduce dtype) rather than the gradients' own.
    pub fn reduce_in(mut self, dtype: Option<DType>) -> Self {
        self.reduce_dtype = dtype;
        self
    }

    /// Reduces the buckets of `group`'s parameters over its ranks, scaled to the whole group's
    /// average (see [`ExpertGroup`]); a bucket must hold experts' parameters only or none.
    pub fn with_experts(mut self, group: Option<&ExpertGroup>) -> Result<Self, CommError> {
        let Some(group) = group else {
            return Ok(self);
        };
        let expert: Vec<bool> = self
            .slots
            .iter()
            .map(|s| group.params.contains(&s.id))
            .collect();
        let mut buckets = Vec::with_capacity(self.buckets.members.len());
        for (b, members) in self.buckets.members.iter().enumerate() {
            let experts = members.iter().filter(|&&p| expert[p]).count();
            if experts != 0 && experts != members.len() {
                return Err(CommError::Config(format!(
                    "invalid gradient buckets: bucket {b} mixes experts' parameters with others; they are reduced over different ranks"
                )));
            }
            buckets.push(experts != 0);
        }
        self.experts = Some(ExpertBuckets {
            comm: group.comm.clone(),
            scale: group.scale(&self.comm),
            buckets,
        });
        Ok(self)
    }

    /// The ranks `bucket` is reduced over.
    fn comm_of(&self, bucket: usize) -> &Communicator {
        match &self.experts {
            Some(experts) if experts.buckets[bucket] => &experts.comm,
            _ => &self.comm,
        }
    }

    /// `bucket`'s reduction: averaged over its ranks, then scaled when it holds experts.
    fn start(&self, bucket: usize, flat: Tensor<Inner<B>, 1>) -> Work<Tensor<Inner<B>, 1>> {
        self.reduction
            .start(self.comm_of(bucket), flat, self.reduce_dtype)
    }

    /// `reduced`, `bucket`'s averaged buffer, as the whole group's average.
    fn rescale(&self, bucket: usize, reduced: Tensor<Inner<B>, 1>) -> Tensor<Inner<B>, 1> {
        match &self.experts {
            Some(experts) if experts.buckets[bucket] => reduced * experts.scale,
            _ => reduced,
        }
    }

    /// Parameters an earlier backward gave late parts: they are taken only after backward, or
    /// their bucket would go before it is complete.
    pub fn known_late(mut self, late: Vec<bool>) -> Self {
        self.known_late = late;
        self
    }

    /// Gradients already summed locally (micro-batches without communication), added to each
    /// parameter's own when it is taken.
    pub fn with_accumulated(mut self, accumulated: Vec<Option<Tensor<Inner<B>, 1>>>) -> Self {
        self.accumulated = accumulated;
        self
    }

    /// Takes `part`'s gradients from `part`'s own tensors from now on, and returns their
    /// indices. `part` holds some of these parameters (same ids) re-wrapped as new leaves, as
    /// the pipeline executor does for each micro-batch: backward keys gradients by tensor, so
    /// the originals would find none.
    pub fn track<M: AutodiffModule<B>>(&mut self, part: &M) -> Vec<usize> {
        params::slots::<B, M>(part)
            .into_iter()
            .filter_map(|slot| {
                let i = *self.index_of.get(&slot.id)?;
                self.slots[i].take = slot.take;
                Some(i)
            })
            .collect()
    }

    /// Adds the gradients `take` finds for the parameters `params` to their local sums,
    /// without communication: a micro-batch that is not the step's last. A parameter already
    /// taken keeps it as a late part.
    pub fn accumulate(
        &mut self,
        params: &[usize],
        mut take: impl FnMut(&ParamSlot<B>) -> Option<Tensor<Inner<B>, 1>>,
    ) {
        for &i in params {
            let sums = if self.taken[i] {
                &mut self.late_parts
            } else {
                &mut self.accumulated
            };
            add(&mut sums[i], take(&self.slots[i]));
        }
    }

    /// During backward: takes the gradients that are complete and starts the buckets they
    /// complete.
    pub fn take_ready(&mut self, grads: &mut B::Gradients) {
        let started = self.next_bucket;
        for i in 0..self.slots.len() {
            if self.taken[i] || self.known_late[i] {
                continue;
            }
            if let Some(grad) = (self.slots[i].take)(grads) {
                self.ready(i, Some(grad));
            }
        }
        self.overlapped += self.next_bucket - started;
    }

    /// After backward: takes every remaining gradient with `take` (zeros where there is
    /// none, so every rank reduces the same buckets) and keeps any part that came after its
    /// parameter was taken.
    pub fn take_rest(&mut self, take: impl FnMut(&ParamSlot<B>) -> Option<Tensor<Inner<B>, 1>>) {
        let all: Vec<usize> = (0..self.slots.len()).collect();
        self.take_rest_of(&all, take);
    }

    /// [`Self::take_rest`] for the parameters `params` only: a part of the module whose
    /// gradients are complete, such as a pipeline chunk after its last micro-batch.
    pub fn take_rest_of(
        &mut self,
        params: &[usize],
        mut take: impl FnMut(&ParamSlot<B>) -> Option<Tensor<Inner<B>, 1>>,
    ) {
        for &i in params {
            let grad = take(&self.slots[i]);
            if self.taken[i] {
                add(&mut self.late_parts[i], grad);
            } else {
                self.ready(i, grad);
            }
        }
    }

    fn ready(&mut self, i: usize, grad: Option<Tensor<Inner<B>, 1>>) {
        self.taken[i] = true;
        self.has_grad[i] = grad.is_some() || self.accumulated[i].is_some();
        self.grads[i] = match (grad, self.accumulated[i].take()) {
            (Some(grad), Some(sum)) => Some(sum + grad),
            (grad, sum) => grad.or(sum),
        };
        self.ready_order.push(i);
        self.waiting[self.bucket_of[i]] -= 1;
        while self.next_bucket < self.waiting.len() && self.waiting[self.next_bucket] == 0 {
            let flat = self.pack(self.next_bucket, |me, p| me.grads[p].take());
            self.bytes += flat.dims()[0] * self.reduce_dtype.unwrap_or(flat.dtype()).size();
            let work = self.start(self.next_bucket, flat);
            self.in_flight.push(work);
            self.next_bucket += 1;
        }
    }

    /// `bucket`'s buffer: its parameters' tensors from `get` (zeros where there is none) end
    /// to end, then zeros up to its length.
    fn pack(
        &mut self,
        bucket: usize,
        get: impl Fn(&mut Self, usize) -> Option<Tensor<Inner<B>, 1>>,
    ) -> Tensor<Inner<B>, 1> {
        let buckets = self.buckets.clone();
        let members = &buckets.members[bucket];
        let slot = &self.slots[members[0]];
        let (device, dtype) = (slot.device.clone(), slot.dtype);
        let mut parts: Vec<_> = members
            .iter()
            .map(|&p| {
                get(self, p)
                    .unwrap_or_else(|| Tensor::zeros([self.slots[p].numel], (&device, dtype)))
            })
            .collect();
        let numel: usize = members.iter().map(|&p| self.slots[p].numel).sum();
        let length = buckets.lengths[bucket];
        if length > numel {
            parts.push(Tensor::zeros([length - numel], (&device, dtype)));
        }
        params::concat(parts)
    }

    /// Waits for every bucket, adds the late parts (reduced over the union of every rank's
    /// late buckets), and agrees with the group on which parameters lacked a gradient where.
    /// Every parameter must have been taken: a bucket never started would leave the group
    /// waiting for this rank.
    pub fn finish(mut self) -> Result<Reduced<B>, CommError> {
        let untaken: Vec<&str> = (0..self.slots.len())
            .filter(|&i| !self.taken[i])
            .map(|i| self.slots[i].name.as_str())
            .collect();
        if !untaken.is_empty() {
            return Err(CommError::Config(format!(
                "rank {}: {} parameter(s) were never taken this step ({}); take every parameter's gradient (take_rest) before finishing",
                self.comm.rank(),
                untaken.len(),
                untaken.join(", ")
            )));
        }
        let mut buffers = Vec::with_capacity(self.in_flight.len());
        for (bucket, work) in std::mem::take(&mut self.in_flight).into_iter().enumerate() {
            buffers.push(self.rescale(bucket, work.wait()?));
        }
        // One exchange of per-parameter codes decides, identically on every rank, which
        // parameters lack a gradient somewhere (bit 0 clear) and which got late parts (bit 1).
        let codes: Vec<i32> = (0..self.slots.len())
            .map(|i| self.has_grad[i] as i32 | (self.late_parts[i].is_some() as i32) << 1)
            .collect();
        let codes = params::gather_codes::<Inner<B>>(&self.comm, &codes, &self.slots[0].device)?;
        let late: Vec<bool> = codes
            .iter()
            .map(|c| c.iter().any(|&c| c & 2 != 0))
            .collect();
        let lacking = codes
            .iter()
            .map(|c| (0..c.len()).filter(|&r| c[r] & 1 == 0).collect())
            .collect();
        let late_buckets: Vec<usize> = (0..self.waiting.len())
            .filter(|&b| self.buckets.members[b].iter().any(|&p| late[p]))
            .collect();
        for bucket in late_buckets {
            let flat = self.pack(bucket, |me, p| me.late_parts[p].take());
            let extra = self.rescale(bucket, self.start(bucket, flat).wait()?);
            buffers[bucket] = buffers[bucket].clone() + extra;
        }
        Ok(Reduced {
            slots: self.slots,
            buffers,
            lacking,
            late,
            ready_order: self.ready_order,
            overlapped: self.overlapped,
            bytes: self.bytes,
        })
    }
}

impl<B: BackwardHooks> Reducer<B> {
    /// Backward of `loss`; with `overlap`, each bucket starts as soon as its gradients are in.
    /// Returns what backward left: the gradients not taken during it (all of them without
    /// `overlap`), for [`Self::take_rest`], and those of tensors that are not parameters.
    pub fn backward(self, loss: Tensor<B, 1>, overlap: bool) -> (Self, B::Gradients) {
        if !overlap {
            return (self, loss.backward());
        }
        let reducer = Arc::new(Mutex::new(Some(self)));
        let hook = reducer.clone();
        let loss = B::with_depth_hooks(
            loss,
            Arc::new(move |grads| {
                if let Some(reducer) = lock(&hook).as_mut() {
                    reducer.take_ready(grads);
                }
            }),
        );
        let grads = loss.backward();
        // Taken out, so a hook that outlived backward would find nothing to act on.
        let reducer = lock(&reducer)
            .take()
            .expect("only backward borrows the reducer");
        (reducer, grads)
    }
}

/// The buckets of an [`ExpertGroup`]'s parameters: reduced over its ranks and scaled.
struct ExpertBuckets {
    comm: Communicator,
    scale: f64,
    /// Whether each bucket holds experts' parameters.
    buckets: Vec<bool>,
}

/// Adds `grad` to `sum`, either of which may be absent.
fn add<B: Backend>(sum: &mut Option<Tensor<B, 1>>, grad: Option<Tensor<B, 1>>) {
    if let Some(grad) = grad {
        *sum = Some(match sum.take() {
            Some(sum) => sum + grad,
            None => grad,
        });
    }
}

/// Which bucket each parameter is in, once `buckets` is checked to hold every parameter
/// exactly once, one dtype per bucket, each buffer at least as long as its parameters.
fn check_buckets<B: AutodiffBackend>(
    slots: &[ParamSlot<B>],
    buckets: &Buckets,
) -> Result<Vec<usize>, CommError> {
    let bad = |why: String| {
        Err(CommError::Config(format!(
            "invalid gradient buckets: {why}"
        )))
    };
    if buckets.lengths.len() != buckets.members.len() {
        return bad(format!(
            "{} buckets but {} lengths",
            buckets.members.len(),
            buckets.lengths.len()
        ));
    }
    let mut bucket_of = vec![usize::MAX; slots.len()];
    for (b, members) in buckets.members.iter().enumerate() {
        let Some(&first) = members.first() else {
            return bad(format!("bucket {b} is empty"));
        };
        let mut numel = 0;
        for &p in members {
            if p >= slots.len() || bucket_of[p] != usize::MAX {
                return bad(format!("parameter {p} is out of range or in two buckets"));
            }
            if slots[p].dtype != slots[first].dtype {
                return bad(format!("bucket {b} mixes dtypes"));
            }
            bucket_of[p] = b;
            numel += slots[p].numel;
        }
        if buckets.lengths[b] < numel {
            return bad(format!(
                "bucket {b} is {} elements long but holds {numel}",
                buckets.lengths[b]
            ));
        }
    }
    if let Some(p) = bucket_of.iter().position(|&b| b == usize::MAX) {
        return bad(format!("parameter {} is in no bucket", slots[p].name));
    }
    Ok(bucket_of)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}
