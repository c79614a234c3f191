//! The classic parameter-server data parallelism (PyTorch's old `nn.DataParallel`), kept as a
//! baseline: rank 0 scatters the batch, every rank computes gradients on its part, rank 0
//! gathers and averages them, steps the optimizer alone and sends the new parameters to all.
//! Rank 0 moves `world - 1` full copies of the gradients and of the parameters every step;
//! [`crate::DistributedDataParallel`] moves one bucketed all-reduce, split over all ranks.

use std::marker::PhantomData;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{BasicOps, Int, Tensor, TensorData};
use burn_comm::Communicator;

use crate::params::{self, ParamSlot};
use crate::{DdpError, MissingGradient};

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

const ROOT: usize = 0;

/// One rank of a parameter-server data-parallel group; rank 0 is the server.
pub struct DataParallel<B: AutodiffBackend, M: AutodiffModule<B>> {
    module: Option<M>,
    comm: Communicator,
    _backend: PhantomData<B>,
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> DataParallel<B, M> {
    /// Wraps `module`, giving every rank rank 0's parameters.
    pub fn new(module: M, comm: Communicator) -> Result<Self, DdpError> {
        let mut this = Self {
            module: Some(module),
            comm,
            _backend: PhantomData,
        };
        this.broadcast_parameters()?;
        Ok(this)
    }

    /// The local replica, for the forward pass.
    pub fn module(&self) -> &M {
        self.module
            .as_ref()
            .expect("the module is always present between calls")
    }

    /// Unwraps the replica.
    pub fn into_module(self) -> M {
        self.module
            .expect("the module is always present between calls")
    }

    /// Rank 0 passes the global batch, the others `None`; every rank gets its contiguous part
    /// along dimension 0, in the backend's default dtype for `K`.
    pub fn scatter<const D: usize, K: BasicOps<B> + 'static>(
        &self,
        global: Option<Tensor<B, D, K>>,
        device: &B::Device,
    ) -> Result<Tensor<B, D, K>, DdpError> {
        let world = self.comm.size();
        if self.comm.rank() == ROOT {
            let global = global.ok_or_else(|| {
                DdpError::Config("rank 0 scatters the batch, so it must pass Some(batch)".into())
            })?;
            let dims = global.dims();
            let local = crate::per_rank_batch(dims[0], world)?;
            let shape: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
            for rank in 1..world {
                let header = TensorData::new(shape.clone(), [D]);
                self.comm
                    .send(Tensor::<B, 1, Int>::from_data(header, device), rank)?;
                self.comm
                    .send(global.clone().narrow(0, rank * local, local), rank)?;
            }
            Ok(global.narrow(0, 0, local))
        } else {
            let header: Vec<i64> = self
                .comm
                .recv::<B, 1, Int>(ROOT, [D], device)?
                .into_data()
                .convert::<i64>()
                .to_vec()
                .expect("an int tensor converts to i64");
            let mut shape = [0; D];
            for (s, h) in shape.iter_mut().zip(header) {
                *s = h as usize;
            }
            shape[0] = crate::per_rank_batch(shape[0], world)?;
            Ok(self.comm.recv(ROOT, shape, device)?)
        }
    }

    /// Backward of this rank's `loss`; rank 0 averages everyone's gradients, steps `optimizer`
    /// and sends the new parameters back. Only rank 0's optimizer holds state.
    pub fn step<O: Optimizer<M, B>>(
        &mut self,
        loss: Tensor<B, 1>,
        optimizer: &mut O,
        lr: f64,
    ) -> Result<(), DdpError> {
        let slots = params::slots::<B, M>(self.module());
        let mut grads = loss.backward();
        let mut local = Vec::with_capacity(slots.len());
        let mut missing = Vec::new();
        for slot in &slots {
            match (slot.take)(&mut grads) {
                Some(grad) => local.push(grad),
                None => missing.push(MissingGradient {
                    name: slot.name.clone(),
                    ranks: vec![self.comm.global_rank()],
                }),
            }
        }
        if !missing.is_empty() {
            return Err(DdpError::MissingGradients(missing));
        }
        let lengths: Vec<usize> = slots.iter().map(|s| s.numel).collect();
        let flat = params::concat(local);
        let world = self.comm.size();
        if self.comm.rank() == ROOT {
            let device = flat.device();
            let mut sum = flat;
            for rank in 1..world {
                let theirs: Tensor<Inner<B>, 1> =
                    self.comm.recv(rank, sum.dims(), (&device, sum.dtype()))?;
                sum = sum + theirs;
            }
            let mean = sum / world as f64;
            let mut averaged = GradientsParams::new();
            for (slot, grad) in slots.iter().zip(params::split(mean, &lengths)) {
                (slot.put)(&mut averaged, grad);
            }
            let module = self.module.take().expect("present between calls");
            self.module = Some(optimizer.step(lr, module, averaged));
        } else {
            self.comm.send(flat, ROOT)?;
        }
        self.broadcast_parameters()
    }

    /// Gives every rank rank 0's parameters, as one flat buffer per dtype run.
    fn broadcast_parameters(&mut self) -> Result<(), DdpError> {
        let slots = params::slots::<B, M>(self.module());
        let mut values = Vec::with_capacity(slots.len());
        for run in runs_of_dtype(&slots) {
            let lengths: Vec<usize> = run.iter().map(|s| s.numel).collect();
            let flat = params::concat(run.iter().map(|s| s.value.clone()).collect());
            let flat = self.comm.broadcast(flat, ROOT)?;
            values.extend(params::split(flat, &lengths));
        }
        let module = self.module.take().expect("present between calls");
        self.module = Some(params::load::<B, M>(module, values));
        Ok(())
    }
}

/// Consecutive parameters of one dtype.
fn runs_of_dtype<B: AutodiffBackend>(slots: &[ParamSlot<B>]) -> Vec<&[ParamSlot<B>]> {
    let mut runs = Vec::new();
    let mut start = 0;
    for i in 1..=slots.len() {
        if i == slots.len() || slots[i].dtype != slots[start].dtype {
            runs.push(&slots[start..i]);
            start = i;
        }
    }
    runs
}
