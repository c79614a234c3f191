//! `llama train` as one process per rank, against the same run on one device and as threads:
//! under `mpirun` (the MPI transport), and under `burn-launch --torchrun-env` (the TCP
//! transport, which is also the host side of a job on NCCL). The losses of every step agree
//! to rtol 1e-5 with one device, as in the threaded parity tests (16-bit runs against the
//! threads only), and bit for bit with the threads. Rank 0 alone prints and writes the metrics,
//! the weights and a pipeline's schedule drawing, which shows every stage as the threads' does.
//! The layouts run one after another: each job already has more processes than this machine
//! has cores. `burn-launch` without flags starts the same job through mpirun on a machine
//! without a GPU. A job stopped by SIGTERM to mpirun, or by the SIGKILL of one rank, resumes
//! from its last committed checkpoint with the uninterrupted job's bits.

use std::path::{Path, PathBuf};
use std::process::Output;

const RUN: [&str; 11] = [
    "train",
    "--steps",
    "4",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--warmup",
    "2",
    "--lr",
    "0.003",
];

/// The jobs of this file run one at a time: each already has more processes than this
/// machine has cores, and mpirun's time to end a signalled job is bounded.
fn one_job_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static JOBS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    JOBS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("llama-mpi-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn transcript(out: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `llama train` with `layout`, as `ranks` processes under mpirun (0: one process, no mpirun),
/// writing its metrics to `metrics`.
fn train(ranks: usize, layout: &[&str], metrics: &Path, extra: &[&str]) -> Output {
    let llama = env!("CARGO_BIN_EXE_llama");
    let mut command = match ranks {
        0 => std::process::Command::new(llama),
        n => {
            let mut command = burn_comm::mpirun(n);
            command.arg(llama);
            command
        }
    };
    command
        .args(RUN)
        .args(layout)
        .arg("--metrics")
        .arg(metrics)
        .args(extra)
        .output()
        .expect("llama runs (under mpirun: install openmpi-bin)")
}

fn losses(metrics: &Path) -> Vec<f64> {
    std::fs::read_to_string(metrics)
        .unwrap_or_else(|e| panic!("{}: {e}", metrics.display()))
        .lines()
        .map(|line| {
            let value: serde_json::Value = serde_json::from_str(line).unwrap();
            value["loss"].as_f64().unwrap()
        })
        .collect()
}

#[test]
fn every_layout_as_processes_matches_threads_and_one_device() {
    let _jobs = one_job_at_a_time();
    let dir = scratch("parity");
    // (processes, layout, flags the one-device run shares)
    let interleaved = [
        "--pp",
        "2",
        "--micro-batches",
        "4",
        "--schedule",
        "interleaved",
        "--virtual-stages",
        "2",
    ];
    let pipeline = |schedule| ["--pp", "2", "--micro-batches", "4", "--schedule", schedule];
    let (gpipe, one_f_one_b, zero_bubble) =
        (pipeline("gpipe"), pipeline("1f1b"), pipeline("zb-h1"));
    let dp_pp_tp = [
        "--dp",
        "2",
        "--pp",
        "2",
        "--tp",
        "2",
        "--micro-batches",
        "2",
    ];
    let moe = ["--model", "tiny-moe"];
    let layouts: [(usize, &[&str], &[&str]); 18] = [
        (2, &["--dp", "2"], &[]),
        (2, &["--dp", "2", "--strategy", "parameter-server"], &[]),
        (2, &["--tp", "2"], &[]),
        (2, &["--tp", "2", "--sp"], &[]),
        (2, &["--tp", "2", "--tp-overlap", "2"], &[]),
        (2, &["--dp", "2", "--zero", "3", "--dtype", "f16"], &[]),
        (2, &["--dp", "2", "--zero", "3"], &[]),
        (
            2,
            &["--dp", "2", "--zero", "2"],
            &["--clip-grad-norm", "0.5"],
        ),
        (2, &["--dp", "2", "--zero", "1", "--dtype", "bf16"], &[]),
        (4, &["--dp", "2", "--tp", "2"], &[]),
        (4, &["--dp", "2", "--cp", "2"], &[]),
        (2, &["--ep", "2"], &moe),
        (4, &["--ep", "2", "--tp", "2"], &moe),
        (2, &gpipe, &[]),
        (2, &one_f_one_b, &[]),
        (2, &zero_bubble, &[]),
        (2, &interleaved, &[]),
        (8, &dp_pp_tp, &[]),
    ];
    for (ranks, layout, shared) in layouts {
        let name = [layout, shared].concat().join(" ");
        let file = |what: &str| dir.join(format!("{}-{what}", name.replace(' ', "_")));
        let one_device = file("single.jsonl");
        let out = train(0, shared, &one_device, &[]);
        assert!(out.status.success(), "{}", transcript(&out));
        // A pipeline draws its last step: rank 0 gathers every stage's spans.
        let pipelined = layout.contains(&"--pp");
        let outputs = |weights: &Path, svg: &Path| {
            let mut flags = vec!["--save".to_string(), weights.display().to_string()];
            if pipelined {
                flags.extend(["--schedule-svg".to_string(), svg.display().to_string()]);
            }
            flags
        };
        let (threads, threads_weights) = (file("threads.jsonl"), file("threads-weights"));
        let threads_svg = file("threads.svg");
        let extra = outputs(&threads_weights, &threads_svg);
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let out = train(0, &[layout, shared].concat(), &threads, &extra);
        assert!(
            out.status.success(),
            "{name} as threads: {}",
            transcript(&out)
        );
        let (metrics, weights, svg) = (
            file("processes.jsonl"),
            file("weights"),
            file("processes.svg"),
        );
        let extra = outputs(&weights, &svg);
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let out = train(ranks, layout, &metrics, &[shared, &extra].concat());
        let text = transcript(&out);
        assert!(out.status.success(), "{name}: {text}");
        if pipelined {
            let drawn = drawn_actions(&svg);
            assert_eq!(drawn.len(), 2, "{name}: a row per stage's rank\n{drawn:?}");
            // Row r is pipeline rank r, which holds the stages s with s % 2 == r.
            for (r, (_, actions)) in drawn.iter().enumerate() {
                for action in actions {
                    let stage: usize = action
                        .rsplit("stage ")
                        .next()
                        .and_then(|s| s.trim().parse().ok())
                        .unwrap_or_else(|| panic!("{name}: no stage in {action:?}"));
                    assert_eq!(stage % 2, r, "{name}: row {r} drew {action:?}");
                }
            }
            assert_eq!(
                drawn,
                drawn_actions(&threads_svg),
                "{name}: the processes drew other actions than the threads"
            );
        }

        // MPI reduces in rank order with the local transport's kernels: the same bits.
        let actual = losses(&metrics);
        assert_eq!(
            actual,
            losses(&threads),
            "{name}: processes against threads"
        );
        let expected = losses(&one_device);
        assert_eq!(actual.len(), expected.len(), "{name}: one line per step");
        // 16-bit weights are rounded each step: one device in f32 is no oracle for them.
        if !layout.contains(&"bf16") && !layout.contains(&"f16") {
            for (step, (a, e)) in actual.iter().zip(&expected).enumerate() {
                assert!(
                    (a - e).abs() <= 1e-5 * e.abs(),
                    "{name}: step {} loss {a} against one device's {e}",
                    step + 1
                );
            }
        }
        assert_rank_0_reports_and_saves_the_threads_weights(
            &name,
            &out,
            &weights,
            &threads_weights,
        );
        println!("{name} as {ranks} processes: losses {actual:?}");
    }
}

/// Rank 0 alone of the job `out` reported, and it saved the whole model in `weights`, the same
/// bits as the threads' run saved in `threads_weights`.
fn assert_rank_0_reports_and_saves_the_threads_weights(
    name: &str,
    out: &Output,
    weights: &Path,
    threads_weights: &Path,
) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.matches("done:").count(),
        1,
        "{name}: rank 0 alone reports\n{}",
        transcript(out)
    );
    let read = |dir: &Path| std::fs::read(dir.join("model.safetensors")).unwrap();
    assert!(
        read(weights) == read(threads_weights),
        "{name}: the processes saved other weights than the threads"
    );
}

/// A schedule SVG's rows: each rank's label and the actions of its boxes, in order. Their
/// times differ from run to run; which actions each rank ran, and in which order, do not.
fn drawn_actions(svg: &Path) -> Vec<(String, Vec<String>)> {
    let text = std::fs::read_to_string(svg).unwrap_or_else(|e| panic!("{}: {e}", svg.display()));
    let inside = |line: &str, open: &str, close: &str| {
        let from = line.find(open)? + open.len();
        let to = line[from..].find(close)? + from;
        Some(line[from..to].to_string())
    };
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    for line in text.lines() {
        if let Some(rank) = inside(line, ">rank ", "<") {
            rows.push((rank, Vec::new()));
        }
        if let Some(action) = inside(line, "<title>", "</title>") {
            let row = rows.last_mut().expect("boxes follow their rank's label");
            row.1.push(action);
        }
    }
    assert!(
        rows.iter().all(|(_, actions)| !actions.is_empty()),
        "{}: a rank without boxes\n{text}",
        svg.display()
    );
    rows
}

#[test]
fn a_job_of_the_wrong_size_is_refused_with_a_sentence() {
    let _jobs = one_job_at_a_time();
    let dir = scratch("refused");
    let metrics = dir.join("m.jsonl");
    let out = train(3, &["--dp", "2"], &metrics, &[]);
    assert!(!out.status.success());
    let text = transcript(&out);
    assert!(
        text.contains("needs 2 ranks but the job has 3 processes; start it with `mpirun -n 2`"),
        "{text}"
    );
}

/// The `burn-launch` built beside llama by the workspace's tests.
fn burn_launch() -> PathBuf {
    let launcher = Path::new(env!("CARGO_BIN_EXE_llama")).with_file_name("burn-launch");
    assert!(
        launcher.exists(),
        "{} is missing: build it with `cargo build --release -p burn-launch`",
        launcher.display()
    );
    launcher
}

#[test]
fn burn_launch_starts_the_job_through_mpirun_on_a_machine_without_a_gpu() {
    let _jobs = one_job_at_a_time();
    let dir = scratch("burn-launch");
    let llama = Path::new(env!("CARGO_BIN_EXE_llama"));
    let launcher = burn_launch();
    let (one_device, launched) = (dir.join("single.jsonl"), dir.join("launched.jsonl"));
    let out = train(0, &[], &one_device, &[]);
    assert!(out.status.success(), "{}", transcript(&out));
    let out = std::process::Command::new(&launcher)
        .args(["--nproc-per-node", "2", "--"])
        .arg(llama)
        .args(RUN)
        .args(["--dp", "2", "--metrics"])
        .arg(&launched)
        // No GPU is seen, whatever the machine has.
        .env("CUDA_VISIBLE_DEVICES", "")
        .output()
        .expect("burn-launch runs");
    assert!(out.status.success(), "{}", transcript(&out));
    let (actual, expected) = (losses(&launched), losses(&one_device));
    assert_eq!(actual.len(), expected.len());
    for (a, e) in actual.iter().zip(&expected) {
        assert!(
            (a - e).abs() <= 1e-5 * e.abs(),
            "{a} against one device's {e}"
        );
    }
}

/// With torchrun's variables the ranks meet in rank 0's store and talk over TCP: the threads'
/// bits, in a layout of every kind of call (collectives on sub-groups, sends between stages),
/// and with ZeRO-3 and clipping.
#[test]
fn burn_launch_with_torchrun_variables_trains_over_tcp_as_threads_do() {
    let _jobs = one_job_at_a_time();
    let dir = scratch("tcp");
    let launcher = burn_launch();
    let layouts: [(usize, &[&str]); 2] = [
        (2, &["--dp", "2", "--zero", "3", "--clip-grad-norm", "0.5"]),
        (
            8,
            &[
                "--dp",
                "2",
                "--pp",
                "2",
                "--tp",
                "2",
                "--micro-batches",
                "2",
            ],
        ),
    ];
    for (ranks, layout) in layouts {
        let name = layout.join(" ");
        let file = |what: &str| dir.join(format!("{}-{what}", name.replace(' ', "_")));
        let (threads, threads_weights) = (file("threads.jsonl"), file("threads-weights"));
        let save = |weights: &Path| vec!["--save".to_string(), weights.display().to_string()];
        let extra = save(&threads_weights);
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let out = train(0, layout, &threads, &extra);
        assert!(
            out.status.success(),
            "{name} as threads: {}",
            transcript(&out)
        );
        let (metrics, weights) = (file("processes.jsonl"), file("weights"));
        let out = std::process::Command::new(&launcher)
            .args(["--torchrun-env", "--master-port", "0"])
            .args(["--nproc-per-node", &ranks.to_string(), "--"])
            .arg(env!("CARGO_BIN_EXE_llama"))
            .args(RUN)
            .args(layout)
            .arg("--metrics")
            .arg(&metrics)
            .args(save(&weights))
            .output()
            .expect("burn-launch runs");
        let text = transcript(&out);
        assert!(out.status.success(), "{name} over TCP: {text}");
        assert_eq!(
            losses(&metrics),
            losses(&threads),
            "{name}: processes over TCP against threads"
        );
        assert_rank_0_reports_and_saves_the_threads_weights(
            &name,
            &out,
            &weights,
            &threads_weights,
        );
        println!("{name} as {ranks} processes over TCP: the threads' bits");
    }
}

#[test]
fn processes_checkpoint_and_resume_as_threads_do() {
    let _jobs = one_job_at_a_time();
    let dir = scratch("checkpoint");
    let checkpoints = dir.join("checkpoints");
    let checkpointing = ["--checkpoint-dir", checkpoints.to_str().unwrap()];
    let layout = ["--dp", "2", "--tp", "2"];
    let whole = dir.join("whole.jsonl");
    let args = [&checkpointing[..], &["--checkpoint-every", "2"]].concat();
    let out = train(4, &layout, &whole, &args);
    assert!(out.status.success(), "{}", transcript(&out));
    // As if the job had died before step 4's checkpoint; resumed as threads of one process
    // in another layout, then as processes again in the first.
    std::fs::remove_dir_all(checkpoints.join("step-00000004")).unwrap();
    let threads = dir.join("threads.jsonl");
    let resume = [&checkpointing[..], &["--resume"]].concat();
    let out = train(0, &["--tp", "2"], &threads, &resume);
    assert!(out.status.success(), "{}", transcript(&out));
    let processes = dir.join("processes.jsonl");
    let out = train(4, &layout, &processes, &resume);
    assert!(out.status.success(), "{}", transcript(&out));
    let whole = losses(&whole);
    assert_eq!(
        losses(&processes),
        whole[2..],
        "the same layout: the same bits"
    );
    let threads = losses(&threads);
    assert_eq!(threads.len(), 2, "steps 3 and 4");
    for (a, e) in threads.iter().zip(&whole[2..]) {
        assert!(
            (a - e).abs() <= 1e-5 * e.abs(),
            "tp 2 from dp 2 x tp 2: {a} against {e}"
        );
    }
}

/// Steps of [`long_job`]: about 3 s here, so that a SIGTERM to mpirun after the second step
/// reaches the ranks while they train (mpirun passes it on about a second later).
#[cfg(unix)]
const LONG_STEPS: usize = 80;

/// `llama train` for [`LONG_STEPS`] steps of `tiny` at dp 2, as two processes under mpirun,
/// checkpointing every step into `checkpoints` (resuming from it with `resume`).
#[cfg(unix)]
fn long_job(checkpoints: &Path, metrics: &Path, resume: bool) -> std::process::Command {
    let mut command = burn_comm::mpirun(2);
    command
        .arg(env!("CARGO_BIN_EXE_llama"))
        .args(["train", "--steps", &LONG_STEPS.to_string()])
        .args(["--batch-size", "8", "--seq-len"])
        .args([
            "16",
            "--dp",
            "2",
            "--checkpoint-every",
            "1",
            "--checkpoint-dir",
        ])
        .arg(checkpoints)
        .arg("--metrics")
        .arg(metrics);
    if resume {
        command.arg("--resume");
    }
    command
}

/// The processes whose parent is `parent`, read from /proc (no procps needed).
#[cfg(target_os = "linux")]
fn children(parent: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| {
            let pid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // "pid (comm) state ppid ...": the command may hold spaces, so read after its ')'.
            let ppid: u32 = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            (ppid == parent).then_some(pid)
        })
        .collect()
}

/// Waits for `child` at most `limit`, killing it (and failing) should it outlive that.
#[cfg(unix)]
fn wait_bounded(
    child: &mut std::process::Child,
    limit: std::time::Duration,
) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("the job still ran {limit:?} after one of its ranks was killed");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[cfg(target_os = "linux")]
#[test]
fn a_sigterm_to_mpirun_checkpoints_and_killing_one_rank_loses_nothing_committed() {
    let _jobs = one_job_at_a_time();
    let dir = scratch("kill");
    let whole = dir.join("whole.jsonl");
    let out = long_job(&dir.join("whole"), &whole, false)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", transcript(&out));
    let whole = losses(&whole);
    assert_eq!(whole.len(), LONG_STEPS);

    // SIGTERM to mpirun (a scheduler's preemption), which passes it to every rank: the ranks
    // agree on the step to stop after, checkpoint it and say how to go on. Open MPI SIGKILLs
    // the ranks a second later (`odls_base_sigkill_timeout`), ample for a step of `tiny` and
    // its checkpoint, with this file's jobs run one at a time.
    let checkpoints = dir.join("terminated");
    let metrics = dir.join("terminated.jsonl");
    let job = long_job(&checkpoints, &metrics, false)
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::fs::read_to_string(&metrics).map_or(0, |m| m.lines().count()) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the job never trained"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let signalled = std::process::Command::new("kill")
        .args(["-TERM", &job.id().to_string()])
        .status()
        .unwrap();
    assert!(signalled.success());
    let out = job.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("stopped by a signal after step")
            && stderr.contains("--resume"),
        "{stderr}"
    );
    // Every rank stopped at the same step: none failed, none aborted the job.
    assert!(
        !stderr.contains("MPI_ABORT") && !stderr.contains("failed:"),
        "{stderr}"
    );
    let stopped = losses(&metrics).len();
    assert!(
        stopped < LONG_STEPS,
        "the signal came too late to test anything"
    );
    let resumed = dir.join("resumed-after-term.jsonl");
    let out = long_job(&checkpoints, &resumed, true).output().unwrap();
    assert!(out.status.success(), "{}", transcript(&out));
    assert_eq!(
        losses(&resumed),
        whole[stopped..],
        "stopped after step {stopped}"
    );

    // One rank, drawn from the clock, SIGKILLed at a moment drawn from the clock once the
    // job has committed a checkpoint: during a step, a save, or its commit.
    let checkpoints = dir.join("checkpoints");
    let mut job = long_job(&checkpoints, &dir.join("killed.jsonl"), false)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !checkpoints.join("latest").exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "no checkpoint was committed"
        );
        assert!(job.try_wait().unwrap().is_none(), "the job ended early");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    std::thread::sleep(std::time::Duration::from_micros(u64::from(clock % 150_000)));
    let committed = std::fs::read_to_string(checkpoints.join("latest")).unwrap();
    let committed: usize = committed
        .trim()
        .trim_start_matches("step-")
        .parse()
        .unwrap();
    let mut ranks = children(job.id());
    ranks.sort_unstable();
    assert_eq!(ranks.len(), 2, "mpirun's children: {ranks:?}");
    let victim = ranks[(clock / 150_000) as usize % 2];
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = wait_bounded(&mut job, std::time::Duration::from_secs(60));
    assert!(!status.success(), "a job that lost a rank cannot succeed");

    let resumed = dir.join("resumed.jsonl");
    let out = long_job(&checkpoints, &resumed, true).output().unwrap();
    assert!(out.status.success(), "{}", transcript(&out));
    let resumed = losses(&resumed);
    let from = whole.len() - resumed.len();
    assert!(
        from >= committed,
        "the job resumed after step {from}, before step {committed}, committed before the kill"
    );
    assert_eq!(resumed, whole[from..], "resumed after step {from}");
    println!("process {victim} killed, the job's {status}; resumed after step {from}");
    std::fs::remove_dir_all(dir).unwrap();
}
