//! ZeRO against DDP and single-device burn, measured in one run: for every stage, the step
//! time (and its ratio to DDP's), the model-state bytes rank 0 holds beside the ZeRO paper's
//! estimate for the same parameter count, and the process's measured peak of live memory per
//! rank (everything: model state, activations, communication buffers).
//!
//! With `--mixed`, ZeRO-1, 2 and 3 also run in bf16 (fp32 master weights in the shards), against
//! the paper's 16-bit estimate.
//!
//! Runs are repeated in interleaved rounds (`--repeats`) so that drift of the machine's speed
//! hits every configuration alike.
//!
//! `cargo run --release -p benches --bin zero -- --help`

use benches::median;
use benches::memory::CountingAllocator;
use burn_zero::{MixedPrecision, Precision, ZeroStage, estimate};
use clap::Parser;
use llama::data::MarkovSource;
use llama::train::{Strategy, TrainConfig};
use serde::Serialize;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[derive(Parser)]
#[command(about = "ZeRO stages against DDP and single-device burn: step time and memory")]
struct Args {
    /// Model preset.
    #[arg(long, default_value = "small")]
    model: String,
    /// Data-parallel ranks.
    #[arg(long, default_value_t = 2)]
    dp: usize,
    /// Samples per step over all ranks.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Tokens per sample.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// Steps per run; the first `--warmup` are not counted.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Steps left out of the medians, in each run.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Rounds over all configurations; the medians pool the rounds.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Also run every ZeRO stage in bf16 mixed precision.
    #[arg(long)]
    mixed: bool,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/zero.json")]
    json: String,
}

#[derive(Serialize)]
struct Row {
    name: String,
    ranks: usize,
    step_s: f64,
    /// Step time over DDP's at the same number of ranks.
    vs_ddp: f64,
    /// Model-state bytes rank 0 holds (ZeRO's own accounting), in MB.
    model_state_mb: Option<f64>,
    /// The paper's model-state bytes per rank, in MB.
    estimate_mb: f64,
    /// Peak of the process's live memory during the run, over the ranks, in MB.
    peak_per_rank_mb: f64,
}

fn main() {
    let args = Args::parse();
    assert!(args.steps > args.warmup, "--steps must exceed --warmup");
    let model = benches::preset(&args.model);
    let params = model.num_params() as u64;
    let data = MarkovSource::new(16, 3, args.seq_len, 1 << 16, 1);
    println!(
        "{} ({:.1}M parameters), dp {}, {} x {} tokens per step, {} steps per run ({} not counted), fp32{}",
        args.model,
        params as f64 / 1e6,
        args.dp,
        args.batch_size,
        args.seq_len,
        args.steps,
        args.warmup,
        if args.mixed { " and bf16" } else { "" }
    );
    let base = |strategy, dp, stage| {
        let mut config = TrainConfig::new(model.clone(), args.steps);
        config.batch_size = args.batch_size;
        config.seq_len = args.seq_len;
        config.strategy = strategy;
        config.dp = dp;
        config.zero = stage;
        config
    };
    let mut runs = vec![(
        "single-device burn".to_string(),
        base(Strategy::Single, 1, ZeroStage::Replicated),
    )];
    for stage in ZeroStage::ALL {
        let name = match stage {
            ZeroStage::Replicated => format!("DDP, {} ranks", args.dp),
            _ => format!("ZeRO-{}, {} ranks", stage.number(), args.dp),
        };
        runs.push((name, base(Strategy::Ddp, args.dp, stage)));
    }
    if args.mixed {
        for stage in &ZeroStage::ALL[1..] {
            let mut config = base(Strategy::Ddp, args.dp, *stage);
            config.zero_config = config
                .zero_config
                .with_precision(Some(MixedPrecision::bf16()));
            let name = format!("ZeRO-{} bf16, {} ranks", stage.number(), args.dp);
            runs.push((name, config));
        }
    }

    let mut steps: Vec<Vec<f64>> = vec![Vec::new(); runs.len()];
    let mut state: Vec<Option<usize>> = vec![None; runs.len()];
    let mut peaks: Vec<Vec<usize>> = vec![Vec::new(); runs.len()];
    benches::interleaved_rounds(&runs, &data, args.repeats, |i, metrics, peak| {
        peaks[i].push(peak);
        steps[i].extend(metrics[args.warmup..].iter().map(|m| m.seconds));
        state[i] = metrics.last().and_then(|m| m.model_state_bytes);
    });

    let ddp_step = median(steps[1].iter().copied());
    let mb = |bytes: usize| bytes as f64 / 1e6;
    println!(
        "\n{:<26} {:>9} {:>8} {:>16} {:>13} {:>8} {:>14}",
        "run", "step (s)", "vs DDP", "model state MB", "estimate MB", "ratio", "peak MB/rank"
    );
    let mut rows = Vec::new();
    for (i, (name, config)) in runs.iter().enumerate() {
        let step = median(steps[i].iter().copied());
        let stage = if config.strategy == Strategy::Single {
            ZeroStage::Replicated
        } else {
            config.zero
        };
        let precision = match config.zero_config.precision {
            Some(_) => Precision::HALF,
            None => Precision::F32,
        };
        let estimated = estimate(params, config.dp, stage, precision).total();
        let peak = median(peaks[i].iter().map(|&p| p as f64)) / config.dp as f64;
        let row = Row {
            name: name.clone(),
            ranks: config.dp,
            step_s: step,
            vs_ddp: step / ddp_step,
            model_state_mb: state[i].map(mb),
            estimate_mb: mb(estimated),
            peak_per_rank_mb: peak / 1e6,
        };
        println!(
            "{:<26} {:>9.3} {:>8.2} {:>16} {:>13.1} {:>8} {:>14.1}",
            row.name,
            row.step_s,
            row.vs_ddp,
            row.model_state_mb.map_or("-".into(), |m| format!("{m:.1}")),
            row.estimate_mb,
            row.model_state_mb
                .map_or("-".into(), |m| format!("{:.4}", m / row.estimate_mb)),
            row.peak_per_rank_mb,
        );
        rows.push(row);
    }
    benches::write_json(&args.json, &rows);
}
