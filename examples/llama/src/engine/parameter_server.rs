//! The parameter-server baseline: rank 0 reads the global batch and scatters it, gathers the
//! gradients, steps, and broadcasts the parameters. Its communication is the step itself.

use burn::optim::AdamW;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::tensor::{Tensor, backend::AutodiffBackend};
use burn_comm::{Communicator, ReduceOp};
use burn_ddp::DataParallel;

use super::{Engine, Finished, Stepped, Trainable};
use crate::batches::Batches;
use crate::train::{TrainConfig, TrainError, scalar};

pub(crate) struct ParameterServerEngine<'a, B: AutodiffBackend, M: Trainable<B>> {
    config: &'a TrainConfig,
    dp: DataParallel<B, M>,
    comm: Communicator,
    optimizer: OptimizerAdaptor<AdamW, M, B>,
    /// The step's loss, between forward and step (the backward is the step's).
    loss: Option<Tensor<B, 1>>,
}

impl<'a, B: AutodiffBackend, M: Trainable<B>> ParameterServerEngine<'a, B, M> {
    pub fn new(config: &'a TrainConfig, model: M, dp: Communicator) -> Result<Self, TrainError> {
        Ok(Self {
            config,
            dp: DataParallel::new(model, dp.clone())?,
            comm: dp,
            optimizer: config.optimizer().init::<B, M>(),
            loss: None,
        })
    }
}

impl<B: AutodiffBackend, M: Trainable<B>> Engine<B> for ParameterServerEngine<'_, B, M> {
    fn forward_backward(
        &mut self,
        step: usize,
        batches: &Batches<'_>,
        device: &B::Device,
    ) -> Result<f64, TrainError> {
        let global = (self.comm.rank() == 0).then(|| batches.global(step, device));
        let local = self.dp.scatter(global, device)?;
        let len = self.config.seq_len;
        let inputs = local.clone().narrow(1, 0, len);
        let targets = local.narrow(1, 1, len);
        let loss = self.dp.module().loss(inputs, targets)?;
        let value = scalar(&loss);
        self.loss = Some(loss);
        Ok(value)
    }

    fn step(&mut self, lr: f64) -> Result<Stepped, TrainError> {
        let loss = self.loss.take().expect("forward_backward ran first");
        self.dp.step(loss, &mut self.optimizer, lr)?;
        Ok(Stepped {
            // Its communication is inside the step, not separable from it.
            comm_wait_s: f64::NAN,
            ..Stepped::default()
        })
    }

    fn loss_groups(&self) -> Vec<(Communicator, ReduceOp)> {
        vec![(self.comm.clone(), ReduceOp::Avg)]
    }

    fn finish(self: Box<Self>) -> Result<Finished<B::InnerBackend>, TrainError> {
        Ok(Finished {
            model: M::whole(self.dp.into_module().valid())?,
            spans: Vec::new(),
        })
    }
}
