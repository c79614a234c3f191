//! The vocabulary-parallel cross-entropy against single-device burn, measured in one run: one
//! forward and backward of the mean loss over `[tokens, vocab]` logits, by burn's dense
//! cross-entropy on one device (the baseline), and split over tp 1 and 2 ranks two ways: burn's
//! autodiff of the formula (the implementation before the fused statistics, kept here to
//! compare with), and `vocab_parallel_cross_entropy` (the fused statistics and their
//! hand-written backward; on a CPU backend both run as plain burn).
//!
//! Rank 0's figures (the ranks are symmetric): the time of forward plus backward, the heap
//! bytes the forward leaves held for backward, and the most held during the pass, both beyond
//! the logits themselves.
//!
//! `cargo run --release -p benches --bin cross_entropy -- --help`

use std::time::Instant;

use benches::median;
use benches::memory::{
    CountingAllocator, reset_slot_peak, set_slot, slot_live_bytes, slot_peak_bytes,
};
use burn::backend::{Autodiff, Flex};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Int, Tensor};
use burn_comm::parallel::reduce_from_parallel_region;
use burn_comm::{ReduceOp, launch};
use burn_tensor_parallel::{TensorParallel, TpError, vocab_parallel_cross_entropy};
use clap::Parser;
use serde::Serialize;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

type B = Autodiff<Flex>;

#[derive(Parser)]
#[command(about = "The vocabulary-parallel cross-entropy against single-device burn")]
struct Args {
    /// Rows of logits (tokens).
    #[arg(long, default_value_t = 2048)]
    tokens: usize,
    /// Columns of logits (the vocabulary).
    #[arg(long, default_value_t = 16384)]
    vocab: usize,
    /// Timed passes per run, after one untimed.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/cross_entropy.json")]
    json: String,
}

/// How the loss is computed.
#[derive(Clone, Copy, PartialEq)]
enum Method {
    /// burn's `CrossEntropyLoss` over the whole vocabulary, on one device.
    Dense,
    /// The vocab-parallel formula in burn's operations, differentiated by burn's autodiff.
    Formula,
    /// `vocab_parallel_cross_entropy`.
    Fused,
}

#[derive(Serialize)]
struct Row {
    name: String,
    ranks: usize,
    pass_s: f64,
    speedup: f64,
    held_mb_per_rank: f64,
    held_vs_base: f64,
    peak_mb_per_rank: f64,
    peak_vs_base: f64,
}

/// What one rank measured.
struct Measured {
    pass_s: Vec<f64>,
    held: usize,
    peak: usize,
}

fn main() {
    let args = Args::parse();
    let logits_mb = (args.tokens * args.vocab * 4) as f64 / 1e6;
    println!(
        "logits {} x {} f32 ({logits_mb:.0} MB), {} timed passes per run (1 not timed), Autodiff<Flex>, ranks are threads",
        args.tokens, args.vocab, args.steps
    );
    let runs = [
        ("single-device burn", Method::Dense, 1),
        ("formula, tp 1", Method::Formula, 1),
        ("fused, tp 1", Method::Fused, 1),
        ("formula, tp 2", Method::Formula, 2),
        ("fused, tp 2", Method::Fused, 2),
    ];
    println!(
        "{:<20} {:>5} {:>8} {:>7} {:>9} {:>7} {:>9} {:>7}",
        "method", "ranks", "pass s", "vs base", "held MB", "vs base", "peak MB", "vs base"
    );
    let mut rows: Vec<Row> = Vec::new();
    for (name, method, tp) in runs {
        let measured = run(&args, method, tp);
        let pass_s = median(measured.pass_s.iter().copied());
        let (held, peak) = (measured.held as f64 / 1e6, measured.peak as f64 / 1e6);
        let base = rows.first().map_or((pass_s, held, peak), |r| {
            (r.pass_s, r.held_mb_per_rank, r.peak_mb_per_rank)
        });
        let row = Row {
            name: name.into(),
            ranks: tp,
            pass_s,
            speedup: base.0 / pass_s,
            held_mb_per_rank: held,
            held_vs_base: held / base.1,
            peak_mb_per_rank: peak,
            peak_vs_base: peak / base.2,
        };
        println!(
            "{:<20} {:>5} {:>8.3} {:>6.2}x {:>9.1} {:>6.2}x {:>9.1} {:>6.2}x",
            row.name,
            row.ranks,
            row.pass_s,
            row.speedup,
            row.held_mb_per_rank,
            row.held_vs_base,
            row.peak_mb_per_rank,
            row.peak_vs_base
        );
        rows.push(row);
    }
    println!(
        "held: heap the forward leaves for backward; peak: the most held during the pass (both beyond the logits)"
    );
    benches::write_json(&args.json, &rows);
}

/// Rank 0's measurements of `--steps` passes of `method` over `tp` ranks.
fn run(args: &Args, method: Method, tp: usize) -> Measured {
    let mut results = launch(tp, |ctx| {
        set_slot(ctx.rank() + 1);
        let group = TensorParallel::new(ctx.world().clone());
        let device = Default::default();
        let part = args.vocab / tp;
        let targets = Tensor::<B, 1, Int>::from_ints(
            (0..args.tokens)
                .map(|i| ((i * 7919) % args.vocab) as i32)
                .collect::<Vec<_>>()
                .as_slice(),
            &device,
        );
        let mut measured = Measured {
            pass_s: Vec::new(),
            held: 0,
            peak: 0,
        };
        for step in 0..=args.steps {
            // Every rank makes the whole table (the same on every rank, different each step)
            // and keeps its own columns.
            let len = (args.tokens * args.vocab) as i64;
            let full = Tensor::<B, 1, Int>::arange(0..len, &device)
                .float()
                .mul_scalar(0.7371)
                .add_scalar(step as f64)
                .sin()
                .mul_scalar(8.0)
                .reshape([args.tokens, args.vocab]);
            let logits = full
                .narrow(1, ctx.rank() * part, part)
                .detach()
                .require_grad();
            ctx.world().barrier()?;
            let before = slot_live_bytes(ctx.rank() + 1);
            reset_slot_peak(ctx.rank() + 1);
            let begun = Instant::now();
            let loss = match method {
                Method::Dense => CrossEntropyLossConfig::new()
                    .init(&device)
                    .forward(logits.clone(), targets.clone()),
                Method::Formula => formula(logits.clone(), targets.clone(), &group)?.mean(),
                Method::Fused => {
                    vocab_parallel_cross_entropy(logits.clone(), targets.clone(), &group)?.mean()
                }
            };
            let held = slot_live_bytes(ctx.rank() + 1).saturating_sub(before);
            let grad = logits.grad(&loss.backward()).expect("the logits' gradient");
            drop(grad);
            let elapsed = begun.elapsed().as_secs_f64();
            ctx.world().barrier()?;
            if step > 0 {
                measured.pass_s.push(elapsed);
                measured.held = held;
                measured.peak = slot_peak_bytes(ctx.rank() + 1).saturating_sub(before);
            }
        }
        Ok::<_, TpError>(measured)
    });
    match results.remove(0) {
        Ok(measured) => measured,
        Err(error) => panic!("{error}"),
    }
}

/// The vocab-parallel cross-entropy as burn's operations, differentiated by burn's autodiff
/// (three all-reduces: the maximum, the sum of exponentials, the target's logit).
fn formula(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    tp: &TensorParallel,
) -> Result<Tensor<B, 1>, TpError> {
    let [n, part] = logits.dims();
    let comm = tp.comm();
    let max = comm.all_reduce(logits.clone().detach().max_dim(1), ReduceOp::Max)?;
    let shifted = logits - max;
    let sum_exp = reduce_from_parallel_region(shifted.clone().exp().sum_dim(1), comm)?;
    let local = targets - (tp.rank() * part) as i64;
    let outside = local
        .clone()
        .lower_elem(0)
        .bool_or(local.clone().greater_equal_elem(part as i64));
    let keep = outside.clone().bool_not().float().unsqueeze_dim::<2>(1);
    let picked = shifted.gather(1, local.mask_fill(outside, 0).unsqueeze_dim::<2>(1)) * keep;
    let target = reduce_from_parallel_region(picked, comm)?;
    Ok((sum_exp.log() - target).reshape([n]))
}
