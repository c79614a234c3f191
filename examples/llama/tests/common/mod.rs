//! What the parity tests share: a training run recorded (losses and final weights) and the
//! comparison against the one-device oracle.
//!
//! Tolerances: the ranks sum in a different order than one device does (per-rank means then
//! an average, partial matmuls then an all-reduce), so float32 rounding differs. Losses must
//! agree to rtol 1e-5 at every step. Final weights must agree to rtol 1e-4 per tensor, in L2
//! norm: AdamW scales each element's step by that element's own gradient history, so the few
//! elements whose gradient is at rounding-noise level take visibly different steps (about 1
//! in 10^5 elements differs by more than 1e-4 relative, by at most ~1.5e-5 absolute).

#![allow(dead_code)]

use burn::tensor::TensorData;
use burn_zero::ZeroStage;
use llama::LlamaConfig;
use llama::data::MarkovSource;
use llama::hf::export;
use llama::train::{StepMetrics, Strategy, TrainConfig};

pub struct Run {
    pub losses: Vec<f64>,
    pub weights: Vec<(String, TensorData)>,
    /// Model-state bytes rank 0 held in the last step, where the run reports them (ZeRO).
    pub model_state_bytes: Option<usize>,
    /// Every step's metrics.
    pub steps: Vec<StepMetrics>,
}

pub fn config(strategy: Strategy, dp: usize) -> TrainConfig {
    let mut config = TrainConfig::new(LlamaConfig::preset("tiny").unwrap(), 20);
    config.batch_size = 8;
    config.seq_len = 32;
    config.warmup_steps = 5;
    config.strategy = strategy;
    config.dp = dp;
    config
}

/// The ZeRO stages, 1 to 3.
pub const STAGES: [ZeroStage; 3] = [
    ZeroStage::OptimizerState,
    ZeroStage::Gradients,
    ZeroStage::Parameters,
];

/// `base` under ZeRO `stage` on `dp` data-parallel ranks.
pub fn zero(base: &TrainConfig, dp: usize, stage: ZeroStage) -> TrainConfig {
    let mut config = base.clone();
    config.strategy = Strategy::Ddp;
    config.dp = dp;
    config.zero = stage;
    config
}

pub fn run(config: &TrainConfig) -> Run {
    run_on(config, 4096)
}

pub fn run_on(config: &TrainConfig, samples: usize) -> Run {
    let data = MarkovSource::new(16, 3, config.seq_len, samples, 1);
    let mut steps = Vec::new();
    let model = llama::cpu::train(config, &data, &mut |m| {
        steps.push(*m);
    })
    .unwrap();
    Run {
        losses: steps.iter().map(|m| m.loss).collect(),
        weights: export(&model),
        model_state_bytes: steps.last().and_then(|m| m.model_state_bytes),
        steps,
    }
}

/// Asserts that `a` and `b` computed the same bits: every loss and every final weight.
pub fn assert_same_bits(a: &Run, b: &Run, what: &str) {
    assert_eq!(a.losses, b.losses, "{what}: losses differ");
    assert!(a.weights == b.weights, "{what}: weights differ");
}

/// Asserts the tolerances above, and prints the largest deviations seen (with `--nocapture`).
pub fn assert_close(oracle: &Run, other: &Run, what: &str) {
    assert_within(oracle, other, what, 1e-5, 1e-4);
}

/// Losses within `loss_rtol` at every step and final weights within `weight_rtol` per tensor
/// (L2); prints the largest deviations seen.
pub fn assert_within(oracle: &Run, other: &Run, what: &str, loss_rtol: f64, weight_rtol: f64) {
    let (worst_loss, worst_weight) = deviations(oracle, other);
    assert!(
        worst_loss.relative <= loss_rtol,
        "{what}: loss at step {} is {}, one device has {}",
        worst_loss.at + 1,
        other.losses[worst_loss.at],
        oracle.losses[worst_loss.at],
    );
    assert!(
        worst_weight.relative <= weight_rtol,
        "{what}: {} differs from one device by {:e} relative (L2)",
        oracle.weights[worst_weight.at].0,
        worst_weight.relative
    );
    eprintln!(
        "{what}: losses within {:.1e}, weights within {:.1e} (relative)",
        worst_loss.relative, worst_weight.relative
    );
}

/// The largest relative deviation of a run from another, and where it is.
#[derive(Debug, Clone, Copy)]
pub struct Deviation {
    /// `|a - b| / |a|` for a loss, L2 norms for a weight.
    pub relative: f64,
    /// The step (from 0) or the weight's index.
    pub at: usize,
}

/// The largest deviation of `other` from `oracle`: of the losses, and of the final weights
/// per tensor (L2). Both runs must have the same steps and tensors.
pub fn deviations(oracle: &Run, other: &Run) -> (Deviation, Deviation) {
    let worst = |deviations: &mut dyn Iterator<Item = f64>| {
        deviations.enumerate().fold(
            Deviation {
                relative: 0.0,
                at: 0,
            },
            |worst, (at, relative)| {
                // A NaN is the worst of all, so that a run gone NaN fails.
                if relative.is_nan() || relative > worst.relative {
                    Deviation { relative, at }
                } else {
                    worst
                }
            },
        )
    };
    assert_eq!(oracle.losses.len(), other.losses.len());
    let loss = worst(
        &mut oracle
            .losses
            .iter()
            .zip(&other.losses)
            .map(|(a, b)| (a - b).abs() / a.abs()),
    );
    assert_eq!(oracle.weights.len(), other.weights.len());
    let weight = worst(&mut oracle.weights.iter().zip(&other.weights).map(
        |((name, a), (other_name, b))| {
            assert_eq!(name, other_name);
            let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
            assert_eq!(a.len(), b.len(), "{name} has another shape");
            let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
            let diff = norm(&mut a.iter().zip(&b).map(|(x, y)| (x - y) as f64));
            diff / norm(&mut a.iter().map(|&x| x as f64))
        },
    ));
    (loss, weight)
}
