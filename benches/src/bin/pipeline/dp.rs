//! dp x pp: the replicas of each pipeline stage average their gradients in DDP's buckets,
//! either once the pipeline has drained (`GradientSync::average` on the summed gradients) or
//! overlapped (each chunk's buckets start during its last backward, `GradientSync::begin` as
//! the executor's gradient sink). The exposed wait is what the averaging costs after a rank's
//! pipeline work is done.

use std::time::Instant;

use benches::median;
use burn::optim::{AdamWConfig, Optimizer};
use burn::tensor::DType;
use burn_comm::{RankContext, launch};
use burn_ddp::{DdpConfig, GradientSync};
use burn_pipeline::{Message, PipelineExecutor, Schedule, ScheduleKind};
use llama::data::MarkovSource;
use llama::pipeline::MicroBatch;
use llama::train::TrainError;
use llama::{Llama, LlamaConfig};
use serde::Serialize;

use crate::{Args, B, micro_batch, seeded_chunks};

/// How the replicas average.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Averaging {
    AfterDrain,
    Overlapped,
}

impl std::fmt::Display for Averaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Averaging::AfterDrain => "after drain",
            Averaging::Overlapped => "overlapped",
        })
    }
}

/// What one rank measured in each counted step.
struct RankRun {
    step_s: Vec<f64>,
    /// From the end of the rank's pipeline work to its averaged gradients.
    wait_s: Vec<f64>,
    overlapped_buckets: usize,
    buckets: usize,
}

#[derive(Serialize)]
pub struct Row {
    name: String,
    dp: usize,
    pp: usize,
    schedule: String,
    averaging: String,
    step_s: f64,
    /// Samples per second over single-device burn's.
    throughput_vs_base: f64,
    /// The after-drain step time of the same layout over this one's.
    speedup_vs_after_drain: f64,
    /// Median exposed wait over the counted steps, per pipeline stage (rank of the pp group).
    wait_ms_per_stage: Vec<f64>,
    overlapped_buckets: usize,
    buckets: usize,
}

/// Measures dp x pp under 1F1B and interleaved 1F1B, both ways of averaging, `args.repeats`
/// rounds; `base_step_s` is single-device burn's step over one replica's batch, from the same
/// run.
pub fn measure(
    args: &Args,
    config: &LlamaConfig,
    data: &MarkovSource,
    base_step_s: f64,
) -> Vec<Row> {
    let (dp, pp) = (args.dp, args.dp_pp);
    let mut rows = Vec::new();
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::Interleaved] {
        let mut after_drain = f64::NAN;
        for averaging in [Averaging::AfterDrain, Averaging::Overlapped] {
            let name = format!("dp {dp} x pp {pp} {kind} {averaging}");
            let mut rounds: Vec<Vec<RankRun>> = Vec::new();
            for round in 0..args.repeats {
                eprintln!("round {}/{}: {name}", round + 1, args.repeats);
                let runs = launch(dp * pp, |ctx| {
                    rank(args, config, data, kind, averaging, ctx)
                })
                .into_iter()
                .map(|result| result.unwrap_or_else(|e| panic!("{name}: {e}")))
                .collect();
                rounds.push(runs);
            }
            let step_s = median(rounds.iter().flat_map(|r| r[0].step_s.clone()));
            // World rank = dp coordinate * pp + stage.
            let wait_ms_per_stage =
                (0..pp)
                    .map(|stage| {
                        1e3 * median(rounds.iter().flat_map(|r| {
                            (0..dp).flat_map(move |d| r[d * pp + stage].wait_s.clone())
                        }))
                    })
                    .collect();
            if averaging == Averaging::AfterDrain {
                after_drain = step_s;
            }
            rows.push(Row {
                name,
                dp,
                pp,
                schedule: kind.to_string(),
                averaging: averaging.to_string(),
                step_s,
                throughput_vs_base: dp as f64 * base_step_s / step_s,
                speedup_vs_after_drain: after_drain / step_s,
                wait_ms_per_stage,
                overlapped_buckets: rounds[0][0].overlapped_buckets,
                buckets: rounds[0][0].buckets,
            });
        }
    }
    rows
}

pub fn print(rows: &[Row]) {
    println!(
        "\n{:<40} {:>8} {:>13} {:>13} {:<22} {:>10}",
        "layout", "step s", "samples/s vs", "vs after", "exposed wait ms", "overlapped"
    );
    println!(
        "{:<40} {:>8} {:>13} {:>13} {:<22} {:>10}",
        "", "", "base", "drain", "per stage", "buckets"
    );
    for row in rows {
        let wait = row
            .wait_ms_per_stage
            .iter()
            .map(|w| format!("{w:.1}"))
            .collect::<Vec<_>>()
            .join(" / ");
        println!(
            "{:<40} {:>8.3} {:>12.2}x {:>12.2}x {:<22} {:>4} of {:<3}",
            row.name,
            row.step_s,
            row.throughput_vs_base,
            row.speedup_vs_after_drain,
            wait,
            row.overlapped_buckets,
            row.buckets
        );
    }
    println!(
        "\nexposed wait: from the end of a rank's pipeline work to its averaged gradients; overlapped buckets: those started while the rank's backwards were still running (rank 0, last step)"
    );
}

fn rank(
    args: &Args,
    config: &LlamaConfig,
    data: &MarkovSource,
    kind: ScheduleKind,
    averaging: Averaging,
    ctx: RankContext,
) -> Result<RankRun, TrainError> {
    let device = Default::default();
    let (dp, pp, m) = (args.dp, args.dp_pp, args.micro_batches);
    let v = if kind == ScheduleKind::Interleaved {
        2
    } else {
        1
    };
    let mesh = ctx.mesh(&[("dp", dp), ("pp", pp)])?;
    let (replica, world) = (mesh.coord("dp")?, ctx.world());
    let executor =
        PipelineExecutor::new(Schedule::new(kind, pp, m, v)?, mesh.group("pp")?.clone())?;
    let mut chunks = seeded_chunks(config, &executor, pp, v)?;
    let bucket_bytes = (args.bucket_mb * 1024.0 * 1024.0) as usize;
    let ddp = DdpConfig::new().with_bucket_cap_bytes(bucket_bytes.max(1));
    let mut sync = GradientSync::new(&chunks, mesh.group("dp")?.clone(), ddp)?;
    let mut optimizer = AdamWConfig::new().init::<B, Vec<Llama<B>>>();
    let message = Message::new(
        [args.batch_size / m, args.seq_len, config.hidden_size],
        DType::F32,
    );
    let mut measured = RankRun {
        step_s: Vec::new(),
        wait_s: Vec::new(),
        overlapped_buckets: 0,
        buckets: 0,
    };
    for step in 0..args.steps {
        // Each replica reads its own samples.
        let batches: Vec<MicroBatch<B>> = (0..m)
            .map(|mb| micro_batch(data, args, step * dp + replica, mb))
            .collect();
        world.barrier()?;
        let begun = Instant::now();
        let (grads, wait) = match averaging {
            Averaging::AfterDrain => {
                let out = executor.step(&chunks, &batches, message, 1.0, &device, begun)?;
                let drained = Instant::now();
                (sync.average(&chunks, out.grads)?, drained.elapsed())
            }
            Averaging::Overlapped => {
                let mut sink = sync.begin(&chunks)?;
                executor.step_into(&chunks, &batches, message, &device, begun, &mut sink)?;
                let drained = Instant::now();
                (sink.finish()?, drained.elapsed())
            }
        };
        chunks = optimizer.step(1e-3, chunks, grads);
        world.barrier()?;
        if step > 0 {
            measured.step_s.push(begun.elapsed().as_secs_f64());
            measured.wait_s.push(wait.as_secs_f64());
        }
        measured.overlapped_buckets = sync.stats().overlapped_buckets;
        measured.buckets = sync.stats().buckets;
    }
    Ok(measured)
}
