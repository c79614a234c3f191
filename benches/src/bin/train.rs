//! Training throughput of data parallelism against single-device burn, measured in one run:
//! a plain burn loop (the baseline), DDP on 1 rank (its overhead), DDP on N ranks with and
//! without overlapping communication, and the parameter-server DataParallel, for a fixed
//! global batch (strong scaling) and a fixed per-rank batch (weak scaling).
//!
//! Every rank is one thread with one compute thread (burn's CPU backend is built without its
//! thread pool here), so N ranks need N cores to scale. With the `mpi` feature, DDP also runs as
//! N processes under `mpirun` (this bench starts itself), beside the same DDP as N threads. The row "N independent runs" trains N
//! single-device models at once without any communication: the most this machine gives N
//! concurrent ranks, the ceiling for weak scaling. Runs are repeated in interleaved rounds
//! (`--repeats`) so that drift of the machine's speed hits every configuration alike.
//!
//! `cargo run --release -p benches --bin train -- --help`

use benches::median;
use burn::backend::{Autodiff, Flex};
use burn_ddp::DdpConfig;
use clap::Parser;
use llama::data::MarkovSource;
use llama::train::{StepMetrics, Strategy, TrainConfig, train};
use serde::Serialize;

#[derive(Parser)]
#[command(about = "Data-parallel training throughput against single-device burn")]
struct Args {
    /// Model preset.
    #[arg(long, default_value = "small")]
    model: String,
    /// Ranks of the data-parallel runs.
    #[arg(long, default_value_t = 2)]
    world: usize,
    /// Samples per step of the strong-scaling runs (all ranks together), and per rank of the
    /// weak-scaling runs.
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
    #[arg(long, default_value_t = 4)]
    repeats: usize,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/train.json")]
    json: String,
}

#[derive(Serialize)]
struct Row {
    scaling: &'static str,
    name: String,
    ranks: usize,
    global_batch: usize,
    tokens_per_s: f64,
    step_s: f64,
    /// Median wait for gradient communication after backward; null where it is not separable.
    comm_wait_ms: f64,
    speedup: f64,
}

fn main() {
    let args = Args::parse();
    assert!(args.steps > args.warmup, "--steps must exceed --warmup");
    let model = benches::preset(&args.model);
    let data = MarkovSource::new(16, 3, args.seq_len, 1 << 16, 1);
    println!(
        "{} ({:.1}M parameters), {} tokens per sample, {} steps per run ({} not counted)",
        args.model,
        model.num_params() as f64 / 1e6,
        args.seq_len,
        args.steps,
        args.warmup
    );

    let base = |strategy, ranks, batch| {
        let mut config = TrainConfig::new(model.clone(), args.steps);
        config.batch_size = batch;
        config.seq_len = args.seq_len;
        config.strategy = strategy;
        config.dp = ranks;
        config
    };
    let (n, b) = (args.world, args.batch_size);
    let mut ddp_serial = base(Strategy::Ddp, n, b);
    ddp_serial.ddp = DdpConfig::new().with_overlap(false);
    let mut weak_serial = base(Strategy::Ddp, n, b * n);
    weak_serial.ddp = DdpConfig::new().with_overlap(false);
    let mut runs: Vec<(&str, String, TrainConfig, usize)> = vec![
        (
            "strong",
            "single-device burn".into(),
            base(Strategy::Single, 1, b),
            1,
        ),
        ("strong", "DDP, 1 rank".into(), base(Strategy::Ddp, 1, b), 1),
        (
            "strong",
            format!("DDP, {n} ranks"),
            base(Strategy::Ddp, n, b),
            1,
        ),
        (
            "strong",
            format!("DDP, {n} ranks, no overlap"),
            ddp_serial,
            1,
        ),
        (
            "strong",
            format!("DataParallel, {n} ranks"),
            base(Strategy::ParameterServer, n, b),
            1,
        ),
        (
            "weak",
            "single-device burn".into(),
            base(Strategy::Single, 1, b),
            1,
        ),
        (
            "weak",
            format!("{n} independent runs"),
            base(Strategy::Single, 1, b),
            n,
        ),
        (
            "weak",
            format!("DDP, {n} ranks"),
            base(Strategy::Ddp, n, b * n),
            1,
        ),
        (
            "weak",
            format!("DDP, {n} ranks, no overlap"),
            weak_serial,
            1,
        ),
        (
            "weak",
            format!("DataParallel, {n} ranks"),
            base(Strategy::ParameterServer, n, b * n),
            1,
        ),
    ];

    if cfg!(feature = "mpi") {
        runs.insert(
            3,
            (
                "strong",
                format!("DDP, {n} processes"),
                base(Strategy::Ddp, n, b),
                0,
            ),
        );
        let weak = runs.iter().position(|r| r.0 == "weak").expect("weak runs") + 3;
        runs.insert(
            weak,
            (
                "weak",
                format!("DDP, {n} processes"),
                base(Strategy::Ddp, n, b * n),
                0,
            ),
        );
    }
    if let Some(which) = std::env::var_os(PROCESS_RUN) {
        // Started by `run_processes` under mpirun: this process is one rank of that run.
        let which = which.to_string_lossy();
        let config = &runs
            .iter()
            .find(|r| process_run(r.0, &r.1) == which)
            .expect("a run of this bench")
            .2;
        return run_as_process(config, &data);
    }

    // Interleaved rounds: every configuration once per round.
    let mut counted: Vec<Vec<StepMetrics>> = vec![Vec::new(); runs.len()];
    for round in 0..args.repeats {
        for (i, (_, name, config, copies)) in runs.iter().enumerate() {
            eprintln!("round {}/{}: {name}", round + 1, args.repeats);
            let steps = match copies {
                0 => run_processes(&process_run(runs[i].0, name), config.dp),
                copies => run(config, *copies, &data),
            };
            counted[i].extend_from_slice(&steps[args.warmup..]);
        }
    }

    println!(
        "{:<7} {:<28} {:>6} {:>6} {:>10} {:>8} {:>12} {:>8}",
        "scaling", "run", "ranks", "batch", "tokens/s", "step s", "comm wait ms", "vs base"
    );
    let mut rows: Vec<Row> = Vec::new();
    for ((scaling, name, config, copies), steps) in runs.into_iter().zip(counted) {
        let tokens_per_s = median(steps.iter().map(|m| m.tokens_per_s));
        let baseline = rows
            .iter()
            .find(|r| r.scaling == scaling)
            .map_or(tokens_per_s, |r| r.tokens_per_s);
        let row = Row {
            scaling,
            name,
            ranks: config.dp * copies.max(1),
            global_batch: config.batch_size * copies.max(1),
            tokens_per_s,
            step_s: median(steps.iter().map(|m| m.seconds)),
            comm_wait_ms: median(steps.iter().map(|m| m.comm_wait_s)) * 1e3,
            speedup: tokens_per_s / baseline,
        };
        let wait = if row.comm_wait_ms.is_nan() {
            "-".to_string()
        } else {
            format!("{:.2}", row.comm_wait_ms)
        };
        println!(
            "{:<7} {:<28} {:>6} {:>6} {:>10.0} {:>8.3} {:>12} {:>7.2}x",
            row.scaling,
            row.name,
            row.ranks,
            row.global_batch,
            row.tokens_per_s,
            row.step_s,
            wait,
            row.speedup
        );
        rows.push(row);
    }
    let overhead = 100.0 * (1.0 / rows[1].speedup - 1.0);
    println!("DDP on 1 rank costs {overhead:+.1}% step time against the plain loop");

    benches::write_json(&args.json, &rows);
}

/// Names the run that a process started under mpirun is a rank of.
const PROCESS_RUN: &str = "BENCH_TRAIN_PROCESS_RUN";

/// The value of [`PROCESS_RUN`] for run `name` of `scaling` (the names repeat across scalings).
fn process_run(scaling: &str, name: &str) -> String {
    format!("{scaling}: {name}")
}

/// The run `name` as `ranks` processes under mpirun, each computing on one thread; returns rank
/// 0's step metrics.
fn run_processes(name: &str, ranks: usize) -> Vec<StepMetrics> {
    let exe = std::env::current_exe().expect("the bench's own path");
    let out = burn_comm::mpirun(ranks)
        .arg(exe)
        .args(std::env::args().skip(1))
        .env(PROCESS_RUN, name)
        .output()
        .expect("mpirun runs (install openmpi-bin)");
    assert!(
        out.status.success(),
        "{name} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.strip_prefix(STEP))
        .map(|json| {
            let v: serde_json::Value = serde_json::from_str(json).expect("step metrics");
            let number = |key: &str| v[key].as_f64().unwrap_or(f64::NAN);
            StepMetrics {
                step: number("step") as usize,
                loss: number("loss"),
                lr: number("lr"),
                tokens: number("tokens") as usize,
                tokens_per_s: number("tokens_per_s"),
                seconds: number("seconds"),
                elapsed: number("elapsed"),
                comm_wait_s: number("comm_wait_s"),
                model_state_bytes: None,
                loss_scale: None,
                skipped: false,
                grad_norm: None,
                checkpoint_s: None,
                moe: None,
            }
        })
        .collect()
}

/// Rank 0's lines of step metrics, read back by `run_processes`.
const STEP: &str = "STEP ";

/// One rank of a run under mpirun: trains `config` as this process's rank.
fn run_as_process(config: &TrainConfig, data: &MarkovSource) {
    let process = burn_comm::Process::from_env()
        .expect("joined the MPI job")
        .expect("started by mpirun");
    process.run(|ctx| {
        let lead = ctx.rank() == 0;
        let mut config = config.clone();
        config.process = Some(ctx);
        train::<Autodiff<Flex>>(&config, data, &Default::default(), &mut |m| {
            if lead {
                println!("{STEP}{}", serde_json::to_string(m).expect("serialises"));
            }
        })
        .map(drop)
    });
}

/// Trains `config`, or `copies` independent single-device copies of it at once; returns every
/// step's metrics, with the copies' throughputs added up step by step.
fn run(config: &TrainConfig, copies: usize, data: &MarkovSource) -> Vec<StepMetrics> {
    let runs: Vec<Vec<StepMetrics>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..copies)
            .map(|_| {
                scope.spawn(|| {
                    let mut steps = Vec::new();
                    train::<Autodiff<Flex>>(config, data, &Default::default(), &mut |m| {
                        steps.push(*m)
                    })
                    .unwrap_or_else(|e| panic!("{e}"));
                    steps
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut total = runs[0].clone();
    for other in &runs[1..] {
        for (step, theirs) in total.iter_mut().zip(other) {
            step.tokens_per_s += theirs.tokens_per_s;
            step.seconds = step.seconds.max(theirs.seconds);
        }
    }
    total
}
