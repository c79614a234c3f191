//! Context-parallel attention against single-device burn, measured in one run: the Llama
//! model's causal attention (rotary positions, grouped-query heads) forward and backward over
//! one long sequence on one device (the baseline), and with the sequence split over cp 2 and 4
//! ranks by the ring (load-balanced and not) and by all-gather. Per layout: the time of a
//! forward and backward; each rank's forward time, whose spread shows the causal mask's
//! imbalance when the chunks are not balanced; the activation bytes a rank keeps for backward;
//! and the bytes each rank sends beside the count the ring's plan gives.
//!
//! Activation bytes are the heap a rank's forward leaves allocated while its output lives
//! (each rank's allocations counted apart; the median rank's). Ranks are threads with one compute thread each: cp 4 on a
//! 2-core machine is oversubscribed, so its times show the work, not the scaling.
//!
//! `cargo run --release -p benches --bin context_parallel -- --help`

use std::time::Instant;

use benches::median;
use benches::memory::{CountingAllocator, set_slot, slot_live_bytes};
use burn::backend::{Autodiff, Flex};
use burn::tensor::{Distribution, Tensor};
use burn_comm::launch;
use burn_tensor_parallel::{ContextParallel, CpAttention, TpError};
use clap::Parser;
use llama::LlamaConfig;
use llama::model::{Positions, attend};
use serde::Serialize;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

type B = Autodiff<Flex>;

#[derive(Parser)]
#[command(about = "Context-parallel attention against single-device burn")]
struct Args {
    /// Tokens in the sequence.
    #[arg(long, default_value_t = 2048)]
    seq_len: usize,
    /// Query heads.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Key/value heads.
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Width of a head.
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Timed forward and backward passes per layout and round (after one untimed).
    #[arg(long, default_value_t = 2)]
    passes: usize,
    /// Rounds over all layouts; the medians pool the rounds.
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/context_parallel.json")]
    json: String,
}

/// One layout: `None` is single-device attention.
#[derive(Clone, Copy)]
struct Layout {
    cp: Option<usize>,
    balanced: bool,
    attention: CpAttention,
}

impl Layout {
    fn name(&self) -> String {
        let Some(cp) = self.cp else {
            return "single-device burn".into();
        };
        match (self.attention, self.balanced) {
            (CpAttention::AllGather, _) => format!("cp {cp} all-gather"),
            (CpAttention::Ring, true) => format!("cp {cp} ring"),
            (CpAttention::Ring, false) => format!("cp {cp} ring, unbalanced"),
        }
    }
}

/// What one round measured.
struct Measured {
    /// Forward and backward, the slowest rank's, per pass.
    step_s: Vec<f64>,
    /// Each rank's forward, per pass.
    forward_s: Vec<Vec<f64>>,
    /// Each rank's backward, per pass.
    backward_s: Vec<Vec<f64>>,
    activation_bytes: f64,
    /// Bytes each rank sent in one forward and backward.
    sent: Vec<u64>,
}

#[derive(Serialize)]
struct Row {
    name: String,
    ranks: usize,
    step_s: f64,
    speedup: f64,
    forward_s_fastest_rank: f64,
    forward_s_slowest_rank: f64,
    backward_s_fastest_rank: f64,
    backward_s_slowest_rank: f64,
    activation_mb_per_rank: f64,
    activation_vs_base: f64,
    sent_mb_per_rank_max: f64,
    sent_mb_all_ranks: f64,
    plan_mb_all_ranks: f64,
}

fn main() {
    let args = Args::parse();
    let hidden = args.heads * args.head_dim;
    let config = LlamaConfig::new(256, hidden, 4 * hidden, 1, args.heads, args.kv_heads)
        .with_max_position_embeddings(args.seq_len);
    println!(
        "causal attention of 1 x {} tokens, {} query heads over {} key/value heads of {}, fp32; {} timed passes per layout, {} rounds",
        args.seq_len, args.heads, args.kv_heads, args.head_dim, args.passes, args.repeats
    );
    let ring = |cp, balanced| Layout {
        cp: Some(cp),
        balanced,
        attention: CpAttention::Ring,
    };
    let gathered = |cp| Layout {
        cp: Some(cp),
        balanced: true,
        attention: CpAttention::AllGather,
    };
    let layouts = [
        Layout {
            cp: None,
            balanced: true,
            attention: CpAttention::Ring,
        },
        ring(1, true),
        ring(2, true),
        ring(2, false),
        gathered(2),
        ring(4, true),
        ring(4, false),
        gathered(4),
    ];
    let mut measured: Vec<Vec<Measured>> = (0..layouts.len()).map(|_| Vec::new()).collect();
    for round in 0..args.repeats {
        for (i, layout) in layouts.iter().enumerate() {
            eprintln!("round {}/{}: {}", round + 1, args.repeats, layout.name());
            measured[i].push(run(&args, &config, *layout));
        }
    }
    println!(
        "{:<26} {:>5} {:>8} {:>7} {:>17} {:>17} {:>10} {:>7} {:>12} {:>10} {:>10}",
        "layout",
        "ranks",
        "step s",
        "vs base",
        "fwd s min..max",
        "bwd s min..max",
        "activ. MB",
        "vs base",
        "sent MB max",
        "sent all",
        "plan all"
    );
    let mut rows: Vec<Row> = Vec::new();
    for (layout, runs) in layouts.iter().zip(&measured) {
        let cp = layout.cp.unwrap_or(1);
        let step_s = median(runs.iter().flat_map(|m| m.step_s.iter().copied()));
        let per_rank = |rank: usize, of: fn(&Measured) -> &Vec<Vec<f64>>| {
            median(
                runs.iter()
                    .flat_map(move |m| of(m).iter().map(move |pass| pass[rank])),
            )
        };
        let spread = |of: fn(&Measured) -> &Vec<Vec<f64>>| {
            let times: Vec<f64> = (0..cp).map(|rank| per_rank(rank, of)).collect();
            (
                times.iter().copied().fold(f64::INFINITY, f64::min),
                times.iter().copied().fold(0.0, f64::max),
            )
        };
        let forwards = spread(|m| &m.forward_s);
        let backwards = spread(|m| &m.backward_s);
        let activation = median(runs.iter().map(|m| m.activation_bytes));
        let sent = &runs[0].sent;
        let plan = match layout.cp {
            Some(cp) if layout.attention == CpAttention::Ring => {
                ring_bytes(&args, cp, layout.balanced)
            }
            Some(cp) => gather_bytes(&args, cp),
            None => 0,
        };
        let (base_step, base_activation) = rows.first().map_or((step_s, activation), |r| {
            (r.step_s, r.activation_mb_per_rank * 1e6)
        });
        let row = Row {
            name: layout.name(),
            ranks: cp,
            step_s,
            speedup: base_step / step_s,
            forward_s_fastest_rank: forwards.0,
            forward_s_slowest_rank: forwards.1,
            backward_s_fastest_rank: backwards.0,
            backward_s_slowest_rank: backwards.1,
            activation_mb_per_rank: activation / 1e6,
            activation_vs_base: activation / base_activation,
            sent_mb_per_rank_max: *sent.iter().max().unwrap_or(&0) as f64 / 1e6,
            sent_mb_all_ranks: sent.iter().sum::<u64>() as f64 / 1e6,
            plan_mb_all_ranks: plan as f64 / 1e6,
        };
        println!(
            "{:<26} {:>5} {:>8.3} {:>7.2} {:>8.3}..{:<8.3} {:>8.3}..{:<8.3} {:>10.1} {:>7.2} {:>12.2} {:>10.2} {:>10.2}",
            row.name,
            row.ranks,
            row.step_s,
            row.speedup,
            row.forward_s_fastest_rank,
            row.forward_s_slowest_rank,
            row.backward_s_fastest_rank,
            row.backward_s_slowest_rank,
            row.activation_mb_per_rank,
            row.activation_vs_base,
            row.sent_mb_per_rank_max,
            row.sent_mb_all_ranks,
            row.plan_mb_all_ranks
        );
        rows.push(row);
    }
    println!(
        "step s: forward + backward of the slowest rank (the two timed apart, each from a barrier); vs base: single-device burn's figure over this one (time) or this one over it (activations); fwd s, bwd s: the fastest and slowest rank's forward and backward; sent: bytes sent per forward + backward, by the busiest rank and by all; plan: what the ring's plan sends (all-gather: the inputs of the gathers and of the backward's reduce-scatters), all ranks"
    );
    benches::write_json(&args.json, &rows);
}

/// Times `args.passes` forward and backward passes of `layout` (after an untimed one, where
/// memory is measured).
fn run(args: &Args, config: &LlamaConfig, layout: Layout) -> Measured {
    let [batch, heads, kv_heads, dim, seq] =
        [1, args.heads, args.kv_heads, args.head_dim, args.seq_len];
    let device = Default::default();
    let whole = |heads: usize| {
        Tensor::<Flex, 4>::random([batch, heads, seq, dim], Distribution::Default, &device)
    };
    let (q, k, v, r) = (whole(heads), whole(kv_heads), whole(kv_heads), whole(heads));
    let cp = layout.cp.unwrap_or(1);
    let results = launch(cp, |ctx| {
        let slot = ctx.rank() + 1;
        set_slot(slot);
        let group = layout.cp.map(|_| {
            ContextParallel::new(ctx.world().clone(), layout.balanced)
                .with_attention(layout.attention)
        });
        let local = |x: &Tensor<Flex, 4>| -> Result<Tensor<B, 4>, TpError> {
            let x = match &group {
                Some(group) => group.shard(x.clone(), 2)?,
                None => x.clone(),
            };
            Ok(Tensor::from_inner(x).require_grad())
        };
        let (q, k, v, r) = (local(&q)?, local(&k)?, local(&v)?, local(&r)?);
        let positions = Positions::new(config, seq, &q.clone().flatten::<3>(0, 1), group.as_ref())?;
        let mut forward_s = Vec::new();
        let mut backward_s = Vec::new();
        let mut step_s = Vec::new();
        let mut activation_bytes = 0.0;
        let mut sent = 0;
        for pass in 0..=args.passes {
            ctx.world().barrier()?;
            let before = slot_live_bytes(slot) as f64;
            let sent_before = ctx.world().stats().send.bytes + gathered(&ctx);
            let started = Instant::now();
            let out = attend(q.clone(), k.clone(), v.clone(), &positions)?;
            let forward = started.elapsed().as_secs_f64();
            ctx.world().barrier()?;
            if pass == 0 {
                activation_bytes = slot_live_bytes(slot) as f64 - before;
            }
            let backward_started = Instant::now();
            (out * r.clone()).sum().backward();
            let backward = backward_started.elapsed().as_secs_f64();
            if pass == 0 {
                sent = ctx.world().stats().send.bytes + gathered(&ctx) - sent_before;
            } else {
                forward_s.push(forward);
                backward_s.push(backward);
                step_s.push(forward + backward);
            }
        }
        Ok::<_, TpError>((step_s, forward_s, backward_s, activation_bytes, sent))
    });
    let results: Vec<_> = results
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect();
    let passes = results[0].0.len();
    Measured {
        step_s: (0..passes)
            .map(|p| results.iter().map(|r| r.0[p]).fold(0.0, f64::max))
            .collect(),
        forward_s: (0..passes)
            .map(|p| results.iter().map(|r| r.1[p]).collect())
            .collect(),
        backward_s: (0..passes)
            .map(|p| results.iter().map(|r| r.2[p]).collect())
            .collect(),
        activation_bytes: median(results.iter().map(|r| r.3)),
        sent: results.iter().map(|r| r.4).collect(),
    }
}

/// Bytes a rank passed to all-gathers (its own part) and reduce-scatters (the whole input),
/// as nccl-tests count them.
fn gathered(ctx: &burn_comm::RankContext) -> u64 {
    let stats = ctx.world().stats();
    stats.all_gather.bytes + stats.reduce_scatter.bytes
}

/// The bytes every rank together sends in one forward and backward of the ring over `cp`
/// ranks, from its plan: a block is a rank's keys and values (fp32 here). Forward, each rank
/// passes the block it holds to the next at all but the last step; backward passes the blocks
/// again with their fp32 gradients beside them, then sends each block's gradient home. With
/// the load-balanced causal cut, block 0's second chunk (the sequence's last) is needed by
/// rank 0 only, so it travels as half a block. Unbalanced, block `j` is needed by ranks `j..cp`
/// only and travels `cp - 1 - j` times.
fn ring_bytes(args: &Args, cp: usize, balanced: bool) -> u64 {
    if cp == 1 {
        return 0;
    }
    let block = (2 * args.kv_heads * (args.seq_len / cp) * args.head_dim * 4) as u64;
    let (passes, finals) = if balanced {
        // Block 0 travels cp - 1 times at half size; the others at full size.
        let passes = (cp as u64 - 1) * (cp as u64 - 1) * block + (cp as u64 - 1) * block / 2;
        // Block 0's first chunk comes home as half a block, the others whole.
        let finals = (cp as u64 - 1) * block + block / 2;
        (passes, finals)
    } else {
        let passes = (0..cp).map(|j| (cp - 1 - j) as u64 * block).sum::<u64>();
        (passes, (cp as u64 - 1) * block)
    };
    // Forward's passes; backward's passes of the blocks and of their gradients; the finals.
    3 * passes + finals
}

/// The bytes every rank passes to the all-gathers of one forward (its keys and values) and to
/// the reduce-scatters of their gradients in backward (the gradients of all keys and values).
fn gather_bytes(args: &Args, cp: usize) -> u64 {
    let block = (2 * args.kv_heads * (args.seq_len / cp) * args.head_dim * 4) as u64;
    cp as u64 * (block + cp as u64 * block)
}
