//! The transports of processes, with real processes: TCP (ranks started with torchrun's
//! variables, as `burn-launch` starts them) and, with the `mpi` feature, MPI (ranks started by
//! `mpirun`). Run as a test (no launcher's variables), this program starts itself at 2, 3 and 4
//! processes, once per case and launcher, and checks how each job ended; started by a launcher,
//! it is one rank of the case named by its first argument.
//!
//! Every collective is compared bit for bit with the local transport, run on threads inside each
//! process with the same inputs (all reduce in rank order with the same kernels). The fault
//! cases check that a rank that panics, fails, stalls, calls something else or is killed ends
//! the whole job within seconds, with a sentence naming the rank and the cause.

mod common;

use std::fs::File;
use std::process::{Command, ExitStatus, Output};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_comm::{
    CommError, Communicator, Launcher, Process, ProcessEnv, RankContext, ReduceOp, launch,
};
use common::{B, random_magnitudes, sum_joined_after_an_async_start};

fn main() {
    match Launcher::from_env() {
        Launcher::Alone => {
            let started = Instant::now();
            orchestrate(Via::Torchrun);
            #[cfg(feature = "mpi")]
            orchestrate(Via::Mpirun);
            println!("every case passed in {:.1?}", started.elapsed());
        }
        _ => {
            let case = std::env::args().nth(1).expect("a case to run");
            let process = Process::from_env()
                .expect("joined the job")
                .expect("started by a launcher");
            process.run(|ctx| rank_case(&case, ctx));
        }
    }
}

/// How the ranks of a case are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// With torchrun's variables, as `burn-launch` starts them: the TCP transport.
    Torchrun,
    /// By `mpirun`: the MPI transport.
    #[cfg(feature = "mpi")]
    Mpirun,
}

impl Via {
    fn run(self, world: usize, case: &str, env: &[(&str, &str)]) -> Output {
        match self {
            Via::Torchrun => torchrun(world, case, env),
            #[cfg(feature = "mpi")]
            Via::Mpirun => mpirun(world, case, env),
        }
    }
}

/// The test harness's side: one job per case.
fn orchestrate(via: Via) {
    for world in [2, 3, 4] {
        let out = via.run(world, "collectives", &[]);
        assert_ok(&out, &format!("collectives at {world} processes ({via:?})"));
        println!("collectives at {world} processes ({via:?}): ok");
    }
    // Without single copy, a receiver needs its sender's MPI to move a message past the eager
    // limit on: a sender that then makes no call must not hold it up.
    let out = via.run(
        2,
        "quiet-sender",
        &[("OMPI_MCA_btl_vader_single_copy_mechanism", "none")],
    );
    assert_ok(&out, "a send whose sender goes quiet");
    println!("a send whose sender goes quiet ({via:?}): ok");
    #[cfg(feature = "mpi")]
    if via == Via::Mpirun {
        // Several machines come from a hostfile; here it lists this one's slots.
        let hostfile = std::env::temp_dir().join(format!("burn-comm-hosts-{}", std::process::id()));
        std::fs::write(&hostfile, "localhost slots=3\n").expect("a temporary file");
        let out = burn_comm::mpirun(3)
            .arg("--hostfile")
            .arg(&hostfile)
            .arg(std::env::current_exe().expect("the test's own path"))
            .arg("collectives")
            .output()
            .expect("mpirun runs");
        let _ = std::fs::remove_file(&hostfile);
        assert_ok(&out, "collectives at 3 processes placed by a hostfile");
        println!("collectives at 3 processes placed by a hostfile: ok");
    }
    let (panic, killed): (&[&str], &[&str]) = match via {
        // mpirun names the killed rank and its signal.
        #[cfg(feature = "mpi")]
        Via::Mpirun => (
            &["rank 1 panicked: rank 1 gives up"],
            &["rank 1", "signal 9"],
        ),
        // The peer's call names the cause: the one the failing rank sent, or a lost connection.
        Via::Torchrun => (
            &[
                "rank 1 panicked: rank 1 gives up",
                "rank 0 failed: all_reduce(sum) on F32 [4] (call 0) on group 'world' failed because rank 1 panicked: rank 1 gives up",
            ],
            &[
                "rank 0 failed: all_reduce(sum) on F32 [4] (call 1) on group 'world' failed because rank 1 ended its connection",
            ],
        ),
    };
    #[cfg_attr(not(feature = "mpi"), allow(unused_mut))]
    let mut faults: Vec<(&str, &[&str])> = vec![
        ("panic", panic),
        (
            "error",
            &["rank 1 failed: the mesh dp=3 x tp=5 has 15 ranks"],
        ),
        (
            "stall",
            &[
                "rank 0 failed: all_reduce(sum) on F32 [4] (call 1) on group 'world' timed out",
                "ranks [1] never joined",
            ],
        ),
        (
            "mismatch",
            &[
                "mismatched calls on group 'world'",
                "all_reduce(sum) on F32 [4]",
                "all_gather(dim 0) on F32 [4]",
            ],
        ),
        (
            "mismatch-dtype",
            &[
                "mismatched calls on group 'world'",
                "all_reduce(sum) on F32 [4]",
                "all_reduce(sum) on I32 [4]",
            ],
        ),
        // Over MPI, one call's data goes in the round of its header, the other's is too large
        // to.
        (
            "mismatch-sizes",
            &[
                "mismatched calls on group 'world'",
                "all_gather(dim 0) on F32 [4]",
                "all_gather(dim 0) on F32 [20000]",
            ],
        ),
        // Over MPI, both go in the headers' round, one much larger than the other expects and
        // in two messages where the other expects one.
        (
            "mismatch-carried",
            &[
                "mismatched calls on group 'world'",
                "all_gather(dim 0) on F32 [4]",
                "all_gather(dim 0) on F32 [1500]",
            ],
        ),
        ("killed", killed),
    ];
    if via == Via::Torchrun {
        // A process stopped whole: its socket soon takes no more data, and its peer's write
        // must give up by the call's deadline.
        faults.push((
            "stopped",
            &[
                "rank 0 failed: all_reduce(sum) on F32 [8000000] (call 1) on group 'world' timed out after 2s",
                "ranks [1] never joined",
            ],
        ));
    }
    #[cfg(feature = "mpi")]
    if via == Via::Mpirun {
        faults.push((
            "frozen",
            &[
                "rank 0 ends the job",
                "(call",
                "data exchange) on group 'world' timed out",
            ],
        ));
    }
    for (case, expected) in faults {
        let begun = Instant::now();
        // Only the stall and the freeze need the watchdog. Elsewhere it is set far beyond the
        // bound below, so that a job ended by it, not by the failing rank, fails the test.
        let timeout = if matches!(case, "stall" | "frozen" | "stopped") {
            "2"
        } else {
            "120"
        };
        let mut env = vec![("BURN_COMM_TIMEOUT_SECS", timeout)];
        if case == "frozen" {
            env.push(("BURN_COMM_FREEZE_IN_EXCHANGE", "1"));
        }
        let out = via.run(2, case, &env);
        let took = begun.elapsed();
        let text = transcript(&out);
        assert!(
            !out.status.success(),
            "the {case} job succeeded ({via:?}):\n{text}"
        );
        for sentence in expected {
            assert!(
                text.contains(sentence),
                "the {case} job ({via:?}) did not say {sentence:?}:\n{text}"
            );
        }
        // Well before the 120 s watchdog of the cases it does not end: they end in 0.3-2.5 s
        // here (the stall over TCP in 2 s and the grace its sleeping rank is given), and a
        // loaded machine starts processes and prints backtraces slower.
        assert!(
            took < Duration::from_secs(60),
            "the {case} job ({via:?}) took {took:?} to end:\n{text}"
        );
        println!("{case} ({via:?}): ended in {took:.1?}");
    }
}

/// How long the other ranks of a torchrun job may take to end by themselves once one has
/// failed, before they are killed, as a launcher kills them: only a rank that is not in a
/// call (the stall's sleeper, the stopped process) needs it.
const GRACE: Duration = Duration::from_secs(5);

/// Starts `world` processes of this program on `case` with torchrun's variables, as
/// `burn-launch` does, and waits for them all; the status is the first failure's. Their output
/// goes to one file, read back as the job's stdout.
fn torchrun(world: usize, case: &str, env: &[(&str, &str)]) -> Output {
    let exe = std::env::current_exe().expect("the test's own path");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let log = std::env::temp_dir().join(format!("burn-comm-{case}-{}.log", std::process::id()));
    let file = File::create(&log).expect("a temporary file");
    let mut ranks: Vec<_> = (0..world)
        .map(|rank| {
            let output = || file.try_clone().expect("a second handle");
            Command::new(&exe)
                .arg(case)
                .envs(ProcessEnv::on_this_machine(rank, world, port).vars())
                .envs(env.iter().copied())
                .stdout(output())
                .stderr(output())
                .spawn()
                .expect("the test starts itself")
        })
        .collect();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; world];
    let mut first_failure: Option<(usize, Instant)> = None;
    while statuses.iter().any(Option::is_none) {
        for (rank, child) in ranks.iter_mut().enumerate() {
            if statuses[rank].is_none()
                && let Some(status) = child.try_wait().expect("a child to wait for")
            {
                if !status.success() && first_failure.is_none() {
                    first_failure = Some((rank, Instant::now()));
                }
                statuses[rank] = Some(status);
            }
        }
        if first_failure.is_some_and(|(_, at)| at.elapsed() > GRACE) {
            for (rank, child) in ranks.iter_mut().enumerate() {
                if statuses[rank].is_none() {
                    let _ = child.kill();
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = match first_failure {
        Some((rank, _)) => statuses[rank],
        None => statuses[0],
    };
    let stdout = std::fs::read(&log).expect("the job's log");
    let _ = std::fs::remove_file(&log);
    Output {
        status: status.expect("every rank ended"),
        stdout,
        stderr: Vec::new(),
    }
}

#[cfg(feature = "mpi")]
fn mpirun(world: usize, case: &str, env: &[(&str, &str)]) -> Output {
    let exe = std::env::current_exe().expect("the test's own path");
    burn_comm::mpirun(world)
        .arg(exe)
        .arg(case)
        .envs(env.iter().copied())
        .output()
        .expect("mpirun runs (install Open MPI: apt-get install openmpi-bin libopenmpi-dev)")
}

fn transcript(out: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn assert_ok(out: &Output, what: &str) {
    assert!(out.status.success(), "{what} failed:\n{}", transcript(out));
}

/// One rank's side of `case`.
fn rank_case(case: &str, ctx: RankContext) -> Result<(), CommError> {
    let world = ctx.world();
    let x = Tensor::<B, 1>::from_floats([1.0, 2.0, 3.0, 4.0], &Default::default());
    match case {
        "collectives" => collectives(&ctx),
        "panic" => {
            if ctx.rank() == 1 {
                panic!("rank 1 gives up");
            }
            world.all_reduce(x, ReduceOp::Sum).map(drop)
        }
        "error" => {
            if ctx.rank() == 1 {
                // A mesh that does not fit the world: the rank's function returns the error.
                ctx.mesh(&[("dp", 3), ("tp", 5)])?;
            }
            world.all_reduce(x, ReduceOp::Sum).map(drop)
        }
        "stall" => {
            world.barrier()?;
            if ctx.rank() == 1 {
                // Stalls well past the timeout: rank 0's watchdog must end the job first.
                std::thread::sleep(Duration::from_secs(60));
            }
            world.all_reduce(x, ReduceOp::Sum).map(drop)
        }
        "mismatch" => {
            if ctx.rank() == 0 {
                world.all_reduce(x, ReduceOp::Sum).map(drop)
            } else {
                world.all_gather(x, 0).map(drop)
            }
        }
        "mismatch-dtype" => {
            if ctx.rank() == 0 {
                world.all_reduce(x, ReduceOp::Sum).map(drop)
            } else {
                world.all_reduce(x.int(), ReduceOp::Sum).map(drop)
            }
        }
        "quiet-sender" => {
            // A deferred send; then a large one the send thread holds (the first of its size
            // from 128 KiB) and one polled among the deferred ones (the second), apart, so
            // that the first batch's sweeps do not move the second on: only the thread's tests
            // do.
            let batches: [&[[usize; 2]]; 2] = [&[[30, 100]], &[[256, 256], [256, 256]]];
            for shapes in batches {
                world.barrier()?;
                if ctx.rank() == 0 {
                    for &shape in shapes {
                        world.send(Tensor::<B, 2>::ones(shape, &Default::default()), 1)?;
                    }
                    // No MPI call for a while, as in a long computation.
                    std::thread::sleep(Duration::from_secs(1));
                } else {
                    let began = Instant::now();
                    for &shape in shapes {
                        let _: Tensor<B, 2> = world.recv(0, shape, &Default::default())?;
                    }
                    let took = began.elapsed();
                    assert!(
                        took < Duration::from_millis(500),
                        "{shapes:?} took {took:?} to arrive while their sender made no MPI call"
                    );
                }
            }
            world.barrier()
        }
        "mismatch-sizes" | "mismatch-carried" => {
            let other = if case == "mismatch-sizes" {
                20_000
            } else {
                1500
            };
            let x = match ctx.rank() {
                0 => x,
                _ => Tensor::zeros([other], &Default::default()),
            };
            world.all_gather(x, 0).map(drop)
        }
        "killed" => {
            world.barrier()?;
            if ctx.rank() == 1 {
                let pid = std::process::id().to_string();
                let _ = std::process::Command::new("kill")
                    .args(["-9", &pid])
                    .status();
            }
            world.all_reduce(x, ReduceOp::Sum).map(drop)
        }
        // Rank 1 stops itself (BURN_COMM_FREEZE_IN_EXCHANGE) inside the all-reduce's data
        // exchange, after both headers came, where MPI's blocking call cannot be left: rank 0's
        // watchdog must end the job, naming the exchange. (A tensor too large to go in the
        // header's round, which has an exchange of its own.)
        "frozen" => {
            let x = Tensor::<B, 1>::ones([20_000], &Default::default());
            world.all_reduce(x, ReduceOp::Sum).map(drop)
        }
        "stopped" => {
            world.barrier()?;
            if ctx.rank() == 1 {
                let pid = std::process::id().to_string();
                let _ = std::process::Command::new("kill")
                    .args(["-STOP", &pid])
                    .status();
            }
            // Half of it (16 MB) is more than the sockets between two processes hold.
            let x = Tensor::<B, 1>::ones([8_000_000], &Default::default());
            world.all_reduce(x, ReduceOp::Sum).map(drop)
        }
        other => panic!("unknown case {other}"),
    }
}

/// Runs `f` on this job's world over MPI or TCP and, with the same inputs, on threads over the local
/// transport; the two must give the same bits.
fn same_as_threads(
    ctx: &RankContext,
    what: &str,
    f: impl Fn(&Communicator, usize) -> Result<TensorData, CommError> + Sync,
) -> Result<(), CommError> {
    let processes = f(ctx.world(), ctx.rank())?;
    let threads = launch(ctx.world_size(), |local| f(local.world(), local.rank()));
    let local = threads
        .into_iter()
        .nth(ctx.rank())
        .expect("one result per rank")
        .unwrap_or_else(|e| panic!("{what} on threads: {e}"));
    assert_eq!(processes.dtype, local.dtype, "{what}: dtype");
    assert_eq!(processes.shape, local.shape, "{what}: shape");
    assert!(
        processes.as_bytes() == local.as_bytes(),
        "{what}: rank {} got other bits as processes than as threads",
        ctx.rank()
    );
    Ok(())
}

fn collectives(ctx: &RankContext) -> Result<(), CommError> {
    let n = ctx.world_size();
    // One machine: the launcher numbers its processes as the job does.
    assert_eq!(ctx.local_rank(), ctx.rank(), "the local rank");
    // Values whose sums round: the reduction's order shows in the bits.
    let input = |seed: u64, rank: usize, shape: [usize; 2], dtype: DType| {
        random_magnitudes(seed * 100 + rank as u64, shape, dtype)
    };
    // Each of an all-reduce's three ways: in the headers' round (up to 8048 bytes, in two
    // messages beyond 4016: bf16 and f16 x 2107), one all-gather after them (up to 32 KiB: f32
    // and f64 x 2107), and a reduce-scatter and an all-gather after them.
    for (seed, shape) in [(1, [3, 5]), (20, [7, 301]), (2, [7, 3001])] {
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let what = format!("all_reduce({op}) of {dtype:?} {shape:?}");
                same_as_threads(ctx, &what, |c, r| {
                    Ok(c.all_reduce(input(seed, r, shape, dtype), op)?.into_data())
                })?;
            }
        }
    }
    // At the edges of the headers' round, in f32: one full message (4016 bytes after the
    // header), a second one (4020; 4096; as small as it gets in f16: 4018), two full ones
    // (8048), and just beyond.
    for (len, dtype) in [
        (1004, DType::F32),
        (1005, DType::F32),
        (1024, DType::F32),
        (2009, DType::F16),
        (2012, DType::F32),
        (2013, DType::F32),
    ] {
        let what = format!("all_reduce of {dtype:?} [{len}]");
        same_as_threads(ctx, &what, |c, r| {
            Ok(c.all_reduce(input(21, r, [1, len], dtype), ReduceOp::Sum)?
                .into_data())
        })?;
    }
    let ints = |r: usize| {
        Tensor::<B, 1, Int>::from_ints([r as i32 * 7 - 3, 11, -(r as i32)], &Default::default())
    };
    same_as_threads(ctx, "all_reduce of ints", |c, r| {
        Ok(c.all_reduce(ints(r), ReduceOp::Sum)?.into_data())
    })?;
    // Above the one-round size, in the slices' uneven split.
    let many_ints = |r: usize| {
        let values: Vec<i32> = (0..12_007).map(|i| i * 7 - 3 * r as i32).collect();
        Tensor::<B, 1, Int>::from_data(TensorData::new(values, [12_007]), &Default::default())
    };
    same_as_threads(ctx, "all_reduce(max) of 48 KB of ints", |c, r| {
        Ok(c.all_reduce(many_ints(r), ReduceOp::Max)?.into_data())
    })?;
    // Every rank holds the same bits of an all-reduce.
    let reduced = ctx
        .world()
        .all_reduce(input(3, ctx.rank(), [5, 4001], DType::F32), ReduceOp::Sum)?;
    let everyone = ctx
        .world()
        .all_gather(reduced.clone().unsqueeze::<3>(), 0)?;
    for r in 0..n {
        let theirs = everyone.clone().slice(r..r + 1).squeeze::<2>().into_data();
        assert!(
            theirs.as_bytes() == reduced.clone().into_data().as_bytes(),
            "rank {r}'s all-reduce differs from rank {}'s",
            ctx.rank()
        );
    }
    // Small enough to go in the round of the calls' headers (up to 8048 bytes a peer), in one
    // message a peer or in two (beyond 4016 bytes), or too large to. Two messages: x 40 the
    // broadcast (5760 bytes); x 100 the reduce-scatter and the f32 all-to-all at 2 and 3
    // processes, and the f16 all-to-all at 4; x 200 the all-gather (4800) and the f16
    // all-to-all at 2 and 3. Not carried: x 3001, and what x 100 and x 200 make larger.
    for wide in [1, 40, 100, 200, 3001] {
        for dim in [0, 1] {
            let shape = [2 * n, 3 * n * wide];
            same_as_threads(ctx, &format!("all_gather(dim {dim}) x {wide}"), |c, r| {
                Ok(c.all_gather(input(4, r, [2, 3 * wide], DType::F32), dim)?
                    .into_data())
            })?;
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let what = format!("reduce_scatter({op}, dim {dim}) x {wide}");
                same_as_threads(ctx, &what, |c, r| {
                    Ok(c.reduce_scatter(input(5, r, shape, DType::F32), op, dim)?
                        .into_data())
                })?;
            }
            same_as_threads(ctx, &format!("all_to_all(split {dim}) x {wide}"), |c, r| {
                Ok(c.all_to_all(input(6, r, shape, DType::F16), dim, 1 - dim)?
                    .into_data())
            })?;
            // Parts that are whole blocks of both the input and the output move without copies.
            let what = format!("all_to_all(split {dim}, concat {dim}) x {wide}");
            same_as_threads(ctx, &what, |c, r| {
                Ok(c.all_to_all(input(8, r, shape, DType::F32), dim, dim)?
                    .into_data())
            })?;
        }
        for root in [0, n - 1] {
            same_as_threads(ctx, &format!("broadcast from {root} x {wide}"), |c, r| {
                Ok(c.broadcast(input(7, r, [4, 9 * wide], DType::F32), root)?
                    .into_data())
            })?;
        }
    }
    // Point to point around the ring, two messages per pair, in order.
    same_as_threads(ctx, "send and recv", |c, r| {
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        c.send(input(8, r, [3, 2], DType::F32), next)?;
        c.send(input(9, r, [3, 2], DType::F32), next)?;
        let first: Tensor<B, 2> = c.recv(prev, [3, 2], &Default::default())?;
        let second: Tensor<B, 2> = c.recv(prev, [3, 2], &Default::default())?;
        Ok(Tensor::cat(vec![first, second], 0).into_data())
    })?;
    // A large message (beyond any MPI's eager sends: the group's send thread completes it) and
    // then a small one (sent at once by its caller) keep their order.
    same_as_threads(ctx, "large and small sends", |c, r| {
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        c.send(input(11, r, [512, 512], DType::F32), next)?;
        c.send(input(12, r, [3, 2], DType::F32), next)?;
        let large: Tensor<B, 2> = c.recv(prev, [512, 512], &Default::default())?;
        let small: Tensor<B, 2> = c.recv(prev, [3, 2], &Default::default())?;
        Ok(Tensor::cat(vec![large.flatten::<1>(0, 1), small.flatten(0, 1)], 0).into_data())
    })?;
    // Sends past the eager limit that MPI finishes only once received: several wait for the
    // group's next call to complete them (up to 32 KiB), for its send thread (beyond), or
    // among the deferred ones polled by both (from 128 KiB, once the process has freed a
    // buffer that large, as the cases before have), in order.
    same_as_threads(ctx, "sends waiting to be received", |c, r| {
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let shapes = [[30, 100], [31, 100], [2, 9000], [160, 256], [29, 100]];
        for (i, shape) in shapes.into_iter().enumerate() {
            c.send(input(30 + i as u64, r, shape, DType::F32), next)?;
        }
        let received = shapes
            .into_iter()
            .map(|shape| c.recv::<B, 2, burn::tensor::Float>(prev, shape, &Default::default()))
            .collect::<Result<Vec<_>, _>>()?;
        let flat = received.into_iter().map(|t| t.flatten::<1>(0, 1)).collect();
        Ok(Tensor::cat(flat, 0).into_data())
    })?;
    // A message of another shape than expected is a mismatch naming both, not garbage.
    let (next, prev) = ((ctx.rank() + 1) % n, (ctx.rank() + n - 1) % n);
    ctx.world().send(input(10, 0, [2, 2], DType::F32), next)?;
    let wrong = ctx
        .world()
        .recv::<B, 2, burn::tensor::Float>(prev, [4, 1], &Default::default());
    let message = wrong.expect_err("a mismatched receive fails").to_string();
    assert!(
        message.contains("recv(from") && message.contains("send of F32 [2, 2]"),
        "{message}"
    );
    ctx.world().barrier()?;
    // The async forms overlap: several in flight, then waited for.
    same_as_threads(ctx, "async collectives", |c, r| {
        // Above the one-round size (36 KB).
        let a = c.all_reduce_async(input(11, r, [2, 4501], DType::F32), ReduceOp::Sum);
        let b = c.all_gather_async(input(12, r, [2, 5], DType::F32), 1);
        let s = c.reduce_scatter_async(input(15, r, [2, 6 * n], DType::F32), ReduceOp::Avg, 1);
        let d = c.broadcast_async(input(16, r, [2, 4], DType::F32), n - 1);
        let (a, b, s, d) = (a.wait()?, b.wait()?, s.wait()?, d.wait()?);
        Ok(Tensor::cat(vec![a, b, s, d], 1).into_data())
    })?;
    // An async call returns while its peers have yet to join it.
    same_as_threads(
        ctx,
        "an async call returns before its peers join",
        |c, r| {
            let x = input(20, r, [2, 3], DType::F32);
            Ok(sum_joined_after_an_async_start(c, x)?.into_data())
        },
    )?;
    // An all-to-all of uneven parts, some empty (zero-byte messages over MPI).
    same_as_threads(ctx, "all_to_all_split", |c, r| {
        let rows = |from: usize, to: usize| (from + 2 * to) % 3;
        let sizes = burn_comm::parallel::SplitSizes {
            send: (0..n).map(|q| rows(r, q)).collect(),
            recv: (0..n).map(|q| rows(q, r)).collect(),
        };
        let total = sizes.send.iter().sum();
        Ok(
            c.all_to_all_split(input(17, r, [total, 3], DType::F32), 0, &sizes)?
                .into_data(),
        )
    })?;
    // Reduce-scatter and all-gather of uneven parts, one empty (padded to equal blocks for MPI).
    let splits: Vec<usize> = (0..n).map(|r| (r * 2 + 1) % 3).collect();
    let total = splits.iter().sum();
    for op in [ReduceOp::Sum, ReduceOp::Max] {
        same_as_threads(ctx, &format!("reduce_scatter_split({op})"), |c, r| {
            let x = input(18, r, [total, 5], DType::F32);
            Ok(c.reduce_scatter_split(x, op, 0, &splits)?.into_data())
        })?;
    }
    same_as_threads(ctx, "all_gather_split", |c, r| {
        let x = input(19, r, [3, splits[r]], DType::BF16);
        Ok(c.all_gather_split(x, 1, &splits)?.into_data())
    })?;
    // Sub-groups: even and odd ranks, and a mesh when the world allows one.
    same_as_threads(ctx, "split", |c, r| {
        let half = c.split("parity", r % 2)?;
        Ok(half
            .all_reduce(input(13, r, [3, 3], DType::F32), ReduceOp::Sum)?
            .into_data())
    })?;
    if n == 4 {
        let mesh = ctx.mesh(&[("dp", 2), ("tp", 2)])?;
        let tp = mesh
            .group("tp")?
            .all_gather(input(14, ctx.rank(), [1, 2], DType::F32), 0)?;
        let dp = mesh.group("dp")?.all_reduce(tp, ReduceOp::Sum)?;
        let (dp_rank, tp_rank) = (mesh.coord("dp")?, mesh.coord("tp")?);
        let expected: Tensor<B, 2> = (0..2)
            .map(|d| {
                let rows = (0..2)
                    .map(|t| input(14, d * 2 + t, [1, 2], DType::F32))
                    .collect();
                Tensor::cat(rows, 0)
            })
            .reduce(|a, b| a + b)
            .expect("two replicas");
        assert_eq!(
            dp.into_data().as_bytes(),
            expected.into_data().as_bytes(),
            "mesh dp {dp_rank} tp {tp_rank}"
        );
    }
    ctx.world().barrier()
}
