//! The launcher on one machine, processes on loopback: the environment it sets, rank-prefixed
//! output, stopping everyone when one rank fails, and a real rendezvous through the store.

use std::process::Command;
use std::time::{Duration, Instant};

fn launch(args: &[&str]) -> (i32, String, String, Duration) {
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_burn-launch"))
        .args(args)
        .output()
        .expect("burn-launch runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        started.elapsed(),
    )
}

#[test]
fn sets_the_torchrun_environment_and_prefixes_output() {
    let script =
        "echo \"$RANK/$WORLD_SIZE $LOCAL_RANK/$LOCAL_WORLD_SIZE $MASTER_ADDR\"; echo oops >&2";
    let (code, stdout, stderr, _) = launch(&[
        "--torchrun-env",
        "--nproc-per-node",
        "3",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-port",
        "29555",
        "--",
        "sh",
        "-c",
        script,
    ]);
    assert_eq!(code, 0, "{stderr}");
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            "[rank 3] 3/6 0/3 127.0.0.1",
            "[rank 4] 4/6 1/3 127.0.0.1",
            "[rank 5] 5/6 2/3 127.0.0.1"
        ]
    );
    assert_eq!(stderr.matches("] oops").count(), 3, "{stderr}");
    assert!(stdout.contains("[rank 3]") && !stdout.contains("29555"));
}

#[test]
fn one_failing_rank_stops_the_others_and_sets_the_exit_code() {
    let script = "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60";
    let (code, _, stderr, took) = launch(&[
        "--torchrun-env",
        "--nproc-per-node",
        "3",
        "--master-port",
        "0",
        "--",
        "sh",
        "-c",
        script,
    ]);
    assert_eq!(code, 3, "{stderr}");
    assert!(stderr.contains("rank 1 exited"), "{stderr}");
    assert!(
        took < Duration::from_secs(20),
        "the sleeping ranks were not stopped"
    );
}

#[test]
fn bad_arguments_get_a_sentence() {
    let (code, _, stderr, _) = launch(&["--nproc-per-node", "0", "--", "true"]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("--nproc-per-node must be at least 1"),
        "{stderr}"
    );
    let (code, _, stderr, _) = launch(&[
        "--torchrun-env",
        "--nproc-per-node",
        "1",
        "--",
        "/no/such/program",
    ]);
    assert_eq!(code, 2);
    assert!(stderr.contains("cannot start /no/such/program"), "{stderr}");
}

#[test]
fn processes_meet_through_rank_0s_store() {
    let (code, stdout, stderr, _) = launch(&[
        "--torchrun-env",
        "--nproc-per-node",
        "4",
        "--master-port",
        "0",
        "--",
        env!("CARGO_BIN_EXE_burn-rendezvous"),
    ]);
    assert_eq!(code, 0, "{stderr}");
    for rank in 0..4 {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("[rank {rank}] rank {rank}/4")))
            .unwrap_or_else(|| panic!("no line from rank {rank}: {stdout}"));
        assert!(line.contains("sees 4 ranks"), "{line}");
        assert_eq!(line.matches("pid ").count(), 4, "{line}");
    }
}

/// Processes whose command line contains `marker`.
fn processes_with(marker: &str) -> usize {
    std::fs::read_dir("/proc")
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
                .filter(|cmdline| {
                    String::from_utf8_lossy(cmdline)
                        .replace('\0', " ")
                        .contains(marker)
                })
                .count()
        })
        .unwrap_or(0)
}

#[cfg(unix)]
#[test]
fn sigterm_to_the_launcher_stops_every_rank_and_what_it_started() {
    // Ranks in their own process groups read no terminal: stdin is closed for them.
    let marker = "sleep 61.25";
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_burn-launch"))
        .args([
            "--torchrun-env",
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "--",
            "sh",
            "-c",
        ])
        .arg(format!("{marker}; true"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    // The launcher, and for each rank its shell and the shell's sleep.
    while processes_with(marker) < 5 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(processes_with(marker), 5, "the ranks did not start");
    let killed = Command::new("kill")
        .args(["-TERM", &launcher.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = launcher.wait().unwrap();
    assert_eq!(
        status.code(),
        Some(128 + 15),
        "128 + SIGTERM, as a shell reports it"
    );
    // Signalled, the sleeps may take a moment to leave /proc.
    let deadline = Instant::now() + Duration::from_secs(5);
    while processes_with(marker) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        processes_with(marker),
        0,
        "a rank's child outlived the launcher"
    );
}

/// Runs `sh -c script` under burn-launch with `options`, every GPU hidden (so a test means the
/// same on a machine with one) and `path` as PATH if given, and checks that it succeeds, that
/// its ranks print `lines` (in any order), and that its stderr says `says`.
fn launch_without_gpu(
    options: &[&str],
    script: &str,
    path: Option<&std::path::Path>,
    lines: &[&str],
    says: &str,
) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_burn-launch"));
    command
        .args(options)
        .args(["--", "sh", "-c", script])
        .env("CUDA_VISIBLE_DEVICES", "");
    if let Some(path) = path {
        command.env("PATH", path);
    }
    let out = command.output().expect("burn-launch runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut printed: Vec<&str> = stdout.lines().collect();
    printed.sort();
    assert_eq!(printed, lines, "{stderr}");
    assert!(stderr.contains(says), "{stderr}");
}

#[test]
fn without_a_cuda_gpu_the_ranks_start_through_mpirun() {
    let script = "echo \"$OMPI_COMM_WORLD_RANK/$OMPI_COMM_WORLD_SIZE\"";
    let options = ["--nproc-per-node", "2"];
    launch_without_gpu(&options, script, None, &["0/2", "1/2"], "no CUDA GPU here");
}

#[cfg(unix)]
#[test]
fn without_a_cuda_gpu_a_job_without_mpirun_or_of_several_machines_uses_torchruns_variables() {
    let script = "echo \"$RANK/$WORLD_SIZE mpi=$OMPI_COMM_WORLD_RANK\"";
    // A PATH with a shell but no mpirun.
    let dir = std::env::temp_dir().join(format!("burn-launch-no-mpirun-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let shell = dir.join("sh");
    let _ = std::fs::remove_file(&shell);
    std::os::unix::fs::symlink("/bin/sh", &shell).unwrap();
    // Prefixed by burn-launch, which started them, and no MPI rank.
    launch_without_gpu(
        &["--nproc-per-node", "2", "--master-port", "0"],
        script,
        Some(&dir),
        &["[rank 0] 0/2 mpi=", "[rank 1] 1/2 mpi="],
        "no mpirun on PATH",
    );
    std::fs::remove_dir_all(&dir).unwrap();

    // One machine's share of a job of several starts so too, mpirun or not.
    launch_without_gpu(
        &["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1"],
        script,
        None,
        &["[rank 2] 2/4 mpi=", "[rank 3] 3/4 mpi="],
        "--nnodes",
    );
}

#[test]
fn with_mpi_the_ranks_start_through_mpirun_on_the_hostfile_machines() {
    let dir = std::env::temp_dir().join(format!("burn-launch-mpi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hostfile = dir.join("hosts");
    std::fs::write(&hostfile, "localhost slots=3\n").unwrap();
    let script = "echo \"$OMPI_COMM_WORLD_RANK/$OMPI_COMM_WORLD_SIZE\"";
    let (code, stdout, stderr, _) = launch(&[
        "--mpi",
        "--hostfile",
        hostfile.to_str().unwrap(),
        "--nproc-per-node",
        "3",
        "--",
        "sh",
        "-c",
        script,
    ]);
    assert_eq!(code, 0, "{stderr}");
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort();
    assert_eq!(lines, ["0/3", "1/3", "2/3"], "{stderr}");

    // A rank that fails fails the job, with its code.
    let (code, _, _, took) =
        launch(&["--mpi", "--nproc-per-node", "2", "--", "sh", "-c", "exit 3"]);
    assert_ne!(code, 0);
    assert!(took < Duration::from_secs(30), "{took:?}");

    let (code, _, stderr, _) = launch(&[
        "--mpi",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--",
        "true",
    ]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("list the machines in --hostfile"),
        "{stderr}"
    );
}
