//! The ZeRO engines on a small network, against DDP: a weight used twice (its gradient gets a
//! part after it was taken), offloaded optimizer state, tiny buckets that leave most units
//! padded, and the errors: a parameter without a gradient named on every rank, a step before
//! any backward, stage 3 asked of the replicated engine, a unit that returns the loss early.
//! Mixed precision: 16-bit parameters are the rounded fp32 master weights, which keep updates
//! smaller than 16 bits can hold; an f16 overflow on one rank skips the step on every rank, and
//! with an overflow group on the ranks holding other parts of the model too.

use burn::backend::{Autodiff, Flex};
use burn::grad_clipping::GradientClippingConfig;
use burn::module::{Module, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorData};
use burn_comm::{RankError, launch};
use burn_ddp::{DdpConfig, DistributedDataParallel};
use burn_pipeline::{PipelineStage, StageOutput};
use burn_zero::{
    FullyShardedDataParallel, LossScaleConfig, MixedPrecision, ShardState, ShardedDataParallel,
    StateTensor, StepOutcome, ZeroConfig, ZeroError, ZeroStage,
};

type AD = Autodiff<Flex>;

#[derive(Module, Debug)]
struct Net<B: Backend> {
    first: Param<Tensor<B, 2>>,
    second: Param<Tensor<B, 2>>,
    extra: Param<Tensor<B, 2>>,
}

impl<B: Backend> Net<B> {
    fn new() -> Self {
        let w = |k| Param::from_tensor(values([5, 5], k, 0.5));
        Self {
            first: w(1),
            second: w(2),
            extra: w(3),
        }
    }

    /// Uses `first` again at the end (a weight used twice); `extra` only if `use_extra`.
    fn loss(&self, x: Tensor<B, 2>, use_extra: bool) -> Tensor<B, 1> {
        let mut h = x.matmul(self.first.val()).tanh();
        h = h.matmul(self.second.val()).tanh();
        if use_extra {
            h = h.matmul(self.extra.val()).tanh();
        }
        h.matmul(self.first.val()).powi_scalar(2).mean()
    }
}

/// Reproducible values in `[-scale, scale)`.
fn values<B: Backend, const D: usize>(shape: [usize; D], seed: u64, scale: f32) -> Tensor<B, D> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let n = shape.iter().product();
    let data: Vec<f32> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_data(TensorData::new(data, shape), &Default::default())
}

fn batch(rank: usize, step: usize) -> Tensor<AD, 2> {
    values([3, 5], 100 + 10 * step as u64 + rank as u64, 1.0)
}

fn adamw() -> AdamWConfig {
    AdamWConfig::new().with_weight_decay(0.1)
}

fn weights(net: &Net<AD>) -> Vec<Vec<f32>> {
    [&net.first, &net.second, &net.extra]
        .iter()
        .map(|p| f32s(p.val()))
        .collect()
}

/// The values of `tensor`, whatever its float dtype, widened to f32.
fn f32s<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Vec<f32> {
    tensor.cast(DType::F32).into_data().to_vec().unwrap()
}

/// `values` rounded to `dtype` and back.
fn rounded(values: &[f32], dtype: DType) -> Vec<f32> {
    let tensor = Tensor::<Flex, 1>::from_floats(values, &Default::default());
    f32s(tensor.cast(dtype))
}

/// Every rank's weights after 3 steps of DDP with AdamW. A weight used twice is reduced in two
/// parts in the first overlapped backward and whole after, so `overlap` changes the rounding.
fn ddp(world: usize, overlap: bool) -> Vec<Vec<Vec<f32>>> {
    let results = launch(world, |ctx| {
        let config = DdpConfig::new().with_overlap(overlap);
        let mut ddp = DistributedDataParallel::new(Net::new(), ctx.world().clone(), config)?;
        let mut optimizer = adamw().init();
        for step in 0..3 {
            let loss = ddp.module().loss(batch(ctx.rank(), step), true);
            let grads = ddp.backward(loss)?;
            ddp.step(&mut optimizer, 0.01, grads);
        }
        Ok::<_, burn_ddp::DdpError>(weights(ddp.module()))
    });
    results.into_iter().map(|r| r.unwrap()).collect()
}

/// Every rank's weights after 3 steps of ZeRO stage 1 or 2.
fn sharded(world: usize, stage: ZeroStage, config: ZeroConfig) -> Vec<Vec<Vec<f32>>> {
    let results = launch(world, |ctx| {
        let comm = ctx.world().clone();
        let mut zero = ShardedDataParallel::new(Net::new(), comm, stage, &adamw(), config.clone())?;
        for step in 0..3 {
            let loss = zero.module().loss(batch(ctx.rank(), step), true);
            zero.backward(loss)?;
            assert_eq!(zero.step(0.01)?, StepOutcome::Applied);
        }
        Ok::<_, ZeroError>(weights(zero.module()))
    });
    results.into_iter().map(|r| r.unwrap()).collect()
}

#[test]
fn a_weight_used_twice_small_buckets_and_offload_give_ddps_bits() {
    for world in [2, 3] {
        let reference = [ddp(world, false), ddp(world, true)];
        for stage in [ZeroStage::OptimizerState, ZeroStage::Gradients] {
            for (what, config) in [
                ("default", ZeroConfig::new()),
                ("no overlap", ZeroConfig::new().with_overlap(false)),
                // One parameter per unit: 25 elements, padded to a multiple of the ranks.
                (
                    "one parameter per unit",
                    ZeroConfig::new().with_bucket_cap_bytes(1),
                ),
                ("offload", ZeroConfig::new().with_offload(true)),
            ] {
                let reference = &reference[config.overlap as usize];
                let got = sharded(world, stage, config);
                assert_eq!(&got, reference, "stage {stage} at {world} ranks, {what}");
            }
        }
    }
}

#[test]
fn a_parameter_without_gradient_is_named_on_every_rank() {
    let results = launch(2, |ctx| {
        let comm = ctx.world().clone();
        let mut zero = ShardedDataParallel::new(
            Net::<AD>::new(),
            comm,
            ZeroStage::Gradients,
            &adamw(),
            ZeroConfig::new(),
        )?;
        let loss = zero.module().loss(batch(ctx.rank(), 0), ctx.rank() == 0);
        zero.backward(loss)
    });
    for result in results {
        let message = format!("{:?}", result.unwrap_err());
        assert!(
            message.contains("extra") && message.contains("[1]"),
            "{message}"
        );
    }
}

#[test]
fn misuse_is_refused_with_a_sentence() {
    let results = launch(1, |ctx| {
        let comm = ctx.world().clone();
        let refused = ShardedDataParallel::new(
            Net::<AD>::new(),
            comm.clone(),
            ZeroStage::Parameters,
            &adamw(),
            ZeroConfig::new(),
        )
        .err()
        .expect("stage 3 is the fully sharded engine's");
        assert!(
            refused.to_string().contains("FullyShardedDataParallel"),
            "{refused}"
        );
        let mut zero = ShardedDataParallel::new(
            Net::<AD>::new(),
            comm.clone(),
            ZeroStage::OptimizerState,
            &adamw(),
            ZeroConfig::new(),
        )?;
        let early = zero.step(0.01).unwrap_err();
        assert!(early.to_string().contains("call backward first"), "{early}");
        let clipping = adamw().with_grad_clipping(Some(GradientClippingConfig::Norm(1.0)));
        for stage in [ZeroStage::OptimizerState, ZeroStage::Gradients] {
            let refused = ShardedDataParallel::new(
                Net::<AD>::new(),
                comm.clone(),
                stage,
                &clipping,
                ZeroConfig::new(),
            )
            .err()
            .expect("clipping is refused, not ignored");
            assert!(refused.to_string().contains("grad_clipping"), "{refused}");
        }
        Ok::<_, ZeroError>(())
    });
    results.into_iter().for_each(|r| r.unwrap());
}

/// `tanh(x W)` (then `tanh(. T)` with a weight `T` tied to another unit's), or its mean
/// square when it is the last unit.
#[derive(Module, Debug)]
struct Layer<B: Backend> {
    weight: Param<Tensor<B, 2>>,
    tied: Option<Param<Tensor<B, 2>>>,
    last: bool,
}

impl<B: AutodiffBackend> PipelineStage<B> for Layer<B> {
    type Batch = Tensor<B, 3>;
    type Error = ZeroError;

    fn forward(
        &self,
        input: Option<Tensor<B, 3>>,
        batch: &Tensor<B, 3>,
    ) -> Result<StageOutput<B>, ZeroError> {
        let weight = self.weight.val();
        let x = input.unwrap_or_else(|| batch.clone().cast(weight.dtype()));
        let mut y = x.matmul(weight.unsqueeze()).tanh();
        if let Some(tied) = &self.tied {
            y = y.matmul(tied.val().unsqueeze()).tanh();
        }
        Ok(if self.last {
            StageOutput::Loss(y.powi_scalar(2).mean())
        } else {
            StageOutput::Activation(y)
        })
    }
}

fn layers(n: usize, early_loss: bool) -> Vec<Layer<AD>> {
    (0..n)
        .map(|i| Layer {
            weight: Param::from_tensor(values([5, 5], 7 + i as u64, 0.6)),
            tied: None,
            last: i + 1 == n || (early_loss && i == 0),
        })
        .collect()
}

/// A way to tie a unit's `tied` field to a unit's weight.
type Tie = fn(Vec<Layer<AD>>) -> Vec<Layer<AD>>;

/// Unit `to` of `chain` reads unit `from`'s weight again (the same parameter).
fn tie(mut chain: Vec<Layer<AD>>, from: usize, to: usize) -> Vec<Layer<AD>> {
    chain[to].tied = Some(chain[from].weight.clone());
    chain
}

/// The last of 3 units reads the first's weight.
fn tie_last_to_first(chain: Vec<Layer<AD>>) -> Vec<Layer<AD>> {
    tie(chain, 0, 2)
}

/// The second of 3 units uses its own weight twice.
fn tie_within_one_unit(chain: Vec<Layer<AD>>) -> Vec<Layer<AD>> {
    tie(chain, 1, 1)
}

/// `chain`'s weights after 3 steps on one device, on every rank's batches at once, stepped by
/// burn's AdamW. burn steps a parameter once per id, so a tied copy is put back after each.
fn chain_on_one_device(
    mut chain: Vec<Layer<AD>>,
    world: usize,
    retie: Option<Tie>,
) -> Vec<Vec<f32>> {
    let mut adam = adamw().init::<AD, Vec<Layer<AD>>>();
    for step in 0..3 {
        let x = Tensor::cat((0..world).map(|r| batch(r, step).unsqueeze()).collect(), 0);
        let mut input = None;
        let mut loss = None;
        for layer in &chain {
            match layer.forward(input.take(), &x).unwrap() {
                StageOutput::Activation(y) => input = Some(y),
                StageOutput::Loss(l) => loss = Some(l),
                StageOutput::ActivationAndLoss(..) => unreachable!("no layer adds a loss"),
            }
        }
        let grads = GradientsParams::from_grads(loss.unwrap().backward(), &chain);
        chain = Optimizer::step(&mut adam, 0.01, chain, grads);
        if let Some(retie) = retie {
            chain = retie(chain);
        }
    }
    chain.iter().map(|l| f32s(l.weight.val())).collect()
}

/// A rank's units' weights, and each unit's tied copy if it has one.
type ChainWeights = (Vec<Vec<f32>>, Vec<Option<Vec<f32>>>);

/// Every rank's weights after 3 steps of ZeRO-3.
fn chain_fully_sharded(world: usize, tie: Option<Tie>) -> Vec<ChainWeights> {
    let results = launch(world, |ctx| {
        let chain = layers(3, false);
        let chain = match tie {
            Some(tie) => tie(chain),
            None => chain,
        };
        let mut fsdp =
            FullyShardedDataParallel::new(chain, ctx.world().clone(), &adamw(), ZeroConfig::new())?;
        // A tied weight is sharded once.
        let held: usize = fsdp.layout().units.iter().map(|u| u.numel).sum();
        assert_eq!(held, 3 * 25);
        for step in 0..3 {
            fsdp.forward_backward(&batch(ctx.rank(), step).unsqueeze(), 1.0)?;
            assert_eq!(fsdp.step(0.01)?, StepOutcome::Applied);
        }
        let full = fsdp.full()?;
        let copies = full.iter().map(|l| l.tied.as_ref().map(|t| f32s(t.val())));
        Ok::<_, ZeroError>((
            full.iter().map(|l| f32s(l.weight.val())).collect(),
            copies.collect(),
        ))
    });
    results.into_iter().map(|r| r.unwrap()).collect()
}

fn assert_close_weights(got: &[Vec<f32>], want: &[Vec<f32>]) {
    for (g, w) in got.iter().zip(want) {
        for (a, b) in g.iter().zip(w) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1e-2), "{a} vs {b}");
        }
    }
}

#[test]
fn fully_sharded_units_train_like_one_device_and_refuse_an_early_loss() {
    let world = 2;
    let want = chain_on_one_device(layers(3, false), world, None);
    for (got, copies) in chain_fully_sharded(world, None) {
        assert_close_weights(&got, &want);
        assert!(copies.iter().all(Option::is_none));
    }

    let results = launch(world, |ctx| {
        let mut fsdp = FullyShardedDataParallel::new(
            layers(3, true),
            ctx.world().clone(),
            &adamw(),
            ZeroConfig::new(),
        )?;
        fsdp.forward_backward(&batch(ctx.rank(), 0).unsqueeze(), 1.0)
            .map(|_| ())
    });
    for result in results {
        let message = format!("{:?}", result.unwrap_err());
        assert!(
            message.contains("only the last unit returns the loss"),
            "{message}"
        );
    }
}

#[test]
fn a_weight_tied_across_units_or_used_twice_in_one_is_sharded_once_with_both_gradients() {
    let world = 2;
    let untied = chain_on_one_device(layers(3, false), world, None);
    let ties: [(Tie, usize, usize); 2] = [(tie_last_to_first, 0, 2), (tie_within_one_unit, 1, 1)];
    for (tie, from, to) in ties {
        let want = chain_on_one_device(tie(layers(3, false)), world, Some(tie));
        assert!(moved(&want, &untied) > 1e-4, "the tie changes the training");
        for (got, copies) in chain_fully_sharded(world, Some(tie)) {
            assert_close_weights(&got, &want);
            // The tied use reads the weight as stepped.
            assert_eq!(copies[to].as_ref(), Some(&got[from]));
        }
    }
    // The same id with another shape is not a tied weight.
    let results = launch(world, |ctx| {
        let mut chain = layers(3, false);
        let id = chain[0].weight.id;
        chain[2].tied = Some(Param::initialized(
            id,
            values([5, 4], 3, 0.5).require_grad(),
        ));
        FullyShardedDataParallel::new(chain, ctx.world().clone(), &adamw(), ZeroConfig::new())
            .map(|_| ())
    });
    for result in results {
        let message = format!("{:?}", result.unwrap_err());
        assert!(
            message.contains("`tied` of unit 2 has the id of `weight` of unit 0"),
            "{message}"
        );
    }
}

/// Mean absolute difference.
fn moved(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let pairs: Vec<(f32, f32)> = a
        .iter()
        .flatten()
        .copied()
        .zip(b.iter().flatten().copied())
        .collect();
    pairs.iter().map(|(x, y)| (x - y).abs()).sum::<f32>() / pairs.len() as f32
}

/// Steps of AdamW at `LR` move a weight by about `LR` each, far below bf16's half spacing near
/// 0.5 (2^-10): bf16 weights stepped on their own would not move at all.
const LR: f64 = 1e-5;

#[test]
fn sixteen_bit_parameters_are_the_rounded_master_weights_which_keep_small_updates() {
    let precision = || ZeroConfig::new().with_precision(Some(MixedPrecision::bf16()));
    let check = |start: &[Vec<f32>], params: &[Vec<f32>], master: &[Vec<f32>], what: &str| {
        for (p, m) in params.iter().zip(master) {
            assert_eq!(
                p,
                &rounded(m, DType::BF16),
                "{what}: parameters are the rounded master"
            );
        }
        // The master holds what bf16 cannot: nearly every element lies between bf16 values.
        let as_bf16: Vec<Vec<f32>> = master.iter().map(|m| rounded(m, DType::BF16)).collect();
        let total = master.iter().map(Vec::len).sum::<usize>();
        let between = moved_count(master, &as_bf16);
        assert!(
            between * 10 > total * 9,
            "{what}: {between} of {total} master weights are not bf16 values"
        );
        // And it moved by the sum of the small updates, from the exact fp32 start.
        let moved = moved(start, master);
        assert!(
            (5.0 * LR as f32..100.0 * LR as f32).contains(&moved),
            "{what}: master moved {moved:e} on average"
        );
    };
    for stage in [ZeroStage::OptimizerState, ZeroStage::Gradients] {
        let results = launch(2, |ctx| {
            let comm = ctx.world().clone();
            let mut zero =
                ShardedDataParallel::new(Net::new(), comm, stage, &adamw(), precision())?;
            for step in 0..30 {
                let x = batch(ctx.rank(), step).cast(DType::BF16);
                zero.backward(zero.module().loss(x, true))?;
                assert_eq!(zero.step(LR)?, StepOutcome::Applied);
            }
            Ok::<_, ZeroError>((weights(zero.module()), weights(&zero.master_module()?)))
        });
        let start = weights(&Net::new());
        let results: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(results[0], results[1], "stage {stage}: ranks agree");
        check(
            &start,
            &results[0].0,
            &results[0].1,
            &format!("stage {stage}"),
        );
    }
    let results = launch(2, |ctx| {
        let mut fsdp = FullyShardedDataParallel::new(
            layers(3, false),
            ctx.world().clone(),
            &adamw(),
            precision(),
        )?;
        for step in 0..30 {
            fsdp.forward_backward(&batch(ctx.rank(), step).unsqueeze(), 1.0)?;
            assert_eq!(fsdp.step(LR)?, StepOutcome::Applied);
        }
        let of = |units: Vec<Layer<AD>>| {
            units
                .into_iter()
                .map(|l| f32s(l.weight.val()))
                .collect::<Vec<_>>()
        };
        let (full, master) = (of(fsdp.full()?), of(fsdp.full_master()?));
        // At the end of training, the same masters with the optimizer let go first.
        assert_eq!(of(fsdp.into_full_master()?), master);
        Ok::<_, ZeroError>((full, master))
    });
    let start: Vec<_> = layers(3, false)
        .into_iter()
        .map(|l| f32s(l.weight.val()))
        .collect();
    let results: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(results[0], results[1], "stage 3: ranks agree");
    check(&start, &results[0].0, &results[0].1, "stage 3");
}

fn moved_count(a: &[Vec<f32>], b: &[Vec<f32>]) -> usize {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .filter(|(x, y)| x != y)
        .count()
}

#[test]
fn an_f16_overflow_on_one_rank_skips_the_step_on_every_rank_and_backs_the_scale_off() {
    let scale = LossScaleConfig::new()
        .with_init_scale(2f64.powi(40))
        .with_backoff_factor(2f64.powi(-8));
    let config =
        ZeroConfig::new().with_precision(Some(MixedPrecision::f16().with_loss_scale(Some(scale))));
    let results = launch(2, |ctx| {
        let comm = ctx.world().clone();
        let mut zero = ShardedDataParallel::new(
            Net::new(),
            comm,
            ZeroStage::Gradients,
            &adamw(),
            config.clone(),
        )?;
        let start = weights(zero.module());
        let mut outcomes = Vec::new();
        for step in 0..6 {
            let loss = zero
                .module()
                .loss(batch(ctx.rank(), step).cast(DType::F16), true);
            // Rank 0's gradients stay finite (zero); only rank 1's overflow.
            let loss = if ctx.rank() == 0 { loss * 0.0 } else { loss };
            zero.backward(loss)?;
            let outcome = zero.step(0.01)?;
            if matches!(outcome, StepOutcome::Skipped { .. }) {
                assert_eq!(
                    weights(zero.module()),
                    start,
                    "a skipped step changes nothing"
                );
            }
            outcomes.push(outcome);
        }
        let changed = weights(zero.module()) != start;
        Ok::<_, ZeroError>((outcomes, changed, zero.loss_scale()))
    });
    let results: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(results[0], results[1], "every rank skips the same steps");
    let (outcomes, changed, _) = &results[0];
    assert_eq!(
        outcomes[0],
        StepOutcome::Skipped {
            loss_scale: 2f64.powi(40),
            next_loss_scale: 2f64.powi(32)
        }
    );
    assert!(outcomes.contains(&StepOutcome::Applied), "{outcomes:?}");
    assert!(changed, "the applied steps moved the weights");
}

#[test]
fn an_overflow_group_makes_ranks_holding_other_parts_of_the_model_skip_together() {
    let scale = LossScaleConfig::new().with_init_scale(2f64.powi(10));
    let config =
        ZeroConfig::new().with_precision(Some(MixedPrecision::f16().with_loss_scale(Some(scale))));
    let results = launch(2, |ctx| {
        // Each rank its own data-parallel group of one, as two pipeline stages are; only rank
        // 1's gradients overflow (a factor past f16's 65504).
        let alone = ctx.world().split("dp", ctx.rank())?;
        let step = |agree: bool| {
            let mut zero = ShardedDataParallel::new(
                Net::new(),
                alone.clone(),
                ZeroStage::Gradients,
                &adamw(),
                config.clone(),
            )?;
            if agree {
                zero = zero.with_overflow_group(ctx.world().clone());
            }
            let loss = zero
                .module()
                .loss(batch(ctx.rank(), 0).cast(DType::F16), true);
            zero.backward(loss * if ctx.rank() == 0 { 1e-3 } else { 1e6 })?;
            zero.step(0.01)
        };
        Ok::<_, ZeroError>((step(false)?, step(true)?))
    });
    let results: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    let skipped = |o: &StepOutcome| matches!(o, StepOutcome::Skipped { .. });
    assert_eq!(results[0].0, StepOutcome::Applied, "alone, rank 0 steps");
    assert!(skipped(&results[1].0), "{:?}", results[1].0);
    assert!(
        skipped(&results[0].1) && skipped(&results[1].1),
        "{results:?}"
    );
}

#[test]
fn gradients_from_outside_at_the_engines_loss_scale_match_its_own_backward() {
    let config = ZeroConfig::new()
        .with_overlap(false)
        .with_precision(Some(MixedPrecision::f16()));
    let results = launch(2, |ctx| {
        let comm = ctx.world().clone();
        let stage = ZeroStage::OptimizerState;
        let new =
            || ShardedDataParallel::new(Net::new(), comm.clone(), stage, &adamw(), config.clone());
        let (mut inside, mut outside) = (new()?, new()?);
        let mut outcomes = Vec::new();
        for step in 0..6 {
            let x = || batch(ctx.rank(), step).cast(DType::F16);
            inside.backward(inside.module().loss(x(), true))?;
            let scale = outside.loss_scale().expect("f16 scales its loss");
            let grads = (outside.module().loss(x(), true) * scale).backward();
            let grads = GradientsParams::from_grads(grads, outside.module());
            if step == 0 {
                let unscaled = outside.add_gradients(GradientsParams::new(), 1.0);
                let refused = unscaled.unwrap_err().to_string();
                assert!(refused.contains("loss scale 1"), "{refused}");
            }
            outside.add_gradients(grads, scale)?;
            let outcome = inside.step(0.01)?;
            assert_eq!(outside.step(0.01)?, outcome, "step {step}");
            outcomes.push(outcome);
        }
        // 2^16 overflows this net's f16 gradients at first: both skip, then both apply.
        assert!(outcomes.contains(&StepOutcome::Applied), "{outcomes:?}");
        Ok::<_, ZeroError>((weights(inside.module()), weights(outside.module())))
    });
    for result in results {
        let (inside, outside) = result.unwrap();
        assert_eq!(inside, outside);
    }
}

/// ZeroAdamW (ZeRO-1 as a burn `Optimizer`) given DDP's averaged gradients steps every replica
/// exactly as burn's AdamW does, holding 1/world of the moments on each rank.
#[test]
fn zero_adamw_matches_burn_s_adamw_with_a_shard_of_the_state() {
    let run = |world: usize, sharded: bool| {
        launch(world, |ctx| {
            let comm = ctx.world().clone();
            let mut ddp = DistributedDataParallel::new(Net::new(), comm.clone(), DdpConfig::new())?;
            let mut zero = burn_zero::ZeroAdamW::new(&adamw(), comm.clone()).unwrap();
            let mut plain = adamw().init::<AD, Net<AD>>();
            for step in 0..3 {
                let loss = ddp.module().loss(batch(ctx.rank(), step), true);
                let grads = ddp.backward(loss)?;
                if sharded {
                    ddp.step(&mut zero, 1e-2, grads);
                } else {
                    ddp.step(&mut plain, 1e-2, grads);
                }
            }
            Ok::<_, burn_ddp::DdpError>((weights(ddp.module()), zero.state_bytes()))
        })
        .into_iter()
        .map(|r| r.unwrap())
        .collect::<Vec<_>>()
    };
    for world in [2, 3] {
        let plain = run(world, false);
        let zero = run(world, true);
        // 75 parameters padded to a multiple of the group, two fp32 moments of one share.
        let shard = 75usize.div_ceil(world);
        for (rank, ((want, _), (got, state))) in plain.iter().zip(&zero).enumerate() {
            assert_eq!(got, want, "rank {rank} of {world}");
            assert_eq!(
                *state,
                2 * 4 * shard,
                "rank {rank} of {world} holds its share"
            );
        }
    }
}

/// ZeroAdamW with gradient sharding (ZeRO-2) given each rank's own gradients reduce-scatters
/// them itself and steps every replica as burn's AdamW does on the averaged gradients, bit for
/// bit (averaged whole after backward, as `GradientSync::average` does: DDP's buckets average
/// a weight used twice in two parts, which rounds otherwise).
#[test]
fn zero_adamw_with_gradient_sharding_averages_each_rank_s_own_gradients() {
    for world in [2, 3] {
        let results = launch(world, |ctx| {
            let comm = ctx.world().clone();
            let mut plain = adamw().init::<AD, Net<AD>>();
            let mut zero2 = burn_zero::ZeroAdamW::new(&adamw(), comm.clone())
                .unwrap()
                .with_gradient_sharding();
            let (mut averaged, mut own) = (Net::new(), Net::new());
            let mut sync = burn_ddp::GradientSync::new(&averaged, comm.clone(), DdpConfig::new())?;
            for step in 0..3 {
                let loss = averaged.loss(batch(ctx.rank(), step), true);
                let grads = GradientsParams::from_grads(loss.backward(), &averaged);
                let grads = sync.average(&averaged, grads)?;
                averaged = plain.step(1e-2, averaged, grads);
                let loss = own.loss(batch(ctx.rank(), step), true);
                let grads = GradientsParams::from_grads(loss.backward(), &own);
                own = zero2.step(1e-2, own, grads);
            }
            Ok::<_, burn_ddp::DdpError>((weights(&averaged), weights(&own), zero2.state_bytes()))
        });
        let shard = 75usize.div_ceil(world);
        for (rank, result) in results.into_iter().enumerate() {
            let (want, got, state) = result.unwrap();
            assert_eq!(got, want, "rank {rank} of {world}");
            assert_eq!(
                state,
                2 * 4 * shard,
                "rank {rank} of {world} holds its share"
            );
        }
    }
}

/// Under ZeRO-2 a gradient one rank lacks fails every rank together, naming it, rather than
/// leave the others waiting in the reduce-scatter.
#[test]
fn zero_2_with_a_gradient_missing_on_one_rank_fails_every_rank_naming_it() {
    let config = burn_comm::LaunchConfig::new(2).with_timeout(std::time::Duration::from_secs(20));
    let results = burn_comm::launch_with(config, |ctx| {
        let comm = ctx.world().clone();
        let mut zero2 = burn_zero::ZeroAdamW::new(&adamw(), comm)
            .unwrap()
            .with_gradient_sharding();
        let net = Net::<AD>::new();
        // Rank 1's batch does not use `extra`.
        let loss = net.loss(batch(ctx.rank(), 0), ctx.rank() == 0);
        let grads = GradientsParams::from_grads(loss.backward(), &net);
        let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            zero2.step(1e-2, net, grads);
        }));
        Ok::<_, burn_comm::CommError>(
            stepped
                .err()
                .map(|panic| panic.downcast_ref::<String>().cloned().unwrap_or_default()),
        )
    });
    for (rank, result) in results.into_iter().enumerate() {
        let message = result
            .unwrap()
            .unwrap_or_else(|| panic!("rank {rank} stepped"));
        assert!(
            message.contains("extra") && message.contains("[1]"),
            "rank {rank}: {message}"
        );
    }
}

/// Each parameter's whole fp32 weights, assembled from every rank's state (`unit_of` names the
/// unit of each range, for engines whose names repeat across units).
fn assemble(states: &[ShardState], unit_of: &[Vec<usize>]) -> Vec<((usize, String), Vec<f32>)> {
    let mut whole: Vec<((usize, String), Vec<f32>)> = Vec::new();
    for (state, units) in states.iter().zip(unit_of) {
        for ((range, weights), &unit) in state.ranges.iter().zip(&state.weights).zip(units) {
            let key = (unit, range.name.clone());
            let at = match whole.iter().position(|(k, _)| *k == key) {
                Some(at) => at,
                None => {
                    whole.push((key, vec![f32::NAN; range.shape.iter().product()]));
                    whole.len() - 1
                }
            };
            let values = weights.to_vec::<f32>().unwrap();
            whole[at].1[range.range.clone()].copy_from_slice(&values);
        }
    }
    whole.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(
        whole.iter().all(|(_, v)| v.iter().all(|x| !x.is_nan())),
        "every element is in some rank's state"
    );
    whole
}

fn matrix(values: &[f32]) -> Param<Tensor<AD, 2>> {
    Param::from_tensor(Tensor::from_data(
        TensorData::new(values.to_vec(), [5, 5]),
        &Default::default(),
    ))
}

#[test]
fn a_shard_state_restored_into_a_new_engine_continues_the_run_bit_for_bit() {
    let world = 2;
    let bf16 = || ZeroConfig::new().with_precision(Some(MixedPrecision::bf16()));
    for (stage, config) in [
        (ZeroStage::OptimizerState, ZeroConfig::new()),
        (ZeroStage::Gradients, bf16()),
    ] {
        let engine = |net: Net<AD>, comm| {
            ShardedDataParallel::new(net, comm, stage, &adamw(), config.clone())
        };
        let train =
            |zero: &mut ShardedDataParallel<AD, Net<AD>>, rank, steps: std::ops::Range<usize>| {
                for step in steps {
                    let dtype = zero.module().first.val().dtype();
                    let loss = zero.module().loss(batch(rank, step).cast(dtype), true);
                    zero.backward(loss)?;
                    assert_eq!(zero.step(0.01)?, StepOutcome::Applied);
                }
                Ok::<_, ZeroError>(())
            };
        let whole = launch(world, |ctx| {
            let mut zero = engine(Net::new(), ctx.world().clone())?;
            train(&mut zero, ctx.rank(), 0..3)?;
            Ok::<_, ZeroError>(weights(zero.module()))
        });
        let states: Vec<ShardState> = launch(world, |ctx| {
            let mut zero = engine(Net::new(), ctx.world().clone())?;
            train(&mut zero, ctx.rank(), 0..2)?;
            let state = zero.shard_state();
            assert_eq!(state.steps, 2);
            Ok::<_, ZeroError>(state)
        })
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
        let params = assemble(&states, &vec![vec![0; 3]; world]);
        let resumed = launch(world, |ctx| {
            let value = |name: &str| &params.iter().find(|((_, n), _)| n == name).unwrap().1;
            let net = Net {
                first: matrix(value("first")),
                second: matrix(value("second")),
                extra: matrix(value("extra")),
            };
            let mut zero = engine(net, ctx.world().clone())?;
            let state = &states[ctx.rank()];
            assert_eq!(zero.shard_ranges(), state.ranges);
            zero.restore_state(state.moments.as_ref(), state.steps, state.loss_scale)?;
            train(&mut zero, ctx.rank(), 2..3)?;
            Ok::<_, ZeroError>(weights(zero.module()))
        });
        for (a, b) in whole.into_iter().zip(resumed) {
            assert_eq!(a.unwrap(), b.unwrap(), "{stage:?}");
        }
    }
    // ZeRO-3: every unit's weights named within it.
    let whole = chain_fully_sharded(world, None);
    let states: Vec<(ShardState, Vec<usize>)> = launch(world, |ctx| {
        let mut fsdp = FullyShardedDataParallel::new(
            layers(3, false),
            ctx.world().clone(),
            &adamw(),
            ZeroConfig::new(),
        )?;
        for step in 0..2 {
            fsdp.forward_backward(&batch(ctx.rank(), step).unsqueeze(), 1.0)?;
            assert_eq!(fsdp.step(0.01)?, StepOutcome::Applied);
        }
        Ok::<_, ZeroError>((fsdp.shard_state(), fsdp.shard_range_units()))
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect();
    let units: Vec<Vec<usize>> = states.iter().map(|(_, u)| u.clone()).collect();
    let states: Vec<ShardState> = states.into_iter().map(|(s, _)| s).collect();
    let params = assemble(&states, &units);
    let resumed = launch(world, |ctx| {
        let mut chain = layers(3, false);
        for (u, layer) in chain.iter_mut().enumerate() {
            let value = &params.iter().find(|((unit, _), _)| *unit == u).unwrap().1;
            layer.weight = matrix(value);
        }
        let mut fsdp =
            FullyShardedDataParallel::new(chain, ctx.world().clone(), &adamw(), ZeroConfig::new())?;
        let state = &states[ctx.rank()];
        fsdp.restore_state(state.moments.as_ref(), state.steps, state.loss_scale)?;
        fsdp.forward_backward(&batch(ctx.rank(), 2).unsqueeze(), 1.0)?;
        assert_eq!(fsdp.step(0.01)?, StepOutcome::Applied);
        let full = fsdp.full()?;
        Ok::<_, ZeroError>(
            full.iter()
                .map(|l| f32s(l.weight.val()))
                .collect::<Vec<_>>(),
        )
    });
    for ((want, _), got) in whole.into_iter().zip(resumed) {
        assert_eq!(want, got.unwrap(), "ZeRO-3");
    }
}

/// A state's weights and moments, flat, in order.
fn state_values(state: &ShardState) -> Vec<Vec<f32>> {
    let moments = state.moments.iter().flatten().flatten();
    state
        .weights
        .iter()
        .chain(moments)
        .map(|d| d.to_vec::<f32>().unwrap())
        .collect()
}

/// Every moment of `state` is held in host memory where the optimizer is `offloaded` (handed
/// in where it is, not moved to the device), and on the device otherwise; its weights in host
/// memory exactly where `weights_on_host`.
fn assert_held_where<B: Backend>(
    state: &ShardState<StateTensor<B>>,
    offloaded: bool,
    weights_on_host: bool,
) {
    let on_host = |t: &StateTensor<B>| matches!(t, StateTensor::Host(_));
    let moments = state.moments.as_ref().expect("a step made the moments");
    assert!(!moments[0].is_empty(), "every rank holds a range");
    for moment in moments.iter().flatten() {
        assert_eq!(on_host(moment), offloaded, "a moment");
    }
    for weight in &state.weights {
        assert_eq!(on_host(weight), weights_on_host, "a weight");
    }
}

/// Each rank's state from `shard_tensors` taken before a step (read after it) is the state
/// `shard_state` copied then, and the step changed the state.
fn assert_held_through_the_step(
    results: Vec<Result<(ShardState, ShardState, ShardState), RankError<ZeroError>>>,
    what: &str,
) {
    for result in results {
        let (held, copied, after) = result.unwrap();
        assert_eq!(held.ranges, copied.ranges, "{what}");
        assert_eq!(state_values(&held), state_values(&copied), "{what}");
        assert_ne!(
            state_values(&after),
            state_values(&copied),
            "{what}: the step changed nothing"
        );
    }
}

#[test]
fn shard_tensors_taken_before_a_step_keep_their_values_through_it() {
    let world = 2;
    let bf16 = || ZeroConfig::new().with_precision(Some(MixedPrecision::bf16()));
    for (stage, config) in [
        (ZeroStage::OptimizerState, ZeroConfig::new()),
        (ZeroStage::Gradients, bf16()),
        (ZeroStage::Gradients, ZeroConfig::new().with_offload(true)),
        (ZeroStage::Gradients, bf16().with_offload(true)),
    ] {
        let results = launch(world, |ctx| {
            let mut zero = ShardedDataParallel::new(
                Net::new(),
                ctx.world().clone(),
                stage,
                &adamw(),
                config.clone(),
            )?;
            let step = |zero: &mut ShardedDataParallel<AD, Net<AD>>, step| {
                let dtype = zero.module().first.val().dtype();
                let loss = zero
                    .module()
                    .loss(batch(ctx.rank(), step).cast(dtype), true);
                zero.backward(loss)?;
                assert_eq!(zero.step(0.01)?, StepOutcome::Applied);
                Ok::<_, ZeroError>(())
            };
            step(&mut zero, 0)?;
            let (held, copied) = (zero.shard_tensors(), zero.shard_state());
            // Without a master copy, ZeRO-1/2 copies its part of the weights to host memory.
            let master = config.precision.is_some();
            assert_held_where(&held, config.offload, config.offload || !master);
            step(&mut zero, 1)?;
            Ok::<_, ZeroError>((held.into_host(), copied, zero.shard_state()))
        });
        assert_held_through_the_step(results, &format!("{stage:?} {config:?}"));
    }
    for config in [
        ZeroConfig::new(),
        bf16(),
        ZeroConfig::new().with_offload(true),
    ] {
        let results = launch(world, |ctx| {
            let mut fsdp = FullyShardedDataParallel::new(
                layers(3, false),
                ctx.world().clone(),
                &adamw(),
                config.clone(),
            )?;
            let step = |fsdp: &mut FullyShardedDataParallel<AD, Layer<AD>>, step| {
                fsdp.forward_backward(&batch(ctx.rank(), step).unsqueeze(), 1.0)?;
                assert_eq!(fsdp.step(0.01)?, StepOutcome::Applied);
                Ok::<_, ZeroError>(())
            };
            step(&mut fsdp, 0)?;
            let (held, copied) = (fsdp.shard_tensors(), fsdp.shard_state());
            // Without a master copy, ZeRO-3's weights are its shard, on the device.
            let master = config.precision.is_some();
            assert_held_where(&held, config.offload, config.offload && master);
            step(&mut fsdp, 1)?;
            Ok::<_, ZeroError>((held.into_host(), copied, fsdp.shard_state()))
        });
        assert_held_through_the_step(results, &format!("ZeRO-3 {config:?}"));
    }
}
