//! `burn-launch --nproc-per-node N -- burn-rendezvous`: every rank meets the others through
//! rank 0's store and prints the job as it sees it. A smoke test of a cluster's start-up.

use std::process::ExitCode;
use std::time::Duration;

use burn_comm::ProcessEnv;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("burn-rendezvous: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let env = ProcessEnv::from_env().map_err(|e| e.to_string())?;
    let mut job = env
        .rendezvous(Duration::from_secs(60))
        .map_err(|e| e.to_string())?;
    let store = &mut job.store;
    let me = format!("pid {} on {}", std::process::id(), hostname());
    store
        .set(&format!("who/{}", env.rank), me.as_bytes())
        .map_err(|e| e.to_string())?;
    let mut seen = Vec::with_capacity(env.world_size);
    for rank in 0..env.world_size {
        let who = store
            .get(&format!("who/{rank}"))
            .map_err(|e| e.to_string())?;
        seen.push(String::from_utf8_lossy(&who).into_owned());
    }
    println!(
        "rank {}/{} (local {}/{}) sees {} ranks: {}",
        env.rank,
        env.world_size,
        env.local_rank,
        env.local_world_size,
        seen.len(),
        seen.join(", ")
    );
    // Rank 0's store must outlive everyone's last read.
    job.depart().map_err(|e| e.to_string())
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "this host".into())
}
