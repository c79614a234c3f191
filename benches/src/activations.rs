//! What one forward of the Llama model keeps for its backward, measured with the counting
//! allocator: the heap the forward leaves allocated while its loss (and so its graph) lives.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{DType, Tensor};
use burn_comm::{CommError, launch};
use burn_tensor_parallel::{ContextParallel, CpAttention, TensorParallel};
use llama::data::MarkovSource;
use llama::parallel_plan::ParallelPlan;
use llama::train::TrainConfig;
use llama::{Llama, LlamaConfig};

use crate::memory::{live_bytes, set_slot, slot_live_bytes};
use crate::token_batch;

type B = Autodiff<Flex>;

/// Every parameter of a module in another float dtype, still a leaf that needs a gradient.
struct Cast(DType);

impl ModuleMapper<B> for Cast {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let dtype = self.0;
        param.map(|tensor| tensor.cast(dtype).detach().require_grad())
    }
}

/// Bytes a forward of `micro_batch x seq_len` tokens through `config`'s model in `dtype`
/// keeps for its backward; the process must count with [`crate::memory::CountingAllocator`]
/// and run nothing else meanwhile. A first forward warms the backend's one-time allocations.
pub fn measured_activation_bytes(
    config: &LlamaConfig,
    micro_batch: usize,
    seq_len: usize,
    dtype: DType,
) -> usize {
    let data = MarkovSource::new(config.vocab_size.min(256), 3, seq_len, micro_batch, 1);
    least_kept(
        &model(config, dtype),
        &data,
        micro_batch,
        seq_len,
        live_bytes,
    )
}

/// `config`'s model drawn from seed 1, every parameter in `dtype`.
fn model(config: &LlamaConfig, dtype: DType) -> Llama<B> {
    Llama::<B>::init(config, 1, &Default::default()).map(&mut Cast(dtype))
}

/// The bytes `counted` grows by across a forward of `model` while its loss lives, after a first
/// forward warms the backend's one-time allocations.
fn least_kept(
    model: &Llama<B>,
    data: &MarkovSource,
    micro_batch: usize,
    seq_len: usize,
    counted: impl Fn() -> usize,
) -> usize {
    let forward = || {
        let (inputs, targets) = token_batch::<B>(data, 0, micro_batch, seq_len);
        let before = counted();
        let loss = model.loss(inputs, targets).expect("every block");
        (counted().saturating_sub(before), loss)
    };
    drop(forward());
    // The heap a forward leaves varies by about 1% from one forward to the next (the
    // autodiff graph frees the previous one's nodes lazily); the least of a few is what the
    // forward itself keeps.
    (0..4).map(|_| forward().0).min().expect("a few forwards")
}

/// What [`measured_activation_bytes`] measures, on each of `cp` context-parallel ranks (threads
/// of this process, each counted in its own slot of [`crate::memory`]), attention by
/// `attention`: the median rank's.
pub fn measured_context_parallel_activation_bytes(
    config: &LlamaConfig,
    micro_batch: usize,
    seq_len: usize,
    dtype: DType,
    cp: usize,
    attention: CpAttention,
) -> usize {
    let data = MarkovSource::new(config.vocab_size.min(256), 3, seq_len, micro_batch, 1);
    let mut per_rank = launch(cp, |ctx| {
        let slot = ctx.rank() + 1;
        set_slot(slot);
        let group = ContextParallel::new(ctx.world().clone(), true).with_attention(attention);
        let model = model(config, dtype).with_cp(Some(group));
        let counted = || slot_live_bytes(slot);
        Ok::<_, CommError>(least_kept(&model, &data, micro_batch, seq_len, counted))
    })
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
    .collect::<Vec<_>>();
    per_rank.sort_unstable();
    per_rank[cp / 2]
}

/// What [`measured_activation_bytes`] measures, on each of `tp` tensor-parallel ranks (threads
/// of this process, each counted in its own slot of [`crate::memory`]), the model cut by
/// `llama`'s plan, with sequence parallelism when `sp`: every rank's, in rank order. A buffer
/// the ranks share (the local transport's all-gather output) counts on the thread that made it.
pub fn measured_tensor_parallel_activation_bytes(
    config: &LlamaConfig,
    micro_batch: usize,
    seq_len: usize,
    dtype: DType,
    tp: usize,
    sp: bool,
) -> Vec<usize> {
    let data = MarkovSource::new(config.vocab_size.min(256), 3, seq_len, micro_batch, 1);
    launch(tp, |ctx| {
        let slot = ctx.rank() + 1;
        set_slot(slot);
        let group = TensorParallel::new(ctx.world().clone()).with_sequence_parallel(sp);
        let mut train = TrainConfig::new(config.clone(), 1);
        (train.tp, train.sequence_parallel, train.seq_len) = (tp, sp, seq_len);
        let plan = ParallelPlan::new(&train).expect("a plan of the layout");
        let model = plan
            .shard(model(config, dtype), Some(&group))
            .expect("the model cut over tp");
        let counted = || slot_live_bytes(slot);
        Ok::<_, CommError>(least_kept(&model, &data, micro_batch, seq_len, counted))
    })
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
    .collect()
}
