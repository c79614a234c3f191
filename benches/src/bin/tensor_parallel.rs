//! Tensor parallelism against single-device burn, measured in one run: the step time of the
//! plain burn loop (the baseline) and of the model split over tp 1, 2 and 4 ranks, with and
//! without sequence parallelism; per rank, the parameter bytes, the activation bytes the
//! forward pass leaves for backward, and the bytes communicated per step beside Megatron's
//! count (per layer: two all-reduces of the activations forward and two backward; under SP
//! an all-gather and a reduce-scatter in place of each all-reduce). At tp 2 the two are run
//! again with `--overlap` chunks of collective matmuls, which overlap that communication with
//! the linears' multiplications: the same bytes in more calls.
//!
//! Parameter bytes are the shards' sizes (each shard is its own copy). Activation bytes are
//! heap bytes held after the first forward pass minus those held before
//! it, over all ranks of the process, divided by tp: the activations kept for backward plus
//! the communication buffers they live in. Ranks are threads with one compute thread each, so
//! tp 4 on a 2-core machine is oversubscribed: its time shows correctness under load, not
//! scaling.
//!
//! `cargo run --release -p benches --bin tensor_parallel -- --help`

use std::time::Instant;

use benches::memory::{CountingAllocator, live_bytes};
use benches::{median, token_batch};
use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn_comm::{CommError, CommStats, Communicator, launch};
use burn_tensor_parallel::TensorParallel;
use clap::Parser;
use llama::data::MarkovSource;
use llama::parallel_plan::ParallelPlan;
use llama::train::{TrainConfig, TrainError};
use llama::{Llama, LlamaConfig};
use serde::Serialize;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

type B = Autodiff<Flex>;

#[derive(Parser)]
#[command(about = "Tensor and sequence parallelism against single-device burn")]
struct Args {
    /// Model preset.
    #[arg(long, default_value = "small")]
    model: String,
    /// Samples per step (the whole batch goes through every tensor-parallel rank).
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Tokens per sample.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// Steps per run; the first is not timed (it is where memory is measured).
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Rounds over all configurations; the medians pool the rounds.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Chunks of the collective matmuls in the overlapped tp 2 layouts.
    #[arg(long, default_value_t = 2)]
    overlap: usize,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/tensor_parallel.json")]
    json: String,
}

/// One layout: `None` is the plain single-device loop.
#[derive(Clone, Copy)]
struct Layout {
    tp: Option<usize>,
    sp: bool,
    /// Chunks of the collective matmuls; 0: communication and matmul one after the other.
    overlap: usize,
}

impl Layout {
    fn new(tp: Option<usize>, sp: bool, overlap: usize) -> Self {
        Self { tp, sp, overlap }
    }

    fn name(&self) -> String {
        let Some(tp) = self.tp else {
            return "single-device burn".into();
        };
        let mut name = format!("tp {tp}");
        if self.sp {
            name += " + sp";
        }
        if self.overlap > 0 {
            name += &format!(", overlap {}", self.overlap);
        }
        name
    }
}

/// What one run measured (rank 0's view; ranks are symmetric).
struct Measured {
    step_s: Vec<f64>,
    param_bytes: usize,
    activation_bytes: f64,
    stats: CommStats,
}

#[derive(Serialize)]
struct Row {
    name: String,
    ranks: usize,
    step_s: f64,
    speedup: f64,
    param_mb_per_rank: f64,
    activation_mb_per_rank: f64,
    activation_vs_base: f64,
    comm_calls_per_step: u64,
    comm_payload_mb_per_step: f64,
    theory_payload_mb_per_step: f64,
    payload_per_layer_mb: f64,
    ring_wire_mb_per_step: f64,
}

fn main() {
    let args = Args::parse();
    assert!(
        args.steps >= 2,
        "--steps must be at least 2: the first is not timed"
    );
    let config = benches::preset(&args.model);
    let data = MarkovSource::new(16, 3, args.seq_len, 4096, 1);
    println!(
        "{} ({:.1}M parameters, {} layers), batch {} x {} tokens, {} steps per run (1 not timed), {} rounds",
        args.model,
        config.num_params() as f64 / 1e6,
        config.num_hidden_layers,
        args.batch_size,
        args.seq_len,
        args.steps,
        args.repeats
    );
    let layouts = [
        Layout::new(None, false, 0),
        Layout::new(Some(1), false, 0),
        Layout::new(Some(2), false, 0),
        Layout::new(Some(2), false, args.overlap),
        Layout::new(Some(2), true, 0),
        Layout::new(Some(2), true, args.overlap),
        Layout::new(Some(4), false, 0),
        Layout::new(Some(4), true, 0),
    ];
    let mut measured: Vec<Vec<Measured>> = (0..layouts.len()).map(|_| Vec::new()).collect();
    for round in 0..args.repeats {
        for (i, layout) in layouts.iter().enumerate() {
            eprintln!("round {}/{}: {}", round + 1, args.repeats, layout.name());
            measured[i].push(run(&args, &config, &data, *layout));
        }
    }

    let tokens = args.batch_size * args.seq_len;
    // One activation message: [batch, seq, hidden] in f32.
    let message = (tokens * config.hidden_size * 4) as f64;
    let layers = config.num_hidden_layers as f64;
    println!(
        "{:<22} {:>5} {:>8} {:>7} {:>10} {:>10} {:>7} {:>6} {:>10} {:>10} {:>10} {:>9}",
        "layout",
        "ranks",
        "step s",
        "vs base",
        "params MB",
        "activ. MB",
        "vs base",
        "calls",
        "payload MB",
        "theory MB",
        "per layer",
        "wire MB"
    );
    let mut rows: Vec<Row> = Vec::new();
    for (layout, runs) in layouts.iter().zip(&measured) {
        let tp = layout.tp.unwrap_or(1);
        let step_s = median(runs.iter().flat_map(|m| m.step_s.iter().copied()));
        let activation = median(runs.iter().map(|m| m.activation_bytes));
        let stats = runs[0].stats;
        let payload = total_payload(&stats);
        let theory = layout
            .tp
            .map_or(0.0, |_| theory_payload(&config, layout.sp, tp, tokens));
        let extras = theory - layers * per_layer_theory(layout.sp, tp, message);
        let (base_step, base_activation) = rows.first().map_or((step_s, activation), |r| {
            (r.step_s, r.activation_mb_per_rank * 1e6)
        });
        let row = Row {
            name: layout.name(),
            ranks: tp,
            step_s,
            speedup: base_step / step_s,
            param_mb_per_rank: runs[0].param_bytes as f64 / 1e6,
            activation_mb_per_rank: activation / 1e6,
            activation_vs_base: activation / base_activation,
            comm_calls_per_step: calls(&stats),
            comm_payload_mb_per_step: payload / 1e6,
            theory_payload_mb_per_step: theory / 1e6,
            payload_per_layer_mb: if layout.tp.is_some() {
                (payload - extras) / layers / 1e6
            } else {
                0.0
            },
            ring_wire_mb_per_step: stats.ring_bytes(tp) / 1e6,
        };
        println!(
            "{:<22} {:>5} {:>8.3} {:>6.2}x {:>10.1} {:>10.1} {:>6.2}x {:>6} {:>10.2} {:>10.2} {:>10.2} {:>9.2}",
            row.name,
            row.ranks,
            row.step_s,
            row.speedup,
            row.param_mb_per_rank,
            row.activation_mb_per_rank,
            row.activation_vs_base,
            row.comm_calls_per_step,
            row.comm_payload_mb_per_step,
            row.theory_payload_mb_per_step,
            row.payload_per_layer_mb,
            row.ring_wire_mb_per_step
        );
        rows.push(row);
    }
    println!(
        "per layer: the measured payload less the theoretical embedding, head, cross-entropy and norm traffic, over the layers"
    );
    println!(
        "per layer, theory: TP 4 all-reduces of {:.2} MB; SP 4 all-gathers of {:.2}/tp MB and 4 reduce-scatters of {:.2} MB (same wire bytes under ring algorithms)",
        message / 1e6,
        message / 1e6,
        message / 1e6
    );
    benches::write_json(&args.json, &rows);
}

fn calls(stats: &CommStats) -> u64 {
    stats.all_reduce.calls + stats.all_gather.calls + stats.reduce_scatter.calls
}

fn total_payload(stats: &CommStats) -> f64 {
    (stats.all_reduce.bytes + stats.all_gather.bytes + stats.reduce_scatter.bytes) as f64
}

/// Payload bytes per layer per step: TP all-reduces 4 messages (2 forward, 2 backward); SP
/// all-gathers 4 parts of one (each rank brings 1/tp) and reduce-scatters 4 whole ones.
fn per_layer_theory(sp: bool, tp: usize, message: f64) -> f64 {
    if sp {
        4.0 * message / tp as f64 + 4.0 * message
    } else {
        4.0 * message
    }
}

/// Payload bytes per step of the whole model: the layers, plus the embedding's exit and the
/// head's entry (one activation message each way, as a layer's), the three per-token numbers
/// of the vocab-parallel cross-entropy, and under SP the gradients of the norms' weights.
fn theory_payload(config: &LlamaConfig, sp: bool, tp: usize, tokens: usize) -> f64 {
    let message = (tokens * config.hidden_size * 4) as f64;
    let layers = config.num_hidden_layers as f64;
    let ends = per_layer_theory(sp, tp, message) / 2.0;
    let cross_entropy = 3.0 * (tokens * 4) as f64;
    let norms = if sp {
        (2.0 * layers + 1.0) * (config.hidden_size * 4) as f64
    } else {
        0.0
    };
    layers * per_layer_theory(sp, tp, message) + ends + cross_entropy + norms
}

/// Trains `model` for `--steps` steps; `sync` lines the ranks up (a barrier, or nothing).
fn steps(
    args: &Args,
    data: &MarkovSource,
    mut model: Llama<B>,
    ranks: usize,
    comm: Option<&Communicator>,
) -> Result<Measured, TrainError> {
    let sync = || -> Result<(), CommError> { comm.map_or(Ok(()), |c| c.barrier()) };
    let mut optimizer = AdamWConfig::new().init::<B, Llama<B>>();
    let param_bytes = model.num_params() * 4;
    let mut step_s = Vec::new();
    let mut activation_bytes = 0.0;
    let mut stats = CommStats::default();
    for step in 0..args.steps {
        let (inputs, targets) =
            token_batch(data, step * args.batch_size, args.batch_size, args.seq_len);
        sync()?;
        if let Some(comm) = comm {
            comm.reset_stats();
        }
        let before = live_bytes();
        sync()?;
        let begun = Instant::now();
        let loss = model.loss(inputs, targets)?;
        if step == 0 {
            sync()?;
            activation_bytes = (live_bytes() as f64 - before as f64) / ranks as f64;
            sync()?;
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(1e-3, model, grads);
        sync()?;
        if step > 0 {
            step_s.push(begun.elapsed().as_secs_f64());
        }
        if let Some(comm) = comm {
            stats = comm.stats();
        }
    }
    Ok(Measured {
        step_s,
        param_bytes,
        activation_bytes,
        stats,
    })
}

fn run(args: &Args, config: &LlamaConfig, data: &MarkovSource, layout: Layout) -> Measured {
    let device = Default::default();
    let Some(tp) = layout.tp else {
        let model = Llama::<B>::init(config, 42, &device);
        return steps(args, data, model, 1, None).unwrap_or_else(|e| panic!("{e}"));
    };
    let mut results = launch(tp, |ctx| {
        let group = TensorParallel::new(ctx.world().clone())
            .with_sequence_parallel(layout.sp)
            .with_comm_overlap(layout.overlap);
        let mut plan_config = TrainConfig::new(config.clone(), args.steps);
        (plan_config.tp, plan_config.sequence_parallel) = (tp, layout.sp);
        plan_config.seq_len = args.seq_len;
        let plan = ParallelPlan::new(&plan_config)?;
        let model = plan.shard(Llama::<B>::init(config, 42, &device), Some(&group))?;
        steps(args, data, model, tp, Some(ctx.world()))
    });
    match results.remove(0) {
        Ok(measured) => measured,
        Err(error) => panic!("{}: {error}", layout.name()),
    }
}
