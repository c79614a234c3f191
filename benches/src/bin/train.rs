//! Training throughput of data parallelism against single-device burn, measured in one run:
//! a plain burn loop (the baseline), DDP on 1 rank (its overhead), DDP on N ranks with and
//! without overlapping communication, and the parameter-server DataParallel, for a fixed
//! global batch (strong scaling) and a fixed per-rank batch (weak scaling).
//!
//! Every rank is one thread with one compute thread (burn's CPU backend is built without its
//! thread pool here), so N ranks need N cores to scale. With the `mpi` feature, DDP also runs as
//! N processes under `mpirun` (this bench starts itself), beside the same DDP as N threads. The
//! row "N independent runs" trains N single-device models at once without any communication:
//! the most this machine gives N concurrent ranks, the ceiling for weak scaling. Runs are
//! repeated in interleaved rounds (`--repeats`) so that drift of the machine's speed hits every
//! configuration alike.
//!
//! With the `flex-threads` feature burn's CPU backend has its thread pool, as a user's one
//! process does; thread ranks would then share one pool, so every row runs as processes: the
//! single device on one thread and on every core, and DDP as N processes computing on
//! cores / N threads each (as torchrun sets `OMP_NUM_THREADS`).
//!
//! `cargo run --release -p benches --bin train -- --help`

use benches::median;
use burn_ddp::DdpConfig;
use clap::Parser;
use llama::data::MarkovSource;
use llama::train::{StepMetrics, Strategy, TrainConfig};
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
    let runs = if cfg!(feature = "flex-threads") {
        pooled_runs(&base, n, b)
    } else {
        thread_runs(&base, n, b)
    };
    if let Some(which) = std::env::var_os(PROCESS_RUN) {
        // Started by `run_processes`: this process is one rank of that run.
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
        for (i, (_, name, config, ranks)) in runs.iter().enumerate() {
            eprintln!("round {}/{}: {name}", round + 1, args.repeats);
            let steps = match *ranks {
                Ranks::Processes { threads } => {
                    run_processes(&process_run(runs[i].0, name), config.dp, threads)
                }
                Ranks::Threads { copies } => run(config, copies, &data),
            };
            counted[i].extend_from_slice(&steps[args.warmup..]);
        }
    }

    println!(
        "{:<7} {:<28} {:>6} {:>6} {:>10} {:>8} {:>12} {:>8}",
        "scaling", "run", "ranks", "batch", "tokens/s", "step s", "comm wait ms", "vs base"
    );
    let mut rows: Vec<Row> = Vec::new();
    for ((scaling, name, config, ranks), steps) in runs.into_iter().zip(counted) {
        let copies = match ranks {
            Ranks::Threads { copies } => copies,
            Ranks::Processes { .. } => 1,
        };
        let tokens_per_s = median(steps.iter().map(|m| m.tokens_per_s));
        let baseline = rows
            .iter()
            .find(|r| r.scaling == scaling)
            .map_or(tokens_per_s, |r| r.tokens_per_s);
        let row = Row {
            scaling,
            name,
            ranks: config.dp * copies,
            global_batch: config.batch_size * copies,
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
    if !cfg!(feature = "flex-threads") {
        let overhead = 100.0 * (1.0 / rows[1].speedup - 1.0);
        println!("DDP on 1 rank costs {overhead:+.1}% step time against the plain loop");
    }

    benches::write_json(&args.json, &rows);
}

/// How a run's ranks are started.
#[derive(Clone, Copy)]
enum Ranks {
    /// Threads of this process; `copies` independent runs at once.
    Threads { copies: usize },
    /// Processes (under mpirun when more than one), each computing on `threads` threads of
    /// burn's CPU backend (`RAYON_NUM_THREADS`; one without the `flex-threads` feature).
    Processes { threads: usize },
}

/// A run of the table: its scaling, name, config and how its ranks start.
type Run = (&'static str, String, TrainConfig, Ranks);

/// The runs with ranks as threads of one compute thread each, and with the `mpi` feature DDP
/// as processes beside them.
fn thread_runs(
    base: &dyn Fn(Strategy, usize, usize) -> TrainConfig,
    n: usize,
    b: usize,
) -> Vec<Run> {
    let one = Ranks::Threads { copies: 1 };
    let mut ddp_serial = base(Strategy::Ddp, n, b);
    ddp_serial.ddp = DdpConfig::new().with_overlap(false);
    let mut weak_serial = base(Strategy::Ddp, n, b * n);
    weak_serial.ddp = DdpConfig::new().with_overlap(false);
    let mut runs: Vec<Run> = vec![
        (
            "strong",
            "single-device burn".into(),
            base(Strategy::Single, 1, b),
            one,
        ),
        (
            "strong",
            "DDP, 1 rank".into(),
            base(Strategy::Ddp, 1, b),
            one,
        ),
        (
            "strong",
            format!("DDP, {n} ranks"),
            base(Strategy::Ddp, n, b),
            one,
        ),
        (
            "strong",
            format!("DDP, {n} ranks, no overlap"),
            ddp_serial,
            one,
        ),
        (
            "strong",
            format!("DataParallel, {n} ranks"),
            base(Strategy::ParameterServer, n, b),
            one,
        ),
        (
            "weak",
            "single-device burn".into(),
            base(Strategy::Single, 1, b),
            one,
        ),
        (
            "weak",
            format!("{n} independent runs"),
            base(Strategy::Single, 1, b),
            Ranks::Threads { copies: n },
        ),
        (
            "weak",
            format!("DDP, {n} ranks"),
            base(Strategy::Ddp, n, b * n),
            one,
        ),
        (
            "weak",
            format!("DDP, {n} ranks, no overlap"),
            weak_serial,
            one,
        ),
        (
            "weak",
            format!("DataParallel, {n} ranks"),
            base(Strategy::ParameterServer, n, b * n),
            one,
        ),
    ];
    if cfg!(feature = "mpi") {
        let processes = Ranks::Processes { threads: 1 };
        let strong = (
            "strong",
            format!("DDP, {n} processes"),
            base(Strategy::Ddp, n, b),
            processes,
        );
        runs.insert(3, strong);
        let weak = runs.iter().position(|r| r.0 == "weak").expect("weak runs") + 3;
        let config = base(Strategy::Ddp, n, b * n);
        runs.insert(
            weak,
            ("weak", format!("DDP, {n} processes"), config, processes),
        );
    }
    runs
}

/// The runs with burn's CPU backend's thread pool: every one a process, so that no two ranks
/// share a pool. The single device on one thread (the base) and on every core; DDP as `n`
/// processes on `cores / n` threads each.
fn pooled_runs(
    base: &dyn Fn(Strategy, usize, usize) -> TrainConfig,
    n: usize,
    b: usize,
) -> Vec<Run> {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let on = |threads| Ranks::Processes { threads };
    let mut runs = Vec::new();
    for (scaling, batch) in [("strong", b), ("weak", b * n)] {
        let single = base(Strategy::Single, 1, b);
        runs.push((
            scaling,
            "single-device burn, 1 thread".into(),
            single.clone(),
            on(1),
        ));
        let name = format!("single-device burn, {cores} threads");
        runs.push((scaling, name, single, on(cores)));
        let threads = (cores / n).max(1);
        let name = format!("DDP, {n} processes x {threads} threads");
        runs.push((scaling, name, base(Strategy::Ddp, n, batch), on(threads)));
    }
    runs
}

/// Names the run that a process started by this bench is a rank of.
const PROCESS_RUN: &str = "BENCH_TRAIN_PROCESS_RUN";

/// The value of [`PROCESS_RUN`] for run `name` of `scaling` (the names repeat across scalings).
fn process_run(scaling: &str, name: &str) -> String {
    format!("{scaling}: {name}")
}

/// The run `name` as `ranks` processes (under mpirun when more than one), each computing on
/// `threads` threads; returns rank 0's step metrics.
fn run_processes(name: &str, ranks: usize, threads: usize) -> Vec<StepMetrics> {
    let exe = std::env::current_exe().expect("the bench's own path");
    let mut command = match ranks {
        1 => std::process::Command::new(exe),
        _ => {
            let mut mpirun = burn_comm::mpirun(ranks);
            mpirun.arg(exe);
            mpirun
        }
    };
    let out = command
        .args(std::env::args().skip(1))
        .env(PROCESS_RUN, name)
        .env("RAYON_NUM_THREADS", threads.to_string())
        .output()
        .expect("the bench starts itself (mpirun: install openmpi-bin)");
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

/// One rank of a run started by `run_processes`: trains `config` as this process's rank (the
/// only one for a single device).
fn run_as_process(config: &TrainConfig, data: &MarkovSource) {
    let print = |m: &StepMetrics| {
        println!("{STEP}{}", serde_json::to_string(m).expect("serialises"));
    };
    if config.dp == 1 {
        llama::cpu::train(config, data, &mut |m| print(m)).unwrap_or_else(|e| panic!("{e}"));
        return;
    }
    let process = burn_comm::Process::from_env()
        .expect("joined the MPI job")
        .expect("started by mpirun");
    process.run(|ctx| {
        let lead = ctx.rank() == 0;
        let mut config = config.clone();
        config.process = Some(ctx);
        llama::cpu::train(&config, data, &mut |m| {
            if lead {
                print(m);
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
                    llama::cpu::train(config, data, &mut |m| steps.push(*m))
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
