//! The layouts `llama train` can run for a model, a cluster and a batch (dp, tp within a
//! node, cp by the ring or all-gather, ep for a mixture of experts, pp, ZeRO, micro-batch
//! size, sp, recompute, three schedules; not yet `--tp-overlap`), each with its memory per
//! device (`llama plan`'s estimate) and its step time (the cost model), ranked by tokens per
//! second per device among those that fit.

use burn_pipeline::ScheduleKind;
use burn_tensor_parallel::CpAttention;
use burn_zero::{MixedPrecision, ZeroStage};

use super::cluster::Cluster;
use super::step_time::{Engine, Recompute, Shape, StepLayout, StepTime, step_time};
use crate::config::LlamaConfig;
use crate::dims::ParallelDims;
use crate::plan::{heaviest, run_bytes};
use crate::train::{Layout, Strategy, TrainConfig};

/// What a plan is asked for.
#[derive(Debug, Clone)]
pub struct Request {
    /// The model.
    pub model: LlamaConfig,
    /// How `llama train --model` names it (a preset), for the printed command.
    pub model_name: Option<String>,
    /// Where it runs; the search uses every device.
    pub cluster: Cluster,
    /// Samples per step over all devices.
    pub global_batch: usize,
    /// Tokens per sample.
    pub seq_len: usize,
    /// The element type weights and activations are computed in.
    pub dtype: Dtype,
}

/// What `llama train --dtype` a plan is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    /// Everything fp32.
    F32,
    /// bf16 weights and activations, fp32 master weights in ZeRO's shards.
    Bf16,
    /// f16 likewise, with a dynamic loss scale.
    F16,
}

impl Dtype {
    /// Its name as `--dtype` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }

    /// ZeRO's mixed precision for it; none for fp32.
    fn mixed(self) -> Option<MixedPrecision> {
        match self {
            Dtype::F32 => None,
            Dtype::Bf16 => Some(MixedPrecision::bf16()),
            Dtype::F16 => Some(MixedPrecision::f16()),
        }
    }
}

/// One runnable layout, sized and timed.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The run, as `llama train` would be configured.
    pub config: TrainConfig,
    /// The layout as the cost model sees it.
    pub layout: StepLayout,
    /// Its predicted step ([`StepTime::UNKNOWN`] when it does not fit).
    pub time: StepTime,
    /// Model-state bytes of the heaviest device.
    pub model_state: u64,
    /// Activation bytes the heaviest device keeps at its peak.
    pub activations: u64,
}

impl Candidate {
    /// Bytes of the heaviest device.
    pub fn memory(&self) -> u64 {
        self.model_state + self.activations
    }

    /// Predicted tokens per second per device (NaN for a layout that does not fit, which is
    /// not timed).
    pub fn tokens_per_device(&self) -> f64 {
        let tokens = (self.layout.global_batch() * self.layout.seq_len) as f64;
        tokens / self.time.total / self.layout.devices() as f64
    }

    /// The layout in `llama train`'s flags, such as `--dp 8 --tp 8 --pp 2 --zero 1`.
    pub fn flags(&self) -> String {
        let c = &self.config;
        let mut flags = format!("--dp {}", c.dp);
        if c.ep > 1 {
            flags += &format!(" --ep {}", c.ep);
        }
        flags += &format!(" --tp {} --pp {}", c.tp, c.pp);
        if c.sequence_parallel {
            flags += " --sp";
        }
        if c.cp > 1 {
            flags += &format!(" --cp {}", c.cp);
            if c.cp_attention == CpAttention::AllGather {
                flags += " --cp-attention all-gather";
            }
        }
        if c.pp > 1 {
            flags += &format!(" --schedule {}", c.schedule);
            if c.virtual_stages > 1 {
                flags += &format!(" --virtual-stages {}", c.virtual_stages);
            }
            if c.recompute {
                flags += " --recompute";
            }
        }
        if c.zero != ZeroStage::Replicated {
            flags += &format!(" --zero {}", c.zero.number());
        }
        flags += &format!(" --micro-batch-size {}", self.layout.micro_batch);
        flags
    }
}

/// How burn-parallel runs a layout, for the cost model: burn's attention writes its scores
/// (fp32 softmax, about 24 bytes a score), its elementwise operations are not fused (about
/// three passes of what a fused kernel streams), gradient buckets are reduced during the
/// backward, pipeline messages are whole.
pub fn burn_parallel(bf16: bool) -> Engine {
    let bytes = if bf16 { 2.0 } else { 4.0 };
    Engine {
        compute_bytes: bytes,
        grad_bytes: bytes,
        flash_attention: None,
        score_bytes: 24.0,
        elementwise_passes: 3.0,
        dropout: false,
        overlap_grad_reduce: true,
        overlap_tp: false,
        split_pipeline_messages: false,
        zero3_forward_twice: true,
        overlap_cost: 0.0,
    }
}

/// The cost model's view of a run of `config` cut as `layout`.
pub fn step_layout(config: &TrainConfig, layout: &Layout) -> StepLayout {
    StepLayout {
        dp: config.dp,
        ep: config.ep,
        tp: config.tp,
        pp: config.pp,
        cp: config.cp,
        cp_attention: config.cp_attention,
        sp: config.sequence_parallel,
        zero: config.zero,
        recompute: if config.recompute {
            Recompute::Full
        } else {
            Recompute::None
        },
        micro_batch: layout.micro,
        micro_batches: layout.accum,
        seq_len: config.seq_len,
        schedule: config.schedule,
        virtual_stages: config.virtual_stages,
    }
}

/// What the search found: the layouts that fit, fastest first, and the fastest of those that
/// do not (to say what would be needed).
#[derive(Debug, Clone)]
pub struct Found {
    /// Layouts whose estimate fits in a device's usable memory, by predicted tokens/s per
    /// device.
    pub fitting: Vec<Candidate>,
    /// Layouts that do not fit, smallest memory first.
    pub too_big: Vec<Candidate>,
    /// Why `llama train` refused the first layout it refused, when it refused every one.
    pub refused: Option<String>,
}

/// Every layout of `request` that `llama train` accepts, sized and timed.
pub fn search(request: &Request) -> Result<Found, String> {
    let shape = Shape::llama(&request.model);
    let cluster = &request.cluster;
    let devices = cluster.devices();
    let engine = burn_parallel(request.dtype != Dtype::F32);
    let mut found = Found {
        fitting: Vec::new(),
        too_big: Vec::new(),
        refused: None,
    };
    let mut refused = None;
    for config in configs(request, devices) {
        let layout = match config.layout() {
            Ok(layout) => layout,
            Err(e) => {
                refused.get_or_insert_with(|| {
                    let ep = match config.ep {
                        1 => String::new(),
                        ep => format!(" --ep {ep}"),
                    };
                    format!(
                        "--dp {}{ep} --tp {} --cp {} --pp {}: {e}",
                        config.dp, config.tp, config.cp, config.pp
                    )
                });
                continue;
            }
        };
        let Ok(bytes) = run_bytes(&config, &layout) else {
            continue;
        };
        let heaviest = heaviest(&bytes);
        let step = step_layout(&config, &layout);
        let fits = heaviest.total() <= cluster.usable_memory();
        // Only what fits is timed (a pipeline's simulation is the search's cost).
        let time = match fits {
            true => step_time(&shape, cluster, &engine, &step)?,
            false => StepTime::UNKNOWN,
        };
        let candidate = Candidate {
            config,
            layout: step,
            time,
            model_state: heaviest.model_state,
            activations: heaviest.activations,
        };
        match fits {
            true => found.fitting.push(candidate),
            false => found.too_big.push(candidate),
        }
    }
    found.fitting.sort_by(|a, b| {
        b.tokens_per_device()
            .total_cmp(&a.tokens_per_device())
            .then(a.memory().cmp(&b.memory()))
    });
    found.too_big.sort_by_key(Candidate::memory);
    if found.fitting.is_empty() && found.too_big.is_empty() {
        found.refused = refused;
    }
    Ok(found)
}

/// The configurations to try: tp within a machine, cp (where the sequence cuts into its
/// `2 cp` chunks), ep (dividing the experts) and pp over the rest, dp what is left;
/// micro-batches of 1 to 8 samples; every ZeRO stage the layout allows; sequence parallelism
/// and recompute on and off; the pipeline schedules with their memory and bubble trade-offs;
/// the ring and all-gather.
fn configs(request: &Request, devices: usize) -> Vec<TrainConfig> {
    let divisors = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
    // Context parallelism cuts each sequence into `2 cp` chunks; expert parallelism splits
    // the experts evenly.
    let cuts = |cp: &usize| *cp == 1 || request.seq_len.is_multiple_of(2 * cp);
    let experts = request.model.num_local_experts;
    let splits = |ep: &usize| *ep == 1 || (experts > 0 && experts.is_multiple_of(*ep));
    let mut configs = Vec::new();
    for tp in divisors(request.cluster.devices_per_node.min(devices)) {
        for cp in divisors(devices / tp).filter(cuts) {
            for ep in divisors(devices / (tp * cp)).filter(splits) {
                for pp in divisors(devices / (tp * cp * ep)) {
                    if pp > request.model.num_hidden_layers {
                        continue;
                    }
                    let dp = devices / (tp * cp * ep * pp);
                    // Expert-parallel ranks read their own samples, as data-parallel ones do.
                    if !request.global_batch.is_multiple_of(dp * ep) {
                        continue;
                    }
                    let per_rank = request.global_batch / (dp * ep);
                    for micro in [1, 2, 4, 8]
                        .into_iter()
                        .filter(|m| per_rank.is_multiple_of(*m))
                    {
                        let dims = ParallelDims { dp, ep, pp, cp, tp };
                        configs.extend(variants(request, dims, micro));
                    }
                }
            }
        }
    }
    configs
}

/// The runs of one `dp x ep x pp x cp x tp` layout and micro-batch size.
fn variants(request: &Request, dims: ParallelDims, micro: usize) -> Vec<TrainConfig> {
    let ParallelDims { dp, ep, pp, cp, tp } = dims;
    let base = {
        let mut c = TrainConfig::new(request.model.clone(), 1);
        c.batch_size = request.global_batch;
        c.seq_len = request.seq_len;
        c.micro_batch_size = Some(micro);
        (c.dp, c.ep, c.tp, c.cp, c.pp) = (dp, ep, tp, cp, pp);
        c
    };
    let attentions: &[CpAttention] = match cp {
        1 => &[CpAttention::Ring],
        _ => &[CpAttention::Ring, CpAttention::AllGather],
    };
    let schedules: &[(ScheduleKind, usize)] = match pp {
        1 => &[(ScheduleKind::OneFOneB, 1)],
        _ => &[
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::ZeroBubbleH1, 1),
            (ScheduleKind::Interleaved, 2),
        ],
    };
    let mut out = Vec::new();
    for zero in ZeroStage::ALL {
        // burn-parallel keeps 16-bit weights' fp32 masters in ZeRO's sharded optimizer; on
        // one data-parallel rank the stages shard nothing, so one of them stands for all.
        let half = request.dtype != Dtype::F32;
        let needed = match (half, dp * ep * cp) {
            (false, 1) => ZeroStage::Replicated,
            (true, 1) => ZeroStage::OptimizerState,
            _ => zero,
        };
        if zero != needed || (half && zero == ZeroStage::Replicated) {
            continue;
        }
        for sp in [false, true].into_iter().filter(|sp| !sp || tp > 1) {
            for recompute in [false, true].into_iter().filter(|r| !r || pp > 1) {
                for &(schedule, virtual_stages) in schedules {
                    for &attention in attentions {
                        let mut c = base.clone();
                        c.zero = zero;
                        c.strategy = if dp * ep * cp > 1 || zero != ZeroStage::Replicated {
                            Strategy::Ddp
                        } else {
                            Strategy::Single
                        };
                        c.zero_config = c.zero_config.with_precision(request.dtype.mixed());
                        c.sequence_parallel = sp;
                        c.recompute = recompute;
                        c.schedule = schedule;
                        c.virtual_stages = virtual_stages;
                        c.cp_attention = attention;
                        out.push(c);
                    }
                }
            }
        }
    }
    out
}

/// What `llama plan --gpus` prints: the best `top` layouts with their memory and time broken
/// down, why the best wins, the command that runs it, and what does not fit.
pub fn report(request: &Request, found: &Found, top: usize) -> String {
    let gb = |bytes: u64| bytes as f64 / 1e9;
    let cluster = &request.cluster;
    let mut out = format!(
        "{} ({:.3e} parameters) on {} x {} ({} devices of {:.0} GB), {} samples of {} tokens per step, {}\n",
        request.model_name.as_deref().unwrap_or("the model"),
        request.model.num_params() as f64,
        cluster.nodes,
        cluster.name,
        cluster.devices(),
        gb(cluster.memory),
        request.global_batch,
        request.seq_len,
        request.dtype.name(),
    );
    let considered = found.fitting.len() + found.too_big.len();
    out += &format!(
        "{considered} layouts `llama train` can run; {} fit in {:.0} GB per device (a tenth of its memory is left to buffers)\n\n",
        found.fitting.len(),
        gb(cluster.usable_memory()),
    );
    if !found.fitting.is_empty() {
        out += &format!(
            "{:<4} {:<62} {:>8} {:>9} {:>12} {:>6}   {}\n",
            "",
            "layout",
            "GB/dev",
            "step s",
            "tok/s/dev",
            "MFU",
            "step: compute, tp comm, cp comm, ep comm, bubble, dp comm, optimizer (s)"
        );
        // Model FLOPs utilisation: the model's own FLOPs (no recompute) per second of peak.
        let flops_per_token = Shape::llama(&request.model).model_flops_per_token(request.seq_len);
        for (i, c) in found.fitting.iter().take(top).enumerate() {
            let parts: Vec<String> = c
                .time
                .parts()
                .iter()
                .map(|(_, s)| format!("{s:.3}"))
                .collect();
            let mfu = flops_per_token * c.tokens_per_device() / cluster.peak_flops;
            out += &format!(
                "{:<4} {:<62} {:>8.2} {:>9.3} {:>12.0} {:>5.1}%   {}\n",
                i + 1,
                c.flags(),
                gb(c.memory()),
                c.time.total,
                c.tokens_per_device(),
                100.0 * mfu,
                parts.join(", "),
            );
        }
        let best = &found.fitting[0];
        out += &format!(
            "\nthe best keeps {:.1} GB of model state and {:.1} GB of activations per device",
            gb(best.model_state),
            gb(best.activations)
        );
        out += &why_best(best, &found.fitting);
        out += &format!("\nrun it: {}\n", command(request, best));
    }
    match found.too_big.first() {
        Some(smallest) if found.fitting.is_empty() => {
            out += &format!(
                "\nno layout fits in {:.0} GB per device: the smallest, {}, needs {:.1} GB ({:.1} GB of model state, {:.1} GB of activations), {:.1} GB too many; shorten --seq-len, take more devices or a smaller model\n",
                gb(cluster.usable_memory()),
                smallest.flags(),
                gb(smallest.memory()),
                gb(smallest.model_state),
                gb(smallest.activations),
                gb(smallest.memory() - cluster.usable_memory()),
            );
        }
        Some(smallest) => {
            out += &format!(
                "{} layout(s) do not fit in {:.0} GB per device; the nearest, {}, needs {:.1} GB\n",
                found.too_big.len(),
                gb(cluster.usable_memory()),
                smallest.flags(),
                gb(smallest.memory()),
            );
        }
        None => {}
    }
    if considered == 0 {
        out += &format!(
            "no layout of {} devices runs this model with a batch of {}: the batch must divide over the data-parallel ranks (in micro-batches of 1, 2, 4 or 8) and the model split over tp and pp{}\n",
            cluster.devices(),
            request.global_batch,
            match &found.refused {
                Some(why) => format!("; for one, {why}"),
                None => String::new(),
            }
        );
    }
    out
}

/// Why `best` beats the fastest layout of another shape (dp, ep, tp, cp, pp): the part of
/// the step where they differ most.
fn why_best(best: &Candidate, fitting: &[Candidate]) -> String {
    let shape = |c: &Candidate| {
        let c = &c.config;
        (c.dp, c.ep, c.tp, c.cp, c.pp)
    };
    let Some(next) = fitting.iter().find(|c| shape(c) != shape(best)) else {
        return "; no layout of another dp x ep x tp x cp x pp fits\n".into();
    };
    let (name, ours, theirs) = best
        .time
        .parts()
        .iter()
        .zip(next.time.parts())
        .map(|(&(name, ours), (_, theirs))| (name, ours, theirs))
        .max_by(|a, b| (a.2 - a.1).total_cmp(&(b.2 - b.1)))
        .expect("a step has parts");
    format!(
        "; it beats the best of another shape, {} ({:.1} % fewer tokens/s), most by its {name}: {ours:.3} s against {theirs:.3} s",
        next.flags(),
        100.0 * (1.0 - next.tokens_per_device() / best.tokens_per_device()),
    )
}

/// The command that runs `candidate`: `llama train` with its flags, under `burn-launch` on a
/// cluster of GPUs.
fn command(request: &Request, candidate: &Candidate) -> String {
    let model = match &request.model_name {
        Some(name) => format!("--model {name}"),
        None => "--init-from DIR".into(),
    };
    let train = format!(
        "llama train {model} --batch-size {} --seq-len {} {}{}",
        request.global_batch,
        request.seq_len,
        candidate.flags(),
        match request.dtype {
            Dtype::F32 => String::new(),
            dtype => format!(" --dtype {}", dtype.name()),
        },
    );
    match request.cluster.devices_per_node {
        // A CPU machine runs the ranks as threads of one process.
        _ if request.cluster.name.starts_with("cpu") => train,
        per_node => format!(
            "burn-launch --nnodes {} --nproc-per-node {per_node} -- {train} --device cuda --nccl",
            request.cluster.nodes
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(model: &str, gpus: usize, global_batch: usize, seq_len: usize) -> Request {
        let mut cluster = Cluster::preset("a100", gpus.div_ceil(8)).unwrap();
        cluster.devices_per_node = cluster.devices_per_node.min(gpus);
        Request {
            model: LlamaConfig::preset(model).unwrap(),
            model_name: Some(model.into()),
            cluster,
            global_batch,
            seq_len,
            dtype: Dtype::Bf16,
        }
    }

    #[test]
    fn every_layout_found_runs_and_the_fastest_that_fits_comes_first() {
        let request = request("llama-7b", 16, 64, 2048);
        let found = search(&request).unwrap();
        assert!(found.fitting.len() > 10 && !found.too_big.is_empty());
        for c in found.fitting.iter().chain(&found.too_big) {
            let layout = c
                .config
                .layout()
                .expect("the search offers runnable layouts only");
            assert_eq!(
                c.config.dp * c.config.ep * c.config.tp * c.config.cp * c.config.pp,
                16
            );
            assert_eq!(layout.micro * layout.accum * c.config.dp, 64);
            assert!(
                c.config.zero != ZeroStage::Replicated,
                "bf16 needs ZeRO's masters"
            );
        }
        for pair in found.fitting.windows(2) {
            assert!(pair[0].tokens_per_device() >= pair[1].tokens_per_device());
        }
        let usable = request.cluster.usable_memory();
        assert_eq!(usable, 72_000_000_000);
        assert!(found.fitting.iter().all(|c| c.memory() <= usable));
        assert!(found.too_big.iter().all(|c| c.memory() > usable));
        // At dp 16 with micro-batches of 4, the stage decides: ZeRO-2 keeps a whole forward's
        // activations (burn's attention keeps its scores) and does not fit; ZeRO-3's units run
        // their forward again before their backward, so it keeps one block's and the other
        // blocks' inputs, and fits.
        let dp16 = |stage: ZeroStage| {
            found
                .fitting
                .iter()
                .chain(&found.too_big)
                .find(|c| (c.config.dp, c.layout.micro_batch, c.config.zero) == (16, 4, stage))
                .expect("dp 16 runs micro-batches of 4 under ZeRO-2 and 3")
        };
        let (two, three) = (dp16(ZeroStage::Gradients), dp16(ZeroStage::Parameters));
        assert!(
            three.memory() <= usable && two.memory() > usable,
            "{} B and {} B against {usable} B",
            three.memory(),
            two.memory()
        );
        assert!(two.activations > 10 * three.activations);
        let report = report(&request, &found, 3);
        assert!(report.contains("run it: burn-launch --nnodes 2 --nproc-per-node 8 -- llama train --model llama-7b --batch-size 64 --seq-len 2048 --dp "), "{report}");
        assert!(report.contains(&found.fitting[0].flags()), "{report}");
        assert!(
            report.contains("it beats the best of another shape"),
            "{report}"
        );
    }

    #[test]
    fn an_f16_plan_runs_in_f16() {
        let request = Request {
            dtype: Dtype::F16,
            ..request("llama-1b", 8, 16, 1024)
        };
        let found = search(&request).unwrap();
        assert!(found.fitting.iter().all(|c| {
            let precision = c.config.zero_config.precision.as_ref();
            precision.is_some_and(|p| {
                p.param_dtype == burn::tensor::DType::F16 && p.loss_scale.is_some()
            })
        }));
        let report = report(&request, &found, 1);
        assert!(
            report.contains(" --dtype f16 --device cuda --nccl"),
            "{report}"
        );
    }

    #[test]
    fn when_nothing_fits_it_says_what_is_needed() {
        // 405B parameters on 8 GPUs: the model state alone is hundreds of GB per device.
        let request = request("llama3-405b", 8, 8, 2048);
        let found = search(&request).unwrap();
        assert!(found.fitting.is_empty() && !found.too_big.is_empty());
        let report = report(&request, &found, 3);
        assert!(
            report.contains("no layout fits in 72 GB per device: the smallest, --dp"),
            "{report}"
        );
        assert!(report.contains("GB too many"), "{report}");
    }

    #[test]
    fn long_sequences_are_split_over_context_parallel_ranks() {
        // burn's attention keeps and streams every score: at 32768 tokens the ring, which
        // computes only the chunk pairs under the causal mask, is the fastest split.
        let request = request("llama-1b", 8, 8, 32768);
        let found = search(&request).unwrap();
        let best = found.fitting.first().expect("a layout fits");
        assert!(best.config.cp > 1, "{}", best.flags());
        assert!(
            found
                .fitting
                .iter()
                .any(|c| c.config.cp_attention == CpAttention::AllGather),
            "all-gather is tried too"
        );
        let report = report(&request, &found, 1);
        assert!(
            report.contains(&format!("--cp {} ", best.config.cp)),
            "{report}"
        );
    }

    #[test]
    fn an_odd_sequence_length_is_planned_without_context_parallelism() {
        let found = search(&request("llama-1b", 8, 8, 2047)).unwrap();
        assert!(!found.fitting.is_empty());
        assert!(found.fitting.iter().all(|c| c.config.cp == 1));
    }

    #[test]
    fn a_mixture_of_experts_is_split_over_expert_parallel_ranks_where_it_can_run() {
        let f32 = Request {
            dtype: Dtype::F32,
            ..request("small-moe", 8, 64, 256)
        };
        let found = search(&f32).unwrap();
        let split: Vec<&Candidate> = found.fitting.iter().filter(|c| c.config.ep > 1).collect();
        assert!(!split.is_empty());
        for c in &split {
            // llama train runs expert parallelism without ZeRO, each rank on its own samples.
            assert_eq!(c.config.zero, ZeroStage::Replicated);
            assert!(c.flags().contains(&format!("--ep {}", c.config.ep)));
            let layout = c.config.layout().unwrap();
            assert_eq!(layout.micro * layout.accum * c.config.dp * c.config.ep, 64);
            assert!(c.time.ep_comm > 0.0);
        }
        // In bf16 the fp32 masters live in ZeRO's shards, which expert parallelism lacks.
        let bf16 = search(&request("small-moe", 8, 64, 256)).unwrap();
        assert!(!bf16.fitting.is_empty());
        assert!(bf16.fitting.iter().all(|c| c.config.ep == 1));
    }

    #[test]
    fn layouts_whose_activations_cannot_fit_are_set_aside_for_split_ones() {
        // Long sequences: burn's attention keeps its scores, so only splitting heads over tp
        // (or layers over pp), or ZeRO-3 (whose units run their forward again before their
        // backward), makes the activations fit; the model state alone would.
        let request = request("llama-7b", 8, 8, 4096);
        let usable = request.cluster.usable_memory();
        let found = search(&request).unwrap();
        let unsplit = |c: &&Candidate| c.config.dp == 8 && c.config.zero != ZeroStage::Parameters;
        let whole: Vec<&Candidate> = found.too_big.iter().filter(unsplit).collect();
        assert!(!whole.is_empty() && !found.fitting.iter().any(|c| unsplit(&c)));
        assert!(
            found
                .fitting
                .iter()
                .any(|c| c.config.dp == 8 && c.config.zero == ZeroStage::Parameters),
            "ZeRO-3 fits unsplit"
        );
        assert!(
            whole.iter().all(|c| c.model_state < usable),
            "{:?}",
            whole.iter().map(|c| c.model_state).collect::<Vec<_>>()
        );
        let best = found.fitting.first().expect("a split layout fits");
        let least = whole.iter().map(|c| c.activations).min().unwrap();
        assert!(best.activations < least, "{}", best.flags());
    }
}
