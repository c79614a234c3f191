//! Checkpoint speed, measured in one run: `llama train` checkpointing every `--every` steps
//! (saved in the background) against the same run without checkpoints, for the stall of the
//! step that copies its state aside and of the next one, beside which the save is written;
//! then that checkpoint loaded, and saved again by one process as one blocking call, beside a
//! plain sequential write and read of the same bytes in the same directory. The stall a
//! blocking save would cause is its save time.
//!
//! Runs are repeated in interleaved rounds (`--repeats`) so that drift of the machine's speed
//! hits every measurement alike. Each checkpoint's stall is also taken against the untouched
//! steps beside it in its own run, which drift between runs cannot move; and the processor
//! time of the plain write shows what writing the bytes costs a machine with no core to spare.
//!
//! `cargo run --release -p benches --bin checkpoint -- --help`

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use benches::median;
use burn::tensor::TensorData;
use burn_checkpoint::{Checkpoint, Shard};
use burn_zero::ZeroStage;
use clap::Parser;
use llama::checkpoint::CheckpointConfig;
use llama::data::MarkovSource;
use llama::train::{Strategy, TrainConfig};
use serde::Serialize;

/// Blocking saves and plain writes per round.
const WRITES_PER_ROUND: usize = 4;

#[derive(Parser)]
#[command(about = "Checkpoint save, load and training stall against plain file I/O")]
struct Args {
    /// Model preset.
    #[arg(long, default_value = "small")]
    model: String,
    /// Data-parallel ranks (threads); 1 trains on one device.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// ZeRO stage over the data-parallel ranks (0: none); its shards are what is saved.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    zero: u8,
    /// Samples per step over all ranks.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Tokens per sample.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// Steps per run.
    #[arg(long, default_value_t = 14)]
    steps: usize,
    /// Checkpoint after every this many steps.
    #[arg(long, default_value_t = 3)]
    every: usize,
    /// Rounds over all measurements; the medians pool the rounds.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Where the checkpoints and plain files go (the disk measured).
    #[arg(long, default_value = "target/bench/checkpoints")]
    dir: PathBuf,
    /// Where to write the results as JSON.
    #[arg(long, default_value = "target/bench/checkpoint.json")]
    json: String,
}

#[derive(Serialize)]
struct Results {
    model: String,
    dp: usize,
    zero: u8,
    checkpoint_bytes: u64,
    /// Median time between consecutive steps without checkpoints.
    step_s: f64,
    /// Median time of a step that starts a background save (its copy aside included).
    checkpointing_step_s: f64,
    /// Median time the run itself reports for handing the state in (the copy aside).
    handing_in_s: f64,
    /// Median time of the step after it, while the save is written.
    next_step_s: f64,
    /// Median time of the other steps of the checkpointing run.
    other_steps_s: f64,
    /// What a checkpoint costs the run: the excess of the two steps over `step_s`.
    stall_s: f64,
    /// The same, each checkpoint against the untouched steps either side of it in its own
    /// run, as a fraction of their step: the median, and the quartiles over the checkpoints.
    paired_stall: [f64; 3],
    save_s: f64,
    plain_write_s: f64,
    /// The processor time of the plain write (the kernel's copy into the page cache, mostly):
    /// what writing these bytes takes from training where no core is free for it.
    plain_write_cpu_s: f64,
    load_s: f64,
    plain_read_s: f64,
}

fn main() {
    let args = Args::parse();
    assert!(
        args.every >= 3 && args.steps > 2 * args.every,
        "--every must be at least 3 (a step to save, one to write, one untouched) and --steps must span two saves"
    );
    let model = benches::preset(&args.model);
    let data = MarkovSource::new(16, 3, args.seq_len, 1 << 16, 1);
    println!(
        "{} ({:.1}M parameters), dp {}, ZeRO-{}, {} x {} tokens per step, {} steps, a checkpoint every {}",
        args.model,
        model.num_params() as f64 / 1e6,
        args.dp,
        args.zero,
        args.batch_size,
        args.seq_len,
        args.steps,
        args.every
    );
    let mut config = TrainConfig::new(model, args.steps);
    config.batch_size = args.batch_size;
    config.seq_len = args.seq_len;
    config.dp = args.dp;
    config.zero = ZeroStage::from_number(args.zero.into()).expect("--zero is 0 to 3");
    config.strategy = if args.dp > 1 || args.zero > 0 {
        Strategy::Ddp
    } else {
        Strategy::Single
    };
    let checkpoints = args.dir.join("run");
    let mut checkpointing = config.clone();
    checkpointing.checkpoint = Some(CheckpointConfig {
        dir: checkpoints.clone(),
        every: args.every,
        resume: false,
        keep: None,
        stage_on_host: false,
    });

    let (mut plain_steps, mut stalled) = (Vec::new(), Vec::new());
    let (mut next, mut others) = (Vec::new(), Vec::new());
    let mut handed_in = Vec::new();
    let mut paired = Vec::new();
    let (mut save, mut write, mut load, mut read) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut write_cpu = Vec::new();
    let mut bytes = 0;
    for round in 1..=args.repeats {
        eprintln!(
            "round {round}/{}: training without checkpoints",
            args.repeats
        );
        plain_steps.extend(step_times(&config, &data).0);
        eprintln!("round {round}/{}: training with checkpoints", args.repeats);
        let _ = std::fs::remove_dir_all(&checkpoints);
        let (intervals, copies) = step_times(&checkpointing, &data);
        handed_in.extend(copies);
        paired.extend(paired_stalls(&intervals, args.every));
        for (i, seconds) in intervals.into_iter().enumerate() {
            // Interval i holds step i + 2 and what ran before its metrics, its save included;
            // a save starts after every `every`-th step and is written during the next.
            let step = i + 2;
            if step.is_multiple_of(args.every) {
                stalled.push(seconds);
            } else if (step - 1).is_multiple_of(args.every) {
                next.push(seconds);
            } else {
                others.push(seconds);
            }
        }
        eprintln!("round {round}/{}: loading and saving", args.repeats);
        let checkpoint = Checkpoint::latest(&checkpoints)
            .expect("the run's checkpoint opens")
            .expect("the run checkpointed");
        let began = Instant::now();
        let tensors: Vec<(String, TensorData)> = checkpoint
            .names()
            .map(|name| {
                let data = checkpoint.read_whole(name).expect("the checkpoint reads");
                (name.to_string(), data)
            })
            .collect();
        load.push(began.elapsed().as_secs_f64());
        read.push(plain_read(checkpoint.dir()));
        bytes = tensors.iter().map(|(_, d)| d.as_bytes().len() as u64).sum();

        // Each first in turn, so that the disk's state after the one hits the other alike.
        let blocking_save = || {
            let again = args.dir.join("again");
            let _ = std::fs::remove_dir_all(&again);
            let shards = tensors
                .iter()
                .map(|(name, data)| Shard::whole(name.clone(), data.clone()))
                .collect();
            let began = Instant::now();
            burn_checkpoint::save(
                &again,
                checkpoint.step(),
                None,
                Ok(shards),
                checkpoint.metadata().clone(),
            )
            .expect("the checkpoint saves");
            began.elapsed().as_secs_f64()
        };
        // The disk's speed swings from one write to the next: several of each, alternating.
        let plain = args.dir.join("plain.bin");
        let mut write_plainly = || {
            let (wall, cpu) = plain_write(&plain, &tensors);
            write.push(wall);
            write_cpu.push(cpu);
        };
        for turn in 0..WRITES_PER_ROUND {
            if (round + turn) % 2 == 1 {
                save.push(blocking_save());
                write_plainly();
            } else {
                write_plainly();
                save.push(blocking_save());
            }
        }
    }
    let _ = std::fs::remove_dir_all(&args.dir);

    let step = median(plain_steps.into_iter());
    let checkpointing_step = median(stalled.into_iter());
    let next_step = median(next.into_iter());
    let results = Results {
        model: args.model,
        dp: args.dp,
        zero: args.zero,
        checkpoint_bytes: bytes,
        step_s: step,
        checkpointing_step_s: checkpointing_step,
        handing_in_s: median(handed_in.into_iter()),
        next_step_s: next_step,
        other_steps_s: median(others.into_iter()),
        stall_s: checkpointing_step + next_step - 2.0 * step,
        paired_stall: quartiles(paired),
        save_s: median(save.into_iter()),
        plain_write_s: median(write.into_iter()),
        plain_write_cpu_s: median(write_cpu.into_iter()),
        load_s: median(load.into_iter()),
        plain_read_s: median(read.into_iter()),
    };
    report(&results);
    benches::write_json(&args.json, &results);
}

/// The wall time between consecutive steps of a run (from the end of step 1 on), checkpoints
/// included, and the run's own measure of each checkpoint's stall (the copy aside).
fn step_times(config: &TrainConfig, data: &MarkovSource) -> (Vec<f64>, Vec<f64>) {
    let (mut ends, mut copies) = (Vec::new(), Vec::new());
    llama::cpu::train(config, data, &mut |m| {
        ends.push(Instant::now());
        copies.extend(m.checkpoint_s);
    })
    .expect("the run trains");
    let intervals = ends
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect();
    (intervals, copies)
}

/// Each checkpoint's stall against its own neighbours: the excess of the step that saves and
/// the next one over the untouched steps just before and just after them (those the run has),
/// as a fraction of those steps' mean, so that the machine's drift between runs, and within
/// one over more than a few steps, cancels. `intervals[i]` is step `i + 2`, as
/// [`step_times`] gives them.
fn paired_stalls(intervals: &[f64], every: usize) -> Vec<f64> {
    let step = |s: usize| s.checked_sub(2).and_then(|i| intervals.get(i)).copied();
    (1..)
        .map(|k| k * every)
        .map_while(|saves| Some((saves, step(saves)?, step(saves + 1)?)))
        .filter_map(|(saves, own, next)| {
            // With `every` >= 3 neither neighbour saves, nor writes a save unless the save
            // outlasts the step after it (the other steps' median, printed, shows whether
            // they do); with `every` = 3 a step is the neighbour of two checkpoints.
            let around: Vec<f64> = [step(saves - 1), step(saves + 2)]
                .into_iter()
                .flatten()
                .collect();
            if around.is_empty() {
                return None;
            }
            let base = around.iter().sum::<f64>() / around.len() as f64;
            Some((own + next - 2.0 * base) / base)
        })
        .collect()
}

/// The lower quartile, the median and the upper quartile of `values`, each interpolated
/// between the two values beside it.
fn quartiles(mut values: Vec<f64>) -> [f64; 3] {
    values.sort_by(f64::total_cmp);
    let at = |q: f64| {
        let place = values.len().saturating_sub(1) as f64 * q;
        let (low, high) = (place.floor() as usize, place.ceil() as usize);
        match (values.get(low), values.get(high)) {
            (Some(a), Some(b)) => a + (b - a) * (place - place.floor()),
            _ => f64::NAN,
        }
    };
    [at(0.25), at(0.5), at(0.75)]
}

/// Writes `tensors`' bytes one after another into `path`, flushed to disk; its seconds, and
/// the processor seconds this thread spent on it.
fn plain_write(path: &Path, tensors: &[(String, TensorData)]) -> (f64, f64) {
    let cpu = thread_cpu_seconds();
    let began = Instant::now();
    let mut file = std::io::BufWriter::new(File::create(path).expect("a plain file"));
    for (_, data) in tensors {
        file.write_all(data.as_bytes()).expect("a plain write");
    }
    let file = file.into_inner().expect("a plain write");
    file.sync_all().expect("a plain flush");
    let times = (began.elapsed().as_secs_f64(), thread_cpu_seconds() - cpu);
    std::fs::remove_file(path).expect("the plain file goes");
    times
}

/// The processor time this thread has used, user and kernel.
fn thread_cpu_seconds() -> f64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec to write.
    let code = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    assert_eq!(code, 0, "the thread's processor time");
    now.tv_sec as f64 + now.tv_nsec as f64 * 1e-9
}

/// Reads the data files of the checkpoint in `dir` from end to end; its seconds.
fn plain_read(dir: &Path) -> f64 {
    let mut buffer = vec![0u8; 8 << 20];
    let began = Instant::now();
    for entry in std::fs::read_dir(dir).expect("the checkpoint's directory") {
        let path = entry.expect("an entry").path();
        if path.extension().is_some_and(|e| e == "bin") {
            let mut file = File::open(&path).expect("a plain read");
            while file.read(&mut buffer).expect("a plain read") > 0 {}
        }
    }
    began.elapsed().as_secs_f64()
}

fn report(r: &Results) {
    let mb = r.checkpoint_bytes as f64 / 1e6;
    println!("checkpoint: {mb:.1} MB");
    println!("{:<44} {:>9} {:>9}", "measure", "seconds", "vs base");
    let row = |name: &str, seconds: f64, base: f64| {
        println!("{name:<44} {seconds:>9.4} {:>9.3}", seconds / base);
    };
    row("step without checkpoints (base)", r.step_s, r.step_s);
    row(
        "step that starts a background save",
        r.checkpointing_step_s,
        r.step_s,
    );
    row("  of which handing the state in", r.handing_in_s, r.step_s);
    row(
        "the step after it (the save written)",
        r.next_step_s,
        r.step_s,
    );
    row(
        "other steps of the checkpointing run",
        r.other_steps_s,
        r.step_s,
    );
    row(
        "a checkpoint's stall, against the other run",
        r.stall_s,
        r.step_s,
    );
    // Not a row: it is a share of the neighbouring steps, not of the base step.
    let [low, mid, high] = r.paired_stall;
    println!(
        "a checkpoint's stall, against its neighbours: {:.1}% of their step (median; quartiles {:.1}% to {:.1}%)",
        100.0 * mid,
        100.0 * low,
        100.0 * high
    );
    row("blocking save (a sync save's stall)", r.save_s, r.step_s);
    row(
        "a plain write's processor time",
        r.plain_write_cpu_s,
        r.step_s,
    );
    println!(
        "save {:.0} MB/s against a plain write's {:.0} MB/s: {:.2} of it",
        mb / r.save_s,
        mb / r.plain_write_s,
        r.plain_write_s / r.save_s
    );
    println!(
        "load {:.0} MB/s against a plain read's {:.0} MB/s: {:.2} of it",
        mb / r.load_s,
        mb / r.plain_read_s,
        r.plain_read_s / r.load_s
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoints_stall_is_measured_against_its_own_neighbours() {
        // Steps 2 to 10 (saves after steps 4 and 8); the second stretch runs at half the
        // speed, its save costing as much of its steps as the first's.
        let intervals = [1.0, 1.0, 1.5, 1.2, 1.0, 2.0, 3.0, 2.4, 2.0];
        let stalls = paired_stalls(&intervals, 4);
        assert_eq!(stalls.len(), 2);
        for stall in stalls {
            assert!((stall - 0.7).abs() < 1e-12, "{stall}");
        }
    }
}
