//! The gradient synchronisation of data parallelism (Li et al., 2020, "PyTorch Distributed:
//! Experiences on Accelerating Data Parallel Training"): gradients averaged over the group in
//! buckets whose all-reduce starts as soon as the bucket's last gradient is ready, overlapping
//! the rest of backward. It does not own the module, so a wrapper that does
//! ([`crate::DistributedDataParallel`]) and a training loop that does (burn-train's `Learner`)
//! share it; gradients computed elsewhere are averaged by [`GradientSync::average`], and a loop
//! that makes them in pieces (a pipeline) feeds a [`SyncStep`]. The reduction itself is the
//! shared [`crate::reducer::Reducer`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::config::Config;
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Device, Tensor};
use burn_comm::Communicator;

use crate::DdpError;
use crate::experts::ExpertGroup;
use crate::hooks::BackwardHooks;
use crate::params;
use crate::reducer::{Buckets, Reduced, Reducer, Reduction};

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
    /// In `backward` (under a [`SyncStep`], the backwards run through it), including starting
    /// the buckets that were ready during it.
    pub backward: Duration,
    /// After backward, waiting for gradient communication to finish: the part not overlapped
    /// (for [`GradientSync::average`], packing and starting the buckets too).
    pub comm_wait: Duration,
    /// Buckets all-reduced.
    pub buckets: usize,
    /// Buckets whose all-reduce started while a backward was still running (not counting
    /// those a pipeline starts between a chunk's last backward and the next).
    pub overlapped_buckets: usize,
    /// Gradient bytes all-reduced by this rank.
    pub bytes: usize,
}

/// The gradient synchronisation of one rank of a data-parallel group: the bucket plan (rebuilt
/// once in the order the first backward produced gradients), the parameters known to get late
/// contributions, gradients accumulated without communication, and the last step's timings.
pub struct GradientSync<B: AutodiffBackend> {
    comm: Communicator,
    /// Parameters held by only some ranks of the group, reduced over those.
    experts: Option<ExpertGroup>,
    /// Whether each parameter is an expert's.
    expert: Vec<bool>,
    config: DdpConfig,
    names: Vec<String>,
    numels: Vec<usize>,
    dtypes: Vec<DType>,
    device: Device<Inner<B>>,
    buckets: Arc<Buckets>,
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
        Self::with_experts(module, comm, None, config)
    }

    /// [`Self::new`], with `experts`' parameters held by only some ranks of `comm` (a mixture
    /// of experts under expert parallelism): their gradients are reduced over the ranks
    /// holding the same ones, as [`ExpertGroup`] says, in buckets of their own. Those ranks
    /// must already hold the same experts ([`params::broadcast_grouped`]).
    pub fn with_experts<M: AutodiffModule<B>>(
        module: &M,
        comm: Communicator,
        experts: Option<ExpertGroup>,
        config: DdpConfig,
    ) -> Result<Self, DdpError> {
        if let Some(experts) = &experts {
            experts.check(&comm)?;
        }
        if config.bucket_cap_bytes == 0 {
            return Err(DdpError::Config(
                "bucket_cap_bytes is 0; give buckets at least one byte (PyTorch uses 25 MiB)"
                    .into(),
            ));
        }
        // Frozen parameters are made equal by the broadcast, then left alone, as in PyTorch.
        let slots = params::trainable::<B, M>(module);
        let Some(first) = slots.first() else {
            return Err(DdpError::Config(
                "the module has no trainable float parameters; there is nothing to keep in sync"
                    .into(),
            ));
        };
        let numels: Vec<usize> = slots.iter().map(|s| s.numel).collect();
        let dtypes: Vec<DType> = slots.iter().map(|s| s.dtype).collect();
        let expert: Vec<bool> = slots
            .iter()
            .map(|s| experts.as_ref().is_some_and(|e| e.params.contains(&s.id)))
            .collect();
        // Backward reaches the last parameters first: start with reverse module order.
        let order: Vec<usize> = (0..slots.len()).rev().collect();
        let buckets =
            Buckets::packed_apart(&order, &numels, &dtypes, &expert, config.bucket_cap_bytes);
        Ok(Self {
            comm,
            experts,
            expert,
            names: slots.iter().map(|s| s.name.clone()).collect(),
            numels,
            dtypes,
            device: first.device.clone(),
            late: vec![false; slots.len()],
            accumulated: vec![None; slots.len()],
            buckets: Arc::new(buckets),
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
        self.buckets
            .members
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

    /// `grads`, computed elsewhere for `module` (burn-train's `TrainStep`), plus any
    /// accumulated by [`Self::backward_no_sync`], averaged over the group in the same buckets,
    /// all sent at once.
    pub fn average<M: AutodiffModule<B>>(
        &mut self,
        module: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams, DdpError> {
        let mut step = self.begin(module)?;
        step.take_rest_params(&mut grads);
        step.finish()
    }

    /// Starts one synchronised step of `module`'s gradients, for a loop that produces them
    /// in pieces (a pipeline's micro-batches and chunks); [`SyncStep::finish`] hands them
    /// back averaged.
    pub fn begin<M: AutodiffModule<B>>(&mut self, module: &M) -> Result<SyncStep<'_, B>, DdpError> {
        let slots = params::trainable::<B, M>(module);
        if slots.len() != self.names.len() {
            return Err(DdpError::Config(format!(
                "the module had {} trainable parameters when wrapped and has {} now; synchronise the new module with a new GradientSync",
                self.names.len(),
                slots.len()
            )));
        }
        let reducer = Reducer::new(
            slots,
            self.buckets.clone(),
            Reduction::Whole,
            self.comm.clone(),
        )?
        .with_experts(self.experts.as_ref())?
        .known_late(self.late.clone())
        .with_accumulated(std::mem::replace(
            &mut self.accumulated,
            vec![None; self.names.len()],
        ));
        Ok(SyncStep {
            sync: self,
            reducer: Some(reducer),
            backward: Duration::ZERO,
            launching: Duration::ZERO,
            from_backward: false,
        })
    }

    /// Unpacks a finished reduction, records the step and, after the first real backward,
    /// rebuilds the buckets in the order gradients arrived.
    fn finish(
        &mut self,
        reduced: Reduced<B>,
        comm_wait: Duration,
        backward: Duration,
        from_backward: bool,
    ) -> Result<GradientsParams, DdpError> {
        self.stats = DdpStepStats {
            backward,
            comm_wait,
            buckets: self.buckets.members.len(),
            overlapped_buckets: reduced.overlapped,
            bytes: reduced.bytes,
        };
        let missing = reduced.missing();
        if !missing.is_empty() && !self.config.allow_unused_parameters {
            return Err(DdpError::MissingGradients(missing));
        }
        for (known, now) in self.late.iter_mut().zip(&reduced.late) {
            *known |= now;
        }
        let world = self.comm.size();
        let mut grads = GradientsParams::new();
        for (members, flat) in self.buckets.members.iter().zip(reduced.buffers) {
            let lengths: Vec<usize> = members.iter().map(|&i| reduced.slots[i].numel).collect();
            for (&i, grad) in members.iter().zip(params::split(flat, &lengths)) {
                // A parameter no rank had a gradient for stays out, as in a plain burn step.
                if reduced.lacking[i].len() < world {
                    (reduced.slots[i].put)(&mut grads, grad);
                }
            }
        }
        // Only a backward shows the order gradients become ready in; gradients handed over
        // whole come in module order, which would make the first bucket the last one ready.
        if from_backward && !self.rebuilt {
            // Late parameters are complete only after backward: they go last, or their bucket
            // would hold back every later one.
            let (mut order, late): (Vec<usize>, Vec<usize>) =
                reduced.ready_order.iter().partition(|&&i| !self.late[i]);
            order.extend(late);
            self.rebuild(&order)?;
        }
        Ok(grads)
    }

    /// Re-packs the buckets in the order gradients became ready in the first backward, as
    /// PyTorch does; rank 0's order is used everywhere so the buckets match.
    fn rebuild(&mut self, order: &[usize]) -> Result<(), DdpError> {
        let order: Vec<i64> = order.iter().map(|&i| i as i64).collect();
        let order = params::to_ints::<Inner<B>>(&order, &self.device);
        let order: Vec<usize> = params::from_ints(self.comm.broadcast(order, 0)?)
            .into_iter()
            .map(|i| i as usize)
            .collect();
        self.buckets = Arc::new(Buckets::packed_apart(
            &order,
            &self.numels,
            &self.dtypes,
            &self.expert,
            self.config.bucket_cap_bytes,
        ));
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
        let mut step = self.begin(module)?;
        let mut grads = step.backward(loss);
        step.take_rest(&mut grads);
        step.finish()
    }
}

/// One synchronised step in progress, from [`GradientSync::begin`]: gradients come in by
/// backward or by hand, buckets start as they fill, [`Self::finish`] waits and averages.
pub struct SyncStep<'a, B: AutodiffBackend> {
    sync: &'a mut GradientSync<B>,
    /// Out only while a backward runs.
    reducer: Option<Reducer<B>>,
    /// In backwards, with the buckets they started, and taking their gradients.
    backward: Duration,
    /// Packing and starting buckets from gradients handed over whole.
    launching: Duration,
    from_backward: bool,
}

impl<B: AutodiffBackend> SyncStep<'_, B> {
    fn reducer(&mut self) -> &mut Reducer<B> {
        self.reducer
            .as_mut()
            .expect("the reducer is back after backward")
    }

    /// Sums the gradients of `part`'s parameters in `grads` locally, without communication:
    /// a micro-batch that is not the last to add to them this step. `part` is the module the
    /// backward ran through: the whole one, or a copy of some of its parameters (same ids).
    pub fn accumulate<M: AutodiffModule<B>>(&mut self, part: &M, grads: &mut B::Gradients) {
        let reducer = self.reducer();
        let params = reducer.track(part);
        reducer.accumulate(&params, |slot| (slot.take)(grads));
    }

    /// After a backward: takes every parameter's gradient from `grads` (zeros where there is
    /// none; what comes for a parameter already taken is a late part), starting the buckets
    /// they complete. Counted in the step's backward time.
    pub fn take_rest(&mut self, grads: &mut B::Gradients) {
        let start = Instant::now();
        self.reducer().take_rest(|slot| (slot.take)(grads));
        self.backward += start.elapsed();
    }

    /// Takes every parameter's gradient from gradients gathered by id (zeros where there is
    /// none), starting every bucket. Counted in the step's communication wait.
    pub fn take_rest_params(&mut self, grads: &mut GradientsParams) {
        let start = Instant::now();
        self.reducer().take_rest(|slot| (slot.take_param)(grads));
        self.launching += start.elapsed();
    }

    /// Waits for every bucket, checks for missing gradients and hands out the averaged
    /// gradients of the whole module.
    pub fn finish(mut self) -> Result<GradientsParams, DdpError> {
        let reducer = self
            .reducer
            .take()
            .expect("the reducer is back after backward");
        let waited = Instant::now();
        let reduced = reducer.finish()?;
        let comm_wait = self.launching + waited.elapsed();
        self.sync
            .finish(reduced, comm_wait, self.backward, self.from_backward)
    }
}

impl<B: BackwardHooks> SyncStep<'_, B> {
    /// Backward of `loss`, each bucket starting as soon as its gradients are in when
    /// [`DdpConfig::overlap`] is on. Returns what backward left for [`Self::take_rest`] and
    /// the gradients of tensors that are not parameters.
    pub fn backward(&mut self, loss: Tensor<B, 1>) -> B::Gradients {
        let start = Instant::now();
        let reducer = self.reducer.take().expect("one backward at a time");
        let (reducer, grads) = reducer.backward(loss, self.sync.config.overlap);
        self.reducer = Some(reducer);
        self.backward += start.elapsed();
        self.from_backward = true;
        grads
    }

    /// The last backward of `part`'s parameters this step (such as a pipeline chunk's last
    /// micro-batch), `loss` computed through `part` (the whole module, or a copy of some of
    /// its parameters, same ids): their gradients, plus what was accumulated, start their
    /// buckets during it, and any missing one counts as zero. Returns the gradients of
    /// tensors that are not these parameters (a stage's input).
    pub fn backward_of<M: AutodiffModule<B>>(
        &mut self,
        part: &M,
        loss: Tensor<B, 1>,
    ) -> B::Gradients {
        let params = self.reducer().track(part);
        let mut grads = self.backward(loss);
        self.reducer()
            .take_rest_of(&params, |slot| (slot.take)(&mut grads));
        grads
    }
}
