//! Data parallelism as a burn-train learning strategy: every rank runs its own `Learner` on its
//! share of each global batch; gradients are averaged over the group before every optimizer
//! step, so every replica takes the same step one device would take on the whole batch.

use burn::data::dataloader::Progress;
use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsAccumulator;
use burn::tensor::Device;
use burn::tensor::backend::AutodiffBackend;
use burn_comm::Communicator;
use burn_ddp::{DdpConfig, DdpError, GradientSync};
use burn_train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent,
    LearningComponentsTypes, LearningResult, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainStep, TrainingComponents, TrainingItem,
    TrainingModel, ValidLoader,
};

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::agree::{Agreement, agree, agree_on_lead, ranks_failing};
use crate::backward;

type Inner<LC> = <<LC as LearningComponentsTypes>::Backend as AutodiffBackend>::InnerBackend;

/// A data-parallel [`SupervisedLearningStrategy`]: one per rank, each with the rank's
/// communicator and device.
///
/// - rank 0's weights are broadcast at the start, so every replica starts equal;
/// - gradients are averaged over the group in buckets at every optimizer step (after the
///   accumulation of `grads_accumulation` micro-batches, if set); when the model's `TrainStep`
///   calls [`crate::backward`], the buckets start during backward instead of after it;
/// - every iteration the ranks agree whether each has a batch and whether one was interrupted,
///   so they stop together, and a rank whose loader runs dry early is an error, not a hang;
/// - rank 0 alone reports metrics, validates, checkpoints and decides early stopping; the
///   others wait for it at the next iteration.
///
/// Install it with [`crate::DataParallelTraining::data_parallel`], which also quiets the other
/// ranks' renderer and loggers.
pub struct DataParallelStrategy<LC: LearningComponentsTypes> {
    comm: Communicator,
    device: Device<LC::Backend>,
    config: DdpConfig,
    checkpoint_every_rank: bool,
    sharded_gradients: bool,
}

impl<LC: LearningComponentsTypes> DataParallelStrategy<LC> {
    /// The strategy of this rank: `comm` is its data-parallel group, `device` where it trains.
    pub fn new(comm: Communicator, device: Device<LC::Backend>) -> Self {
        Self {
            comm,
            device,
            config: DdpConfig::new(),
            checkpoint_every_rank: false,
            sharded_gradients: false,
        }
    }

    /// The optimizer averages the gradients itself, reduce-scattering them (ZeRO-2: burn-zero's
    /// `ZeroAdamW::with_gradient_sharding`): the strategy hands it each rank's own (accumulated)
    /// gradients, and [`crate::backward`] is a plain backward. An optimizer step that did not
    /// average them (any other optimizer) stops the run after that step with a sentence. Use it
    /// with
    /// [`with_checkpoints_on_every_rank`](Self::with_checkpoints_on_every_rank), as for ZeRO-1.
    pub fn with_sharded_gradients(mut self, sharded: bool) -> Self {
        self.sharded_gradients = sharded;
        self
    }

    /// Every rank writes and resumes from its own checkpoint, as a sharded optimizer
    /// (burn-zero's `ZeroAdamW`) needs: each rank holds a different part of its state. Give
    /// each rank its own directory ([`crate::rank_directory`]) and a checkpointing strategy
    /// that does not read metrics (`KeepLastNCheckpoints`), since only rank 0 has them. Off
    /// (the default), rank 0 alone writes one checkpoint that every rank resumes from, which
    /// is right when the replicas and their optimizer states are identical (DDP).
    pub fn with_checkpoints_on_every_rank(mut self, every_rank: bool) -> Self {
        self.checkpoint_every_rank = every_rank;
        self
    }

    /// DDP's settings: bucket size, overlap (used by [`crate::backward`]), unused parameters.
    pub fn with_config(mut self, config: DdpConfig) -> Self {
        self.config = config;
        self
    }

    /// Whether this rank reports, validates and checkpoints: rank 0 of the group.
    pub fn is_lead(&self) -> bool {
        self.comm.rank() == 0
    }

    /// Ends the job on this rank with a sentence naming it; `launch` reports it and its peers
    /// get an error naming it at their next collective.
    fn fail(&self, what: impl std::fmt::Display) -> ! {
        panic!(
            "data-parallel training failed on rank {} of {}: {what}",
            self.comm.rank(),
            self.comm.size()
        )
    }

    fn train_epoch(
        &self,
        learner: &mut Learner<LC>,
        loader: &TrainLoader<LC>,
        stepper: &mut Stepper<LC>,
        interrupter: &Interrupter,
        events: &mut SupervisedTrainingEventProcessor<LC>,
        epoch: &Progress,
    ) -> EpochEnd {
        let mut iterator = loader.iter();
        stepper.start_epoch();
        let mut end = EpochEnd::Done;
        let mut iteration = 0;
        loop {
            let item = iterator.next();
            match agree::<Inner<LC>>(
                &self.comm,
                &self.device,
                item.is_some(),
                interrupter.should_stop(),
            ) {
                Ok(Agreement::Go) => {}
                Ok(Agreement::EpochDone) => break,
                Ok(Agreement::Stop { rank }) => {
                    stop_with_peer(interrupter, rank);
                    end = EpochEnd::Stopped;
                    break;
                }
                Ok(Agreement::Uneven { dry, with_batch }) => self.fail(format!(
                    "rank(s) {dry:?} ran out of training batches at iteration {} of epoch {} while rank(s) {with_batch:?} had more; every rank needs the same number of batches per epoch (DistributedDataLoader gives them that)",
                    iteration + 1,
                    epoch.items_processed
                )),
                Err(e) => self.fail(e),
            }
            let item = item.expect("agreed that every rank has a batch");
            iteration += 1;
            learner.lr_step();
            let progress = iterator.progress();
            let output = stepper.step(learner, item).unwrap_or_else(|e| self.fail(e));
            if self.is_lead() {
                let item = TrainingItem::new(
                    output,
                    progress,
                    epoch.clone(),
                    Some(iteration),
                    Some(learner.lr_current()),
                );
                events.process_train(LearnerEvent::ProcessedItem(item));
            }
        }
        if self.is_lead() {
            events.process_train(LearnerEvent::EndEpoch(epoch.items_processed));
        }
        end
    }

    /// The lead's validation epoch, over whatever its validation loader gives it: pass an
    /// ordinary loader (not a `DistributedDataLoader`) to score the whole validation set.
    fn valid_epoch(
        learner: &Learner<LC>,
        loader: &ValidLoader<LC>,
        interrupter: &Interrupter,
        events: &mut SupervisedTrainingEventProcessor<LC>,
        epoch: &Progress,
    ) {
        let model = learner.model().valid();
        let mut iterator = loader.iter();
        let mut iteration = 0;
        while let Some(item) = iterator.next() {
            iteration += 1;
            let progress = iterator.progress();
            let item = TrainingItem::new(
                model.step(item),
                progress,
                epoch.clone(),
                Some(iteration),
                None,
            );
            events.process_valid(LearnerEvent::ProcessedItem(item));
            if interrupter.should_stop() {
                break;
            }
        }
        events.process_valid(LearnerEvent::EndEpoch(epoch.items_processed));
    }
}

/// How a training epoch ended, the same on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EpochEnd {
    Done,
    Stopped,
}

/// The text of a caught panic.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(text), _) => text.to_string(),
        (_, Some(text)) => text.clone(),
        _ => "a panic without a message".into(),
    }
}

/// Interrupts this rank too, saying who asked, unless it was this rank.
fn stop_with_peer(interrupter: &Interrupter, rank: usize) {
    if !interrupter.should_stop() {
        interrupter.stop(Some(&format!(
            "rank {rank} of the data-parallel group stopped"
        )));
    }
}

impl<LC: LearningComponentsTypes> SupervisedLearningStrategy<LC> for DataParallelStrategy<LC> {
    /// burn-train's own `train`, but a checkpoint is loaded on this rank's device.
    fn train(
        &self,
        mut learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        mut components: TrainingComponents<LC>,
    ) -> LearningResult<LC::InferenceModel> {
        let first_epoch = match components.checkpoint.take() {
            Some(epoch) => {
                let Some(checkpointer) = &components.checkpointer else {
                    self.fail(format!(
                        "asked to resume after epoch {epoch}, but no checkpointer is set; add .with_file_checkpointer(..)"
                    ))
                };
                // burn-train panics on a missing file; every rank says whether it loaded, so
                // none is left waiting and the error names the ranks.
                let loaded = catch_unwind(AssertUnwindSafe(|| {
                    checkpointer.load_checkpoint(learner.clone(), &self.device, epoch)
                }));
                let here = match &loaded {
                    Err(panic) => format!(" (here: {})", panic_message(&**panic)),
                    Ok(_) => String::new(),
                };
                let failing = ranks_failing::<Inner<LC>>(&self.comm, &self.device, loaded.is_ok())
                    .unwrap_or_else(|e| self.fail(format!("{e}{here}")));
                match loaded {
                    Ok(resumed) if failing.is_empty() => learner = resumed,
                    _ => {
                        self.fail(format!(
                            "the checkpoint of epoch {epoch} could not be loaded on rank(s) {failing:?}{here}; check that it exists in each rank's checkpoint directory"
                        ))
                    }
                }
                epoch + 1
            }
            None => 1,
        };
        Resumed {
            strategy: self,
            first_epoch,
        }
        .train(learner, dataloader_train, dataloader_valid, components)
    }

    fn fit(
        &self,
        components: TrainingComponents<LC>,
        learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        self.fit_from(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
        )
    }
}

/// The strategy with its checkpoint already loaded, so burn-train's own `train` (its events,
/// its summary) runs it from the epoch after the checkpoint.
struct Resumed<'a, LC: LearningComponentsTypes> {
    strategy: &'a DataParallelStrategy<LC>,
    first_epoch: usize,
}

impl<LC: LearningComponentsTypes> SupervisedLearningStrategy<LC> for Resumed<'_, LC> {
    fn fit(
        &self,
        components: TrainingComponents<LC>,
        learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        _starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        self.strategy.fit_from(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            self.first_epoch,
        )
    }
}

impl<LC: LearningComponentsTypes> DataParallelStrategy<LC> {
    fn fit_from(
        &self,
        components: TrainingComponents<LC>,
        mut learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        let train = dataloader_train.to_device(&self.device);
        learner.fork(&self.device);
        let model = burn_ddp::params::broadcast::<LC::Backend, _>(learner.model(), &self.comm, 0)
            .unwrap_or_else(|e| self.fail(e));
        learner.load_model(model.into_record());
        let sync = GradientSync::new(&learner.model(), self.comm.clone(), self.config.clone())
            .unwrap_or_else(|e| self.fail(e));
        let mut stepper = Stepper::new(sync, components.grad_accumulation, self.sharded_gradients);
        // A resumed run reads the epochs it skips, so a loader that reshuffles every epoch
        // (ours or burn's) gives the batches of the uninterrupted run.
        for _ in 1..starting_epoch {
            drop(train.iter());
        }
        let valid = self
            .is_lead()
            .then(|| dataloader_valid.to_device(&self.device));

        let mut events = components.event_processor;
        let mut checkpointer = components.checkpointer;
        let mut early_stopping = components.early_stopping;
        let interrupter = components.interrupter;
        for epoch in starting_epoch..=components.num_epochs {
            let progress = Progress::new(epoch, components.num_epochs);
            let end = self.train_epoch(
                &mut learner,
                &train,
                &mut stepper,
                &interrupter,
                &mut events,
                &progress,
            );
            // The group's decision, not this rank's interrupter, which may have been set since:
            // a late interrupt is taken up by the next epoch's first agreement.
            if end == EpochEnd::Stopped {
                let reason = interrupter.get_message().unwrap_or("reason unknown".into());
                log::info!("Training interrupted: {reason}");
                break;
            }
            let mut stop = false;
            if let Some(valid) = &valid {
                Self::valid_epoch(&learner, valid, &interrupter, &mut events, &progress);
            }
            if let Some(checkpointer) = &mut checkpointer
                && (self.is_lead() || self.checkpoint_every_rank)
            {
                checkpointer.checkpoint(&learner, epoch, &components.event_store);
            }
            if self.is_lead() {
                stop = early_stopping
                    .as_mut()
                    .is_some_and(|e| e.should_stop(epoch, &components.event_store));
            }
            match agree_on_lead::<Inner<LC>>(&self.comm, &self.device, stop) {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => self.fail(e),
            }
        }
        (learner.model(), events)
    }
}

/// One training step of this rank: forward and backward in the user's `TrainStep`, gradients
/// accumulated and averaged over the group, the optimizer step.
struct Stepper<LC: LearningComponentsTypes> {
    /// `None` only while lent to the thread during a step.
    sync: Option<GradientSync<LC::Backend>>,
    accumulation: Option<usize>,
    accumulator: GradientsAccumulator<LC::TrainingModel>,
    accumulated: usize,
    /// The optimizer averages the gradients itself (ZeRO-2).
    sharded: bool,
}

impl<LC: LearningComponentsTypes> Stepper<LC> {
    fn new(sync: GradientSync<LC::Backend>, accumulation: Option<usize>, sharded: bool) -> Self {
        Self {
            sync: Some(sync),
            accumulation,
            accumulator: GradientsAccumulator::new(),
            accumulated: 0,
            sharded,
        }
    }

    /// Micro-batches left over from the last epoch are dropped, as burn-train does.
    fn start_epoch(&mut self) {
        self.accumulator = GradientsAccumulator::new();
        self.accumulated = 0;
    }

    fn step(
        &mut self,
        learner: &mut Learner<LC>,
        item: <LC::TrainingModel as TrainStep>::Input,
    ) -> Result<<LC::TrainingModel as TrainStep>::Output, DdpError> {
        let sync = self
            .sync
            .take()
            .expect("the synchronisation is back after each step");
        // Lent only when this step's gradients are the ones to average: with accumulation the
        // sum of the micro-batches is averaged at the end instead, and under ZeRO-2 by the
        // optimizer.
        let (output, mut sync, averaged) = if self.accumulation.is_none() && !self.sharded {
            backward::lend(sync);
            let output = learner.train_step(item);
            let (sync, averaged) = backward::reclaim::<LC::Backend>();
            (output, sync, averaged)
        } else {
            (learner.train_step(item), sync, false)
        };
        let grads = match self.accumulation {
            Some(every) => {
                self.accumulator.accumulate(&learner.model(), output.grads);
                self.accumulated += 1;
                (self.accumulated >= every).then(|| {
                    self.accumulated = 0;
                    self.accumulator.grads()
                })
            }
            None => Some(output.grads),
        };
        let result = match grads {
            Some(grads) if averaged || self.sharded => Ok(Some(grads)),
            Some(grads) => sync.average(&learner.model(), grads).map(Some),
            None => Ok(None),
        };
        if let Ok(Some(_)) = &result
            && !self.sharded
        {
            backward::record(sync.stats());
        }
        self.sync = Some(sync);
        if let Some(grads) = result? {
            let before = burn_zero::gradient_sharding_steps();
            learner.optimizer_step(grads);
            if self.sharded && burn_zero::gradient_sharding_steps() == before {
                return Err(DdpError::Config(
                    "with_sharded_gradients hands each rank its own gradients for the optimizer to average, but the optimizer's step did not (each rank would learn from its own batch alone); use burn-zero's ZeroAdamW::with_gradient_sharding, or drop with_sharded_gradients".into(),
                ));
            }
        }
        Ok(output.item)
    }
}
