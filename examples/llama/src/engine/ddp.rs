//! DistributedDataParallel: every rank holds the replica; gradients are averaged in buckets
//! while the last micro-batch's backward runs, then every rank steps alike.

use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, GradientsParams};
use burn_comm::{Communicator, ReduceOp};
use burn_ddp::{BackwardHooks, DistributedDataParallel};

use super::{Engine, Finished, Stepped, Trainable};
use crate::batches::Batches;
use crate::train::{TrainConfig, TrainError, scalar};

pub(crate) struct DdpEngine<'a, B: BackwardHooks, M: Trainable<B>> {
    config: &'a TrainConfig,
    ddp: DistributedDataParallel<B, M>,
    optimizer: OptimizerAdaptor<AdamW, M, B>,
    /// The step's averaged gradients, between backward and step.
    grads: Option<GradientsParams>,
}

impl<'a, B: BackwardHooks, M: Trainable<B>> DdpEngine<'a, B, M> {
    pub fn new(config: &'a TrainConfig, model: M, dp: Communicator) -> Result<Self, TrainError> {
        Ok(Self {
            config,
            ddp: DistributedDataParallel::new(model, dp, config.ddp.clone())?,
            optimizer: config.optimizer().init::<B, M>(),
            grads: None,
        })
    }
}

impl<B: BackwardHooks, M: Trainable<B>> Engine<B> for DdpEngine<'_, B, M> {
    fn forward_backward(
        &mut self,
        step: usize,
        batches: &Batches<'_>,
        device: &B::Device,
    ) -> Result<f64, TrainError> {
        let accum = batches.micro_batches();
        let mut loss_sum = 0.0;
        for micro in 0..accum {
            let (inputs, targets) = batches.micro(step, micro, device);
            let loss = self.ddp.module().loss(inputs, targets)? / accum as f64;
            loss_sum += scalar(&loss);
            if micro + 1 < accum {
                self.ddp.backward_no_sync(loss);
            } else {
                self.grads = Some(self.ddp.backward(loss)?);
            }
        }
        Ok(loss_sum)
    }

    fn step(&mut self, lr: f64) -> Result<Stepped, TrainError> {
        let grads = self
            .grads
            .take()
            .expect("the last micro-batch synchronises");
        let (grads, grad_norm) = self.config.clip(self.ddp.module(), grads);
        self.ddp.step(&mut self.optimizer, lr, grads);
        Ok(Stepped {
            comm_wait_s: self.ddp.stats().comm_wait.as_secs_f64(),
            zero: None,
            grad_norm,
        })
    }

    fn loss_groups(&self) -> Vec<(Communicator, ReduceOp)> {
        vec![(self.ddp.comm().clone(), ReduceOp::Avg)]
    }

    fn finish(self: Box<Self>) -> Result<Finished<B::InnerBackend>, TrainError> {
        Ok(Finished {
            model: M::whole(self.ddp.into_module().valid())?,
            spans: Vec::new(),
        })
    }
}
