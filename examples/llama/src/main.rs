//! `llama train` and `llama eval`: the command line of the example.

use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::backend::Flex;
use burn::tensor::backend::Backend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use burn_comm::RankContext;
use burn_ddp::DdpConfig;
use burn_pipeline::ScheduleKind;
use burn_tensor_parallel::CpAttention;
use burn_zero::{MixedPrecision, Precision, ZeroConfig, ZeroStage};
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use llama::data::{Dataset, MarkovSource, TokenCorpus};
use llama::parallel_plan::ParallelPlan;
use llama::pipeline::Balance;
use llama::plan::Plan;
use llama::tokenizer::TextTokenizer;
use llama::train::{Layout, StepMetrics, Strategy, TrainConfig, TrainError};
use llama::{Llama, LlamaConfig, hf};

#[derive(Parser)]
#[command(about = "A Llama-style model trained with burn-parallel")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train on the synthetic Markov source (or --data FILE) and report every step.
    Train(Box<TrainArgs>),
    /// Mean next-token cross-entropy of a checkpoint on token sequences (or lines of text
    /// through a tokenizer), as JSON.
    Eval(EvalArgs),
    /// Model-state bytes per rank at every ZeRO stage (the ZeRO paper's formulas) and the
    /// activations of a micro-batch, in GB (10^9 bytes); with --gpus, the best layouts of a
    /// cluster, their memory and predicted step time.
    Plan(PlanArgs),
    /// Write a training checkpoint's weights as `train --save` does (Hugging Face safetensors,
    /// config.json and burn's record), whatever layout saved it.
    Export(ExportArgs),
}

#[derive(clap::Args)]
struct ExportArgs {
    /// A --checkpoint-dir (its newest checkpoint is taken) or one of its step-N directories.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Where to write the weights.
    #[arg(long)]
    out: PathBuf,
    /// The largest safetensors file; above it the weights are sharded with an index.
    #[arg(long, default_value = "5GB", value_parser = parse_size)]
    max_shard_size: u64,
}

#[derive(clap::Args)]
struct PlanArgs {
    /// Model preset (tiny, small, tiny-moe, small-moe, llama-1b, llama-7b); its shape also sizes
    /// the activations.
    #[arg(long, conflicts_with = "params")]
    model: Option<String>,
    /// Any parameter count instead of a preset, such as 7.5e9.
    #[arg(long)]
    params: Option<f64>,
    /// Data-parallel ranks, over which ZeRO shards.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Expert-parallel ranks (a model with experts): each holds experts / ep of every block's
    /// experts and reads its own samples; the dense weights are sharded over dp x ep.
    #[arg(long, default_value_t = 1)]
    ep: usize,
    /// Context-parallel ranks: each holds seq-len / cp tokens of a sequence; ZeRO shards over
    /// dp x cp.
    #[arg(long, default_value_t = 1)]
    cp: usize,
    /// How context-parallel attention reaches the other ranks' keys (activations differ).
    #[arg(long, value_enum, default_value_t = CpAttentionArg::Ring)]
    cp_attention: CpAttentionArg,
    /// Tensor-parallel ranks.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Sequence parallelism over the tensor-parallel ranks (activations).
    #[arg(long)]
    sp: bool,
    /// Pipeline ranks.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Parameter and gradient type: f32, or bf16/f16 with fp32 master weights.
    #[arg(long, value_enum, default_value_t = DTypeArg::Bf16)]
    dtype: DTypeArg,
    /// Samples per micro-batch (activations).
    #[arg(long, default_value_t = 1)]
    micro_batch_size: usize,
    /// Tokens per sample (activations).
    #[arg(long, default_value_t = 2048)]
    seq_len: usize,
    /// A Llama `config.json` (Hugging Face's, or a checkpoint directory holding one) instead
    /// of a preset, for the search.
    #[arg(long, conflicts_with_all = ["model", "params"], requires = "gpus")]
    config: Option<PathBuf>,
    /// Search every layout over this many devices and print the best (with --cluster and
    /// --global-batch); the layout flags above are then the search's to choose.
    #[arg(long)]
    gpus: Option<usize>,
    /// The devices searched over: h100 or a100 (nodes of 8 GPUs), or cpu (this machine,
    /// measured; --gpus is then its thread ranks).
    #[arg(long, default_value = "h100", requires = "gpus")]
    cluster: String,
    /// Samples per step over all devices, for the search.
    #[arg(long, requires = "gpus")]
    global_batch: Option<usize>,
    /// How many of the best layouts the search prints.
    #[arg(long, default_value_t = 5, requires = "gpus")]
    top: usize,
    /// GPUs per node, instead of the preset's 8.
    #[arg(long, requires = "gpus")]
    devices_per_node: Option<usize>,
    /// Memory per device in GB (10^9 bytes), instead of the preset's (or the measured
    /// figure, with --cluster cpu; so are the figures below).
    #[arg(long, requires = "gpus")]
    device_memory_gb: Option<f64>,
    /// Dense peak TFLOP/s of a device in the training dtype, instead of the preset's.
    #[arg(long, requires = "gpus")]
    peak_tflops: Option<f64>,
    /// Ring bus bandwidth within a node in GB/s per device, instead of the preset's.
    #[arg(long, requires = "gpus")]
    intra_node_gbps: Option<f64>,
    /// Network bandwidth between nodes in GB/s per device (a ring moves this through each of
    /// its ranks in a node), instead of the preset's.
    #[arg(long, requires = "gpus")]
    inter_node_gbps: Option<f64>,
    /// Latency of a ring hop within a node in microseconds, instead of the preset's.
    #[arg(long, requires = "gpus")]
    intra_node_latency_us: Option<f64>,
    /// Latency of a ring hop between nodes in microseconds, instead of the preset's.
    #[arg(long, requires = "gpus")]
    inter_node_latency_us: Option<f64>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CpAttentionArg {
    Ring,
    AllGather,
}

impl From<CpAttentionArg> for CpAttention {
    fn from(arg: CpAttentionArg) -> Self {
        match arg {
            CpAttentionArg::Ring => CpAttention::Ring,
            CpAttentionArg::AllGather => CpAttention::AllGather,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DTypeArg {
    F32,
    Bf16,
    F16,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Device {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StrategyArg {
    /// No data parallelism for --dp 1, DDP otherwise.
    Auto,
    Single,
    Ddp,
    ParameterServer,
}

#[derive(clap::Args)]
struct TrainArgs {
    /// Model preset: tiny (the default), small, llama-1b or llama-7b.
    #[arg(long)]
    model: Option<String>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 400)]
    steps: usize,
    /// Samples per step over all ranks.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Samples per forward/backward on one rank (the rest is gradient accumulation).
    #[arg(long)]
    micro_batch_size: Option<usize>,
    /// Micro-batches per step on each rank (with --pp, the pipeline's micro-batches).
    #[arg(long, alias = "micro-batches")]
    grad_accum: Option<usize>,
    /// Tokens per sample.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// Peak learning rate (linear warmup, then cosine decay to a tenth).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Warmup steps.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Seed of the weights, the data and its order.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Where the ranks compute.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// Data-parallel ranks (threads of this process).
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Expert-parallel ranks (a model with experts, such as --model tiny-moe): each holds
    /// experts / ep of every block's experts and reads its own samples, its tokens travelling
    /// to their experts' ranks and back; the run uses dp x ep x pp x cp x tp threads, and each
    /// expert's gradient is summed over the dp x cp ranks holding it and scaled to the
    /// average over all dp x ep x cp.
    #[arg(long, default_value_t = 1)]
    ep: usize,
    /// Weight of each block's load-balancing loss, for a model with experts (its config's
    /// router_aux_loss_coef otherwise).
    #[arg(long)]
    moe_aux_coef: Option<f64>,
    /// Weight of each block's router z-loss, for a model with experts (its config's otherwise).
    #[arg(long)]
    moe_z_coef: Option<f64>,
    /// Each expert takes at most this factor times its even share of a rank's token copies,
    /// dropping the rest (Megatron's capacity factor); its config's otherwise (the presets
    /// drop nothing).
    #[arg(long)]
    moe_capacity_factor: Option<f64>,
    /// Tensor-parallel ranks per replica (Megatron: attention heads, MLP features and the
    /// vocabulary split); the run uses dp x tp threads.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Sequence parallelism: norms and the residual stream split along the sequence over the
    /// tensor-parallel ranks (needs --tp 2 or more).
    #[arg(long)]
    sp: bool,
    /// Context-parallel ranks per replica: every sequence split over them (2 chunks each,
    /// load-balanced for the causal mask), attention reaching the others' keys by the ring
    /// or by all-gather (--cp-attention); the run uses dp x pp x cp x tp ranks.
    #[arg(long, default_value_t = 1)]
    cp: usize,
    /// How context-parallel attention reaches the other ranks' keys and values: passed around
    /// a ring, overlapped with the computation, or all-gathered (small with grouped-query
    /// attention, as Llama 3 did).
    #[arg(long, value_enum, default_value_t = CpAttentionArg::Ring)]
    cp_attention: CpAttentionArg,
    /// Overlap the tensor-parallel communication with the linears' matmuls, each cut into this
    /// many chunks (Megatron's --tp-comm-overlap); 0: one after the other.
    #[arg(long, default_value_t = 0)]
    tp_overlap: usize,
    /// Pipeline ranks per replica: the blocks are cut into stages (see --balance); the run uses
    /// dp x pp x cp x tp threads.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Pipeline schedule.
    #[arg(long, value_enum, default_value_t = ScheduleKind::OneFOneB)]
    schedule: ScheduleKind,
    /// Model chunks per pipeline rank (with --schedule interleaved).
    #[arg(long, default_value_t = 1)]
    virtual_stages: usize,
    /// Keep only each stage's input and redo its forward before its backward.
    #[arg(long)]
    recompute: bool,
    /// Cut the blocks into stages of even parameter count, or of even time measured on the
    /// first micro-batch before training.
    #[arg(long, value_enum, default_value_t = Balance::Params)]
    balance: Balance,
    /// Print the parallel plan (each parameter's placement and its shape per rank, the
    /// pipeline's stages, ZeRO-3's units) and exit without training.
    #[arg(long)]
    print_plan: bool,
    /// Draw the pipeline's last step, as measured, as an SVG Gantt chart.
    #[arg(long)]
    schedule_svg: Option<PathBuf>,
    /// Data-parallel strategy.
    #[arg(long, value_enum, default_value_t = StrategyArg::Auto)]
    strategy: StrategyArg,
    /// DDP bucket size in MiB.
    #[arg(long, default_value_t = 25.0)]
    bucket_mb: f64,
    /// Start DDP's all-reduces after backward instead of during it.
    #[arg(long)]
    no_overlap: bool,
    /// ZeRO stage over the data-parallel ranks: 0 plain DDP, 1 shards the optimizer state,
    /// 2 also the gradients, 3 also the parameters (one block per unit).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    zero: u8,
    /// With --zero and --device cuda: keep the optimizer state in host memory and step it
    /// there (ZeRO-Offload).
    #[arg(long)]
    offload: bool,
    /// Dtype of the weights and activations: bf16 and f16 (with --zero) keep fp32 master
    /// weights and Adam moments in each rank's shard; f16 adds dynamic loss scaling.
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    dtype: DTypeArg,
    /// With --dtype bf16 or f16: reduce gradients in fp32.
    #[arg(long)]
    fp32_reduce: bool,
    /// Clip the gradients to this global L2 norm before each step (1.0 is usual).
    #[arg(long)]
    clip_grad_norm: Option<f64>,
    /// With --device cuda: move the ranks' gradients, shards and activations with NCCL in GPU
    /// memory, instead of through host memory (pipeline stages send rank to rank).
    #[arg(long)]
    nccl: bool,
    /// Train on this file's bytes instead of the synthetic source (its text, with
    /// --tokenizer).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Read --data as text through this Hugging Face tokenizer.json (tokenized once, cached
    /// beside the data). Training from the seed, the model's vocabulary becomes the
    /// tokenizer's; with --init-from, the tokenizer's ids must fit the stored vocabulary.
    #[arg(long, requires = "data")]
    tokenizer: Option<PathBuf>,
    /// Symbols of the synthetic second-order Markov source.
    #[arg(long, default_value_t = 16)]
    markov_symbols: usize,
    /// Possible next symbols after each pair of symbols in the synthetic source.
    #[arg(long, default_value_t = 3)]
    markov_branching: usize,
    /// Write one JSON object per step here.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Save the final weights here (burn record, safetensors, config.json).
    #[arg(long)]
    save: Option<PathBuf>,
    /// With --save: the largest safetensors file; above it the weights are sharded with an
    /// index, as transformers' max_shard_size (bytes, or with kB, MB or GB: powers of 1000).
    #[arg(long, default_value = "5GB", value_parser = parse_size)]
    max_shard_size: u64,
    /// Start from the weights in this directory; its config.json sets the shape.
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// Directory of the run's checkpoints (step-N/ each, and `latest`).
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// With --checkpoint-dir: checkpoint after every this many steps.
    #[arg(long, requires = "checkpoint_dir")]
    checkpoint_every: Option<usize>,
    /// With --checkpoint-dir: resume from its newest checkpoint, if it has one (in this or
    /// another layout).
    #[arg(long, requires = "checkpoint_dir")]
    resume: bool,
    /// With --checkpoint-dir: keep only this many of the newest checkpoints (default: all).
    #[arg(long, requires = "checkpoint_dir")]
    checkpoint_keep: Option<usize>,
}

#[derive(clap::Args)]
struct EvalArgs {
    /// Directory with config.json and model.safetensors (or burn's model.mpk).
    #[arg(long)]
    weights: PathBuf,
    /// Token ids separated by whitespace, one sequence per line.
    #[arg(long, required_unless_present = "text", conflicts_with = "text")]
    tokens: Option<PathBuf>,
    /// Text, one sequence per line, read through --tokenizer (each line encoded as
    /// transformers' `tokenizer(line)` does, with the tokens it adds, such as Llama 3's
    /// begin-of-text).
    #[arg(long, requires = "tokenizer")]
    text: Option<PathBuf>,
    /// A Hugging Face tokenizer.json, for --text.
    #[arg(long, requires = "text")]
    tokenizer: Option<PathBuf>,
    /// Where to compute.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
}

/// Fails before reading the data and training, not after, when `--save`, `--checkpoint-dir`,
/// `--metrics` or `--schedule-svg` cannot be written. Every rank writes its part of a
/// checkpoint; the schedule's drawing is rank 0's alone (`lead`).
fn check_outputs(args: &TrainArgs, lead: bool) -> Result<(), String> {
    let refuse = |flag: &str, path: &std::path::Path, e: std::io::Error| {
        format!(
            "{flag} {}: {e}; nothing was trained, pick a place this user can write",
            path.display()
        )
    };
    for (flag, dir) in [
        ("--save", &args.save),
        ("--checkpoint-dir", &args.checkpoint_dir),
    ] {
        let Some(dir) = dir else { continue };
        std::fs::create_dir_all(dir).map_err(|e| refuse(flag, dir, e))?;
        let probe = dir.join(format!(".write-check-{}", std::process::id()));
        std::fs::File::create(&probe)
            .and_then(|_| std::fs::remove_file(&probe))
            .map_err(|e| refuse(flag, dir, e))?;
    }
    let drawing = args.schedule_svg.as_ref().filter(|_| lead);
    for (flag, path) in [
        ("--metrics", args.metrics.as_ref()),
        ("--schedule-svg", drawing),
    ] {
        let Some(path) = path else { continue };
        // Open without truncating, so a file that is there stays as it was until the run
        // writes it; one that was not is removed again.
        let existed = path.exists();
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .and_then(|_| match existed {
                true => Ok(()),
                false => std::fs::remove_file(path),
            })
            .map_err(|e| refuse(flag, path, e))?;
    }
    Ok(())
}

/// A byte count: a whole number, optionally followed by kB, MB or GB (powers of 1000, as
/// transformers reads them).
fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        _ => {
            return Err(format!(
                "`{text}` is not a size; write bytes, or a whole number of kB, MB or GB"
            ));
        }
    };
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("`{text}` is not a size of at least one byte"))
}

fn main() {
    let command = Cli::parse().command;
    // Under mpirun or burn-launch this process is one rank; a rank that fails ends the whole job, naming it.
    let process = burn_comm::Process::from_env().unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(1)
    });
    let lead = process.as_ref().is_none_or(|p| p.rank() == 0);
    let result = match (command, process) {
        // Every rank stops at the same step when a signal interrupts the run, so the job then
        // ends as a whole, with no rank failing; any other error ends it naming the rank.
        (Command::Train(args), Some(process)) => process.run(|ctx| match run_train(*args, Some(ctx)) {
            Err(Ended::Failed(message)) => Err(message),
            Err(Ended::Interrupted(message)) => {
                // Said before MPI is finalised: mpirun, signalled, may end the job then.
                if lead {
                    eprintln!("{message}");
                }
                Ok(Err(Ended::Interrupted(String::new())))
            }
            Ok(()) => Ok(Ok(())),
        }),
        (Command::Train(args), None) => run_train(*args, None),
        (_, Some(_)) => Err(
            "only `llama train` runs as one process per rank; run `llama eval`, `llama plan` and `llama export` alone, without mpirun or burn-launch".into(),
        ),
        (Command::Eval(args), None) => run_eval(args).map_err(Ended::from),
        (Command::Plan(args), None) => run_plan(args).map_err(Ended::from),
        (Command::Export(args), None) => {
            llama::checkpoint::export(&args.checkpoint, &args.out, args.max_shard_size)
                .map(|step| println!("exported the checkpoint after step {step} to {}", args.out.display()))
                .map_err(Ended::from)
        }
    };
    match result {
        Ok(()) => {}
        Err(Ended::Interrupted(message)) => {
            if lead && !message.is_empty() {
                eprintln!("{message}");
            }
            std::process::exit(EXIT_INTERRUPTED);
        }
        Err(Ended::Failed(message)) => {
            eprintln!("error: {message}");
            std::process::exit(1);
        }
    }
}

/// The exit status of a run a signal stopped after checkpointing: sysexits' EX_TEMPFAIL
/// ("try again"), so that a requeueing script tells a preemption from a failure.
const EXIT_INTERRUPTED: i32 = 75;

/// Why a command did not finish.
enum Ended {
    /// A signal stopped training after a checkpoint; `--resume` continues it.
    Interrupted(String),
    Failed(String),
}

impl From<String> for Ended {
    fn from(message: String) -> Self {
        Self::Failed(message)
    }
}

impl From<&str> for Ended {
    fn from(message: &str) -> Self {
        Self::Failed(message.into())
    }
}

impl From<TrainError> for Ended {
    fn from(error: TrainError) -> Self {
        match error {
            TrainError::Interrupted { .. } => Self::Interrupted(error.to_string()),
            error => Self::Failed(error.to_string()),
        }
    }
}

/// The model preset `--model` names, or the choices.
fn preset(name: &str) -> Result<LlamaConfig, String> {
    LlamaConfig::preset(name).ok_or_else(|| {
        format!(
            "unknown --model {name}; choose one of {}",
            llama::config::PRESETS.join(", ")
        )
    })
}

fn run_plan(args: PlanArgs) -> Result<(), String> {
    if let Some(gpus) = args.gpus {
        return run_search(&args, gpus);
    }
    let model = match (&args.model, args.params) {
        (Some(name), _) => Some(preset(name)?),
        (None, Some(_)) => None,
        (None, None) => return Err("give --model PRESET or --params COUNT (such as 7.5e9)".into()),
    };
    let params = match (&model, args.params) {
        (Some(model), _) => model.num_params() as u64,
        (None, Some(count)) if count >= 1.0 && count.is_finite() => count.round() as u64,
        (None, Some(count)) => return Err(format!("--params {count} is not a parameter count")),
        (None, None) => unreachable!("checked above"),
    };
    if args.dp == 0
        || args.ep == 0
        || args.cp == 0
        || args.tp == 0
        || args.pp == 0
        || args.micro_batch_size == 0
        || args.seq_len == 0
    {
        return Err(
            "--dp, --ep, --cp, --tp, --pp, --micro-batch-size and --seq-len must be at least 1"
                .into(),
        );
    }
    if args.cp > 1 && !args.seq_len.is_multiple_of(2 * args.cp) {
        return Err(format!(
            "--cp {} cuts each sequence into {} chunks, but --seq-len {} does not divide by {}",
            args.cp,
            2 * args.cp,
            args.seq_len,
            2 * args.cp
        ));
    }
    if args.sp && args.tp < 2 {
        return Err("--sp splits the norms along the sequence over the tensor-parallel ranks; give --tp 2 or more".into());
    }
    if args.sp && model.as_ref().is_some_and(LlamaConfig::is_moe) {
        return Err("--sp splits a block's tokens over the tensor-parallel ranks, which a mixture of experts cannot run with (llama train refuses it); drop --sp".into());
    }
    if let Some(model) = model.as_ref().filter(|_| args.ep > 1) {
        if !model.is_moe() || !model.num_local_experts.is_multiple_of(args.ep) {
            return Err(format!(
                "--ep {} splits a mixture of experts' experts evenly; choose a model with experts (tiny-moe, small-moe) whose count it divides",
                args.ep
            ));
        }
    } else if args.ep > 1 {
        return Err("--ep splits a mixture of experts' experts; give --model with experts (tiny-moe, small-moe)".into());
    }
    let plan = Plan {
        params,
        model,
        dp: args.dp,
        ep: args.ep,
        cp: args.cp,
        cp_attention: args.cp_attention.into(),
        tp: args.tp,
        sequence_parallel: args.sp,
        pp: args.pp,
        precision: match args.dtype {
            DTypeArg::F32 => Precision::F32,
            DTypeArg::Bf16 | DTypeArg::F16 => Precision::HALF,
        },
        micro_batch: args.micro_batch_size,
        seq_len: args.seq_len,
    };
    if let Some(name) = &args.model {
        print!("model {name}: ");
    }
    print!("{}", plan.table());
    Ok(())
}

/// `llama plan --gpus N`: every layout over N devices, the best first.
fn run_search(args: &PlanArgs, gpus: usize) -> Result<(), String> {
    use llama::planner::{Cluster, Dtype, Request, search};

    let (model, model_name) = match (&args.model, &args.config) {
        (Some(name), _) => (preset(name)?, Some(name.clone())),
        (None, Some(path)) if path.is_dir() => (hf::load_config(path)?, None),
        (None, Some(path)) => (hf::read_config(path)?, None),
        (None, None) => {
            return Err("--gpus searches layouts for a model's shape: give --model PRESET or --config config.json".into());
        }
    };
    let global_batch = args
        .global_batch
        .ok_or("--gpus needs --global-batch, the samples of one step over all devices")?;
    if gpus == 0 || global_batch == 0 || args.seq_len == 0 || args.top == 0 {
        return Err("--gpus, --global-batch, --seq-len and --top must be at least 1".into());
    }
    let overrides = ClusterOverrides::of(args)?;
    let gpu = args.cluster != "cpu";
    if !gpu && args.devices_per_node.is_some() {
        return Err("--devices-per-node belongs to the GPU presets; with --cluster cpu, --gpus is this machine's thread ranks".into());
    }
    if gpu && args.dtype == DTypeArg::F32 && args.peak_tflops.is_none() {
        return Err(format!(
            "the {} preset's peak is its bf16 tensor cores'; to plan --dtype f32, give the device's fp32 (or TF32) peak with --peak-tflops",
            args.cluster
        ));
    }
    let mut cluster = match args.cluster.as_str() {
        "cpu" => {
            let memory = llama::plan::available_host_memory()
                .ok_or("--cluster cpu needs the host's available memory (/proc/meminfo)")?;
            eprintln!("calibrating this machine (a few seconds)");
            Cluster::cpu(gpus, &llama::planner::calibrate()?, memory)
        }
        name => {
            let per_node = args.devices_per_node.unwrap_or(8);
            if per_node == 0 {
                return Err("--devices-per-node must be at least 1".into());
            }
            if gpus > per_node && !gpus.is_multiple_of(per_node) {
                return Err(format!(
                    "--gpus {gpus}: a cluster of {per_node}-GPU nodes has up to {per_node} GPUs or a multiple of {per_node}"
                ));
            }
            let mut cluster = Cluster::preset(name, gpus.div_ceil(per_node)).ok_or_else(|| {
                format!(
                    "unknown --cluster {name}; choose one of {}, cpu",
                    llama::planner::CLUSTER_PRESETS.join(", ")
                )
            })?;
            cluster.devices_per_node = per_node.min(gpus);
            cluster
        }
    };
    overrides.apply(&mut cluster);
    let request = Request {
        model,
        model_name,
        cluster,
        global_batch,
        seq_len: args.seq_len,
        dtype: match args.dtype {
            DTypeArg::F32 => Dtype::F32,
            DTypeArg::Bf16 => Dtype::Bf16,
            DTypeArg::F16 => Dtype::F16,
        },
    };
    let found = search(&request)?;
    print!(
        "{}",
        llama::planner::search::report(&request, &found, args.top)
    );
    Ok(())
}

/// The figures of a cluster that the command line gives instead of its preset's (or of the
/// measured ones, with `--cluster cpu`), checked before anything is measured.
struct ClusterOverrides {
    memory: Option<f64>,
    peak_flops: Option<f64>,
    intra_bandwidth: Option<f64>,
    inter_bandwidth: Option<f64>,
    intra_latency: Option<f64>,
    inter_latency: Option<f64>,
}

impl ClusterOverrides {
    fn of(args: &PlanArgs) -> Result<Self, String> {
        let positive = |flag: &str, value: Option<f64>, unit: f64| match value {
            Some(v) if !(v.is_finite() && v > 0.0) => {
                Err(format!("--{flag} {v}: give a positive number"))
            }
            v => Ok(v.map(|v| v * unit)),
        };
        Ok(Self {
            memory: positive("device-memory-gb", args.device_memory_gb, 1e9)?,
            peak_flops: positive("peak-tflops", args.peak_tflops, 1e12)?,
            intra_bandwidth: positive("intra-node-gbps", args.intra_node_gbps, 1e9)?,
            inter_bandwidth: positive("inter-node-gbps", args.inter_node_gbps, 1e9)?,
            intra_latency: positive("intra-node-latency-us", args.intra_node_latency_us, 1e-6)?,
            inter_latency: positive("inter-node-latency-us", args.inter_node_latency_us, 1e-6)?,
        })
    }

    /// `cluster` with these figures; its name says so when any was given.
    fn apply(&self, cluster: &mut llama::planner::Cluster) {
        let before = cluster.clone();
        let set = |field: &mut f64, value: Option<f64>| *field = value.unwrap_or(*field);
        if let Some(bytes) = self.memory {
            cluster.memory = bytes as u64;
        }
        set(&mut cluster.peak_flops, self.peak_flops);
        set(&mut cluster.intra_node.bandwidth, self.intra_bandwidth);
        set(&mut cluster.inter_node.bandwidth, self.inter_bandwidth);
        set(&mut cluster.intra_node.latency, self.intra_latency);
        set(&mut cluster.inter_node.latency, self.inter_latency);
        if *cluster != before {
            cluster.name += ", figures as given";
        }
    }
}

/// Trains as `llama train` was asked to; `process` is this process's rank when the job runs
/// one process per rank, of which rank 0 alone prints and writes files.
fn run_train(mut args: TrainArgs, process: Option<RankContext>) -> Result<(), Ended> {
    let lead = process.as_ref().is_none_or(|ctx| ctx.rank() == 0);
    // The others keep `--schedule-svg`: every rank takes part in gathering the timeline that
    // rank 0 alone writes.
    if !lead {
        args.save = None;
        args.metrics = None;
    }
    let name = args.model.clone().unwrap_or_else(|| "tiny".into());
    let mut model = preset(&name)?;
    if let Some(dir) = &args.init_from {
        let stored = hf::load_config(dir)?;
        if args.model.is_some() && !stored.same_model(&model) {
            return Err(format!(
                "{} holds another shape than --model {name}; drop --model to use the stored shape",
                dir.display()
            )
            .into());
        }
        model = stored;
    }
    let router = [
        ("--moe-aux-coef", args.moe_aux_coef),
        ("--moe-z-coef", args.moe_z_coef),
        ("--moe-capacity-factor", args.moe_capacity_factor),
    ];
    if let Some((flag, _)) = router.iter().find(|(_, v)| v.is_some())
        && !model.is_moe()
    {
        return Err(format!(
            "{flag} sets a mixture of experts' router, but this model has none; use --model tiny-moe or small-moe"
        )
        .into());
    }
    if let Some(coef) = args.moe_aux_coef {
        model.router_aux_loss_coef = coef;
    }
    if let Some(coef) = args.moe_z_coef {
        model.router_z_loss_coef = coef;
    }
    if let Some(factor) = args.moe_capacity_factor {
        model.expert_capacity_factor = Some(factor);
    }
    let tokenizer = args
        .tokenizer
        .as_deref()
        .map(TextTokenizer::open)
        .transpose()?;
    if let Some(tokenizer) = &tokenizer {
        if args.init_from.is_some() {
            tokenizer.check_fits(model.vocab_size)?;
        } else {
            model.vocab_size = tokenizer.vocab_size();
        }
    }
    let strategy = match args.strategy {
        StrategyArg::Auto if args.dp == 1 && args.ep == 1 && args.cp == 1 && args.zero == 0 => {
            Strategy::Single
        }
        StrategyArg::Auto | StrategyArg::Ddp => Strategy::Ddp,
        StrategyArg::Single => Strategy::Single,
        StrategyArg::ParameterServer => Strategy::ParameterServer,
    };
    let mut config = TrainConfig::new(model, args.steps);
    config.batch_size = args.batch_size;
    config.micro_batch_size = args.micro_batch_size;
    config.grad_accum = args.grad_accum;
    config.seq_len = args.seq_len;
    config.lr = args.lr;
    config.warmup_steps = args.warmup;
    config.seed = args.seed;
    config.dp = args.dp;
    config.ep = args.ep;
    config.tp = args.tp;
    config.cp = args.cp;
    config.cp_attention = args.cp_attention.into();
    config.sequence_parallel = args.sp;
    config.tp_overlap = args.tp_overlap;
    config.pp = args.pp;
    config.schedule = args.schedule;
    config.virtual_stages = args.virtual_stages;
    config.recompute = args.recompute;
    config.balance = args.balance;
    config.schedule_svg = args.schedule_svg.clone();
    config.strategy = strategy;
    if !(args.bucket_mb.is_finite() && args.bucket_mb > 0.0) {
        return Err(format!(
            "--bucket-mb {}: a bucket holds a positive, finite number of MiB (25 is the default)",
            args.bucket_mb
        )
        .into());
    }
    let bucket_bytes = ((args.bucket_mb * 1024.0 * 1024.0) as usize).max(1);
    config.ddp = DdpConfig::new()
        .with_bucket_cap_bytes(bucket_bytes)
        .with_overlap(!args.no_overlap);
    config.zero = ZeroStage::from_number(args.zero.into()).expect("clap checks the range");
    config.max_grad_norm = args.clip_grad_norm;
    config.zero_config = ZeroConfig::new()
        .with_bucket_cap_bytes(bucket_bytes)
        .with_overlap(!args.no_overlap)
        .with_offload(args.offload)
        .with_precision(match args.dtype {
            DTypeArg::F32 => None,
            DTypeArg::Bf16 => Some(MixedPrecision::bf16().with_reduce_f32(args.fp32_reduce)),
            DTypeArg::F16 => Some(MixedPrecision::f16().with_reduce_f32(args.fp32_reduce)),
        });
    if args.fp32_reduce && args.dtype == DTypeArg::F32 {
        return Err(
            "--fp32-reduce reduces 16-bit gradients in fp32; use it with --dtype bf16 or f16"
                .into(),
        );
    }
    config.nccl = args.nccl;
    config.init_from = args.init_from.clone();
    if args.checkpoint_dir.is_some() {
        // A run that checkpoints stops at a step's end on SIGTERM or Ctrl-C, checkpointed.
        llama::interrupt::install();
    }
    config.checkpoint = match &args.checkpoint_dir {
        None => None,
        Some(_) if args.checkpoint_every == Some(0) => {
            return Err("--checkpoint-every 0 would never checkpoint; give a number of steps, or drop it to only --resume".into());
        }
        Some(_) if args.checkpoint_keep == Some(0) => {
            return Err("--checkpoint-keep 0 would remove every checkpoint, the one to resume from too; keep at least 1".into());
        }
        Some(_) if args.checkpoint_every.is_none() && !args.resume => {
            return Err("--checkpoint-dir needs --checkpoint-every N (to take checkpoints), --resume (to start from the newest), or both".into());
        }
        Some(dir) => Some(llama::checkpoint::CheckpointConfig {
            dir: dir.clone(),
            every: args.checkpoint_every.unwrap_or(0),
            resume: args.resume,
            keep: args.checkpoint_keep,
            stage_on_host: matches!(args.device, Device::Cuda),
        }),
    };
    config.process = process;
    let layout = config.layout().map_err(|e| e.to_string())?;
    if args.print_plan {
        let plan = ParallelPlan::new(&config).map_err(|e| e.to_string())?;
        if lead {
            print!("{}", plan.describe(&config.model));
        }
        return Ok(());
    }
    if args.offload && args.device == Device::Cpu {
        return Err("--offload moves the optimizer state from GPU to host memory; with --device cpu it is in host memory already, so drop --offload (or train with --device cuda)".into());
    }
    if args.nccl && args.device == Device::Cpu {
        return Err("--nccl moves CUDA tensors between GPUs; use it with --device cuda".into());
    }
    check_outputs(&args, lead)?;

    let data: Box<dyn Dataset> = match &args.data {
        Some(path) => match &tokenizer {
            Some(tokenizer) => Box::new(TokenCorpus::tokenized(path, tokenizer, config.seq_len)?),
            None => Box::new(TokenCorpus::bytes(path, config.seq_len)?),
        },
        None => {
            if !(2..=config.model.vocab_size).contains(&args.markov_symbols)
                || !(1..=args.markov_symbols).contains(&args.markov_branching)
            {
                return Err(format!(
                    "the Markov source needs 2 to {} symbols and 1 to --markov-symbols successors per context",
                    config.model.vocab_size
                ).into());
            }
            Box::new(MarkovSource::new(
                args.markov_symbols,
                args.markov_branching,
                config.seq_len,
                1 << 20,
                config.seed,
            ))
        }
    };
    if config.model.vocab_size < 256 && args.data.is_some() && tokenizer.is_none() {
        return Err("byte-level data needs a vocabulary of at least 256".into());
    }
    if lead {
        print_run(&args, &name, &config, &layout, &*data);
    }
    match args.device {
        Device::Cpu => {
            // The ranks' tensors live in this machine's memory.
            config.memory_available = llama::plan::available_host_memory();
            train_on(&config, &*data, &args, |on_step| {
                llama::cpu::train(&config, &*data, on_step)
            })
        }
        Device::Cuda => train_on_cuda(&config, &*data, &args),
    }
}

/// What the run will do, before it starts.
fn print_run(
    args: &TrainArgs,
    name: &str,
    config: &TrainConfig,
    layout: &Layout,
    data: &dyn Dataset,
) {
    let strategy = config.strategy;
    println!(
        "model {} ({:.2}M parameters), {} x {} tokens per step, dp {} ({:?}){} x tp {}{} x pp {}{}, {} micro-batch(es) of {} per replica",
        args.init_from
            .as_ref()
            .map_or(name.to_string(), |d| d.display().to_string()),
        config.model.num_params() as f64 / 1e6,
        config.batch_size,
        config.seq_len,
        config.dp,
        strategy,
        if config.cp > 1 {
            let how = match config.cp_attention {
                CpAttention::Ring => "ring",
                CpAttention::AllGather => "all-gather",
            };
            format!(" x cp {} ({how} attention)", config.cp)
        } else {
            String::new()
        },
        config.tp,
        describe_tp(config),
        config.pp,
        if config.pp > 1 {
            format!(
                " ({}, {} chunk(s) per rank{}, stages balanced by {})",
                config.schedule,
                config.virtual_stages,
                if config.recompute { ", recompute" } else { "" },
                config.balance
            )
        } else {
            String::new()
        },
        layout.accum,
        layout.micro
    );
    if config.zero != ZeroStage::Replicated {
        println!("zero: {}", describe_zero(config));
    }
    println!("data: {}", data.describe());
    if let Some(floor) = data.loss_floor() {
        println!("loss floor: {floor:.4} nats/token (the entropy of the source at this --seq-len)");
    }
}

#[cfg(feature = "cuda")]
fn train_on_cuda(config: &TrainConfig, data: &dyn Dataset, args: &TrainArgs) -> Result<(), Ended> {
    let gpu = config
        .process
        .as_ref()
        .map_or(0, llama::launch::process_gpu);
    let device = burn::backend::cuda::CudaDevice { index: gpu };
    train_on(config, data, args, |on_step| {
        llama::train::train::<burn::backend::Autodiff<burn::backend::Cuda>>(
            config, data, &device, on_step,
        )
    })
}

#[cfg(not(feature = "cuda"))]
fn train_on_cuda(_: &TrainConfig, _: &dyn Dataset, _: &TrainArgs) -> Result<(), Ended> {
    Err("this binary was built without CUDA; rebuild with `--features cuda`".into())
}

/// Keeps the lines of `--metrics` up to the step the run resumes after: a run killed after
/// its last checkpoint wrote lines of steps the resumed run trains again.
fn drop_lines_after_checkpoint(path: &Path, config: &TrainConfig) -> Result<(), String> {
    let Some(checkpoints) = &config.checkpoint else {
        return Ok(());
    };
    let resumed = burn_checkpoint::Checkpoint::latest(&checkpoints.dir)
        .map_err(|e| e.to_string())?
        .map_or(0, |c| c.step());
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let step_of = |line: &str| {
        serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v["step"].as_u64())
    };
    let kept: String = text
        .lines()
        .take_while(|line| step_of(line).is_some_and(|step| step <= resumed))
        .map(|line| format!("{line}\n"))
        .collect();
    if kept.len() < text.len() {
        std::fs::write(path, kept)
            .map_err(|e| format!("cannot rewrite {}: {e}", path.display()))?;
    }
    Ok(())
}

/// The progress bar, `--metrics`, the summary and `--save` around `train` (the CPU's, compiled
/// in the library, or CUDA's).
fn train_on<B: Backend>(
    config: &TrainConfig,
    data: &dyn Dataset,
    args: &TrainArgs,
    train: impl FnOnce(&mut (dyn FnMut(&StepMetrics) + Send)) -> Result<Llama<B>, TrainError>,
) -> Result<(), Ended> {
    let mut metrics = match &args.metrics {
        Some(path) => {
            // A resumed run adds its steps to the lines of the steps before it.
            let resuming = config.checkpoint.as_ref().is_some_and(|c| c.resume);
            if resuming {
                drop_lines_after_checkpoint(path, config)?;
            }
            let file = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(resuming)
                .truncate(!resuming)
                .open(path);
            Some(BufWriter::new(file.map_err(|e| {
                format!("cannot create {}: {e}", path.display())
            })?))
        }
        None => None,
    };
    let terminal = std::io::stderr().is_terminal();
    let bar = ProgressBar::new(config.steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    let mut history: Vec<StepMetrics> = Vec::new();
    let mut write_error = None;
    let mut on_step = |m: &StepMetrics| {
        let mut line = format!("loss {:.4} | lr {:.2e}", m.loss, m.lr);
        if let Some(moe) = &m.moe {
            line += &format!(
                " | aux {:.4} | tokens/expert {}-{} (mean {:.0})",
                moe.aux_loss + moe.z_loss,
                moe.tokens_per_expert_min,
                moe.tokens_per_expert_max,
                moe.tokens_per_expert_mean
            );
            if moe.dropped > 0 {
                line += &format!(" | dropped {}", moe.dropped);
            }
        }
        if let Some(norm) = m.grad_norm {
            line += &format!(" | grad norm {norm:.3}");
        }
        line += &format!(" | {:.0} tok/s", m.tokens_per_s);
        if let Some(seconds) = m.checkpoint_s {
            line += &format!(" | checkpoint started ({seconds:.2}s)");
        }
        if m.skipped {
            let scale = m.loss_scale.unwrap_or(f64::NAN);
            bar.suspend(|| {
                eprintln!(
                    "step {}: gradients overflowed (inf/NaN) at loss scale {scale}; step skipped, scale lowered",
                    m.step
                )
            });
        }
        bar.set_position(m.step as u64);
        bar.set_message(line.clone());
        if !terminal && (m.step == 1 || m.step.is_multiple_of(10) || m.step == config.steps) {
            eprintln!(
                "step {:>5}/{} | {line} | {:.1}s",
                m.step, config.steps, m.elapsed
            );
        }
        if let Some(file) = metrics.as_mut() {
            let json = serde_json::to_string(m).expect("metrics serialise");
            if let Err(e) = writeln!(file, "{json}").and_then(|_| file.flush()) {
                write_error.get_or_insert(e.to_string());
            }
        }
        history.push(*m);
    };
    let started = Instant::now();
    let model = train(&mut on_step)?;
    bar.finish_and_clear();
    if config.process.as_ref().is_some_and(|ctx| ctx.rank() != 0) {
        // Rank 0 reports and saves.
        return Ok(());
    }
    if let Some(e) = write_error {
        return Err(format!("cannot write the metrics: {e}").into());
    }

    let last = history.last().expect("at least one step");
    let mut speeds: Vec<f64> = history
        .iter()
        .skip(history.len() / 5)
        .map(|m| m.tokens_per_s)
        .collect();
    speeds.sort_by(f64::total_cmp);
    let skipped = history.iter().filter(|m| m.skipped).count();
    println!(
        "done: {} steps in {:.1}s{}, final loss {:.4}, median {:.0} tokens/s",
        history.len(),
        started.elapsed().as_secs_f64(),
        if skipped > 0 {
            format!(" ({skipped} skipped for overflowing gradients)")
        } else {
            String::new()
        },
        last.loss,
        speeds[speeds.len() / 2]
    );
    if let Some(floor) = data.loss_floor() {
        println!("loss floor {floor:.4}: {:.4} above it", last.loss - floor);
    }
    if let Some(dir) = &args.save {
        hf::save(&model, &config.model, dir, args.max_shard_size)?;
        println!("weights saved in {}", dir.display());
    }
    Ok(())
}

fn run_eval(args: EvalArgs) -> Result<(), String> {
    match args.device {
        Device::Cpu => eval_on::<Flex>(&args, &Default::default()),
        Device::Cuda => eval_on_cuda(&args),
    }
}

#[cfg(feature = "cuda")]
fn eval_on_cuda(args: &EvalArgs) -> Result<(), String> {
    eval_on::<burn::backend::Cuda>(args, &Default::default())
}

#[cfg(not(feature = "cuda"))]
fn eval_on_cuda(_: &EvalArgs) -> Result<(), String> {
    Err("this binary was built without CUDA; rebuild with `--features cuda`".into())
}

fn eval_on<B: burn_tensor_parallel::TpBackend>(
    args: &EvalArgs,
    device: &B::Device,
) -> Result<(), String> {
    let (config, model): (LlamaConfig, Llama<B>) = hf::load(&args.weights, device)?;
    let (path, sequences) = eval_sequences(args, config.vocab_size)?;
    let (mut total, mut count, mut sequences_read) = (0.0f64, 0usize, 0usize);
    for ids in sequences {
        if ids.len() < 2 {
            continue;
        }
        let n = ids.len();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, n]), device);
        // The cross-entropy alone: a mixture of experts' routers' losses are for training.
        let logits = model
            .forward(tokens.clone().narrow(1, 0, n - 1))
            .map_err(|e| e.to_string())?;
        let loss = llama::model::next_token_loss(logits, tokens.narrow(1, 1, n - 1));
        total += loss.into_scalar().elem::<f64>() * (n - 1) as f64;
        count += n - 1;
        sequences_read += 1;
    }
    if count == 0 {
        return Err(format!(
            "{} has no line with at least two tokens",
            path.display()
        ));
    }
    let mean = total / count as f64;
    let report = serde_json::json!({
        "mean_cross_entropy": mean,
        "perplexity": mean.exp(),
        "predicted_tokens": count,
        "sequences": sequences_read,
    });
    println!("{report}");
    Ok(())
}

/// The file `eval` reads and its lines' token ids: `--tokens` as written, or `--text`
/// through `--tokenizer`; every id below the model's vocabulary `vocab`.
fn eval_sequences(args: &EvalArgs, vocab: usize) -> Result<(&PathBuf, Vec<Vec<i64>>), String> {
    let path = args
        .tokens
        .as_ref()
        .or(args.text.as_ref())
        .expect("clap asks for --tokens or --text");
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if args.text.is_some() {
        let tokenizer = args
            .tokenizer
            .as_deref()
            .expect("clap asks --text for --tokenizer");
        let tokenizer = TextTokenizer::open(tokenizer)?;
        tokenizer.check_fits(vocab)?;
        let sequences = text
            .lines()
            .filter(|line| !line.is_empty())
            .map(|line| {
                let ids = tokenizer.encode(line, true)?;
                Ok(ids.into_iter().map(i64::from).collect())
            })
            .collect::<Result<_, String>>()?;
        return Ok((path, sequences));
    }
    let sequences = text
        .lines()
        .enumerate()
        .map(|(number, line)| {
            line.split_whitespace()
                .map(|t| t.parse::<i64>().ok().filter(|&id| id >= 0 && (id as usize) < vocab))
                .collect::<Option<Vec<i64>>>()
                .ok_or_else(|| {
                    format!(
                        "line {} of {} holds something that is not a token id below the vocabulary size {vocab}",
                        number + 1,
                        path.display(),
                    )
                })
        })
        .collect::<Result<_, String>>()?;
    Ok((path, sequences))
}

/// Sequence parallelism and communication overlap of the tensor-parallel group, if any.
fn describe_tp(config: &TrainConfig) -> String {
    let mut text = String::new();
    if config.sequence_parallel {
        text += " with sequence parallelism";
    }
    if config.tp_overlap > 0 {
        text += &format!(
            " (communication overlapped, {} chunk(s))",
            config.tp_overlap
        );
    }
    text
}

/// The ZeRO stage and what it computes in, for the run's header.
fn describe_zero(config: &TrainConfig) -> String {
    let zero = &config.zero_config;
    let mut parts = vec![format!("stage {}", config.zero.number())];
    match &zero.precision {
        None => parts.push("fp32".into()),
        Some(p) => {
            let dtype = format!("{:?}", p.param_dtype).to_lowercase();
            parts.push(format!("{dtype} parameters with fp32 master weights"));
            let reduce = if p.reduce_f32 { "fp32" } else { &dtype };
            parts.push(format!("gradients reduced in {reduce}"));
            if let Some(scale) = &p.loss_scale {
                parts.push(format!("loss scaled dynamically from {}", scale.init_scale));
            }
        }
    }
    if zero.offload {
        parts.push("optimizer state in host memory".into());
    }
    parts.join(", ")
}
