//! The classic parameter-server data parallelism (PyTorch's old `nn.DataParallel`), kept as a
//! baseline: rank 0 scatters the batch, every rank computes gradients on its part, rank 0
//! gathers and averages them, steps the optimizer alone and sends the new parameters to all.
//! Rank 0 moves `world - 1` full copies of the gradients and of the parameters every step;
//! [`crate::DistributedDataParallel`] moves one bucketed all-reduce, split over all ranks.

use std::marker::PhantomData;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{BasicOps, Int, Tensor};
use burn_comm::Communicator;

use crate::params::{self, ParamSlot};
use crate::replica::Replica;
use crate::{DdpError, MissingGradient};

type Inner<B> = <B as AutodiffBackend>::InnerBackend;

const ROOT: usize = 0;

/// One rank of a parameter-server data-parallel group; rank 0 is the server.
pub struct DataParallel<B: AutodiffBackend, M: AutodiffModule<B>> {
    module: Replica<M>,
    comm: Communicator,
    _backend: PhantomData<B>,
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> DataParallel<B, M> {
    /// Wraps `module`, giving every rank rank 0's parameters.
    pub fn new(module: M, comm: Communicator) -> Result<Self, DdpError> {
        let mut this = Self {
            module: Replica::new(module),
            comm,
            _backend: PhantomData,
        };
        this.broadcast_parameters()?;
        Ok(this)
    }

    /// The local replica, for the forward pass.
    pub fn module(&self) -> &M {
        self.module.get()
    }

    /// Unwraps the replica.
    pub fn into_module(self) -> M {
        self.module.into_inner()
    }

    /// Rank 0 passes the global batch, the others `None`; every rank gets its contiguous part
    /// along dimension 0, in the backend's default dtype for `K`. Rank 0 first sends the shape
    /// to everyone, so a batch that cannot be split fails on every rank alike.
    pub fn scatter<const D: usize, K: BasicOps<B> + 'static>(
        &self,
        global: Option<Tensor<B, D, K>>,
        device: &B::Device,
    ) -> Result<Tensor<B, D, K>, DdpError> {
        let world = self.comm.size();
        let (global, dims) = if self.comm.rank() == ROOT {
            // A zero shape tells the others that rank 0 had nothing to scatter.
            let dims = global.as_ref().map_or([0; D], |g| g.dims());
            let header: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
            for rank in 1..world {
                self.comm
                    .send(params::to_ints::<B>(&header, device), rank)?;
            }
            (global, dims)
        } else {
            let header = params::from_ints(self.comm.recv::<B, 1, Int>(ROOT, [D], device)?);
            let mut dims = [0; D];
            for (d, h) in dims.iter_mut().zip(header) {
                *d = h as usize;
            }
            (None, dims)
        };
        if dims.iter().all(|&d| d == 0) {
            return Err(DdpError::Config(
                "rank 0 passed no batch to scatter; rank 0 must pass Some(batch)".into(),
            ));
        }
        let local = crate::per_rank_batch(dims[0], world)?;
        match global {
            Some(global) => {
                for rank in 1..world {
                    self.comm
                        .send(global.clone().narrow(0, rank * local, local), rank)?;
                }
                Ok(global.narrow(0, 0, local))
            }
            None => {
                let mut shape = dims;
                shape[0] = local;
                Ok(self.comm.recv(ROOT, shape, device)?)
            }
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
        let slots = params::trainable::<B, M>(self.module());
        let mut grads = loss.backward();
        let local: Vec<Option<Tensor<Inner<B>, 1>>> =
            slots.iter().map(|slot| (slot.take)(&mut grads)).collect();
        // Every rank learns which gradients are missing where, so all stop together.
        let codes: Vec<i32> = local.iter().map(|g| g.is_some() as i32).collect();
        let device = slots.first().map(|s| s.device.clone()).unwrap_or_default();
        let codes = params::gather_codes::<Inner<B>>(&self.comm, &codes, &device)?;
        let missing: Vec<MissingGradient> = codes
            .iter()
            .zip(&slots)
            .filter(|(c, _)| c.contains(&0))
            .map(|(c, slot)| MissingGradient {
                name: slot.name.clone(),
                ranks: (0..c.len()).filter(|&r| c[r] == 0).collect(),
            })
            .collect();
        if !missing.is_empty() {
            return Err(DdpError::MissingGradients(missing));
        }

        let world = self.comm.size();
        let mut local: Vec<Tensor<Inner<B>, 1>> = local.into_iter().flatten().collect();
        let members: Vec<&ParamSlot<B>> = slots.iter().collect();
        let mut averaged = GradientsParams::new();
        for run in params::dtype_runs(&members) {
            let lengths: Vec<usize> = slots[run.clone()].iter().map(|s| s.numel).collect();
            let parts: Vec<_> = local.drain(..run.len()).collect();
            let flat = params::concat(parts);
            if self.comm.rank() != ROOT {
                self.comm.send(flat, ROOT)?;
                continue;
            }
            let device = flat.device();
            let mut sum = flat;
            for rank in 1..world {
                let theirs: Tensor<Inner<B>, 1> =
                    self.comm.recv(rank, sum.dims(), (&device, sum.dtype()))?;
                sum = sum + theirs;
            }
            let mean = sum / world as f64;
            for (slot, grad) in slots[run].iter().zip(params::split(mean, &lengths)) {
                (slot.put)(&mut averaged, grad);
            }
        }
        if self.comm.rank() == ROOT {
            self.module
                .update(|module| optimizer.step(lr, module, averaged));
        }
        self.broadcast_parameters()
    }

    /// Gives every rank rank 0's parameters, as one flat buffer per dtype run.
    fn broadcast_parameters(&mut self) -> Result<(), DdpError> {
        let slots = params::slots::<B, M>(self.module());
        let members: Vec<&ParamSlot<B>> = slots.iter().collect();
        let mut values = Vec::with_capacity(slots.len());
        for run in params::dtype_runs(&members) {
            let run = &slots[run];
            let lengths: Vec<usize> = run.iter().map(|s| s.numel).collect();
            let flat = params::concat(run.iter().map(|s| s.value.clone()).collect());
            let flat = self.comm.broadcast(flat, ROOT)?;
            values.extend(params::split(flat, &lengths));
        }
        self.module
            .update(|module| params::load::<B, M>(module, values));
        Ok(())
    }
}
