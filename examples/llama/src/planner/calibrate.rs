//! `--cluster cpu`: this machine, measured. A rank of a CPU run is a thread computing on one
//! core with burn's CPU backend; a short calibration times what the cost model needs: its
//! multiplications (a large one and a small micro-batch's linear, for the rate and the
//! shape's effect) and an elementwise pass, each the fastest of several runs (what the core
//! can do, the VM's noise left out), an all-reduce between two thread ranks of the local
//! transport, and the forward and backward of a small reference model (not the planned one)
//! under burn's autodiff at two batch sizes, whose times against the model's from the raw
//! rates give what burn's training operations reach of them (transposed operands, unfused
//! elementwise work, the graph) and a fixed cost per block; and the same reference with its
//! MLPs made mixtures of 2 and of 8 experts, for what a mixture's block costs beyond that,
//! once (its routing) and per expert the rank holds.

use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, Int, Tensor};

use super::cluster::{Cluster, Link};
use super::search::burn_parallel;
use super::step_time::{Shape, StepLayout, step_time};
use crate::config::LlamaConfig;
use crate::model::{Llama, next_token_loss};

/// What the calibration measured on one core.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibration {
    /// Floating-point operations per second of a `[512, 512] x [512, 512]` product.
    pub large_matmul: f64,
    /// Of a `[64, 512] x [512, 512]` product (a linear of a small micro-batch).
    pub small_matmul: f64,
    /// Bytes per second an elementwise addition streams (two reads and a write).
    pub bandwidth: f64,
    /// Two thread ranks' all-reduce: bus bandwidth of 4 MB, latency per hop of 4 KB.
    pub link: Link,
    /// Cores the ranks share.
    pub cores: usize,
    /// How many times longer a training step's forward and backward takes under burn's
    /// autodiff than the cost model gives from the rates above, beyond a fixed cost per block
    /// (both measured on the reference at two batch sizes).
    pub overhead: f64,
    /// That fixed cost: seconds per block per forward and backward.
    pub block_overhead: f64,
    /// A mixture of experts' block's fixed cost beyond that, for its routing (measured on the
    /// reference with its MLPs made mixtures of 2 and of 8 experts).
    pub routing_overhead: f64,
    /// And for each expert it holds.
    pub expert_overhead: f64,
    /// How much slower each of `cores` ranks computes when all compute at once (shared
    /// memory bandwidth and caches, the machine's turbo).
    pub contention: f64,
}

/// The seconds of `f` over `reps` runs after two unmeasured, sorted.
fn seconds(reps: usize, mut f: impl FnMut()) -> Vec<f64> {
    f();
    f();
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times
}

/// The median of [`seconds`]: a training pass as a run sees it.
fn median_seconds(reps: usize, f: impl FnMut()) -> f64 {
    seconds(reps, f)[reps / 2]
}

/// The fastest of [`seconds`]: what a kernel can do, with the machine's noise left out.
fn best_seconds(reps: usize, f: impl FnMut()) -> f64 {
    seconds(reps, f)[0]
}

/// Measures this machine (a few seconds).
pub fn calibrate() -> Result<Calibration, String> {
    let device = Default::default();
    let random = |shape: [usize; 3]| {
        Tensor::<Flex, 3>::random(shape, Distribution::Normal(0.0, 1.0), &device)
    };
    let (a, b) = (random([1, 512, 512]), random([1, 512, 512]));
    let large = best_seconds(15, || {
        std::hint::black_box(a.clone().matmul(b.clone()));
    });
    let c = random([1, 64, 512]);
    let small = best_seconds(15, || {
        std::hint::black_box(c.clone().matmul(b.clone()));
    });
    let elements = 1 << 22;
    let (x, y) = (random([1, 1, elements]), random([1, 1, elements]));
    let add = best_seconds(15, || {
        std::hint::black_box(x.clone() + y.clone());
    });
    let link = measure_link()?;
    let mut calibration = Calibration {
        large_matmul: 2.0 * 512f64.powi(3) / large,
        small_matmul: 2.0 * 64.0 * 512f64.powi(2) / small,
        bandwidth: 3.0 * 4.0 * elements as f64 / add,
        link,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        overhead: 1.0,
        block_overhead: 0.0,
        routing_overhead: 0.0,
        expert_overhead: 0.0,
        contention: 1.0,
    };
    // The reference at two batch sizes: what grows with the work (the rates burn's
    // operations reach) and what does not (each block's fixed cost).
    let (model, seq) = reference();
    let modelled = |model: &LlamaConfig, cluster: &Cluster, batch| -> Result<f64, String> {
        let layout = StepLayout::data_parallel(1, batch, 1, seq);
        let shape = Shape::llama(model);
        Ok(step_time(&shape, cluster, &burn_parallel(false), &layout)?.compute)
    };
    let (small, large) = (1, 8);
    let (t_small, t_large) = (
        time_training_pass::<Autodiff<Flex>>(&model, small, seq),
        time_training_pass::<Autodiff<Flex>>(&model, large, seq),
    );
    let raw = Cluster::cpu(1, &calibration, 0);
    let (m_small, m_large) = (
        modelled(&model, &raw, small)?,
        modelled(&model, &raw, large)?,
    );
    let overhead = ((t_large - t_small) / (m_large - m_small)).max(0.1);
    calibration.overhead = overhead;
    let blocks = model.num_hidden_layers as f64;
    calibration.block_overhead = ((t_small - overhead * m_small) / blocks).max(0.0);
    // The reference's MLPs made mixtures of 2 and of 8 experts (of a quarter of its width,
    // top-2): what a block costs beyond the model calibrated so far, once and per expert.
    let calibrated = Cluster::cpu(1, &calibration, 0);
    let beyond = |experts: usize| -> Result<f64, String> {
        let mut moe = model.clone().with_num_local_experts(experts);
        moe.intermediate_size /= 4;
        let measured = time_training_pass::<Autodiff<Flex>>(&moe, large, seq);
        Ok(((measured - modelled(&moe, &calibrated, large)?) / blocks).max(0.0))
    };
    let (two, eight) = (beyond(2)?, beyond(8)?);
    calibration.expert_overhead = ((eight - two) / 6.0).max(0.0);
    calibration.routing_overhead = (two - 2.0 * calibration.expert_overhead).max(0.0);
    // Every core busy at once: what a rank gets when all are.
    let together = std::thread::scope(|scope| {
        let runs: Vec<_> = (0..calibration.cores)
            .map(|_| scope.spawn(|| time_training_pass::<Autodiff<Flex>>(&model, large, seq)))
            .collect();
        runs.into_iter()
            .map(|run| run.join().expect("a calibration thread"))
            .fold(0.0, f64::max)
    });
    calibration.contention = (together / t_large).max(1.0);
    Ok(calibration)
}

/// The calibration's reference: a small Llama (4 blocks of width 256) and its sequence
/// length, unlike the models planned (the calibration is of the machine and burn, not of a
/// model).
fn reference() -> (LlamaConfig, usize) {
    (LlamaConfig::new(256, 256, 704, 4, 4, 2), 64)
}

/// Median seconds of one forward and backward of `model` on `batch x seq` tokens, fp32.
fn time_training_pass<B: AutodiffBackend + burn_tensor_parallel::TpBackend>(
    model: &LlamaConfig,
    batch: usize,
    seq: usize,
) -> f64 {
    let device = Default::default();
    let llama = Llama::<B>::init(model, 1, &device);
    let tokens = Tensor::<B, 2, Int>::random(
        [batch, seq + 1],
        Distribution::Uniform(0.0, model.vocab_size as f64),
        &device,
    );
    let inputs = tokens.clone().slice([0..batch, 0..seq]);
    let targets = tokens.slice([0..batch, 1..seq + 1]);
    median_seconds(7, || {
        let logits = llama.forward(inputs.clone()).expect("a whole model");
        let grads = next_token_loss(logits, targets.clone()).backward();
        std::hint::black_box(grads);
    })
}

/// Two thread ranks' all-reduce through the local transport, large and small.
fn measure_link() -> Result<Link, String> {
    let results = burn_comm::launch(2, |ctx| {
        let comm = ctx.world();
        let device = Default::default();
        let time = |elements: usize| -> Result<f64, burn_comm::CommError> {
            let tensor = Tensor::<Flex, 1>::ones([elements], &device);
            let mut error = None;
            let seconds = median_seconds(7, || {
                if let Err(e) = comm.all_reduce(tensor.clone(), burn_comm::ReduceOp::Sum) {
                    error = Some(e);
                }
            });
            error.map_or(Ok(seconds), Err)
        };
        Ok::<_, burn_comm::CommError>((time(1 << 20)?, time(1 << 10)?))
    });
    let (large, small) = results
        .into_iter()
        .next()
        .expect("rank 0 reports")
        .map_err(|e| format!("calibrating the local transport: {e}"))?;
    // A ring all-reduce over 2 ranks moves the whole message once and takes 2 hops.
    Ok(Link {
        bandwidth: 4.0 * (1 << 20) as f64 / large,
        latency: small / 2.0,
    })
}

impl Cluster {
    /// This machine as `ranks` thread ranks: each computes at the calibrated single-core
    /// rates (less burn's overhead, and slowed by the others when there are several), and
    /// they share its cores and `memory`.
    /// The matmul rate's dependence on the smallest dimension is fitted through the two
    /// measured sizes (`rate(d) = peak d / (d + half)`).
    pub fn cpu(ranks: usize, calibration: &Calibration, memory: u64) -> Self {
        // With every core busy, each computes slower; ranks beyond the cores take turns
        // (the step time model shares the cores out).
        // The contention was measured with every core busy; fewer busy cores, less of it.
        let busy = ranks.min(calibration.cores);
        let share = match calibration.cores {
            1 => 1.0,
            cores => {
                let part = (busy - 1) as f64 / (cores - 1) as f64;
                1.0 / (1.0 + (calibration.contention - 1.0) * part)
            }
        };
        let (d1, d2) = (512.0, 64.0);
        // Solved from rate(d1) / rate(d2) = q: a small product no slower than a large one
        // means the shape costs nothing, and at q = d1 / d2 the curve has no finite fit, so
        // it is held below (rate nearly proportional to the dimension).
        let q = (calibration.large_matmul / calibration.small_matmul).clamp(1.0, 0.95 * d1 / d2);
        let half = d1 * d2 * (q - 1.0) / (d1 - q * d2);
        // burn's training operations reach `1 / overhead` of the raw rates.
        let peak = calibration.large_matmul * (d1 + half) / d1 / calibration.overhead;
        Self {
            name: format!("cpu ({} cores, measured)", calibration.cores),
            nodes: 1,
            devices_per_node: ranks,
            memory: memory / ranks as u64,
            peak_flops: peak * share,
            matmul_efficiency: 1.0,
            matmul_half_dim: half,
            memory_bandwidth: calibration.bandwidth * share / calibration.overhead,
            block_overhead: calibration.block_overhead / share,
            routing_overhead: calibration.routing_overhead / share,
            expert_overhead: calibration.expert_overhead / share,
            intra_node: calibration.link,
            inter_node: calibration.link,
            shared_cores: Some(calibration.cores),
        }
    }
}
