//! Pipeline parallelism against single-device burn, measured in one run: the step time of the
//! plain burn loop accumulating gradients over the same micro-batches (the baseline) and of the
//! Llama model cut into pp stages under every schedule, with and without activation recompute.
//!
//! For each schedule it prints the bubble three ways: measured (idle time over the ranks' total,
//! from the executor's timestamps of the step), simulated by `burn_pipeline::simulate` with
//! each action's cost calibrated from the measured durations, and the papers' formula with those
//! costs. Memory is per rank: the most heap the rank's thread held during the step above what it
//! held before, less the gradients it holds at the end, so mostly the activations kept for
//! backward. It is also given in micro-batches, the unit of `Timeline::peak_activations`: one
//! micro-batch's activations on one device (measured by the baseline) over pp.
//!
//! Ranks are threads with one compute thread each, so pp 4 on a 2-core machine is
//! oversubscribed: waiting for a core then counts as busy, and the measured bubble is a lower
//! bound. A tensor received from another rank stays charged to its sender.
//!
//! Then dp x pp (`--dp`, `--dp-pp`): the replicas of each stage average their gradients after
//! the pipeline has drained or overlapped with its last backwards ([`dp`]).
//!
//! `cargo run --release -p benches --bin pipeline -- --help`

mod dp;

use std::time::Instant;

use benches::memory::{
    CountingAllocator, reset_slot_peak, set_slot, slot_live_bytes, slot_peak_bytes,
};
use benches::{median, token_batch};
use burn::backend::{Autodiff, Flex};
use burn::optim::{AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::DType;
use burn_comm::{Communicator, launch};
use burn_pipeline::{
    Costs, Kind, Message, PipelineExecutor, Schedule, ScheduleKind, Span, Timeline, simulate,
};
use clap::Parser;
use llama::data::MarkovSource;
use llama::pipeline::{MicroBatch, split};
use llama::train::TrainError;
use llama::{Llama, LlamaConfig};
use serde::Serialize;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

type B = Autodiff<Flex>;

#[derive(Parser)]
#[command(about = "Pipeline schedules against single-device burn: time, bubble, memory")]
struct Args {
    /// Model preset (interleaved pp 4 needs 8 blocks).
    #[arg(long, default_value = "small")]
    model: String,
    /// Samples per step, split into the micro-batches.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 8)]
    micro_batches: usize,
    /// Tokens per sample.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// Pipeline ranks to measure.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    pp: Vec<usize>,
    /// Steps per run; the first is not counted.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Rounds over all configurations; the medians pool the rounds.
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// Data-parallel replicas of the dp x pp comparison (0 skips it).
    #[arg(long, default_value_t = 2)]
    dp: usize,
    /// Pipeline ranks of the dp x pp comparison.
    #[arg(long, default_value_t = 2)]
    dp_pp: usize,
    /// DDP bucket size in MiB for the dp x pp comparison (small, so the model makes several).
    #[arg(long, default_value_t = 1.0)]
    bucket_mb: f64,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/pipeline.json")]
    json: String,
}

/// One configuration; `pp: None` is the plain single-device loop.
#[derive(Clone, Copy)]
struct Layout {
    pp: Option<usize>,
    kind: ScheduleKind,
    recompute: bool,
}

impl Layout {
    fn virtual_stages(&self) -> usize {
        if self.kind == ScheduleKind::Interleaved {
            2
        } else {
            1
        }
    }

    fn name(&self) -> String {
        let Some(pp) = self.pp else {
            return "single-device burn".into();
        };
        let v = match self.virtual_stages() {
            1 => String::new(),
            v => format!(" v{v}"),
        };
        let recompute = if self.recompute { " +recompute" } else { "" };
        format!("pp {pp} {}{v}{recompute}", self.kind)
    }
}

/// What one rank measured in each counted step.
struct RankRun {
    step_s: Vec<f64>,
    spans: Vec<Vec<Span>>,
    /// Peak heap above the step's start, less what is held at its end (the gradients).
    activation_bytes: Vec<f64>,
}

#[derive(Serialize)]
struct Row {
    name: String,
    pp: usize,
    schedule: String,
    virtual_stages: usize,
    recompute: bool,
    step_s: f64,
    speedup: f64,
    bubble_measured: f64,
    bubble_simulated: f64,
    bubble_formula: f64,
    calibrated_costs_ms: Option<Costs>,
    activation_mb_per_rank: Vec<f64>,
    activation_micro_batches_per_rank: Vec<f64>,
    simulated_micro_batches_per_rank: Vec<f64>,
}

fn main() {
    let args = Args::parse();
    assert!(
        args.steps >= 2,
        "--steps must be at least 2: the first is not counted"
    );
    assert!(
        args.micro_batches >= 1 && args.batch_size.is_multiple_of(args.micro_batches),
        "--batch-size {} must be a multiple of --micro-batches {}",
        args.batch_size,
        args.micro_batches
    );
    assert!(
        args.dp == 0 || args.dp_pp >= 2,
        "--dp-pp {} must be at least 2: a pipeline has two stages or more",
        args.dp_pp
    );
    assert!(
        args.bucket_mb.is_finite() && args.bucket_mb > 0.0,
        "--bucket-mb {} must be a positive number of MiB",
        args.bucket_mb
    );
    let config = benches::preset(&args.model);
    let data = MarkovSource::new(16, 3, args.seq_len, 4096, 1);
    println!(
        "{} ({:.1}M parameters, {} layers), batch {} x {} tokens in {} micro-batches, {} steps per run (1 not counted), {} rounds",
        args.model,
        config.num_params() as f64 / 1e6,
        config.num_hidden_layers,
        args.batch_size,
        args.seq_len,
        args.micro_batches,
        args.steps,
        args.repeats
    );
    let mut layouts = vec![Layout {
        pp: None,
        kind: ScheduleKind::Gpipe,
        recompute: false,
    }];
    for &pp in &args.pp {
        for kind in [
            ScheduleKind::Gpipe,
            ScheduleKind::OneFOneB,
            ScheduleKind::Interleaved,
            ScheduleKind::ZeroBubbleH1,
        ] {
            for recompute in [false, true] {
                layouts.push(Layout {
                    pp: Some(pp),
                    kind,
                    recompute,
                });
            }
        }
    }
    let mut runs: Vec<Vec<Vec<RankRun>>> = (0..layouts.len()).map(|_| Vec::new()).collect();
    for round in 0..args.repeats {
        for (i, layout) in layouts.iter().enumerate() {
            eprintln!("round {}/{}: {}", round + 1, args.repeats, layout.name());
            runs[i].push(run(&args, &config, &data, *layout));
        }
    }

    let mut rows: Vec<Row> = Vec::new();
    let mut base_step = f64::NAN;
    let mut base_activation = f64::NAN;
    for (layout, rounds) in layouts.iter().zip(&runs) {
        let step_s = median(
            rounds
                .iter()
                .flat_map(|ranks| ranks[0].step_s.iter().copied()),
        );
        let ranks = layout.pp.unwrap_or(1);
        let activation: Vec<f64> = (0..ranks)
            .map(|r| {
                median(
                    rounds
                        .iter()
                        .flat_map(|run| run[r].activation_bytes.clone()),
                )
            })
            .collect();
        let Some(pp) = layout.pp else {
            base_step = step_s;
            base_activation = activation[0];
            rows.push(Row {
                name: layout.name(),
                pp: 1,
                schedule: "-".into(),
                virtual_stages: 1,
                recompute: false,
                step_s,
                speedup: 1.0,
                bubble_measured: 0.0,
                bubble_simulated: 0.0,
                bubble_formula: 0.0,
                calibrated_costs_ms: None,
                activation_mb_per_rank: vec![activation[0] / 1e6],
                activation_micro_batches_per_rank: vec![1.0],
                simulated_micro_batches_per_rank: vec![1.0],
            });
            continue;
        };
        let v = layout.virtual_stages();
        let schedule = Schedule::new(layout.kind, pp, args.micro_batches, v)
            .expect("the bench's schedules are valid");
        let timelines: Vec<Timeline> = rounds
            .iter()
            .flat_map(|run| {
                (0..run[0].spans.len()).map(move |step| Timeline {
                    ranks: run.iter().map(|rank| rank.spans[step].clone()).collect(),
                    virtual_stages: v,
                })
            })
            .collect();
        let costs = calibrate(&timelines, v);
        let simulated = simulate(&schedule, &costs).expect("a valid schedule simulates");
        let unit = base_activation / pp as f64;
        rows.push(Row {
            name: layout.name(),
            pp,
            schedule: layout.kind.to_string(),
            virtual_stages: v,
            recompute: layout.recompute,
            step_s,
            speedup: base_step / step_s,
            bubble_measured: median(timelines.iter().map(Timeline::bubble)),
            bubble_simulated: simulated.bubble(),
            bubble_formula: schedule.bubble_formula(&costs),
            calibrated_costs_ms: Some(Costs {
                forward: costs.forward * 1e3,
                backward_input: costs.backward_input * 1e3,
                backward_weight: costs.backward_weight * 1e3,
                send: costs.send * 1e3,
            }),
            activation_mb_per_rank: activation.iter().map(|b| b / 1e6).collect(),
            activation_micro_batches_per_rank: activation.iter().map(|b| b / unit).collect(),
            simulated_micro_batches_per_rank: if layout.recompute {
                // One chunk's forward is redone at a time; only stage inputs wait.
                vec![1.0 / v as f64; pp]
            } else {
                simulated.peak_activations()
            },
        });
    }
    print_tables(&rows);
    let dp_rows = if args.dp > 0 {
        let dp_rows = dp::measure(&args, &config, &data, base_step);
        dp::print(&dp_rows);
        dp_rows
    } else {
        Vec::new()
    };
    benches::write_json(
        &args.json,
        &Results {
            pipeline: rows,
            dp_pp: dp_rows,
        },
    );
}

#[derive(Serialize)]
struct Results {
    pipeline: Vec<Row>,
    dp_pp: Vec<dp::Row>,
}

fn print_tables(rows: &[Row]) {
    println!(
        "\n{:<28} {:>8} {:>7} {:>9} {:>9} {:>9}   {:<30}",
        "layout",
        "step s",
        "vs base",
        "bubble",
        "simulated",
        "formula",
        "costs ms F / I / W / send"
    );
    for row in rows {
        let costs = row.calibrated_costs_ms.map_or(String::new(), |c| {
            format!(
                "{:.1} / {:.1} / {:.1} / {:.2}",
                c.forward, c.backward_input, c.backward_weight, c.send
            )
        });
        println!(
            "{:<28} {:>8.3} {:>6.2}x {:>9.3} {:>9.3} {:>9.3}   {costs}",
            row.name,
            row.step_s,
            row.speedup,
            row.bubble_measured,
            row.bubble_simulated,
            row.bubble_formula
        );
    }
    println!(
        "\n{:<28} {:<28} {:<24} {:<24}",
        "layout", "activations MB per rank", "in micro-batches", "simulated"
    );
    let list = |values: &[f64], digits: usize| {
        values
            .iter()
            .map(|v| format!("{v:.digits$}"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    for row in rows {
        println!(
            "{:<28} {:<28} {:<24} {:<24}",
            row.name,
            list(&row.activation_mb_per_rank, 1),
            list(&row.activation_micro_batches_per_rank, 2),
            list(&row.simulated_micro_batches_per_rank, 2)
        );
    }
    println!(
        "\nbubble: idle (waiting, sending, receiving) over the ranks' total time, from the first action to the last; simulated and formula use the measured median cost of each kind of action (a rank's whole share, F / I / W; I is the whole backward outside zero-bubble)"
    );
    println!(
        "activations: the most heap a rank held during the step above its start, less the gradients it holds at the end; in micro-batches: over one micro-batch's activations on one device / pp; simulated: Timeline::peak_activations, or with recompute one chunk (1/v) besides the stage inputs kept"
    );
}

/// Each kind's median duration over the counted steps, as a rank's whole share (a chunk does
/// `1 / v` of it). The first stage's input half of zero-bubble has nothing to do, so it is left
/// out of the median.
fn calibrate(timelines: &[Timeline], virtual_stages: usize) -> Costs {
    let spans = || timelines.iter().flat_map(|t| t.ranks.iter().flatten());
    let cost = |pick: &dyn Fn(&Span) -> bool| {
        let durations = spans().filter(|s| pick(s)).map(|s| s.end - s.start);
        let value = median(durations);
        if value.is_nan() { 0.0 } else { value }
    };
    let v = virtual_stages as f64;
    let whole = cost(&|s| s.action.kind == Kind::Backward);
    let input_half = cost(&|s| s.action.kind == Kind::BackwardInput && s.action.stage > 0);
    Costs {
        forward: cost(&|s| s.action.kind == Kind::Forward) * v,
        backward_input: (whole + input_half) * v,
        backward_weight: cost(&|s| s.action.kind == Kind::BackwardWeight) * v,
        send: cost(&|s| matches!(s.action.kind, Kind::SendForward | Kind::SendBackward)),
    }
}

/// This rank's chunks of the seeded model cut into `pp * v` stages.
fn seeded_chunks(
    config: &LlamaConfig,
    executor: &PipelineExecutor,
    pp: usize,
    v: usize,
) -> Result<Vec<Llama<B>>, TrainError> {
    let ranges = split(config, pp, v)?;
    let mut stages: Vec<Option<Llama<B>>> = Llama::init(config, 42, &Default::default())
        .cut(&ranges)
        .into_iter()
        .map(Some)
        .collect();
    Ok(executor
        .stages()
        .iter()
        .map(|&s| stages[s].take().expect("each stage once"))
        .collect())
}

/// Micro-batch `mb` of step `step`: `[micro, seq]` inputs and their next tokens.
fn micro_batch(data: &MarkovSource, args: &Args, step: usize, mb: usize) -> MicroBatch<B> {
    let micro = args.batch_size / args.micro_batches;
    token_batch(
        data,
        step * args.batch_size + mb * micro,
        micro,
        args.seq_len,
    )
}

/// Runs `layout` and returns each rank's measurements.
fn run(args: &Args, config: &LlamaConfig, data: &MarkovSource, layout: Layout) -> Vec<RankRun> {
    let ranks = layout.pp.unwrap_or(1);
    let origin = Instant::now();
    launch(ranks, |ctx| {
        let comm = ctx.world();
        set_slot(comm.rank() + 1);
        match layout.pp {
            None => single_device(args, config, data),
            Some(_) => pipeline_rank(args, config, data, layout, comm, origin),
        }
    })
    .into_iter()
    .map(|result| result.unwrap_or_else(|e| panic!("{}: {e}", layout.name())))
    .collect()
}

/// The heap this thread's slot held: (peak above `before`, held now above `before`).
fn measured_since(slot: usize, before: usize) -> f64 {
    let peak = slot_peak_bytes(slot) as f64 - before as f64;
    let held = slot_live_bytes(slot) as f64 - before as f64;
    peak - held
}

fn single_device(
    args: &Args,
    config: &LlamaConfig,
    data: &MarkovSource,
) -> Result<RankRun, TrainError> {
    let device = Default::default();
    let mut model = Llama::<B>::init(config, 42, &device);
    let mut optimizer = AdamWConfig::new().init::<B, Llama<B>>();
    let mut measured = RankRun {
        step_s: Vec::new(),
        spans: Vec::new(),
        activation_bytes: Vec::new(),
    };
    let m = args.micro_batches;
    for step in 0..args.steps {
        let batches: Vec<MicroBatch<B>> =
            (0..m).map(|mb| micro_batch(data, args, step, mb)).collect();
        reset_slot_peak(1);
        let before = slot_live_bytes(1);
        let begun = Instant::now();
        let mut accumulator = GradientsAccumulator::<Llama<B>>::new();
        for (inputs, targets) in batches {
            let loss = model.loss(inputs, targets)? / m as f64;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            accumulator.accumulate(&model, grads);
        }
        let activation = measured_since(1, before);
        model = optimizer.step(1e-3, model, accumulator.grads());
        if step > 0 {
            measured.step_s.push(begun.elapsed().as_secs_f64());
            measured.activation_bytes.push(activation);
        }
    }
    Ok(measured)
}

fn pipeline_rank(
    args: &Args,
    config: &LlamaConfig,
    data: &MarkovSource,
    layout: Layout,
    comm: &Communicator,
    origin: Instant,
) -> Result<RankRun, TrainError> {
    let device = Default::default();
    let (pp, v, m) = (comm.size(), layout.virtual_stages(), args.micro_batches);
    let slot = comm.rank() + 1;
    let schedule = Schedule::new(layout.kind, pp, m, v)?;
    let executor = PipelineExecutor::new(schedule, comm.clone())?.with_recompute(layout.recompute);
    let mut chunks = seeded_chunks(config, &executor, pp, v)?;
    let mut optimizer = AdamWConfig::new().init::<B, Vec<Llama<B>>>();
    let message = Message::new(
        [args.batch_size / m, args.seq_len, config.hidden_size],
        DType::F32,
    );
    let mut measured = RankRun {
        step_s: Vec::new(),
        spans: Vec::new(),
        activation_bytes: Vec::new(),
    };
    for step in 0..args.steps {
        let batches: Vec<MicroBatch<B>> =
            (0..m).map(|mb| micro_batch(data, args, step, mb)).collect();
        comm.barrier()?;
        reset_slot_peak(slot);
        let before = slot_live_bytes(slot);
        comm.barrier()?;
        let begun = Instant::now();
        let out = executor.step(&chunks, &batches, message, 1.0, &device, origin)?;
        let activation = measured_since(slot, before);
        chunks = optimizer.step(1e-3, chunks, out.grads);
        comm.barrier()?;
        if step > 0 {
            measured.step_s.push(begun.elapsed().as_secs_f64());
            measured.spans.push(out.spans);
            measured.activation_bytes.push(activation);
        }
    }
    Ok(measured)
}
