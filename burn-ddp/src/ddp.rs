//! DistributedDataParallel (Li et al., 2020, "PyTorch Distributed: Experiences on Accelerating
//! Data Parallel Training"): every rank holds the whole model, computes gradients on its shard
//! of the batch, and the gradients are averaged in buckets whose all-reduce starts as soon as
//! the bucket's last gradient is ready, overlapping the rest of backward ([`GradientSync`]).

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn_comm::Communicator;

use crate::experts::ExpertGroup;
use crate::hooks::BackwardHooks;
use crate::params;
use crate::replica::Replica;
use crate::sync::GradientSync;
use crate::{DdpConfig, DdpError, DdpStepStats};

/// A replica of `module` on one rank of a data-parallel group.
///
/// ```ignore
/// let mut ddp = DistributedDataParallel::new(model, comm, DdpConfig::new())?;
/// let loss = ddp.module().loss(local_batch);
/// let grads = ddp.backward(loss)?; // averaged over the group
/// ddp.step(&mut optimizer, lr, grads);
/// ```
pub struct DistributedDataParallel<B: BackwardHooks, M: AutodiffModule<B>> {
    module: Replica<M>,
    sync: GradientSync<B>,
}

impl<B: BackwardHooks, M: AutodiffModule<B>> DistributedDataParallel<B, M> {
    /// Wraps `module`, replacing its parameters by rank 0's so every replica starts equal.
    pub fn new(module: M, comm: Communicator, config: DdpConfig) -> Result<Self, DdpError> {
        Self::with_experts(module, comm, None, config)
    }

    /// [`Self::new`] for a module some of whose parameters only some ranks of `comm` hold (a
    /// mixture of experts under expert parallelism, see [`ExpertGroup`]): those are made equal
    /// among the ranks holding the same experts, and their gradients reduced over those.
    pub fn with_experts(
        module: M,
        comm: Communicator,
        experts: Option<ExpertGroup>,
        config: DdpConfig,
    ) -> Result<Self, DdpError> {
        let module = params::broadcast_grouped::<B, M>(module, &comm, experts.as_ref())?;
        let sync = GradientSync::with_experts(&module, comm, experts, config)?;
        Ok(Self {
            module: Replica::new(module),
            sync,
        })
    }

    /// The local replica, for the forward pass.
    pub fn module(&self) -> &M {
        self.module.get()
    }

    /// Unwraps the replica.
    pub fn into_module(self) -> M {
        self.module.into_inner()
    }

    /// The data-parallel group.
    pub fn comm(&self) -> &Communicator {
        self.sync.comm()
    }

    /// Timings of the last synchronised backward.
    pub fn stats(&self) -> DdpStepStats {
        self.sync.stats()
    }

    /// Buckets' parameter names, in launch order.
    pub fn buckets(&self) -> Vec<Vec<String>> {
        self.sync.buckets()
    }

    /// Applies `grads` with `optimizer`. Every rank passes the same averaged gradients, so the
    /// replicas stay bit-identical.
    pub fn step<O: Optimizer<M, B>>(&mut self, optimizer: &mut O, lr: f64, grads: GradientsParams) {
        self.module
            .update(|module| optimizer.step(lr, module, grads));
    }

    /// Backward of a micro-batch whose gradients are only accumulated locally (PyTorch's
    /// `no_sync`): no communication. The next [`Self::backward`] adds them in before averaging.
    pub fn backward_no_sync(&mut self, loss: Tensor<B, 1>) {
        self.sync.backward_no_sync(self.module.get(), loss);
    }

    /// Backward of `loss`, with the gradients (plus any accumulated by
    /// [`Self::backward_no_sync`]) averaged over the group, bucket by bucket, overlapping
    /// backward when [`DdpConfig::overlap`] is on.
    pub fn backward(&mut self, loss: Tensor<B, 1>) -> Result<GradientsParams, DdpError> {
        self.sync.backward(self.module.get(), loss)
    }
}
