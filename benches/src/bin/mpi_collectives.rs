//! Collective bandwidth of burn-comm's MPI transport against raw MPI on plain buffers and
//! against the local transport, measured in the same run, and of its TCP transport beside them.
//!
//! Started alone, it measures the local transport (ranks as threads) here, then starts itself
//! with torchrun's variables for each world size (the TCP transport: every process times
//! burn-comm's calls alone) and under `mpirun`; there every process times the same operations through
//! burn-comm's `Communicator` on burn tensors and through MPI's own `MPI_Allreduce`,
//! `MPI_Allgather`, `MPI_Reduce_scatter_block`, `MPI_Bcast`, `MPI_Alltoall` and `MPI_Sendrecv`
//! (a ring) on `Vec<f32>`, in turns of a tenth of the calls each, and rank 0 prints the rows
//! back as JSON lines. Raw MPI is timed twice: on a fresh input each call, allocated as
//! burn-comm's input tensor is, and on an input kept from call to call; both are copies of the
//! same values, as burn-comm's input is, made before the call. Raw MPI's output is kept
//! (burn-comm's comes from its pool of freed results). The ratio is against the faster. With
//! `--rounds`, every world's job runs that many times, in turn with the others, and a summary
//! gives each row's median ratio over the rounds with its range, against the targets.
//!
//! `cargo run --release -p benches --features mpi --bin mpi_collectives -- --help`

use std::ffi::c_int;
use std::time::{Duration, Instant};

use benches::collectives::{
    Op, elements, human, iterations, sizes, slowest_median, time_call, time_rank,
};
use burn::backend::Flex;
use burn::tensor::Tensor;
use burn_comm::{Communicator, Launcher, Process, launch};
use clap::Parser;
use mpi::ffi;
use serde::{Deserialize, Serialize};

#[derive(Parser, Clone)]
#[command(about = "burn-comm's MPI and TCP transports against raw MPI and the local transport")]
struct Args {
    /// World sizes to measure.
    #[arg(long, value_delimiter = ',', default_values_t = [2, 4])]
    worlds: Vec<usize>,
    /// Operations to measure.
    #[arg(long, value_delimiter = ',', default_values_t = Op::all())]
    ops: Vec<Op>,
    /// Smallest message, in bytes.
    #[arg(long, default_value_t = 4 << 10)]
    min_bytes: usize,
    /// Largest message, in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    max_bytes: usize,
    /// Each size is this factor times the previous one.
    #[arg(long, default_value_t = 4)]
    step: usize,
    /// Iterations of each size (default: enough for about 2 GB moved, within [5, 200]); a
    /// large count gives a profiler enough samples.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    iterations: Option<u64>,
    /// How many times each world's MPI job runs, the worlds taking turns; with more than one,
    /// a summary gives each row's median over the rounds (this VM's speed swings from run to
    /// run by more than the targets' margin).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/mpi_collectives.json")]
    json: String,
}

/// One measurement of the MPI job, sent back to the process that started it.
#[derive(Serialize, Deserialize)]
struct Measured {
    op: Op,
    world: usize,
    bytes: usize,
    iterations: usize,
    burn_comm_us: f64,
    /// Raw MPI on a fresh input each call, as burn-comm's is.
    raw_fresh_us: f64,
    /// Raw MPI on an input kept from call to call.
    raw_kept_us: f64,
}

#[derive(Serialize)]
struct Row {
    /// Which run of the world's MPI job, from 0.
    round: u64,
    op: Op,
    world: usize,
    bytes: usize,
    local_us: f64,
    /// burn-comm's TCP transport, processes started with torchrun's variables.
    tcp_us: f64,
    mpi_us: f64,
    raw_fresh_us: f64,
    raw_kept_us: f64,
    /// burn-comm's MPI algorithm bandwidth: the message's bytes over its time.
    mpi_algbw_gbps: f64,
    mpi_busbw_gbps: f64,
    /// Raw MPI's bus bandwidth, the faster of its two inputs.
    raw_busbw_gbps: f64,
    /// burn-comm's MPI bus bandwidth over raw MPI's (the time ratio raw / ours).
    mpi_over_raw: f64,
    /// burn-comm's TCP bus bandwidth over raw MPI's.
    tcp_over_raw: f64,
}

const ROW: &str = "MEASURED ";

fn main() {
    let args = Args::parse();
    match Launcher::from_env() {
        Launcher::Alone => orchestrate(args),
        launcher => {
            // Raw MPI only where MPI runs.
            let raw = launcher != Launcher::Torchrun;
            let process = Process::from_env()
                .expect("joined the job")
                .expect("started by a launcher");
            process.run(|ctx| {
                measure(ctx.world(), &args, raw);
                Ok::<_, burn_comm::CommError>(())
            });
        }
    }
}

fn orchestrate(args: Args) {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "burn-comm's MPI and TCP transports (processes) against raw MPI and the local transport (threads)"
    );
    println!("Flex backend, f32, {cores} cores; time: median over iterations of the slowest rank");
    println!(
        "algbw = size / time (GB/s); busbw = algbw x factor (all-reduce 2(n-1)/n, all-gather, reduce-scatter and all-to-all (n-1)/n, broadcast and send/recv 1)"
    );
    println!(
        "raw: MPI's own call on a fresh input each call, as burn-comm's is (a new tensor); kept: on an input kept from call to call; both copied from the same values before the call, as burn-comm's input is"
    );
    println!(
        "mpi, raw and kept take turns of a tenth of the calls each; mpi/raw: burn-comm's MPI bus bandwidth over raw MPI's, the faster of raw and kept"
    );
    println!(
        "tcp: burn-comm's TCP transport (processes started with torchrun's variables), in a job of its own before the MPI job; tcp/raw as mpi/raw\n"
    );
    println!(
        "{:<15} {:>5} {:>9} {:>11} {:>11} {:>11} {:>11} {:>11} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "op",
        "world",
        "size",
        "local (us)",
        "tcp (us)",
        "mpi (us)",
        "raw (us)",
        "kept (us)",
        "mpi algbw",
        "mpi busbw",
        "raw busbw",
        "mpi/raw",
        "tcp/raw"
    );
    let exe = std::env::current_exe().expect("the bench's own path");
    let mut rows = Vec::new();
    for round in 0..args.rounds {
        if args.rounds > 1 {
            println!("round {} of {}", round + 1, args.rounds);
        }
        for &world in &args.worlds {
            let tcp = run_tcp_job(&exe, world);
            for m in run_job(&exe, world) {
                let tcp_us = tcp
                    .iter()
                    .find(|t| (t.op, t.bytes) == (m.op, m.bytes))
                    .expect("the TCP job measured the same rows")
                    .burn_comm_us;
                let row = compare(round, world, m, tcp_us);
                print_row(&row);
                rows.push(row);
            }
        }
    }
    if args.rounds > 1 {
        summarise(&rows, args.rounds);
    }
    println!();
    benches::write_json(&args.json, &rows);
}

/// Runs the bench as an MPI job of `world` processes (this same command line) and reads back
/// rank 0's measurements.
fn run_job(exe: &std::path::Path, world: usize) -> Vec<Measured> {
    let mut command = burn_comm::mpirun(world);
    command.arg(exe).args(std::env::args().skip(1));
    let out = command
        .output()
        .expect("mpirun runs (install openmpi-bin and libopenmpi-dev)");
    assert!(
        out.status.success(),
        "the MPI job of {world} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix(ROW))
        .map(|l| serde_json::from_str(l).expect("a measurement"))
        .collect()
}

/// Runs the bench as a job of `world` processes started with torchrun's variables (the TCP
/// transport), as `burn-launch --torchrun-env` starts them, and reads back rank 0's
/// measurements.
fn run_tcp_job(exe: &std::path::Path, world: usize) -> Vec<Measured> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut ranks: Vec<_> = (0..world)
        .map(|rank| {
            std::process::Command::new(exe)
                .args(std::env::args().skip(1))
                .envs(burn_comm::ProcessEnv::on_this_machine(rank, world, port).vars())
                .stdout(match rank {
                    0 => std::process::Stdio::piped(),
                    _ => std::process::Stdio::null(),
                })
                .spawn()
                .expect("the bench starts itself")
        })
        .collect();
    let mut stdout = ranks[0].stdout.take().expect("rank 0's output is piped");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut text).map(|_| text)
    });
    // As a launcher does: one rank failing stops the others.
    let mut running = world;
    while running > 0 {
        running = 0;
        for rank in 0..world {
            match ranks[rank].try_wait().expect("a rank to wait for") {
                None => running += 1,
                Some(status) if status.success() => {}
                Some(status) => {
                    ranks.iter_mut().for_each(|r| drop(r.kill()));
                    panic!(
                        "rank {rank} of the TCP job of {world} ended with {status} (its error is above)"
                    );
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let text = reader.join().expect("the reader").expect("rank 0's output");
    text.lines()
        .filter_map(|l| l.strip_prefix(ROW))
        .map(|l| serde_json::from_str(l).expect("a measurement"))
        .collect()
}

/// One measurement of the MPI job beside the TCP job's time (`tcp_us`) and the local
/// transport's for the same call, measured now.
fn compare(round: u64, world: usize, m: Measured, tcp_us: f64) -> Row {
    let elems = m.bytes / 4;
    let local = launch(world, |ctx| {
        time_rank(ctx.world(), m.op, elems, m.iterations)
    })
    .into_iter()
    .map(|r| r.expect("rank failed"))
    .collect::<Vec<_>>();
    let local_us = slowest_median(&local).as_secs_f64() * 1e6;
    // The faster of raw MPI's two inputs: a fresh buffer for every call also slows MPI's own
    // allocations (2.4-2.9x for MPI_Allreduce of 1 MiB here).
    let best_raw = m.raw_fresh_us.min(m.raw_kept_us);
    let algbw = |us: f64| m.bytes as f64 / (us * 1e-6) / 1e9;
    let busbw = |us: f64| algbw(us) * m.op.bus_factor(world);
    Row {
        round,
        op: m.op,
        world,
        bytes: m.bytes,
        local_us,
        tcp_us,
        mpi_us: m.burn_comm_us,
        raw_fresh_us: m.raw_fresh_us,
        raw_kept_us: m.raw_kept_us,
        mpi_algbw_gbps: algbw(m.burn_comm_us),
        mpi_busbw_gbps: busbw(m.burn_comm_us),
        raw_busbw_gbps: busbw(best_raw),
        mpi_over_raw: best_raw / m.burn_comm_us,
        tcp_over_raw: best_raw / tcp_us,
    }
}

fn print_row(row: &Row) {
    println!(
        "{:<15} {:>5} {:>9} {:>11.1} {:>11.1} {:>11.1} {:>11.1} {:>11.1} {:>10.2} {:>10.2} {:>10.2} {:>8.2} {:>8.2}",
        row.op.name(),
        row.world,
        human(row.bytes),
        row.local_us,
        row.tcp_us,
        row.mpi_us,
        row.raw_fresh_us,
        row.raw_kept_us,
        row.mpi_algbw_gbps,
        row.mpi_busbw_gbps,
        row.raw_busbw_gbps,
        row.mpi_over_raw,
        row.tcp_over_raw
    );
}

/// Issue 22's targets: below `LATENCY_BELOW` bytes burn-comm within `LATENCY_FACTOR` of raw
/// MPI's time, from `BANDWIDTH_FROM` bytes at least `BANDWIDTH_SHARE` of its bus bandwidth.
const LATENCY_BELOW: usize = 64 << 10;
const LATENCY_FACTOR: f64 = 2.0;
const BANDWIDTH_FROM: usize = 1 << 20;
const BANDWIDTH_SHARE: f64 = 0.9;

/// Each row's median over the rounds of burn-comm's time and of its ratio to raw MPI (each
/// round's ratio is of times measured in turn in one job, so the VM's phase cancels in it),
/// with the ratio's range, judged against the targets.
fn summarise(rows: &[Row], rounds: u64) {
    println!(
        "\nmedian of {rounds} rounds (range); targets: below {} mpi/raw latency <= {LATENCY_FACTOR}x, from {} mpi/raw bus bandwidth >= {BANDWIDTH_SHARE}",
        human(LATENCY_BELOW),
        human(BANDWIDTH_FROM)
    );
    println!(
        "{:<15} {:>5} {:>9} {:>11} {:>11} {:>18} {:>7}",
        "op", "world", "size", "mpi (us)", "raw (us)", "figure", "target"
    );
    let mut keys: Vec<(Op, usize, usize)> = Vec::new();
    for row in rows {
        if !keys.contains(&(row.op, row.world, row.bytes)) {
            keys.push((row.op, row.world, row.bytes));
        }
    }
    let (mut met, mut missed) = (0, Vec::new());
    for (op, world, bytes) in keys {
        let of_key: Vec<&Row> = rows
            .iter()
            .filter(|r| (r.op, r.world, r.bytes) == (op, world, bytes))
            .collect();
        let med = |f: &dyn Fn(&Row) -> f64| benches::median(of_key.iter().map(|r| f(r)));
        // For small calls the figure is burn-comm's latency over raw MPI's, as its target is.
        let latency = bytes < LATENCY_BELOW;
        let figure = |r: &Row| match latency {
            true => 1.0 / r.mpi_over_raw,
            false => r.mpi_over_raw,
        };
        let value = med(&figure);
        let low = of_key
            .iter()
            .map(|r| figure(r))
            .fold(f64::INFINITY, f64::min);
        let high = of_key.iter().map(|r| figure(r)).fold(0.0, f64::max);
        let verdict = if latency {
            Some(value <= LATENCY_FACTOR)
        } else if bytes >= BANDWIDTH_FROM {
            Some(value >= BANDWIDTH_SHARE)
        } else {
            None
        };
        let unit = if latency { "x" } else { "" };
        let shown = format!("{value:.2}{unit} ({low:.2}-{high:.2})");
        match verdict {
            Some(true) => met += 1,
            Some(false) => {
                let size = human(bytes);
                missed.push(format!("{op} at {world} processes and {size}: {shown}"));
            }
            None => {}
        }
        println!(
            "{:<15} {:>5} {:>9} {:>11.1} {:>11.1} {:>18} {:>7}",
            op.name(),
            world,
            human(bytes),
            med(&|r| r.mpi_us),
            med(&|r| r.raw_fresh_us.min(r.raw_kept_us)),
            shown,
            match verdict {
                Some(true) => "met",
                Some(false) => "MISSED",
                None => "-",
            }
        );
    }
    let judged = met + missed.len();
    println!("\n{met} of {judged} rows meet their target in the median of {rounds} rounds");
    for miss in missed {
        println!("  missed: {miss}");
    }
}

/// Every process's side: burn-comm and, `with_raw` (MPI runs), raw MPI on the same sizes, in turns
/// (see [`turns`]); rank 0 prints the rows.
fn measure(world: &Communicator, args: &Args, with_raw: bool) {
    let n = world.size();
    for &op in &args.ops {
        for bytes in sizes(args.min_bytes, args.max_bytes, args.step) {
            let elems = elements(bytes, n);
            let iters = args
                .iterations
                .map_or_else(|| iterations(elems * 4), |n| n as usize);
            let values = vec![1.0f32; op.input_elems(elems, n)];
            let mut raw = with_raw.then(|| Raw::new(op, n, elems));
            // burn-comm, raw MPI on a fresh input, raw MPI on a kept one.
            let mut times: [Vec<Duration>; 3] = Default::default();
            let sides = if with_raw { 3 } else { 1 };
            for (turn, calls) in turns(iters).enumerate() {
                // A side's first call of a turn follows the other sides' calls: it is not
                // timed (nor, in the first turn, its second). The order rotates, so that no
                // side always follows the same one.
                let warm = if turn == 0 { 2 } else { 1 };
                for side in (0..sides).map(|s| (s + turn) % sides) {
                    for i in 0..warm + calls {
                        let time = match (side, raw.as_mut()) {
                            (1, Some(raw)) => raw.time(&values, true),
                            (2, Some(raw)) => raw.time(&values, false),
                            _ => time_call(world, op, &values).expect("burn-comm's collective"),
                        };
                        if i >= warm {
                            times[side].push(time);
                        }
                    }
                }
            }
            let [ours, fresh, kept] = times.map(|times| match times.is_empty() {
                true => Duration::ZERO,
                false => slowest_median(&gather(world, &times)),
            });
            if world.rank() == 0 {
                let m = Measured {
                    op,
                    world: n,
                    bytes: elems * 4,
                    iterations: iters,
                    burn_comm_us: ours.as_secs_f64() * 1e6,
                    raw_fresh_us: fresh.as_secs_f64() * 1e6,
                    raw_kept_us: kept.as_secs_f64() * 1e6,
                };
                println!("{ROW}{}", serde_json::to_string(&m).expect("serialises"));
            }
        }
    }
}

/// How many calls of each side each turn makes: `iters` in up to `TURNS` turns. Calls in a row
/// keep their state warm, as a run of calls of one size does; the turns spread this VM's
/// speed, which drifts over seconds, over all sides alike.
fn turns(iters: usize) -> impl Iterator<Item = usize> {
    let turns = iters.clamp(1, TURNS);
    (0..turns).map(move |t| iters * (t + 1) / turns - iters * t / turns)
}

const TURNS: usize = 10;

/// Every rank's times, in rank order.
fn gather(world: &Communicator, times: &[Duration]) -> Vec<Vec<Duration>> {
    // Microseconds, exact enough in f32 (the backend's float).
    let micros: Vec<f32> = times.iter().map(|t| t.as_secs_f32() * 1e6).collect();
    let len = micros.len();
    let mine = Tensor::<Flex, 1>::from_floats(micros.as_slice(), &Default::default());
    let all: Vec<f32> = world
        .all_gather(mine, 0)
        .expect("gathering the times")
        .into_data()
        .to_vec()
        .expect("f32 times");
    all.chunks(len)
        .map(|rank| {
            rank.iter()
                .map(|&us| Duration::from_secs_f32(us * 1e-6))
                .collect()
        })
        .collect()
}

/// This process's rank in MPI's world.
fn rank() -> usize {
    let mut rank: c_int = 0;
    // SAFETY: MPI is initialised (this runs inside `Process::run`).
    unsafe { ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank) };
    rank as usize
}

/// Raw MPI's side of one operation and size: MPI's own call on plain `Vec<f32>` buffers.
struct Raw {
    op: Op,
    n: usize,
    /// This process's rank.
    me: usize,
    elems: usize,
    /// An input kept from call to call (rewritten before each by a copy of the same values).
    kept: Vec<f32>,
    output: Vec<f32>,
}

impl Raw {
    fn new(op: Op, n: usize, elems: usize) -> Self {
        let out_len = match op {
            Op::ReduceScatter => elems / n,
            _ => elems,
        };
        Self {
            op,
            n,
            me: rank(),
            elems,
            kept: vec![1.0f32; op.input_elems(elems, n)],
            output: vec![0.0f32; out_len],
        }
    }

    /// One call, timed from a barrier, on a copy of `values`: a fresh one (allocated as
    /// burn-comm's input tensor is) or the kept input.
    fn time(&mut self, values: &[f32], fresh: bool) -> Duration {
        let (op, n, me, elems) = (self.op, self.n, self.me, self.elems);
        let mut copy = fresh.then(|| values.to_vec());
        let input = match copy.as_mut() {
            Some(copy) => copy.as_mut_slice(),
            None => {
                // Written before every call, as any tensor a model just computed is: MPI reads
                // data another core has just written much slower than data it read before (at
                // 64 KiB, 2.3x for MPI_Bcast here). Written by a copy, as burn-comm's input is,
                // not a fill: at 1 MiB, MPI_Alltoall read a buffer `memcpy` had written 1.23x
                // slower than one `memset` had (BENCHMARKS.md).
                self.kept.copy_from_slice(values);
                self.kept.as_mut_slice()
            }
        };
        let (next, previous) = (((me + 1) % n) as c_int, ((me + n - 1) % n) as c_int);
        // SAFETY: MPI is initialised (this runs inside `Process::run`); the buffers hold the
        // counts given, and every rank makes the same calls.
        unsafe {
            let comm = ffi::RSMPI_COMM_WORLD;
            let float = ffi::RSMPI_FLOAT;
            let sum = ffi::RSMPI_SUM;
            ffi::MPI_Barrier(comm);
            let start = Instant::now();
            let send = input.as_ptr().cast();
            let recv = self.output.as_mut_ptr().cast();
            match op {
                Op::AllReduce => {
                    ffi::MPI_Allreduce(send, recv, elems as c_int, float, sum, comm);
                }
                Op::AllGather => {
                    let part = (elems / n) as c_int;
                    ffi::MPI_Allgather(send, part, float, recv, part, float, comm);
                }
                Op::ReduceScatter => {
                    let part = (elems / n) as c_int;
                    ffi::MPI_Reduce_scatter_block(send, recv, part, float, sum, comm);
                }
                Op::Broadcast => {
                    // The root sends its input; the others receive into their output.
                    let buffer = if me == 0 {
                        input.as_mut_ptr().cast()
                    } else {
                        recv
                    };
                    ffi::MPI_Bcast(buffer, elems as c_int, float, 0, comm);
                }
                Op::AllToAll => {
                    let part = (elems / n) as c_int;
                    ffi::MPI_Alltoall(send, part, float, recv, part, float, comm);
                }
                Op::SendRecv => {
                    let count = elems as c_int;
                    ffi::MPI_Sendrecv(
                        send,
                        count,
                        float,
                        next,
                        0,
                        recv,
                        count,
                        float,
                        previous,
                        0,
                        comm,
                        ffi::RSMPI_STATUS_IGNORE,
                    );
                }
            }
            let elapsed = start.elapsed();
            ffi::MPI_Barrier(comm);
            elapsed
        }
    }
}
