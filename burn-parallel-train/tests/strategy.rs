//! burn-train's `SupervisedTraining` run data-parallel against the same training on one device:
//! a small classifier, the same global batch, losses step by step and weights at the end. Also:
//! accumulation, shuffling, uneven data, a dry loader, an interrupt on one rank and a resume.

use std::cell::RefCell;
use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, AdamWConfig, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_comm::parallel::CommBackend;
use burn_comm::{RankError, launch};
use burn_parallel_train::{
    DataParallelStrategy, DataParallelTraining, DdpConfig, DdpStepStats, DistributedDataLoader,
    last_sync_stats, rank_directory,
};
use burn_tensor_parallel::{ColumnParallelLinear, RowParallelLinear, TensorParallel};
use burn_train::checkpoint::KeepLastNCheckpoints;
use burn_train::metric::LossMetric;
use burn_train::metric::store::EventStoreClient;
use burn_train::{
    ClassificationOutput, EarlyStoppingStrategy, InferenceStep, Interrupter, Learner,
    SupervisedTraining, TrainOutput, TrainStep,
};
use burn_zero::ZeroAdamW;

type AD = Autodiff<Flex>;
const FEATURES: usize = 4;
const HIDDEN: usize = 16;
const CLASSES: usize = 3;

#[derive(Module, Debug)]
struct Net<B: Backend> {
    w1: Param<Tensor<B, 2>>,
    b1: Param<Tensor<B, 1>>,
    w2: Param<Tensor<B, 2>>,
}

impl<B: Backend> Net<B> {
    /// Deterministic weights from `seed`: ranks given different seeds must be made equal.
    fn new(seed: u64) -> Self {
        let device = Default::default();
        let values = |shape: Vec<usize>, salt: u64| {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n as u64)
                .map(|i| (noise(seed * 1000 + salt * 100 + i) - 0.5) * 0.8)
                .collect();
            TensorData::new(data, shape)
        };
        Self {
            w1: Param::from_tensor(Tensor::from_data(
                values(vec![FEATURES, HIDDEN], 1),
                &device,
            )),
            b1: Param::from_tensor(Tensor::from_data(values(vec![HIDDEN], 2), &device)),
            w2: Param::from_tensor(Tensor::from_data(values(vec![HIDDEN, CLASSES], 3), &device)),
        }
    }

    fn forward(&self, batch: Batch<B>) -> ClassificationOutput<B> {
        let hidden = (batch.x.matmul(self.w1.val()) + self.b1.val().unsqueeze()).tanh();
        let logits = hidden.matmul(self.w2.val());
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.y.clone());
        ClassificationOutput::new(loss, logits, batch.y)
    }

    fn weights(&self) -> Vec<f32> {
        [
            self.w1.val().into_data(),
            self.b1.val().into_data(),
            self.w2.val().into_data(),
        ]
        .into_iter()
        .flat_map(|d| d.to_vec::<f32>().unwrap())
        .collect()
    }
}

/// A number in [0, 1) from `i` (splitmix64), the same on every thread.
fn noise(i: u64) -> f32 {
    let mut z = i.wrapping_add(0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
}

thread_local! {
    /// This rank's training losses, in order.
    static LOSSES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Use burn_parallel_train::backward in the step (overlapping the all-reduce).
    static OVERLAP: RefCell<bool> = const { RefCell::new(false) };
    /// Stop this rank's training after this many steps.
    static STOP_AFTER: RefCell<Option<(usize, Interrupter)>> = const { RefCell::new(None) };
}

impl TrainStep for Net<AD> {
    type Input = Batch<AD>;
    type Output = ClassificationOutput<AD>;

    fn step(&self, batch: Batch<AD>) -> TrainOutput<ClassificationOutput<AD>> {
        let output = self.forward(batch);
        let loss = output.loss.clone().into_scalar();
        let steps = LOSSES.with(|l| {
            l.borrow_mut().push(loss);
            l.borrow().len()
        });
        STOP_AFTER.with(|s| {
            if let Some((after, interrupter)) = &*s.borrow()
                && steps == *after
            {
                interrupter.stop(Some("the test asked"));
            }
        });
        if OVERLAP.with(|o| *o.borrow()) {
            burn_parallel_train::backward(self, output.loss.clone(), output)
        } else {
            TrainOutput::new(self, output.loss.backward(), output)
        }
    }
}

impl InferenceStep for Net<Flex> {
    type Input = Batch<Flex>;
    type Output = ClassificationOutput<Flex>;

    fn step(&self, batch: Batch<Flex>) -> ClassificationOutput<Flex> {
        self.forward(batch)
    }
}

#[derive(Clone, Debug)]
struct Sample {
    x: [f32; FEATURES],
    y: i64,
}

#[derive(Clone, Debug)]
struct Batch<B: Backend> {
    x: Tensor<B, 2>,
    y: Tensor<B, 1, Int>,
}

#[derive(Clone)]
struct SampleBatcher;

impl<B: Backend> Batcher<B, Sample, Batch<B>> for SampleBatcher {
    fn batch(&self, items: Vec<Sample>, device: &B::Device) -> Batch<B> {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|s| s.x).collect();
        let y: Vec<i64> = items.iter().map(|s| s.y).collect();
        Batch {
            x: Tensor::from_data(TensorData::new(x, [n, FEATURES]), device),
            y: Tensor::from_data(TensorData::new(y, [n]), device),
        }
    }
}

/// Points whose class is decided by a fixed rule, so the loss falls as it trains.
fn dataset(samples: usize) -> InMemDataset<Sample> {
    InMemDataset::new(
        (0..samples as u64)
            .map(|i| {
                let x: [f32; FEATURES] =
                    std::array::from_fn(|k| noise(i * 7 + k as u64) * 2.0 - 1.0);
                let y = ((x[0] + x[1] > 0.0) as i64) + ((x[2] > 0.3) as i64);
                Sample { x, y }
            })
            .collect(),
    )
}

/// One training setup, run on one device or on several ranks.
#[derive(Clone)]
struct Setup {
    samples: usize,
    global_batch: usize,
    epochs: usize,
    accumulation: Option<usize>,
    shuffle: Option<u64>,
    checkpoint: Option<usize>,
    overlap: bool,
    /// ZeRO-1 (burn-zero's ZeroAdamW) on the ranks, burn's AdamW on one device; else Adam.
    zero: bool,
    /// With `zero`, ZeRO-2: the optimizer reduce-scatters each rank's own gradients.
    zero2: bool,
    /// Every rank checkpoints into its own directory.
    checkpoint_every_rank: bool,
}

impl Setup {
    fn new() -> Self {
        Self {
            samples: 64,
            global_batch: 8,
            epochs: 3,
            accumulation: None,
            shuffle: None,
            checkpoint: None,
            overlap: false,
            zero: false,
            zero2: false,
            checkpoint_every_rank: false,
        }
    }

    /// burn-train as a user writes it, on `train`, checkpointing every epoch into `dir`.
    fn training<O: Optimizer<Net<AD>, AD> + 'static>(
        &self,
        dir: &Path,
        train: std::sync::Arc<dyn burn::data::dataloader::DataLoader<AD, Batch<AD>>>,
    ) -> SupervisedTraining<Components<O>> {
        let valid = DataLoaderBuilder::new(SampleBatcher)
            .batch_size(16)
            .build(dataset(32));
        let mut training = SupervisedTraining::new(dir, train, valid)
            .metrics((LossMetric::new(),))
            .num_epochs(self.epochs)
            .with_application_logger(None)
            .with_file_checkpointer(NamedMpkFileRecorder::<FullPrecisionSettings>::new())
            .with_checkpointing_strategy(KeepLastNCheckpoints::new(100));
        if let Some(every) = self.accumulation {
            training = training.grads_accumulation(every);
        }
        if let Some(epoch) = self.checkpoint {
            training = training.checkpoint(epoch);
        }
        training
    }

    fn learner<O: Optimizer<Net<AD>, AD> + 'static>(seed: u64, optim: O) -> Learner<Components<O>> {
        Learner::new(Net::new(seed), optim, 1e-2)
    }

    /// On one device with burn's own strategy: burn's loader, or ours at world 1 when shuffled.
    fn single(&self, dir: &Path) -> (Vec<f32>, Vec<f32>) {
        let train = match self.shuffle {
            None => DataLoaderBuilder::new(SampleBatcher)
                .batch_size(self.global_batch)
                .build(dataset(self.samples)),
            Some(seed) => DistributedDataLoader::for_rank(
                SampleBatcher,
                dataset(self.samples),
                self.global_batch,
                0,
                1,
            )
            .unwrap()
            .with_shuffle(seed)
            .into_arc(),
        };
        LOSSES.with(|l| l.borrow_mut().clear());
        OVERLAP.with(|o| *o.borrow_mut() = self.overlap);
        let model = if self.zero {
            let optim = AdamWConfig::new().init();
            self.training(dir, train).launch(Self::learner(0, optim))
        } else {
            let optim = AdamConfig::new().init();
            self.training(dir, train).launch(Self::learner(0, optim))
        }
        .model;
        (LOSSES.with(|l| l.take()), model.weights())
    }

    /// One rank's training: the strategy with small buckets (so a step has several to
    /// overlap); the rank interrupts itself after `stop_after` steps.
    fn rank_training<O: Optimizer<Net<AD>, AD> + 'static>(
        &self,
        dir: &Path,
        train: std::sync::Arc<dyn burn::data::dataloader::DataLoader<AD, Batch<AD>>>,
        comm: &burn_comm::Communicator,
        stop_after: Option<usize>,
    ) -> SupervisedTraining<Components<O>> {
        let strategy = DataParallelStrategy::new(comm.clone(), Default::default())
            .with_config(DdpConfig::new().with_bucket_cap_bytes(128))
            .with_checkpoints_on_every_rank(self.checkpoint_every_rank)
            .with_sharded_gradients(self.zero2);
        let training = self
            .training(dir, train)
            .with_data_parallel_strategy(strategy);
        if let Some(after) = stop_after {
            STOP_AFTER.with(|s| *s.borrow_mut() = Some((after, training.interrupter())));
        }
        training
    }

    /// On `world` ranks: every rank's losses and weights. Rank `stop.0` interrupts itself after
    /// `stop.1` steps.
    fn parallel(
        &self,
        world: usize,
        dir: &Path,
        stop: Option<(usize, usize)>,
    ) -> Vec<Result<RankRun, RankError<String>>> {
        launch(world, |ctx| {
            OVERLAP.with(|o| *o.borrow_mut() = self.overlap);
            let comm = ctx.world().clone();
            let mut train = DistributedDataLoader::new(
                SampleBatcher,
                dataset(self.samples),
                self.global_batch / world,
                &comm,
            )
            .map_err(|e| e.to_string())?;
            if let Some(seed) = self.shuffle {
                train = train.with_shuffle(seed);
            }
            let dir = match self.checkpoint_every_rank {
                true => rank_directory(dir, &comm),
                false => dir.to_path_buf(),
            };
            let train = train.into_arc();
            // Different weights on every rank: rank 0's must win.
            let seed = ctx.rank() as u64;
            let stop_after = stop.filter(|(rank, _)| *rank == ctx.rank()).map(|(_, n)| n);
            let model = if self.zero {
                let optim =
                    ZeroAdamW::new(&AdamWConfig::new(), comm.clone()).map_err(|e| e.to_string())?;
                let optim = match self.zero2 {
                    true => optim.with_gradient_sharding(),
                    false => optim,
                };
                self.rank_training(&dir, train, &comm, stop_after)
                    .launch(Self::learner(seed, optim))
            } else {
                let optim = AdamConfig::new().init();
                self.rank_training(&dir, train, &comm, stop_after)
                    .launch(Self::learner(seed, optim))
            }
            .model;
            Ok(RankRun {
                losses: LOSSES.with(|l| l.take()),
                weights: model.weights(),
                stats: last_sync_stats(),
            })
        })
    }
}

/// What one rank ends with.
struct RankRun {
    losses: Vec<f32>,
    weights: Vec<f32>,
    stats: Option<DdpStepStats>,
}

type Components<O> = burn_train::LearningComponentsMarker<AD, f64, Net<AD>, O>;

/// Losses step by step: the mean of the ranks' (equal shares of each global batch).
fn mean_over_ranks(ranks: &[RankRun]) -> Vec<f32> {
    let steps = ranks[0].losses.len();
    assert!(
        ranks.iter().all(|r| r.losses.len() == steps),
        "every rank took the same steps"
    );
    (0..steps)
        .map(|s| ranks.iter().map(|r| r.losses[s]).sum::<f32>() / ranks.len() as f32)
        .collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= rtol * w.abs().max(g.abs()) + 1e-6,
            "{what} [{i}]: {g} vs one device's {w}"
        );
    }
}

fn unwrap_all(results: Vec<Result<RankRun, RankError<String>>>) -> Vec<RankRun> {
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

/// Every rank ended with the same weights, bit for bit.
fn assert_replicas_equal(ranks: &[RankRun]) {
    for (r, rank) in ranks.iter().enumerate() {
        assert_eq!(
            rank.weights, ranks[0].weights,
            "rank {r}'s weights differ from rank 0's"
        );
    }
}

fn check_parity(setup: &Setup, world: usize) -> Vec<RankRun> {
    let dir = tempfile::tempdir().unwrap();
    let (losses, weights) = setup.single(&dir.path().join("single"));
    let ranks = unwrap_all(setup.parallel(world, &dir.path().join("parallel"), None));
    assert_replicas_equal(&ranks);
    let steps = setup.epochs * setup.samples / setup.global_batch;
    assert_eq!(losses.len(), steps, "one device's steps");
    assert_close("loss", &mean_over_ranks(&ranks), &losses, 1e-5);
    assert_close("weights", &ranks[0].weights, &weights, 1e-5);
    assert!(losses.last() < losses.first(), "the loss falls: {losses:?}");
    // Rank 0 alone logs: one line per step, as one device writes.
    let lines = |run: &str| {
        let log = dir.path().join(run).join("train/epoch-1/Loss.log");
        std::fs::read_to_string(&log)
            .unwrap_or_else(|e| panic!("{}: {e}", log.display()))
            .lines()
            .count()
    };
    assert_eq!(
        lines("parallel"),
        lines("single"),
        "lines logged in epoch 1"
    );
    ranks
}

#[test]
fn two_and_four_ranks_give_the_single_device_losses() {
    for world in [2, 4] {
        for rank in check_parity(&Setup::new(), world) {
            let stats = rank.stats.expect("every step synchronises");
            assert!(stats.buckets > 1, "{stats:?}");
            assert_eq!(
                stats.overlapped_buckets, 0,
                "nothing overlaps a plain backward"
            );
        }
    }
}

#[test]
fn backward_in_the_train_step_overlaps_the_all_reduce_and_gives_the_same_losses() {
    let setup = Setup {
        overlap: true,
        ..Setup::new()
    };
    for rank in check_parity(&setup, 2) {
        let stats = rank.stats.expect("every step synchronises");
        assert!(stats.overlapped_buckets > 0, "{stats:?}");
    }
}

#[test]
fn gradient_accumulation_steps_as_one_device_does() {
    let setup = Setup {
        accumulation: Some(2),
        ..Setup::new()
    };
    check_parity(&setup, 2);
}

#[test]
fn a_shuffled_loader_reads_one_device_s_batches_every_epoch() {
    let setup = Setup {
        shuffle: Some(7),
        ..Setup::new()
    };
    check_parity(&setup, 4);
}

#[test]
fn an_uneven_dataset_gives_every_rank_the_same_number_of_batches() {
    // 10 samples over 4 ranks: padded to 12, 3 per rank, batches of 2 and 1.
    let setup = Setup {
        samples: 10,
        epochs: 2,
        ..Setup::new()
    };
    let dir = tempfile::tempdir().unwrap();
    let ranks = unwrap_all(setup.parallel(4, dir.path(), None));
    assert_replicas_equal(&ranks);
    for (r, rank) in ranks.iter().enumerate() {
        assert_eq!(rank.losses.len(), 4, "rank {r} trained 2 batches per epoch");
    }
}

#[test]
fn a_rank_whose_own_loader_runs_dry_is_named_and_nobody_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let results = launch(2, |ctx| {
        // burn's plain loader, a different share per rank: rank 1 has 2 batches, rank 0 has 4.
        let train = DataLoaderBuilder::new(SampleBatcher)
            .batch_size(4)
            .build(dataset(16 / (ctx.rank() + 1)));
        let training = Setup::new()
            .training(dir.path(), train)
            .data_parallel(ctx.world().clone(), Default::default());
        training.launch(Setup::learner(0, AdamConfig::new().init()));
        Ok::<_, String>(())
    });
    let message = results
        .iter()
        .find_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .expect("the uneven loaders are refused");
    assert!(
        message.contains("rank(s) [1] ran out of training batches at iteration 3 of epoch 1")
            && message.contains("DistributedDataLoader"),
        "{message}"
    );
}

#[test]
fn an_interrupt_on_one_rank_stops_every_rank_at_the_same_step() {
    let dir = tempfile::tempdir().unwrap();
    let ranks = unwrap_all(Setup::new().parallel(3, dir.path(), Some((1, 5))));
    assert_replicas_equal(&ranks);
    for (r, rank) in ranks.iter().enumerate() {
        assert_eq!(
            rank.losses.len(),
            5,
            "rank {r} stopped after rank 1's fifth step"
        );
    }
}

#[test]
fn a_resume_from_a_checkpoint_equals_the_uninterrupted_run() {
    let setup = Setup {
        shuffle: Some(3),
        ..Setup::new()
    };
    let dir = tempfile::tempdir().unwrap();
    resume_equals_whole_run(&setup, dir.path());
}

/// Trains 3 epochs in one run, and 2 then 1 more resumed from the checkpoint of epoch 2, on 2
/// ranks: the resumed epoch's losses and the final weights are the same bits.
fn resume_equals_whole_run(setup: &Setup, dir: &Path) {
    let whole = unwrap_all(setup.parallel(2, &dir.join("whole"), None));
    let part = dir.join("part");
    let first = Setup {
        epochs: 2,
        ..setup.clone()
    };
    unwrap_all(first.parallel(2, &part, None));
    let resumed = Setup {
        checkpoint: Some(2),
        ..setup.clone()
    };
    let rest = unwrap_all(resumed.parallel(2, &part, None));
    let per_epoch = setup.samples / setup.global_batch;
    for (r, (whole, rest)) in whole.iter().zip(&rest).enumerate() {
        assert_eq!(
            rest.losses,
            whole.losses[2 * per_epoch..],
            "rank {r}'s third-epoch losses"
        );
        assert_eq!(
            rest.weights, whole.weights,
            "rank {r}'s weights after resuming"
        );
    }
}

#[test]
fn zero_adamw_on_the_ranks_trains_as_burn_s_adamw_on_one_device() {
    let setup = Setup {
        zero: true,
        ..Setup::new()
    };
    check_parity(&setup, 2);
    check_parity(&setup, 4);
}

#[test]
fn zero_2_on_the_ranks_trains_as_burn_s_adamw_on_one_device() {
    let setup = Setup {
        zero: true,
        zero2: true,
        accumulation: Some(2),
        ..Setup::new()
    };
    check_parity(&setup, 2);
    check_parity(
        &Setup {
            accumulation: None,
            ..setup
        },
        4,
    );
}

/// The strategy told that the optimizer averages, given one that does not (ZeRO-1, whose shards
/// would each learn from their own rank's batch while the replicas stayed equal): the first step
/// says so instead.
#[test]
fn sharded_gradients_with_an_optimizer_that_does_not_average_them_is_refused() {
    let setup = Setup {
        zero: true,
        zero2: true,
        ..Setup::new()
    };
    let dir = tempfile::tempdir().unwrap();
    let errors: Vec<String> = launch(2, |ctx| {
        let comm = ctx.world().clone();
        let train = DistributedDataLoader::new(SampleBatcher, dataset(setup.samples), 4, &comm)
            .map_err(|e| e.to_string())?
            .into_arc();
        // ZeRO-1 expects averaged gradients, and gets each rank's own.
        let optim = ZeroAdamW::new(&AdamWConfig::new(), comm.clone()).map_err(|e| e.to_string())?;
        setup
            .rank_training(&rank_directory(dir.path(), &comm), train, &comm, None)
            .launch(Setup::learner(ctx.rank() as u64, optim));
        Ok::<_, String>(())
    })
    .into_iter()
    .filter_map(|r| r.err().map(|e| e.to_string()))
    .collect();
    assert!(!errors.is_empty(), "the run was not refused");
    assert!(
        errors
            .iter()
            .any(|e| e.contains("but the optimizer's step did not")),
        "{errors:?}"
    );
}

#[test]
fn a_sharded_optimizer_resumes_from_every_rank_s_own_checkpoint() {
    let setup = Setup {
        zero: true,
        shuffle: Some(5),
        checkpoint_every_rank: true,
        ..Setup::new()
    };
    let dir = tempfile::tempdir().unwrap();
    resume_equals_whole_run(&setup, dir.path());
    assert!(
        dir.path()
            .join("part/rank-1/checkpoint/optim-2.mpk")
            .exists()
    );
    let first = Setup {
        epochs: 2,
        ..setup.clone()
    };
    let resumed = Setup {
        checkpoint: Some(2),
        ..setup.clone()
    };

    // Rank 0's checkpoint alone cannot resume a sharded optimizer: refused, naming why.
    let shared = dir.path().join("shared");
    let lead_only = Setup {
        checkpoint_every_rank: false,
        ..first
    };
    unwrap_all(lead_only.parallel(2, &shared, None));
    let resumed = Setup {
        checkpoint_every_rank: false,
        ..resumed
    };
    let errors: Vec<String> = resumed
        .parallel(2, &shared, None)
        .into_iter()
        .filter_map(|r| r.err().map(|e| e.to_string()))
        .collect();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(
        errors
            .iter()
            .any(|e| e.contains("could not be loaded on rank(s) [1]")
                && e.contains("holds the optimizer shard of rank 0 of 2")),
        "{errors:?}"
    );
}

/// The test network with its layers split over a tensor-parallel group: `w1` by columns,
/// `w2` by rows (Megatron's MLP), built from the full network's weights.
#[derive(Module, Debug)]
struct TpNet<B: Backend> {
    up: ColumnParallelLinear<B>,
    down: RowParallelLinear<B>,
}

impl<B: CommBackend> TpNet<B> {
    fn new(full: Net<B>, tp: &TensorParallel) -> Self {
        Self {
            up: ColumnParallelLinear::from_full(full.w1.val(), Some(full.b1.val()), tp, false)
                .unwrap(),
            down: RowParallelLinear::from_full(full.w2.val(), None, tp, true).unwrap(),
        }
    }

    fn forward(&self, batch: Batch<B>) -> ClassificationOutput<B> {
        let hidden = self.up.forward(batch.x).unwrap().tanh();
        let logits = self.down.forward(hidden).unwrap();
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.y.clone());
        ClassificationOutput::new(loss, logits, batch.y)
    }
}

impl TrainStep for TpNet<AD> {
    type Input = Batch<AD>;
    type Output = ClassificationOutput<AD>;

    fn step(&self, batch: Batch<AD>) -> TrainOutput<ClassificationOutput<AD>> {
        let output = self.forward(batch);
        LOSSES.with(|l| l.borrow_mut().push(output.loss.clone().into_scalar()));
        burn_parallel_train::backward(self, output.loss.clone(), output)
    }
}

impl InferenceStep for TpNet<Flex> {
    type Input = Batch<Flex>;
    type Output = ClassificationOutput<Flex>;

    fn step(&self, batch: Batch<Flex>) -> ClassificationOutput<Flex> {
        self.forward(batch)
    }
}

#[test]
fn tensor_parallel_layers_train_under_the_strategy_over_the_data_parallel_group() {
    let setup = Setup::new();
    let dir = tempfile::tempdir().unwrap();
    let (want, _) = setup.single(&dir.path().join("single"));
    let (dp, tp) = (2, 2);
    let runs = launch(dp * tp, |ctx| {
        let mesh = ctx
            .mesh(&[("dp", dp), ("tp", tp)])
            .map_err(|e| e.to_string())?;
        let (dp_comm, tp_comm) = (mesh.group("dp").unwrap(), mesh.group("tp").unwrap());
        let tensor_parallel = TensorParallel::new(tp_comm.clone());
        // Every rank but dp rank 0's differs: the strategy broadcasts over dp only, so each
        // tensor-parallel shard must come from its own dp rank 0.
        let model = TpNet::<AD>::new(Net::new(dp_comm.rank() as u64), &tensor_parallel);
        let train = DistributedDataLoader::new(
            SampleBatcher,
            dataset(setup.samples),
            setup.global_batch / dp,
            dp_comm,
        )
        .map_err(|e| e.to_string())?;
        let valid = DataLoaderBuilder::new(SampleBatcher)
            .batch_size(16)
            .build(dataset(32));
        // Each tensor-parallel rank's lead keeps its own shard, logs and checkpoints.
        let mut training =
            SupervisedTraining::new(rank_directory(dir.path(), tp_comm), train.into_arc(), valid)
                .metrics((LossMetric::new(),))
                .num_epochs(setup.epochs)
                .with_application_logger(None)
                .data_parallel(dp_comm.clone(), Default::default());
        if tp_comm.rank() != 0 {
            training = training.renderer(burn_parallel_train::QuietRenderer);
        }
        LOSSES.with(|l| l.borrow_mut().clear());
        let optim = AdamConfig::new().init();
        training.launch(Learner::new(model, optim, 1e-2));
        Ok::<_, String>((dp_comm.rank(), LOSSES.with(|l| l.take())))
    });
    let runs: Vec<(usize, Vec<f32>)> = runs
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect();
    for tp_rank in 0..tp {
        // Global rank = dp coordinate * tp + tp coordinate.
        let column: Vec<&Vec<f32>> = (0..dp).map(|d| &runs[d * tp + tp_rank].1).collect();
        let mean: Vec<f32> = (0..want.len())
            .map(|s| column.iter().map(|l| l[s]).sum::<f32>() / dp as f32)
            .collect();
        assert_close(&format!("tp rank {tp_rank}'s loss"), &mean, &want, 1e-5);
    }
}

/// Stops after `after` epochs.
#[derive(Clone)]
struct StopAfter(usize);

impl EarlyStoppingStrategy for StopAfter {
    fn should_stop(&mut self, epoch: usize, _store: &EventStoreClient) -> bool {
        epoch >= self.0
    }
}

#[test]
fn rank_zero_s_early_stopping_stops_every_rank() {
    let setup = Setup::new();
    let dir = tempfile::tempdir().unwrap();
    let runs = launch(3, |ctx| {
        let comm = ctx.world().clone();
        let train = DistributedDataLoader::new(
            SampleBatcher,
            dataset(setup.samples),
            setup.global_batch / 4,
            &comm,
        )
        .map_err(|e| e.to_string())?;
        // The other ranks' own strategies would stop at once: only rank 0's may count.
        let after = if comm.rank() == 0 { 2 } else { 1 };
        let training = setup
            .training(dir.path(), train.into_arc())
            .early_stopping(StopAfter(after))
            .data_parallel(comm, Default::default());
        LOSSES.with(|l| l.borrow_mut().clear());
        training.launch(Setup::learner(0, AdamConfig::new().init()));
        Ok::<_, String>(LOSSES.with(|l| l.take()).len())
    });
    let per_epoch = setup.samples.div_ceil(3).div_ceil(setup.global_batch / 4);
    for (rank, steps) in runs.into_iter().enumerate() {
        assert_eq!(
            steps.unwrap(),
            2 * per_epoch,
            "rank {rank} trained 2 of 3 epochs"
        );
    }
}
