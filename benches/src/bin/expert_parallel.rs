//! A mixture of experts with expert parallelism against single-device burn, measured in one
//! run: `--model` (a preset with experts) on one device and with its experts split over 2 and
//! 4 expert-parallel ranks, beside the dense model of the same active parameters (one MLP
//! `top-k x` an expert's width) on one device and under DDP on as many ranks. For each: the
//! step time and its ratio to the dense model's at the same ranks, the parameters a rank holds,
//! the process's peak of live memory per rank, and the bytes each rank sends its
//! expert-parallel peers beside the formula for evenly routed tokens.
//!
//! Runs are repeated in interleaved rounds (`--repeats`) so that drift of the machine's speed
//! hits every configuration alike.
//!
//! `cargo run --release -p benches --bin expert_parallel -- --help`

use benches::median;
use benches::memory::CountingAllocator;
use clap::Parser;
use llama::LlamaConfig;
use llama::data::MarkovSource;
use llama::train::{Strategy, TrainConfig};
use serde::Serialize;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[derive(Parser)]
#[command(about = "Expert parallelism against the dense model of the same active parameters")]
struct Args {
    /// Model preset, with experts.
    #[arg(long, default_value = "small-moe")]
    model: String,
    /// Samples per step over all ranks.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Tokens per sample.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// Steps per run; the first `--warmup` are not counted.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Steps left out of the medians, in each run.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Rounds over all configurations; the medians pool the rounds.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Rank counts to run, each as ep N beside dense DDP at N (1: one device).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    ranks: Vec<usize>,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/expert_parallel.json")]
    json: String,
}

#[derive(Serialize)]
struct Row {
    name: String,
    ranks: usize,
    step_s: f64,
    tokens_per_s: f64,
    /// Step time over the dense model's on as many ranks.
    vs_dense: f64,
    /// Parameters each rank holds, in millions.
    params_per_rank_m: f64,
    /// Peak of the process's live memory during the run, over the ranks, in MB.
    peak_per_rank_mb: f64,
    /// Bytes a rank sent its expert-parallel peers per step (mean over ranks), in MB.
    exchanged_mb: Option<f64>,
    /// The same for tokens routed evenly, in MB.
    exchanged_formula_mb: Option<f64>,
}

fn main() {
    let args = Args::parse();
    assert!(args.steps > args.warmup, "--steps must exceed --warmup");
    let moe = benches::preset(&args.model);
    assert!(
        moe.is_moe(),
        "--model {} has no experts; choose tiny-moe or small-moe",
        args.model
    );
    let k = moe.num_experts_per_tok;
    // The same active parameters: one MLP as wide as the k experts a token visits.
    let mut dense = moe.clone().with_num_local_experts(0);
    dense.intermediate_size = k * moe.intermediate_size;
    let data = MarkovSource::new(16, 3, args.seq_len, 1 << 16, 1);
    println!(
        "{} ({:.1}M parameters, {:.1}M active) against its dense twin ({:.1}M), {} x {} tokens per step, {} steps per run ({} not counted), fp32",
        args.model,
        moe.num_params() as f64 / 1e6,
        moe.num_active_params() as f64 / 1e6,
        dense.num_params() as f64 / 1e6,
        args.batch_size,
        args.seq_len,
        args.steps,
        args.warmup,
    );
    let base = |model: &LlamaConfig, ranks: usize, ep: usize| {
        let mut config = TrainConfig::new(model.clone(), args.steps);
        config.batch_size = args.batch_size;
        config.seq_len = args.seq_len;
        config.strategy = if ranks == 1 {
            Strategy::Single
        } else {
            Strategy::Ddp
        };
        (config.dp, config.ep) = (ranks / ep, ep);
        config
    };
    let mut runs = Vec::new();
    for &ranks in &args.ranks {
        let dense_name = match ranks {
            1 => "dense, one device".to_string(),
            n => format!("dense, DDP at {n}"),
        };
        runs.push((dense_name, base(&dense, ranks, 1)));
        let moe_name = match ranks {
            1 => "experts, one device".to_string(),
            n => format!("experts, ep {n}"),
        };
        runs.push((moe_name, base(&moe, ranks, ranks)));
    }

    let mut steps: Vec<Vec<f64>> = vec![Vec::new(); runs.len()];
    let mut peaks: Vec<Vec<usize>> = vec![Vec::new(); runs.len()];
    let mut exchanged: Vec<Vec<f64>> = vec![Vec::new(); runs.len()];
    benches::interleaved_rounds(&runs, &data, args.repeats, |i, metrics, peak| {
        peaks[i].push(peak);
        let counted = &metrics[args.warmup..];
        steps[i].extend(counted.iter().map(|m| m.seconds));
        exchanged[i].extend(
            counted
                .iter()
                .filter_map(|m| m.moe)
                .map(|m| m.exchanged_bytes),
        );
    });

    let tokens = (args.batch_size * args.seq_len) as f64;
    let mb = |bytes: f64| bytes / 1e6;
    println!(
        "\n{:<22} {:>9} {:>8} {:>9} {:>12} {:>13} {:>14} {:>12} {:>7}",
        "run",
        "step (s)",
        "tok/s",
        "vs dense",
        "params/rank",
        "peak MB/rank",
        "sent MB/rank",
        "formula MB",
        "ratio"
    );
    let mut rows = Vec::new();
    for (i, (name, config)) in runs.iter().enumerate() {
        let ranks = config.dp * config.ep;
        let step = median(steps[i].iter().copied());
        // Each run's dense twin is the run before it (same ranks).
        let dense_step = median(steps[i - i % 2].iter().copied());
        let model = &config.model;
        let experts = model.num_expert_params();
        let per_rank = model.num_params() - experts + experts / config.ep;
        let (sent, formula) = match model.is_moe() && config.ep > 1 {
            false => (None, None),
            true => {
                // Every copy of a rank's tokens that leaves it goes there and back, forward and
                // backward: four rows of `hidden` fp32 per copy and block.
                let copies = tokens / ranks as f64 * k as f64;
                let leaving = (config.ep - 1) as f64 / config.ep as f64;
                let per_copy = (4 * model.hidden_size * 4 * model.num_hidden_layers) as f64;
                (
                    Some(mb(median(exchanged[i].iter().copied()))),
                    Some(mb(copies * leaving * per_copy)),
                )
            }
        };
        let row = Row {
            name: name.clone(),
            ranks,
            step_s: step,
            tokens_per_s: tokens / step,
            vs_dense: step / dense_step,
            params_per_rank_m: per_rank as f64 / 1e6,
            peak_per_rank_mb: median(peaks[i].iter().map(|&p| p as f64)) / ranks as f64 / 1e6,
            exchanged_mb: sent,
            exchanged_formula_mb: formula,
        };
        let optional = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2}"));
        println!(
            "{:<22} {:>9.3} {:>8.0} {:>9.2} {:>11.2}M {:>13.1} {:>14} {:>12} {:>7}",
            row.name,
            row.step_s,
            row.tokens_per_s,
            row.vs_dense,
            row.params_per_rank_m,
            row.peak_per_rank_mb,
            optional(row.exchanged_mb),
            optional(row.exchanged_formula_mb),
            match (row.exchanged_mb, row.exchanged_formula_mb) {
                (Some(a), Some(b)) => format!("{:.3}", a / b),
                _ => "-".into(),
            },
        );
        rows.push(row);
    }
    benches::write_json(&args.json, &rows);
}
