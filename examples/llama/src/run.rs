//! What one rank does, the same whether it is a thread or a process: build its groups, read
//! its batches, pick its engine and drive it with the one training loop.

use std::time::Instant;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn_checkpoint::BackgroundSaver;
use burn_comm::{Communicator, ReduceOp};

use crate::batches::Batches;
use crate::checkpoint;
use crate::data::Dataset;
use crate::dims::{Groups, ParallelDims};
use crate::engine::{Engine, Finished, TrainBackend, choose};
use crate::experts::{Counting, MoeRecord};
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
    with_rank::<B, _>(config, data, world, weights, device, |mut rank| {
        let mut saver = Saver::new(config, rank.groups.world.as_ref())?;
        let moe = MoeReport::of(config, &rank.groups, rank.batches.micro_batches());
        train_loop(
            config,
            rank.engine.as_mut(),
            &rank.batches,
            device,
            on_step,
            rank.start,
            &mut saver,
            moe.as_ref(),
        )?;
        rank.engine.finish()
    })
}

/// Builds one rank of `config` from `weights`, which resume from a checkpoint, and saves its
/// state again, unchanged, as the checkpoint of the same step under `to` (a collective over
/// `world`): the checkpoint resharded to `config`'s layout. Returns its step.
pub fn resave_rank<B: TrainBackend>(
    config: &TrainConfig,
    data: &dyn Dataset,
    world: Option<&Communicator>,
    weights: &Weights,
    device: &B::Device,
    to: &std::path::Path,
) -> Result<usize, TrainError> {
    if weights.resumed().is_none() {
        return Err(TrainError::Config(
            "there is no checkpoint to save again: resume from one".into(),
        ));
    }
    with_rank::<B, _>(config, data, world, weights, device, |rank| {
        let mut saver = Saver::new(config, rank.groups.world.as_ref())?;
        saver.save(rank.engine.as_ref(), rank.start, to)?;
        saver.finish()?;
        Ok(rank.start)
    })
}

/// One rank, built: its engine (restored when resuming), its batches and groups, and the
/// step it starts after.
struct Rank<'a, B: TrainBackend> {
    engine: Box<dyn Engine<B> + 'a>,
    batches: Batches<'a>,
    groups: Groups,
    start: usize,
}

/// Builds this rank of `config` from `weights` (only its parts) and hands it to `then`.
fn with_rank<B: TrainBackend, T>(
    config: &TrainConfig,
    data: &dyn Dataset,
    world: Option<&Communicator>,
    weights: &Weights,
    device: &B::Device,
    then: impl FnOnce(Rank<'_, B>) -> Result<T, TrainError>,
) -> Result<T, TrainError> {
    let layout = config.layout()?;
    let plan = ParallelPlan::new(config)?;
    let dims = ParallelDims::of(config);
    let groups = match world {
        Some(world) => dims.groups(world, config)?,
        None if dims.ranks() == 1 && config.strategy == Strategy::Single => {
            Groups::default().with_experts(config)?
        }
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
    then(Rank {
        engine,
        batches,
        groups,
        start,
    })
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
            .map(|c| BackgroundSaver::new(world).map(|saver| saver.keeping(c.keep)))
            .transpose()?;
        Ok(Self {
            config,
            world,
            background,
        })
    }

    /// Checkpoints after the step of `metrics` when the run asks for it then, or when a signal
    /// asked any rank to stop, noting the stall in `metrics`, which go to `report` (always,
    /// once) before the checkpoint can commit: a run killed after a commit has reported every
    /// step up to it. Returns whether to stop; fails, on every rank, once any rank's
    /// background save has failed.
    fn after<B: AutodiffBackend>(
        &mut self,
        engine: &dyn Engine<B>,
        metrics: &mut StepMetrics,
        device: &B::Device,
        report: &mut dyn FnMut(&StepMetrics),
    ) -> Result<bool, TrainError> {
        let Some(checkpoints) = &self.config.checkpoint else {
            report(metrics);
            return Ok(false);
        };
        let dir = checkpoints.dir.clone();
        let step = metrics.step;
        let due = checkpoints.every > 0 && step.is_multiple_of(checkpoints.every);
        let staged = self.agree_on_stop::<B>(device).and_then(|stop| {
            let began = Instant::now();
            let staged = (due || stop)
                .then(|| self.stage(engine, step))
                .transpose()?;
            if staged.is_some() {
                metrics.checkpoint_s = Some(began.elapsed().as_secs_f64());
            }
            Ok((stop, staged))
        });
        report(metrics);
        let (stop, staged) = staged?;
        if let Some(staged) = staged {
            self.start(staged, &dir)?;
        }
        // A signal that came while the state was handed in is acted on now.
        if due && !stop {
            return self.agree_on_stop::<B>(device);
        }
        Ok(stop)
    }

    /// Whether a signal asked any rank to stop (a collective: the ranks may see it at
    /// different steps, so they stop at the first any saw). Fails on every rank once any has
    /// seen its background save fail, rather than train on without checkpoints.
    fn agree_on_stop<B: AutodiffBackend>(
        &mut self,
        device: &B::Device,
    ) -> Result<bool, TrainError> {
        const ASKED: f64 = 1.0;
        const SAVE_FAILED: f64 = 2.0;
        let failed = self.background.as_mut().is_some_and(|b| b.has_failed());
        let mine = match (failed, interrupt::requested()) {
            (true, _) => SAVE_FAILED,
            (false, true) => ASKED,
            (false, false) => 0.0,
        };
        let any = match self.world {
            Some(world) => reduce_scalar::<B::InnerBackend>(world, mine, ReduceOp::Max, device)?,
            None => mine,
        };
        if any >= SAVE_FAILED {
            // Every rank's save agrees on its outcome, so each has the failure to report.
            self.finish()?;
            return Err(TrainError::PeerCheckpointFailed);
        }
        Ok(any >= ASKED)
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

    /// Hands this rank's state in and starts writing it as step `step`'s checkpoint
    /// under `dir`.
    fn save<B: AutodiffBackend>(
        &mut self,
        engine: &dyn Engine<B>,
        step: usize,
        dir: &std::path::Path,
    ) -> Result<(), TrainError> {
        let staged = self.stage(engine, step)?;
        self.start(staged, dir)
    }

    /// Hands this rank's state in (copied aside or to be read as written, see
    /// [`checkpoint::CheckpointConfig::stage_on_host`]), once the save before has finished
    /// (one save at a time): what the step stalls for.
    fn stage<B: AutodiffBackend>(
        &mut self,
        engine: &dyn Engine<B>,
        step: usize,
    ) -> Result<Staged, TrainError> {
        self.finish()?;
        // A rank that cannot hand in its pieces still joins the save, so every rank fails alike.
        let mut state = engine.checkpoint_pieces();
        // Under NCCL too: the writer thread must not read device memory beside the training's
        // collectives.
        if self.config.nccl
            || self
                .config
                .checkpoint
                .as_ref()
                .is_some_and(|c| c.stage_on_host)
        {
            state = state.and_then(|mut held| {
                for piece in &mut held.pieces {
                    piece.data = piece.data.clone().to_host().map_err(|why| {
                        TrainError::Config(format!(
                            "the state could not be copied to host memory: {why}"
                        ))
                    })?;
                }
                Ok(held)
            });
        }
        let metadata = match &state {
            Ok(state) => checkpoint::metadata(self.config, state),
            Err(_) => serde_json::Value::Null,
        };
        Ok(Staged {
            step,
            pieces: state.map(|s| s.pieces).map_err(|e| e.to_string()),
            metadata,
        })
    }

    /// Starts writing `staged` in the background.
    fn start(&mut self, staged: Staged, dir: &std::path::Path) -> Result<(), TrainError> {
        let background = self.background.as_mut().expect("a run that checkpoints");
        let step = staged.step as u64;
        background.start(dir, step, staged.pieces, staged.metadata)?;
        Ok(())
    }

    /// Waits for the save under way, so that its checkpoint is committed.
    fn finish(&mut self) -> Result<(), TrainError> {
        if let Some(background) = &mut self.background
            && let Some(saved) = background.wait()?
            && let Some(why) = saved.prune_failed
        {
            // The checkpoint is committed; only the disk fills faster than asked.
            eprintln!(
                "warning: checkpointed step {}, but could not remove older checkpoints: {why}",
                saved.step
            );
        }
        Ok(())
    }
}

/// Where a rank's mixtures of experts note their figures, and how they count in the job's.
struct MoeReport<'a> {
    record: &'a MoeRecord,
    counting: Counting,
    /// The expert-parallel group, whose sends are the token exchanges.
    ep: Option<&'a Communicator>,
    world: Option<&'a Communicator>,
}

impl<'a> MoeReport<'a> {
    /// The report of a rank of `config` with `groups`; none for a dense model.
    fn of(config: &TrainConfig, groups: &'a Groups, micro_batches: usize) -> Option<Self> {
        let experts = groups.experts.as_ref()?;
        let dims = ParallelDims::of(config);
        Some(Self {
            record: &experts.record,
            counting: Counting {
                blocks: config.model.num_hidden_layers,
                experts: config.model.num_local_experts,
                data_ranks: dims.data_ranks() * dims.cp,
                micro_batches,
                counts: groups.tp.as_ref().is_none_or(|tp| tp.rank() == 0),
                ranks: dims.ranks(),
            },
            ep: groups.ep.as_ref(),
            world: groups.world.as_ref(),
        })
    }

    /// Puts the step's figures in `metrics`: the language-model loss as its loss, and the
    /// experts' own (a collective over the job).
    fn fill<B: Backend>(
        &self,
        metrics: &mut StepMetrics,
        device: &B::Device,
    ) -> Result<(), TrainError> {
        let exchanged = self.ep.map_or(0, |ep| {
            let sent = ep.stats().send.bytes;
            ep.reset_stats();
            sent
        });
        let step = self
            .record
            .step_metrics::<B>(self.counting, exchanged, self.world, device)?;
        metrics.loss = step.lm_loss;
        metrics.moe = Some(step.metrics);
        Ok(())
    }
}

/// A rank's state handed in for a checkpoint, not yet written.
struct Staged {
    step: usize,
    pieces: Result<Vec<burn_checkpoint::Shard>, String>,
    metadata: serde_json::Value,
}

/// The one training loop: every step's learning rate, forward and backward, optimizer step,
/// the loss over the whole global batch, the metrics (a mixture of experts' from `moe`) and
/// the checkpoints; then the last checkpoint committed, so that an interrupted run says it
/// was checkpointed only once it is.
#[allow(clippy::too_many_arguments)]
fn train_loop<B: AutodiffBackend>(
    config: &TrainConfig,
    engine: &mut dyn Engine<B>,
    batches: &Batches<'_>,
    device: &B::Device,
    on_step: &mut dyn FnMut(&StepMetrics),
    start: usize,
    saver: &mut Saver<'_>,
    moe: Option<&MoeReport<'_>>,
) -> Result<(), TrainError> {
    let mut steps = || -> Result<(), TrainError> {
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
            if let Some(moe) = moe {
                moe.fill::<B::InnerBackend>(&mut metrics, device)?;
            }
            // Reported even when its checkpoint fails: the step was trained.
            let stop = saver.after(engine, &mut metrics, device, on_step)?;
            // A stop asked during the last step changes nothing: the run ends as it would.
            if stop && step + 1 < config.steps {
                return Err(TrainError::Interrupted {
                    step: step + 1,
                    dir: saver.dir().to_path_buf(),
                });
            }
        }
        Ok(())
    };
    let trained = steps();
    match (trained, saver.finish()) {
        (Err(TrainError::Interrupted { .. }), Err(unsaved)) => Err(unsaved),
        (Err(error), _) => Err(error),
        (Ok(()), saved) => saved,
    }
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
                None,
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

    /// Six steps of `tiny` checkpointing every 2 into a fresh directory named `name`.
    fn checkpointing(name: &str) -> (TrainConfig, std::path::PathBuf) {
        let mut config = TrainConfig::new(LlamaConfig::preset("tiny").unwrap(), 6);
        config.seq_len = 8;
        let dir = std::env::temp_dir().join(format!("llama-run-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        config.checkpoint = Some(checkpoint::CheckpointConfig {
            dir: dir.clone(),
            every: 2,
            resume: false,
            keep: None,
            stage_on_host: false,
        });
        (config, dir)
    }

    #[test]
    fn a_failed_background_save_stops_the_run_by_the_next_save_naming_its_step() {
        let (config, dir) = checkpointing("failed-save");
        let data = MarkovSource::new(16, 2, config.seq_len, 64, 1);
        let batches = Batches::new(&config, &data, 1, 0, config.layout().unwrap()).unwrap();
        // A scripted engine holds no state to hand in, so its save fails, in the background.
        let mut engine = Scripted(vec![2.0; 6]);
        let mut seen = Vec::new();
        let mut saver = Saver::new(&config, None).unwrap();
        let error = train_loop::<A>(
            &config,
            &mut engine,
            &batches,
            &Default::default(),
            &mut |m| seen.push(m.step),
            0,
            &mut saver,
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.starts_with("the checkpoint after step 2: ")
                && error.contains("checkpoints are taken on"),
            "{error}"
        );
        // Found failed as soon as a check sees it (after step 2, 3, or step 4's save waiting
        // for it): the run never trains past the next save.
        assert!(matches!(seen.len(), 2..=4), "steps reported: {seen:?}");
        assert!(!dir.join("step-00000002").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_background_save_failing_on_every_rank_stops_them_all_with_its_step() {
        let (config, dir) = checkpointing("failed-dp");
        let data = MarkovSource::new(16, 2, config.seq_len, 64, 1);
        let results = burn_comm::launch(2, |ctx| {
            let batches = Batches::new(&config, &data, 1, 0, config.layout()?)?;
            // The scripted engines hold no state, so every rank's save fails in the
            // background; each rank sees it when its own check comes, and the per-step
            // agreement stops both together.
            let mut engine = Scripted(vec![2.0; 6]);
            let mut saver = Saver::new(&config, Some(ctx.world()))?;
            let mut steps = 0;
            train_loop::<A>(
                &config,
                &mut engine,
                &batches,
                &Default::default(),
                &mut |_| steps += 1,
                0,
                &mut saver,
                None,
            )
            .map(|()| steps)
        });
        for result in results {
            let error = result.unwrap_err().to_string();
            assert!(
                error.contains("the checkpoint after step 2: ")
                    || error.contains("another rank's checkpoint failed"),
                "{error}"
            );
        }
        assert!(!dir.join("step-00000002").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
