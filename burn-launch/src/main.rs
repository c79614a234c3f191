//! `burn-launch --nproc-per-node N [options] -- PROGRAM [ARGS...]`: starts N processes of
//! PROGRAM with the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//! MASTER_ADDR, MASTER_PORT), prefixes every line they print with their rank, and stops them
//! all as soon as one fails.
//!
//! On a machine without a CUDA GPU (or with `--mpi`), the ranks are started through `mpirun`
//! instead (CPU ranks talk through MPI, which only processes that `mpirun` started can join):
//! `--hostfile` names the machines, and Open MPI's own variables tell each process its rank.
//! `--torchrun-env`, or a machine without `mpirun`, keeps torchrun's way there too: burn-comm's
//! ranks then meet in rank 0's store and talk over TCP, which needs no MPI.
//!
//! Each rank runs in its own process group, so stopping a rank stops whatever it started (a
//! shell's children, say); Ctrl-C or SIGTERM to the launcher stops every rank the same way.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;

#[derive(Parser)]
#[command(about = "Start N processes of a program with the torchrun environment")]
struct Args {
    /// Processes on this machine (one per GPU, usually).
    #[arg(long)]
    nproc_per_node: usize,
    /// Machines in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This machine's index among them.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Host of rank 0 (where the rendezvous store runs).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store; 0 picks a free one (single machine only).
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// Start the ranks through mpirun (CPU ranks on burn-comm's MPI transport) instead of
    /// with torchrun's variables (TCP, and NCCL on GPUs): the default on a machine without a
    /// CUDA GPU that has mpirun.
    #[arg(long)]
    mpi: bool,
    /// Start the ranks with torchrun's variables even on a machine without a CUDA GPU (they
    /// talk over burn-comm's TCP transport).
    #[arg(long, conflicts_with_all = ["mpi", "hostfile"])]
    torchrun_env: bool,
    /// The machines and their slots, in Open MPI's hostfile format (the ranks start through
    /// mpirun).
    #[arg(long)]
    hostfile: Option<String>,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(code) => code,
        Err(message) => {
            eprintln!("burn-launch: {message}");
            ExitCode::from(2)
        }
    }
}

fn run(args: Args) -> Result<ExitCode, String> {
    if args.nproc_per_node == 0 || args.nnodes == 0 || args.node_rank >= args.nnodes {
        return Err(format!(
            "--nproc-per-node must be at least 1 and --node-rank ({}) below --nnodes ({})",
            args.node_rank, args.nnodes
        ));
    }
    if args.mpi || args.hostfile.is_some() {
        return run_mpi(&args);
    }
    if !args.torchrun_env && !has_cuda_gpu() {
        // mpirun starts a whole job from one machine: one of several starts its own share.
        if args.nnodes > 1 {
            eprintln!(
                "burn-launch: no CUDA GPU here, and this machine starts its share of a job of {} (--nnodes), so its ranks start with torchrun's variables and meet over TCP (--hostfile starts the whole job through mpirun)",
                args.nnodes
            );
        } else if !on_path("mpirun") {
            eprintln!(
                "burn-launch: no CUDA GPU here and no mpirun on PATH, so the ranks start with torchrun's variables and meet over TCP (install Open MPI, apt-get install openmpi-bin, to start them through mpirun)"
            );
        } else {
            eprintln!(
                "burn-launch: no CUDA GPU here, so the ranks start through mpirun and meet through MPI (--torchrun-env starts them with torchrun's variables instead, to meet over TCP)"
            );
            return run_mpi(&args);
        }
    }
    let port = match args.master_port {
        0 if args.nnodes > 1 => {
            return Err(
                "--master-port 0 works on one machine only; give every machine the same port"
                    .into(),
            );
        }
        0 => free_port()?,
        port => port,
    };
    let world_size = args.nnodes * args.nproc_per_node;
    on_interrupt_stop();
    let mut children = Vec::with_capacity(args.nproc_per_node);
    let mut pipes = Vec::new();
    for local_rank in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local_rank;
        let mut command = Command::new(&args.command[0]);
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        #[cfg(target_os = "linux")]
        die_with_launcher(&mut command);
        let env = burn_comm::ProcessEnv {
            rank,
            world_size,
            local_rank,
            local_world_size: args.nproc_per_node,
            master_addr: args.master_addr.clone(),
            master_port: port,
        };
        let spawned = command
            .args(&args.command[1..])
            .envs(env.vars())
            // A rank in its own process group that read the terminal would be stopped (SIGTTIN).
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                stop(&mut children);
                return Err(format!("cannot start {}: {e}", args.command[0]));
            }
        };
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        pipes.push(thread::spawn(move || {
            prefix(stdout, rank, std::io::stdout())
        }));
        pipes.push(thread::spawn(move || {
            prefix(stderr, rank, std::io::stderr())
        }));
        children.push((rank, Some(child)));
    }

    let code = supervise(&mut children);
    // A process that left its rank's group may still hold a pipe open: do not wait for it long.
    let deadline = Instant::now() + Duration::from_secs(2);
    while pipes.iter().any(|p| !p.is_finished()) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(10));
    }
    Ok(code)
}

/// Starts the ranks through mpirun, which supervises them: it stops every rank when one fails
/// and forwards Ctrl-C.
fn run_mpi(args: &Args) -> Result<ExitCode, String> {
    if args.nnodes > 1 {
        return Err(
            "through mpirun (--mpi), one burn-launch starts the whole job: list the machines in --hostfile instead of --nnodes/--node-rank".into(),
        );
    }
    let mut mpirun = burn_comm::mpirun(args.nproc_per_node);
    if let Some(hostfile) = &args.hostfile {
        mpirun.arg("--hostfile").arg(hostfile);
    }
    let status = mpirun.args(&args.command).status().map_err(|e| {
        format!("cannot start mpirun ({e}); install Open MPI (apt-get install openmpi-bin)")
    })?;
    Ok(match status.success() {
        true => ExitCode::SUCCESS,
        false => ExitCode::from(exit_code(status)),
    })
}

/// Whether `program` is an executable file in one of PATH's directories (without PATH, those
/// a program is looked for in then).
fn on_path(program: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
    std::env::split_paths(&path).any(|dir| {
        let file = dir.join(program);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(&file)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        }
        #[cfg(not(unix))]
        file.is_file()
    })
}

/// Whether this machine shows its processes a CUDA GPU: NVIDIA's driver lists one, and
/// `CUDA_VISIBLE_DEVICES` does not hide them all.
fn has_cuda_gpu() -> bool {
    if let Ok(visible) = std::env::var("CUDA_VISIBLE_DEVICES")
        && matches!(visible.trim(), "" | "-1")
    {
        return false;
    }
    std::fs::read_dir("/proc/driver/nvidia/gpus").is_ok_and(|mut gpus| gpus.next().is_some())
}

/// Waits for every child; when one fails, stops the others and returns its exit code.
fn supervise(children: &mut [(usize, Option<Child>)]) -> ExitCode {
    loop {
        let signal = SIGNALLED.load(Ordering::Relaxed);
        if signal != 0 {
            eprintln!("burn-launch: got signal {signal}; stopping every rank");
            stop(children);
            return ExitCode::from((128 + signal).clamp(0, 255) as u8);
        }
        let mut running = 0;
        for i in 0..children.len() {
            let (rank, slot) = &mut children[i];
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(None) => running += 1,
                Ok(Some(status)) if status.success() => *slot = None,
                outcome => {
                    let rank = *rank;
                    let (why, code) = match outcome {
                        Ok(Some(status)) => (format!("exited with {status}"), exit_code(status)),
                        Err(e) => (format!("could not be waited for: {e}"), 1),
                        Ok(None) => unreachable!("handled above"),
                    };
                    *slot = None;
                    eprintln!("burn-launch: rank {rank} {why}; stopping the other ranks");
                    stop(children);
                    return ExitCode::from(code);
                }
            }
        }
        if running == 0 {
            return ExitCode::SUCCESS;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// A failed rank's code for the launcher: its own, or 128 + the signal that killed it.
fn exit_code(status: std::process::ExitStatus) -> u8 {
    #[cfg(unix)]
    if let Some(signal) = std::os::unix::process::ExitStatusExt::signal(&status) {
        return (128 + signal).clamp(1, 255) as u8;
    }
    status
        .code()
        .and_then(|c| u8::try_from(c).ok())
        .filter(|&c| c != 0)
        .unwrap_or(1)
}

/// The last SIGINT/SIGTERM/SIGHUP received (0: none); the supervision loop stops the ranks,
/// and a second signal during the grace period kills them at once.
static SIGNALLED: AtomicI32 = AtomicI32::new(0);
static SIGNALS: AtomicI32 = AtomicI32::new(0);

#[cfg(unix)]
fn on_interrupt_stop() {
    extern "C" fn note(signal: libc::c_int) {
        SIGNALLED.store(signal, Ordering::Relaxed);
        SIGNALS.fetch_add(1, Ordering::Relaxed);
    }
    let handler = note as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to atomics, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
        libc::signal(libc::SIGHUP, handler);
    }
}

/// The rank gets SIGKILL if the launcher dies without stopping it (killed with SIGKILL, say).
#[cfg(target_os = "linux")]
fn die_with_launcher(command: &mut Command) {
    // SAFETY: prctl is async-signal-safe, as pre_exec requires.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(command, || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[cfg(not(unix))]
fn on_interrupt_stop() {}

/// Stops every remaining rank: SIGTERM to its process group, SIGKILL after a grace period.
fn stop(children: &mut [(usize, Option<Child>)]) {
    let running: Vec<Child> = children.iter_mut().filter_map(|(_, c)| c.take()).collect();
    signal_all(&running, Signal::Terminate);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut running: Vec<Child> = running;
    let signals = SIGNALS.load(Ordering::Relaxed);
    while !running.is_empty() && Instant::now() < deadline {
        if SIGNALS.load(Ordering::Relaxed) > signals {
            break;
        }
        running.retain_mut(|c| matches!(c.try_wait(), Ok(None)));
        thread::sleep(Duration::from_millis(20));
    }
    signal_all(&running, Signal::Kill);
    for mut child in running {
        let _ = child.wait();
    }
}

enum Signal {
    Terminate,
    Kill,
}

#[cfg(unix)]
fn signal_all(children: &[Child], signal: Signal) {
    let signal = match signal {
        Signal::Terminate => libc::SIGTERM,
        Signal::Kill => libc::SIGKILL,
    };
    for child in children {
        // SAFETY: plain syscall; a negative pid names the child's process group.
        unsafe { libc::kill(-(child.id() as libc::pid_t), signal) };
    }
}

#[cfg(not(unix))]
fn signal_all(children: &[Child], _: Signal) {
    for child in children {
        let _ = child.kill();
    }
}

/// Copies `source` to `sink` line by line, each line prefixed with the rank.
fn prefix(source: impl Read, rank: usize, sink: impl Write) {
    let mut sink = sink;
    for line in BufReader::new(source).split(b'\n') {
        let Ok(line) = line else { return };
        let mut out = format!("[rank {rank}] ").into_bytes();
        out.extend_from_slice(&line);
        out.push(b'\n');
        // One write per line keeps lines of different ranks whole.
        if sink.write_all(&out).and_then(|_| sink.flush()).is_err() {
            return;
        }
    }
}

fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("cannot find a free port: {e}"))
}
