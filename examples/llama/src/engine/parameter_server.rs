//! The parameter-server baseline: rank 0 reads the global batch and scatters it, gathers the
//! gradients, steps, and broadcasts the parameters. Its communication is the step itself.

use burn::module::AutodiffModule;
use burn::optim::AdamW;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::tensor::Tensor;
use burn_comm::{Communicator, ReduceOp};
use burn_ddp::DataParallel;

use burn_checkpoint::Checkpoint;

use super::{Engine, Finished, Stepped, TrainBackend};
use crate::batches::Batches;
use crate::checkpoint::{self, TrainingState};
use crate::model::Llama;
use crate::parallel_plan::ParallelPlan;
use crate::train::{TrainConfig, TrainError, scalar};

/// The rank that steps the optimizer (burn-ddp's `DataParallel` root).
const SERVER: usize = 0;

pub(crate) struct ParameterServerEngine<'a, B: TrainBackend> {
    config: &'a TrainConfig,
    plan: &'a ParallelPlan,
    dp: DataParallel<B, Llama<B>>,
    comm: Communicator,
    optimizer: OptimizerAdaptor<AdamW, Llama<B>, B>,
    /// The step's loss, between forward and step (the backward is the step's).
    loss: Option<Tensor<B, 1>>,
}

impl<'a, B: TrainBackend> ParameterServerEngine<'a, B> {
    pub fn new(
        config: &'a TrainConfig,
        plan: &'a ParallelPlan,
        model: Llama<B>,
        dp: Communicator,
    ) -> Result<Self, TrainError> {
        Ok(Self {
            config,
            plan,
            dp: DataParallel::new(model, dp.clone())?,
            comm: dp,
            optimizer: config.optimizer().init::<B, Llama<B>>(),
            loss: None,
        })
    }
}

impl<B: TrainBackend> Engine<B> for ParameterServerEngine<'_, B> {
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
        Finished::gathered(self.plan, self.dp.into_module().valid())
    }

    /// The server's parameters and AdamW state; the workers hold no state of their own (their
    /// parameters are the server's, broadcast each step).
    fn checkpoint_pieces(&self) -> Result<TrainingState, TrainError> {
        if self.comm.rank() != SERVER {
            return Ok(TrainingState {
                pieces: Vec::new(),
                adam_steps: 0,
                loss_scale: None,
            });
        }
        let held = checkpoint::Held::of(self.plan, self.dp.module());
        checkpoint::adamw_pieces(&held, self.dp.module(), &self.optimizer)
    }

    /// Every rank's parameters were read from the checkpoint; the server's optimizer too.
    fn restore(&mut self, from: &Checkpoint, device: &B::Device) -> Result<(), TrainError> {
        if self.comm.rank() != SERVER {
            return Ok(());
        }
        let fresh = self.config.optimizer().init::<B, Llama<B>>();
        let optimizer = std::mem::replace(&mut self.optimizer, fresh);
        let held = checkpoint::Held::of(self.plan, self.dp.module());
        self.optimizer = checkpoint::load_adamw(&held, self.dp.module(), optimizer, from, device)?;
        Ok(())
    }
}
