//! Collective bandwidth of burn-comm's MPI transport against raw MPI on plain buffers and
//! against the local transport, measured in the same run.
//!
//! Started alone, it measures the local transport (ranks as threads) here, then starts itself
//! under `mpirun` for each world size; there every process times the same operations through
//! burn-comm's `Communicator` on burn tensors and through MPI's own `MPI_Allreduce`,
//! `MPI_Allgather`, `MPI_Reduce_scatter_block`, `MPI_Bcast`, `MPI_Alltoall` and `MPI_Sendrecv`
//! (a ring) on `Vec<f32>`, and rank 0 prints
//! the rows back as JSON lines.
//!
//! `cargo run --release -p benches --features mpi --bin mpi_collectives -- --help`

use std::ffi::c_int;
use std::time::{Duration, Instant};

use benches::collectives::{Op, elements, human, iterations, sizes, slowest_median, time_rank};
use burn::backend::Flex;
use burn::tensor::Tensor;
use burn_comm::{Communicator, Launcher, Process, launch};
use clap::Parser;
use mpi::ffi;
use serde::{Deserialize, Serialize};

#[derive(Parser, Clone)]
#[command(about = "burn-comm's MPI transport against raw MPI and the local transport")]
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
    raw_mpi_us: f64,
}

#[derive(Serialize)]
struct Row {
    op: Op,
    world: usize,
    bytes: usize,
    local_us: f64,
    mpi_us: f64,
    raw_mpi_us: f64,
    mpi_busbw_gbps: f64,
    raw_busbw_gbps: f64,
    /// burn-comm's MPI bus bandwidth over raw MPI's (the time ratio raw / ours).
    mpi_over_raw: f64,
}

const ROW: &str = "MEASURED ";

fn main() {
    let args = Args::parse();
    match Launcher::from_env() {
        Launcher::Alone => orchestrate(args),
        _ => {
            let process = Process::from_env()
                .expect("joined the MPI job")
                .expect("started by mpirun");
            process.run(|ctx| {
                measure(ctx.world(), &args);
                Ok::<_, burn_comm::CommError>(())
            });
        }
    }
}

fn orchestrate(args: Args) {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "burn-comm's MPI transport (processes) against raw MPI and the local transport (threads)"
    );
    println!("Flex backend, f32, {cores} cores; time: median over iterations of the slowest rank");
    println!(
        "busbw = algbw x factor (all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, broadcast 1)"
    );
    println!("mpi/raw: burn-comm's MPI bus bandwidth over raw MPI's on the same buffers\n");
    println!(
        "{:<15} {:>5} {:>9} {:>11} {:>11} {:>11} {:>10} {:>10} {:>8}",
        "op",
        "world",
        "size",
        "local (us)",
        "mpi (us)",
        "raw (us)",
        "mpi busbw",
        "raw busbw",
        "mpi/raw"
    );
    let exe = std::env::current_exe().expect("the bench's own path");
    let mut rows = Vec::new();
    for &world in &args.worlds {
        let mut command = burn_comm::mpirun(world);
        command.arg(&exe).args(std::env::args().skip(1));
        let out = command
            .output()
            .expect("mpirun runs (install openmpi-bin and libopenmpi-dev)");
        assert!(
            out.status.success(),
            "the MPI job of {world} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let measured: Vec<Measured> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_prefix(ROW))
            .map(|l| serde_json::from_str(l).expect("a measurement"))
            .collect();
        for m in measured {
            let elems = m.bytes / 4;
            let local = launch(world, |ctx| {
                time_rank(ctx.world(), m.op, elems, m.iterations)
            })
            .into_iter()
            .map(|r| r.expect("rank failed"))
            .collect::<Vec<_>>();
            let local_us = slowest_median(&local).as_secs_f64() * 1e6;
            let busbw = |us: f64| m.bytes as f64 / (us * 1e-6) / 1e9 * m.op.bus_factor(world);
            let row = Row {
                op: m.op,
                world,
                bytes: m.bytes,
                local_us,
                mpi_us: m.burn_comm_us,
                raw_mpi_us: m.raw_mpi_us,
                mpi_busbw_gbps: busbw(m.burn_comm_us),
                raw_busbw_gbps: busbw(m.raw_mpi_us),
                mpi_over_raw: m.raw_mpi_us / m.burn_comm_us,
            };
            println!(
                "{:<15} {:>5} {:>9} {:>11.1} {:>11.1} {:>11.1} {:>10.2} {:>10.2} {:>8.2}",
                row.op.name(),
                world,
                human(row.bytes),
                row.local_us,
                row.mpi_us,
                row.raw_mpi_us,
                row.mpi_busbw_gbps,
                row.raw_busbw_gbps,
                row.mpi_over_raw
            );
            rows.push(row);
        }
    }
    println!();
    benches::write_json(&args.json, &rows);
}

/// Every process's side: burn-comm and raw MPI on the same sizes; rank 0 prints the rows.
fn measure(world: &Communicator, args: &Args) {
    let n = world.size();
    for &op in &args.ops {
        for bytes in sizes(args.min_bytes, args.max_bytes, args.step) {
            let elems = elements(bytes, n);
            let iters = args
                .iterations
                .map_or_else(|| iterations(elems * 4), |n| n as usize);
            let ours = time_rank(world, op, elems, iters).expect("burn-comm's collective");
            let raw = time_raw(op, n, elems, iters);
            let ours = slowest_median(&gather(world, &ours));
            let raw = slowest_median(&gather(world, &raw));
            if world.rank() == 0 {
                let m = Measured {
                    op,
                    world: n,
                    bytes: elems * 4,
                    iterations: iters,
                    burn_comm_us: ours.as_secs_f64() * 1e6,
                    raw_mpi_us: raw.as_secs_f64() * 1e6,
                };
                println!("{ROW}{}", serde_json::to_string(&m).expect("serialises"));
            }
        }
    }
}

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

/// One rank's times of `iters` raw MPI calls of `op` on plain buffers, each from a barrier.
fn time_raw(op: Op, n: usize, elems: usize, iters: usize) -> Vec<Duration> {
    let mut input = vec![1.0f32; op.input_elems(elems, n)];
    let out_len = match op {
        Op::AllReduce | Op::Broadcast | Op::AllToAll | Op::SendRecv => elems,
        Op::AllGather => elems,
        Op::ReduceScatter => elems / n,
    };
    let (next, previous) = (((rank() + 1) % n) as c_int, ((rank() + n - 1) % n) as c_int);
    let mut output = vec![0.0f32; out_len];
    // SAFETY: MPI is initialised (this runs inside `Process::run`); the buffers hold the counts
    // given, and every rank makes the same calls.
    unsafe {
        let comm = ffi::RSMPI_COMM_WORLD;
        let float = ffi::RSMPI_FLOAT;
        let sum = ffi::RSMPI_SUM;
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters + 2 {
            // Written afresh before every call, as burn-comm's input is (a new tensor) and as
            // any tensor a model just computed is: MPI reads data another core has just
            // written much slower than data it read before (at 64 KiB, 2.3x for MPI_Bcast
            // here).
            match op {
                // The root broadcasts `output`.
                Op::Broadcast if rank() == 0 => output.fill(1.0),
                Op::Broadcast => {}
                _ => input.fill(1.0),
            }
            ffi::MPI_Barrier(comm);
            let start = Instant::now();
            let send = input.as_ptr().cast();
            let recv = output.as_mut_ptr().cast();
            match op {
                Op::AllReduce => {
                    ffi::MPI_Allreduce(send, recv, elems as c_int, float, sum, comm);
                }
                Op::AllGather => {
                    ffi::MPI_Allgather(
                        send,
                        (elems / n) as c_int,
                        float,
                        recv,
                        (elems / n) as c_int,
                        float,
                        comm,
                    );
                }
                Op::ReduceScatter => {
                    ffi::MPI_Reduce_scatter_block(
                        send,
                        recv,
                        (elems / n) as c_int,
                        float,
                        sum,
                        comm,
                    );
                }
                Op::Broadcast => {
                    ffi::MPI_Bcast(recv, elems as c_int, float, 0, comm);
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
            if i >= 2 {
                times.push(elapsed);
            }
        }
        times
    }
}
