//! What one rank does, the same whether it is a thread or a process: build its groups, read
//! its batches, pick its engine and drive it with the one training loop.

use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;
use burn_checkpoint::BackgroundSaver;
use burn_comm::{Communicator, ReduceOp};

use crate::batches::Batches;
use crate::checkpoint;
use crate::data::Dataset;
use crate::dims::{Groups, ParallelDims};
use crate::engine::{Engine, Finished, TrainBackend, choose};
use crate::interrupt;
use crate::parallel_plan::ParallelPlan;
use crate::train::{StepMetrics, Strategy, TrainConfig, TrainError, reduce_scalar};
use crate::weights::Weights;

/// Trains one rank of `config` from `weights` (of which it builds only its parts) and returns
/// the whole trained model. `world` holds every rank of the run; none when one rank trains
/// alone.
/// `on_step` sees every step's metrics (the same on every rank).
pub fn train_rank<B: TrainBackend>(
    config: &TrainConfig,
    data: &dyn Dataset,
    world: Option<&Communicator>,
    weights: &Weights,
    device: &B::Device,
    on_step: &mut dyn FnMut(&StepMetrics),
) -> Result<Finished<B::InnerBackend>, TrainError> {
    let layout = config.layout()?;
    let plan = ParallelPlan::new(config)?;
    let dims = ParallelDims::of(config);
    let groups = match world {
        Some(world) => dims.groups(world, config)?,
        None if dims.ranks() == 1 && config.strategy == Strategy::Single => Groups::default(),
        None => {
            return Err(TrainError::Config(format!(
                "this layout ({}, strategy {:?}) needs a communicator of its {} rank(s); run it through `train`",
                dims.describe(),
                config.strategy,
                dims.ranks()
            )));
        }
    };
    let (replicas, replica) = groups.dp.as_ref().map_or((1, 0), |c| (c.size(), c.rank()));
    let batches = Batches::new(config, data, replicas, replica, layout)?;
    let mut engine = choose::<B>(config, &plan, weights, &groups, &batches, device)?;
    let mut start = 0;
    if let Some(checkpoint) = weights.resumed() {
        engine.restore(checkpoint, device)?;
        start = checkpoint.step() as usize;
    }
    let mut saver = Saver::new(config, groups.world.as_ref())?;
    train_loop(
        config,
        engine.as_mut(),
        &batches,
        device,
        on_step,
        start,
        &mut saver,
    )?;
    engine.finish()
}

/// Takes a run's checkpoints, each written in the background while training goes on.
struct Saver<'a> {
    config: &'a TrainConfig,
    /// Every rank of the run; none when one rank trains alone.
    world: Option<&'a Communicator>,
    /// Present when the run checkpoints.
    background: Option<BackgroundSaver>,
}

impl<'a> Saver<'a> {
    /// The saver of a run; a collective over `world` when the run checkpoints.
    fn new(config: &'a TrainConfig, world: Option<&'a Communicator>) -> Result<Self, TrainError> {
        let background = config
            .checkpoint
            .as_ref()
            .map(|_| BackgroundSaver::new(world))
            .transpose()
            .map_err(|e| TrainError::Config(format!("checkpoints: {e}")))?;
        Ok(Self {
            config,
            world,
            background,
        })
    }

    /// Checkpoints after the step of `metrics` when the run asks for it then, or when a signal
    /// asked any rank to stop (a collective), noting the stall in `metrics`; returns whether to
    /// stop.
    fn after<B: AutodiffBackend>(
        &mut self,
        engine: &dyn Engine<B>,
        metrics: &mut StepMetrics,
        device: &B::Device,
    ) -> Result<bool, TrainError> {
        let Some(checkpoints) = &self.config.checkpoint else {
            return Ok(false);
        };
        let step = metrics.step;
        let stop = self.asked_to_stop::<B>(device)?;
        let due = checkpoints.every > 0 && step.is_multiple_of(checkpoints.every);
        if due || stop {
            let began = Instant::now();
            self.save(engine, step)?;
            metrics.checkpoint_s = Some(began.elapsed().as_secs_f64());
        }
        // A signal that came during a due save is acted on now, not a step later.
        if due && !stop {
            return self.asked_to_stop::<B>(device);
        }
        Ok(stop)
    }

    /// Whether a signal asked any rank to stop (a collective): the ranks may see it at
    /// different steps, so they stop at the first any saw.
    fn asked_to_stop<B: AutodiffBackend>(&self, device: &B::Device) -> Result<bool, TrainError> {
        let asked = f64::from(u8::from(interrupt::requested()));
        let any = match self.world {
            Some(world) => reduce_scalar::<B::InnerBackend>(world, asked, ReduceOp::Max, device)?,
            None => asked,
        };
        Ok(any > 0.0)
    }

    /// Where the run checkpoints.
    fn dir(&self) -> &std::path::Path {
        &self
            .config
            .checkpoint
            .as_ref()
            .expect("a run that checkpoints")
            .dir
    }

    /// Copies this rank's state aside and starts writing it; the step stalls only for the
    /// copy (and for the save before, should it still be under way).
    fn save<B: AutodiffBackend>(
        &mut self,
        engine: &dyn Engine<B>,
        step: usize,
    ) -> Result<(), TrainError> {
        // One copy aside at a time.
        self.finish()?;
        // A rank that cannot hand in its pieces still joins the save, so every rank fails alike.
        let state = engine.checkpoint_pieces();
        let metadata = match &state {
            Ok(state) => checkpoint::metadata(self.config, state),
            Err(_) => serde_json::Value::Null,
        };
        let pieces = state.map(|s| s.pieces).map_err(|e| e.to_string());
        let dir = self.dir().to_path_buf();
        let background = self.background.as_mut().expect("a run that checkpoints");
        background
            .start(&dir, step as u64, pieces, metadata)
            .map_err(|e| save_failed(step as u64, e))?;
        Ok(())
    }

    /// Waits for the save under way, so that its checkpoint is committed.
    fn finish(&mut self) -> Result<(), TrainError> {
        let Some(background) = &mut self.background else {
            return Ok(());
        };
        let step = background.saving();
        background
            .wait()
            .map_err(|e| save_failed(step.unwrap_or_default(), e))?;
        Ok(())
    }
}

fn save_failed(step: u64, error: burn_checkpoint::CheckpointError) -> TrainError {
    TrainError::Config(format!("checkpoint after step {step}: {error}"))
}

/// The one training loop, [`steps`], then the last checkpoint committed: an interrupted run
/// says it was checkpointed only once it is.
fn train_loop<B: AutodiffBackend>(
    config: &TrainConfig,
    engine: &mut dyn Engine<B>,
    batches: &Batches<'_>,
    device: &B::Device,
    on_step: &mut dyn FnMut(&StepMetrics),
    start: usize,
    saver: &mut Saver<'_>,
) -> Result<(), TrainError> {
    let trained = steps(config, engine, batches, device, on_step, start, saver);
    match (trained, saver.finish()) {
        (Err(TrainError::Interrupted { .. }), Err(unsaved)) => Err(unsaved),
        (Err(error), _) => Err(error),
        (Ok(()), saved) => saved,
    }
}

/// Every step's learning rate, forward and backward, optimizer step, the loss over the whole
/// global batch, the metrics, and the checkpoints.
fn steps<B: AutodiffBackend>(
    config: &TrainConfig,
    engine: &mut dyn Engine<B>,
    batches: &Batches<'_>,
    device: &B::Device,
    on_step: &mut dyn FnMut(&StepMetrics),
    start: usize,
    saver: &mut Saver<'_>,
) -> Result<(), TrainError> {
    let schedule = config.schedule();
    let tokens = config.batch_size * config.seq_len;
    let started = Instant::now();
    for step in start..config.steps {
        let lr = schedule.lr(step);
        engine.prepare(step, batches, device)?;
        let begun = Instant::now();
        let mut loss = engine.forward_backward(step, batches, device)?;
        let stepped = engine.step(lr)?;
        for (group, op) in engine.loss_groups() {
            loss = reduce_scalar::<B::InnerBackend>(&group, loss, op, device)?;
        }
        // Every rank holds the same loss, so every rank stops here together.
        if !loss.is_finite() {
            return Err(TrainError::Config(format!(
                "step {}: the loss is {loss}: training diverged at learning rate {lr:.3e}; lower --lr or clip with --clip-grad-norm 1.0",
                step + 1
            )));
        }
        let mut metrics = StepMetrics::measure(step, loss, lr, tokens, (begun, started));
        stepped.fill(&mut metrics);
        let stop = saver.after(engine, &mut metrics, device)?;
        on_step(&metrics);
        // A stop asked during the last step changes nothing: the run ends as it would.
        if stop && step + 1 < config.steps {
            return Err(TrainError::Interrupted {
                step: step + 1,
                dir: saver.dir().to_path_buf(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};

    use super::*;
    use crate::config::LlamaConfig;
    use crate::data::MarkovSource;
    use crate::engine::Stepped;

    type A = Autodiff<Flex>;

    /// An engine whose steps report the given losses.
    struct Scripted(Vec<f64>);

    impl<B: AutodiffBackend> Engine<B> for Scripted {
        fn forward_backward(
            &mut self,
            step: usize,
            _: &Batches<'_>,
            _: &B::Device,
        ) -> Result<f64, TrainError> {
            Ok(self.0[step])
        }

        fn step(&mut self, _: f64) -> Result<Stepped, TrainError> {
            Ok(Stepped::default())
        }

        fn loss_groups(&self) -> Vec<(Communicator, ReduceOp)> {
            Vec::new()
        }

        fn finish(self: Box<Self>) -> Result<Finished<B::InnerBackend>, TrainError> {
            Err(TrainError::Config(
                "a scripted engine holds no model".into(),
            ))
        }
    }

    #[test]
    fn a_loss_that_is_not_finite_ends_the_run_at_its_step() {
        let mut config = TrainConfig::new(LlamaConfig::preset("tiny").unwrap(), 3);
        config.seq_len = 8;
        let data = MarkovSource::new(16, 2, config.seq_len, 64, 1);
        let batches = Batches::new(&config, &data, 1, 0, config.layout().unwrap()).unwrap();
        for bad in [f64::NAN, f64::INFINITY] {
            let mut engine = Scripted(vec![2.0, bad, 1.0]);
            let mut seen = Vec::new();
            let error = train_loop::<A>(
                &config,
                &mut engine,
                &batches,
                &Default::default(),
                &mut |m| seen.push(m.loss),
                0,
                &mut Saver::new(&config, None).unwrap(),
            )
            .unwrap_err()
            .to_string();
            assert!(
                error.starts_with(&format!("step 2: the loss is {bad}: training diverged")),
                "{error}"
            );
            assert_eq!(seen, vec![2.0], "only the finite step is reported");
        }
    }
}
