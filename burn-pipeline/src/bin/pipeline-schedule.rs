//! Prints a pipeline schedule, its simulated bubble beside the paper's formula and the peak
//! activations per rank, and draws it as an SVG Gantt chart.
//!
//! ```text
//! pipeline-schedule --stages 4 --micro-batches 8 --kind 1f1b --svg 1f1b.svg
//! ```

use std::process::ExitCode;

use burn_pipeline::{Costs, Schedule, ScheduleKind, simulate};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Print, simulate and draw a pipeline-parallel schedule")]
struct Args {
    /// Pipeline ranks.
    #[arg(long)]
    stages: usize,
    /// Micro-batches per step.
    #[arg(long)]
    micro_batches: usize,
    /// Which schedule.
    #[arg(long, value_enum)]
    kind: ScheduleKind,
    /// Model chunks per rank (interleaved only).
    #[arg(long, default_value_t = 1)]
    virtual_stages: usize,
    /// Cost of a forward of one rank's share of the model.
    #[arg(long, default_value_t = 1.0)]
    forward: f64,
    /// Cost of the input half of its backward.
    #[arg(long, default_value_t = 1.0)]
    backward_input: f64,
    /// Cost of the weight half of its backward.
    #[arg(long, default_value_t = 1.0)]
    backward_weight: f64,
    /// Also list the sends and receives.
    #[arg(long)]
    comm: bool,
    /// Write the Gantt chart here.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    let schedule = Schedule::new(
        args.kind,
        args.stages,
        args.micro_batches,
        args.virtual_stages,
    )
    .map_err(|e| e.to_string())?;
    let costs = Costs {
        forward: args.forward,
        backward_input: args.backward_input,
        backward_weight: args.backward_weight,
        send: 0.0,
    };
    let timeline = simulate(&schedule, &costs).map_err(|e| e.to_string())?;
    let title = format!(
        "{}: {} ranks, {} micro-batches, {} chunk(s) per rank",
        schedule.kind, schedule.ranks, schedule.micro_batches, schedule.virtual_stages
    );
    println!("{title}");
    println!("F forward, B backward, I/W its input/weight halves; .c is the chunk");
    for rank in 0..schedule.ranks {
        println!("rank {rank}: {}", schedule.describe(rank));
        if args.comm {
            let all: Vec<String> = schedule.actions[rank]
                .iter()
                .map(|a| format!("{}{}@{}", a.kind.letter(), a.micro_batch, a.stage))
                .collect();
            println!("        {}", all.join(" "));
        }
    }
    println!(
        "bubble: simulated {:.2}%, formula {:.2}%",
        100.0 * timeline.bubble(),
        100.0 * schedule.bubble_formula(&costs)
    );
    let peaks: Vec<String> = timeline
        .peak_activations()
        .iter()
        .map(|p| format!("{p:.2}"))
        .collect();
    println!(
        "peak activations per rank (micro-batches of the rank's layers): {}",
        peaks.join(" ")
    );
    if let Some(path) = &args.svg {
        std::fs::write(path, timeline.to_svg(&title))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
