//! ZeRO in the training loop. Stages 1 and 2 wrap the replica (whole, or this rank's
//! tensor-parallel part) as DDP does; stage 3 runs the model as a chain of units, one block
//! each (the embedding with the first, the final norm and head with the last), gathered unit
//! by unit.

use std::time::Instant;

use burn::module::AutodiffModule;
use burn::tensor::ElementConversion;
use burn::tensor::backend::AutodiffBackend;
use burn_comm::{Communicator, DeviceMesh, ReduceOp};
use burn_ddp::BackwardHooks;
use burn_pipeline::PipelineStage;
use burn_tensor_parallel::TpBackend;
use burn_zero::{FullyShardedDataParallel, ShardedDataParallel, StepOutcome};

use crate::model::Llama;
use crate::pipeline::{LlamaStage, MicroBatch};
use crate::tp_stage::TpLlamaStage;
use crate::train::{
    Batches, StepMetrics, TrainConfig, TrainError, Trainable, launch_ranks, reduce_scalar,
};

/// Reports a step: its number, mean loss, start, communication wait and what else it did.
pub(crate) type Report<'a> = dyn FnMut(usize, f64, Instant, f64, Extras) + 'a;

/// What a step adds to the basic metrics: ZeRO's, and the gradient norm under clipping.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Extras {
    /// What a ZeRO step did.
    pub zero: Option<ZeroStep>,
    /// The global gradient norm before clipping.
    pub grad_norm: Option<f64>,
}

impl Extras {
    pub fn fill(&self, metrics: &mut StepMetrics) {
        if let Some(zero) = &self.zero {
            zero.fill(metrics);
        }
        metrics.grad_norm = self.grad_norm;
    }
}

/// What a ZeRO step adds to its metrics.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ZeroStep {
    /// Model-state bytes this rank held.
    pub bytes: usize,
    /// The loss scale the step ran with (f16).
    pub loss_scale: Option<f64>,
    /// Whether the optimizer stepped.
    pub outcome: StepOutcome,
}

impl ZeroStep {
    /// Steps `zero` and records what the step did.
    pub fn sharded<B: BackwardHooks, M: AutodiffModule<B>>(
        zero: &mut ShardedDataParallel<B, M>,
        lr: f64,
    ) -> Result<Self, TrainError> {
        let loss_scale = zero.loss_scale();
        let outcome = zero.step(lr)?;
        Ok(Self {
            bytes: zero.memory().total(),
            loss_scale,
            outcome,
        })
    }

    pub fn fill(&self, metrics: &mut StepMetrics) {
        metrics.model_state_bytes = Some(self.bytes);
        metrics.loss_scale = self.loss_scale;
        metrics.skipped = matches!(self.outcome, StepOutcome::Skipped { .. });
    }
}

/// ZeRO-1 or ZeRO-2 over the data-parallel group `comm`: micro-batches' gradients are reduced
/// as each backward runs and summed; each rank steps its shard and gathers the rest.
pub(crate) fn train_sharded<B: BackwardHooks, M: Trainable<B>>(
    config: &TrainConfig,
    batches: &Batches<'_>,
    comm: &Communicator,
    init: M,
    device: &B::Device,
    report: &mut Report<'_>,
) -> Result<M, TrainError> {
    let layout = config.layout()?;
    let schedule = config.schedule();
    let mut zero = ShardedDataParallel::new(
        init,
        comm.clone(),
        config.zero,
        &config.optimizer(),
        config.zero_engine_config(),
    )?;
    for step in 0..config.steps {
        let begun = Instant::now();
        let mut loss_sum = 0.0;
        let mut wait = 0.0;
        for micro in 0..layout.accum {
            let (inputs, targets) = batches.micro(step, micro, device);
            let loss = zero.module().loss(inputs, targets)? / layout.accum as f64;
            loss_sum += loss.clone().into_scalar().elem::<f64>();
            zero.backward(loss)?;
            wait += zero.stats().comm_wait.as_secs_f64();
        }
        let extras = Extras {
            zero: Some(ZeroStep::sharded(&mut zero, schedule.lr(step))?),
            grad_norm: zero.grad_norm(),
        };
        let loss = reduce_scalar::<B::InnerBackend>(comm, loss_sum, ReduceOp::Avg, device)?;
        report(step, loss, begun, wait, extras);
    }
    Ok(zero.master_module()?)
}

/// Runs ZeRO-3 on `config.dp * config.tp` ranks (threads) and returns the final weights, whole.
pub(crate) fn train_fully_sharded<B: BackwardHooks + TpBackend>(
    config: &TrainConfig,
    data: &dyn crate::data::Dataset,
    device: &B::Device,
    init: &(dyn Fn() -> Result<Llama<B>, TrainError> + Sync),
    on_step: &mut (dyn FnMut(&StepMetrics) + Send),
) -> Result<Llama<B::InnerBackend>, TrainError>
where
    B::InnerBackend: TpBackend,
{
    let ranks = config.dp * config.tp;
    let mut results = launch_ranks(config, ranks, on_step, |world, forward| {
        let mesh = DeviceMesh::new(world, &[("dp", config.dp), ("tp", config.tp)])?;
        let dp = mesh.group("dp")?;
        let units = units(init()?, config);
        if config.tp == 1 {
            let units = run_units(config, data, dp, None, units, device, forward)?;
            return Ok(LlamaStage::join(
                units.into_iter().map(|u| u.valid()).collect(),
            ));
        }
        let tp = config.tensor_parallel(mesh.group("tp")?);
        let units = units
            .into_iter()
            .map(|unit| TpLlamaStage::from_stage(unit, &tp))
            .collect::<Result<Vec<_>, _>>()?;
        let units = run_units(config, data, dp, Some(tp.comm()), units, device, forward)?;
        let whole = units
            .into_iter()
            .map(|unit| unit.valid().full())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(LlamaStage::join(whole))
    })?;
    Ok(results.remove(0))
}

/// ZeRO-3's units of `model`: one block each, the embedding with the first and the final norm
/// and head with the last.
pub fn units<B: AutodiffBackend>(model: Llama<B>, config: &TrainConfig) -> Vec<LlamaStage<B>> {
    let ranges: Vec<_> = (0..config.model.num_hidden_layers)
        .map(|i| i..i + 1)
        .collect();
    LlamaStage::cut(model, &config.model, &ranges)
}

/// One rank's ZeRO-3 loop over `units`, sharded over `dp`; `tp` is the tensor-parallel group
/// whose collectives run inside each unit's backward, if any. Returns the units, gathered.
fn run_units<B, S>(
    config: &TrainConfig,
    data: &dyn crate::data::Dataset,
    dp: &Communicator,
    tp: Option<&Communicator>,
    units: Vec<S>,
    device: &B::Device,
    on_step: &mut dyn FnMut(&StepMetrics),
) -> Result<Vec<S>, TrainError>
where
    B: AutodiffBackend,
    S: PipelineStage<B, Batch = MicroBatch<B>, Error = TrainError>,
{
    let layout = config.layout()?;
    let batches = Batches::new(config, data, dp.size(), dp.rank(), layout)?;
    let schedule = config.schedule();
    let mut fsdp = FullyShardedDataParallel::new(
        units,
        dp.clone(),
        &config.optimizer(),
        config.zero_engine_config(),
    )?;
    if let Some(tp) = tp {
        fsdp = fsdp.with_backward_group(tp.clone());
    }
    let started = Instant::now();
    for step in 0..config.steps {
        let begun = Instant::now();
        let mut loss_sum = 0.0;
        for micro in 0..layout.accum {
            let batch = batches.micro(step, micro, device);
            loss_sum += fsdp.forward_backward(&batch, 1.0 / layout.accum as f64)?;
        }
        let loss_scale = fsdp.loss_scale();
        let outcome = fsdp.step(schedule.lr(step))?;
        let loss = loss_sum / layout.accum as f64;
        let loss = reduce_scalar::<B::InnerBackend>(dp, loss, ReduceOp::Avg, device)?;
        let tokens = config.batch_size * config.seq_len;
        let mut metrics =
            StepMetrics::measure(step, loss, schedule.lr(step), tokens, (begun, started), 0.0);
        let extras = Extras {
            zero: Some(ZeroStep {
                bytes: fsdp.memory().total(),
                loss_scale,
                outcome,
            }),
            grad_norm: fsdp.grad_norm(),
        };
        extras.fill(&mut metrics);
        on_step(&metrics);
    }
    Ok(fsdp.full_master()?)
}
