//! The gradient synchronisation of data parallelism (Li et al., 2020, "PyTorch Distributed:
//! Experiences on Accelerating Data Parallel Training"): gradients averaged over the group in
//! buckets whose all-reduce starts as soon as the bucket's last gradient is ready, overlapping
//! the rest of backward. It does not own the module, so a wrapper that does
//! ([`crate::DistributedDataParallel`]) and a training loop that does (burn-train's `Learner`)
//! share it; gradients computed elsewhere are averaged by [`GradientSync::average`].

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::config::Config;
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn_comm::{Communicator, ReduceOp, Work};

use crate::bucket::BucketPlan;
use crate::hooks::BackwardHooks;
use crate::params::{self, ParamSlot};
use crate::{DdpError, MissingGradient};

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// Settings of [`DistributedDataParallel`].
#[derive(Config, Debug)]
pub struct DdpConfig {
    /// Gradients per all-reduce, in bytes (PyTorch's `bucket_cap_mb`, 25 MiB).
    #[config(default = 26214400)]
    pub bucket_cap_bytes: usize,
    /// Start each bucket's all-reduce during backward. Off: all of them after backward.
    #[config(default = true)]
    pub overlap: bool,
    /// Accept parameters without a gradient (PyTorch's `find_unused_parameters`): they count
    /// as zero on the ranks that lack one, and are left out when no rank has one.
    #[config(default = false)]
    pub allow_unused_parameters: bool,
}

/// Where the last synchronised backward spent its time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DdpStepStats {
    /// In `backward`, including starting the buckets that were ready during it.
    pub backward: Duration,
    /// After backward, waiting for gradient communication to finish: the part not overlapped.
    pub comm_wait: Duration,
    /// Buckets all-reduced.
    pub buckets: usize,
    /// Buckets whose all-reduce started while backward was still running.
    pub overlapped_buckets: usize,
    /// Gradient bytes all-reduced by this rank.
    pub bytes: usize,
}

/// The gradient synchronisation of one rank of a data-parallel group: the bucket plan (rebuilt
/// once in the order the first backward produced gradients), the parameters known to get late
/// contributions, gradients accumulated without communication, and the last step's timings.
pub struct GradientSync<B: AutodiffBackend> {
    comm: Communicator,
    config: DdpConfig,
    names: Vec<String>,
    plan: BucketPlan,
    /// Parameters whose gradient got a contribution after it was taken: reduced after backward.
    late: Vec<bool>,
    /// Whether the bucket order has been rebuilt from the first backward's order.
    rebuilt: bool,
    /// Gradients summed locally by `backward_no_sync`.
    accumulated: Vec<Option<Tensor<Inner<B>, 1>>>,
    stats: DdpStepStats,
}

impl<B: AutodiffBackend> GradientSync<B> {
    /// The synchronisation of `module`'s trainable parameters over `comm`. The replicas must
    /// already be equal ([`params::broadcast`] makes them so).
    pub fn new<M: AutodiffModule<B>>(
        module: &M,
        comm: Communicator,
        config: DdpConfig,
    ) -> Result<Self, DdpError> {
        if config.bucket_cap_bytes == 0 {
            return Err(DdpError::Config(
                "bucket_cap_bytes is 0; give buckets at least one byte (PyTorch uses 25 MiB)"
                    .into(),
            ));
        }
        // Frozen parameters are made equal by the broadcast, then left alone, as in PyTorch.
        let slots = params::trainable::<B, M>(module);
        if slots.is_empty() {
            return Err(DdpError::Config(
                "the module has no trainable float parameters; there is nothing to keep in sync"
                    .into(),
            ));
        }
        // Backward reaches the last parameters first: start with reverse module order.
        let order: Vec<usize> = (0..slots.len()).rev().collect();
        let plan = plan_for(&slots, &order, config.bucket_cap_bytes);
        Ok(Self {
            comm,
            names: slots.iter().map(|s| s.name.clone()).collect(),
            late: vec![false; slots.len()],
            accumulated: vec![None; slots.len()],
            plan,
            config,
            rebuilt: false,
            stats: DdpStepStats::default(),
        })
    }

    /// The data-parallel group.
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// Timings of the last synchronisation.
    pub fn stats(&self) -> DdpStepStats {
        self.stats
    }

    /// Buckets' parameter names, in launch order.
    pub fn buckets(&self) -> Vec<Vec<String>> {
        self.plan
            .buckets
            .iter()
            .map(|b| b.iter().map(|&i| self.names[i].clone()).collect())
            .collect()
    }

    /// Backward of a micro-batch whose gradients are only accumulated locally (PyTorch's
    /// `no_sync`): no communication. The next synchronisation adds them in before averaging.
    pub fn backward_no_sync<M: AutodiffModule<B>>(&mut self, module: &M, loss: Tensor<B, 1>) {
        let slots = params::trainable::<B, M>(module);
        let mut grads = loss.backward();
        for (i, slot) in slots.iter().enumerate() {
            if let Some(grad) = (slot.take)(&mut grads) {
                self.accumulated[i] = Some(match self.accumulated[i].take() {
                    Some(sum) => sum + grad,
                    None => grad,
                });
            }
        }
    }

    /// `grads`, computed elsewhere for `module` (burn-train's `TrainStep`, a pipeline's
    /// micro-batches), plus any accumulated by [`Self::backward_no_sync`], averaged over the
    /// group in the same buckets, all sent at once.
    pub fn average<M: AutodiffModule<B>>(
        &mut self,
        module: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams, DdpError> {
        let mut reducer = self.reducer(params::trainable::<B, M>(module))?;
        let start = Instant::now();
        reducer.take_remaining(|slot| (slot.take_param)(&mut grads));
        self.finish(reducer, start, Duration::ZERO, false)
    }

    fn reducer(&mut self, slots: Vec<ParamSlot<B>>) -> Result<Reducer<B>, DdpError> {
        if slots.len() != self.names.len() {
            return Err(DdpError::Config(format!(
                "the module had {} trainable parameters when wrapped and has {} now; synchronise the new module with a new GradientSync",
                self.names.len(),
                slots.len()
            )));
        }
        Ok(Reducer::new(
            slots,
            self.plan.clone(),
            self.late.clone(),
            std::mem::replace(&mut self.accumulated, vec![None; self.names.len()]),
            self.comm.clone(),
        ))
    }

    /// Waits for the buckets, checks for missing gradients, records the step and, after the
    /// first real backward, rebuilds the buckets in the order gradients arrived.
    fn finish(
        &mut self,
        reducer: Reducer<B>,
        waited: Instant,
        backward: Duration,
        from_backward: bool,
    ) -> Result<GradientsParams, DdpError> {
        let outcome = reducer.finish(self.config.allow_unused_parameters)?;
        self.stats = DdpStepStats {
            backward,
            comm_wait: waited.elapsed(),
            buckets: self.plan.buckets.len(),
            overlapped_buckets: outcome.overlapped,
            bytes: outcome.bytes,
        };
        if !outcome.missing.is_empty() {
            return Err(DdpError::MissingGradients(
                outcome
                    .missing
                    .into_iter()
                    .map(|(i, ranks)| MissingGradient {
                        name: self.names[i].clone(),
                        ranks,
                    })
                    .collect(),
            ));
        }
        for (i, late) in outcome.late.iter().enumerate() {
            self.late[i] |= late;
        }
        // Only a backward shows the order gradients become ready in; gradients handed over
        // whole come in module order, which would make the first bucket the last one ready.
        if from_backward && !self.rebuilt {
            // Late parameters are complete only after backward: they go last, or their bucket
            // would hold back every later one.
            let (mut order, late): (Vec<usize>, Vec<usize>) =
                outcome.ready_order.iter().partition(|&&i| !self.late[i]);
            order.extend(late);
            self.rebuild(&order, &outcome.slots)?;
        }
        Ok(outcome.grads)
    }

    /// Re-packs the buckets in the order gradients became ready in the first backward, as
    /// PyTorch does; rank 0's order is used everywhere so the buckets match.
    fn rebuild(&mut self, order: &[usize], slots: &[ParamSlot<B>]) -> Result<(), DdpError> {
        let order: Vec<i64> = order.iter().map(|&i| i as i64).collect();
        let order = params::to_ints::<Inner<B>>(&order, &slots[0].device);
        let order: Vec<usize> = params::from_ints(self.comm.broadcast(order, 0)?)
            .into_iter()
            .map(|i| i as usize)
            .collect();
        self.plan = plan_for(slots, &order, self.config.bucket_cap_bytes);
        self.rebuilt = true;
        Ok(())
    }
}

impl<B: BackwardHooks> GradientSync<B> {
    /// Backward of `loss`, computed from `module`, with the gradients (plus any accumulated by
    /// [`Self::backward_no_sync`]) averaged over the group, bucket by bucket, overlapping
    /// backward when [`DdpConfig::overlap`] is on.
    pub fn backward<M: AutodiffModule<B>>(
        &mut self,
        module: &M,
        loss: Tensor<B, 1>,
    ) -> Result<GradientsParams, DdpError> {
        if !B::is_tracked(&loss) {
            return Err(DdpError::Config(
                "the loss does not depend on any parameter that requires a gradient; compute it from the module's forward".into(),
            ));
        }
        let reducer = Arc::new(Mutex::new(Some(
            self.reducer(params::trainable::<B, M>(module))?,
        )));
        let start = Instant::now();
        let loss = if self.config.overlap {
            let hook = reducer.clone();
            B::with_depth_hooks(
                loss,
                Arc::new(move |grads| {
                    if let Some(reducer) = lock(&hook).as_mut() {
                        reducer.take_ready(grads);
                    }
                }),
            )
        } else {
            loss
        };
        let mut grads = loss.backward();
        // Taken out, so a hook that outlived backward would find nothing to act on.
        let mut reducer = lock(&reducer)
            .take()
            .expect("only backward borrows the reducer");
        reducer.take_remaining(|slot| (slot.take)(&mut grads));
        let backward = start.elapsed();
        self.finish(reducer, Instant::now(), backward, true)
    }
}

fn plan_for<B: AutodiffBackend>(slots: &[ParamSlot<B>], order: &[usize], cap: usize) -> BucketPlan {
    let bytes: Vec<usize> = slots.iter().map(ParamSlot::bytes).collect();
    let dtypes: Vec<_> = slots.iter().map(|s| s.dtype).collect();
    BucketPlan::new(order, &bytes, &dtypes, cap)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// The state of one synchronised backward: which gradients are in, which buckets are in flight.
struct Reducer<B: AutodiffBackend> {
    slots: Vec<ParamSlot<B>>,
    plan: BucketPlan,
    late: Vec<bool>,
    accumulated: Vec<Option<Tensor<Inner<B>, 1>>>,
    comm: Communicator,
    grads: Vec<Option<Tensor<Inner<B>, 1>>>,
    taken: Vec<bool>,
    ready_order: Vec<usize>,
    waiting_in_bucket: Vec<usize>,
    next_bucket: usize,
    in_flight: Vec<(usize, Work<Tensor<Inner<B>, 1>>)>,
    late_grads: Vec<Option<Tensor<Inner<B>, 1>>>,
    has_grad: Vec<bool>,
    overlapped: usize,
}

struct Outcome<B: AutodiffBackend> {
    grads: GradientsParams,
    slots: Vec<ParamSlot<B>>,
    ready_order: Vec<usize>,
    late: Vec<bool>,
    missing: Vec<(usize, Vec<usize>)>,
    bytes: usize,
    overlapped: usize,
}

impl<B: AutodiffBackend> Reducer<B> {
    fn new(
        slots: Vec<ParamSlot<B>>,
        plan: BucketPlan,
        late: Vec<bool>,
        accumulated: Vec<Option<Tensor<Inner<B>, 1>>>,
        comm: Communicator,
    ) -> Self {
        let n = slots.len();
        Self {
            waiting_in_bucket: plan.buckets.iter().map(Vec::len).collect(),
            slots,
            plan,
            late,
            accumulated,
            comm,
            grads: vec![None; n],
            taken: vec![false; n],
            ready_order: Vec::with_capacity(n),
            next_bucket: 0,
            in_flight: Vec::new(),
            late_grads: vec![None; n],
            has_grad: vec![false; n],
            overlapped: 0,
        }
    }

    /// During backward: takes the gradients that are complete and starts their buckets.
    /// Parameters known to receive late contributions wait for the end of backward.
    fn take_ready(&mut self, grads: &mut B::Gradients) {
        let started = self.next_bucket;
        for i in 0..self.slots.len() {
            if self.taken[i] || self.late[i] {
                continue;
            }
            if let Some(grad) = (self.slots[i].take)(grads) {
                self.ready(i, Some(grad));
            }
        }
        self.overlapped += self.next_bucket - started;
    }

    /// After backward: takes every remaining gradient with `take` (zeros where there is none,
    /// so every rank all-reduces the same buckets) and notes contributions that came after a
    /// take.
    fn take_remaining(
        &mut self,
        mut take: impl FnMut(&ParamSlot<B>) -> Option<Tensor<Inner<B>, 1>>,
    ) {
        for i in 0..self.slots.len() {
            let grad = take(&self.slots[i]);
            if self.taken[i] {
                self.late_grads[i] = grad;
            } else {
                self.ready(i, grad);
            }
        }
    }

    fn ready(&mut self, i: usize, grad: Option<Tensor<Inner<B>, 1>>) {
        self.taken[i] = true;
        self.has_grad[i] = grad.is_some() || self.accumulated[i].is_some();
        let slot = &self.slots[i];
        let grad = match (grad, self.accumulated[i].take()) {
            (Some(grad), Some(sum)) => sum + grad,
            (Some(grad), None) | (None, Some(grad)) => grad,
            (None, None) => Tensor::zeros([slot.numel], (&slot.device, slot.dtype)),
        };
        self.grads[i] = Some(grad);
        self.ready_order.push(i);
        let bucket = self.plan.bucket_of[i];
        self.waiting_in_bucket[bucket] -= 1;
        // Buckets start in order, so every rank issues the same sequence of all-reduces.
        while self.next_bucket < self.plan.buckets.len()
            && self.waiting_in_bucket[self.next_bucket] == 0
        {
            self.launch(self.next_bucket);
            self.next_bucket += 1;
        }
    }

    fn launch(&mut self, bucket: usize) {
        let parts = self.plan.buckets[bucket]
            .iter()
            .map(|&i| {
                self.grads[i]
                    .take()
                    .expect("every gradient of a full bucket")
            })
            .collect();
        let flat = params::concat(parts);
        self.in_flight
            .push((bucket, self.comm.all_reduce_async(flat, ReduceOp::Avg)));
    }

    /// Waits for every bucket, reduces late contributions, checks that every parameter had a
    /// gradient somewhere, and hands out the averaged gradients.
    fn finish(mut self, allow_unused: bool) -> Result<Outcome<B>, DdpError> {
        assert_eq!(
            self.next_bucket,
            self.plan.buckets.len(),
            "every bucket started"
        );
        let mut averaged: Vec<Option<Tensor<Inner<B>, 1>>> = vec![None; self.slots.len()];
        let mut bytes = 0;
        for (bucket, work) in std::mem::take(&mut self.in_flight) {
            let flat = work.wait()?;
            bytes += flat.dims()[0] * self.slots[self.plan.buckets[bucket][0]].dtype.size();
            let members = &self.plan.buckets[bucket];
            let lengths: Vec<usize> = members.iter().map(|&i| self.slots[i].numel).collect();
            for (&i, piece) in members.iter().zip(params::split(flat, &lengths)) {
                averaged[i] = Some(piece);
            }
        }
        // One exchange of per-parameter codes decides, identically on every rank, which
        // parameters lack a gradient somewhere (bit 0 clear) and which got late parts (bit 1).
        let codes: Vec<i32> = (0..self.slots.len())
            .map(|i| self.has_grad[i] as i32 | (self.late_grads[i].is_some() as i32) << 1)
            .collect();
        let codes = params::gather_codes::<Inner<B>>(&self.comm, &codes, &self.slots[0].device)?;
        let late: Vec<bool> = codes
            .iter()
            .map(|c| c.iter().any(|&c| c & 2 != 0))
            .collect();
        let lacking: Vec<Vec<usize>> = codes
            .iter()
            .map(|c| (0..c.len()).filter(|&r| c[r] & 1 == 0).collect())
            .collect();

        // Late parts, all-reduced over the union of every rank's late parameters (zeros where a
        // rank has none), one buffer per dtype.
        let indices: Vec<usize> = (0..self.slots.len()).filter(|&i| late[i]).collect();
        let members: Vec<&ParamSlot<B>> = indices.iter().map(|&i| &self.slots[i]).collect();
        for run in params::dtype_runs(&members) {
            let run = &indices[run];
            let parts = run
                .iter()
                .map(|&i| {
                    let slot = &self.slots[i];
                    self.late_grads[i]
                        .take()
                        .unwrap_or_else(|| Tensor::zeros([slot.numel], (&slot.device, slot.dtype)))
                })
                .collect();
            let lengths: Vec<usize> = run.iter().map(|&i| self.slots[i].numel).collect();
            let flat = self.comm.all_reduce(params::concat(parts), ReduceOp::Avg)?;
            for (&i, piece) in run.iter().zip(params::split(flat, &lengths)) {
                averaged[i] = averaged[i].take().map(|early| early + piece);
            }
        }

        let world = self.comm.size();
        let missing = lacking
            .iter()
            .enumerate()
            .filter(|(_, ranks)| !ranks.is_empty() && !allow_unused)
            .map(|(i, ranks)| (i, ranks.clone()))
            .collect();
        let mut grads = GradientsParams::new();
        for (i, grad) in averaged.into_iter().enumerate() {
            // A parameter no rank had a gradient for stays out, as in a plain burn step.
            if let Some(grad) = grad.filter(|_| lacking[i].len() < world) {
                (self.slots[i].put)(&mut grads, grad);
            }
        }
        Ok(Outcome {
            grads,
            slots: self.slots,
            ready_order: self.ready_order,
            late,
            missing,
            bytes,
            overlapped: self.overlapped,
        })
    }
}
