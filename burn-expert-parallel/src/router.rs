//! The router: each token's top-k experts from a softmax over its router logits, in fp32 (as
//! Megatron computes it), and the losses that keep the experts evenly used.
//!
//! The load-balancing loss is Switch Transformer's (GShard's with k copies): `coeff * E * sum_e
//! f_e * P_e`, where `f_e` is the fraction of the batch's token copies routed to expert `e` and
//! `P_e` the mean router probability of `e`. When a batch is spread over ranks (data and expert
//! parallelism), `f` counts the whole batch (one all-reduce of `E` numbers) and each rank's
//! loss holds its tokens' share of `P` scaled so that the ranks' mean, which their averaged
//! gradients descend, is the whole batch's loss: the same value and gradient as on one device.
//! The z-loss (ST-MoE) is `coeff * mean(logsumexp(logits)^2)`, a mean of equal shares.

use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_comm::{Communicator, ReduceOp};

use crate::{MoeError, Routing};

/// How a router chooses, and what it adds to the loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterConfig {
    /// Experts in the layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Weight of the load-balancing loss (Switch: 0.01); 0 turns it off.
    pub aux_loss_coeff: f64,
    /// Weight of the router z-loss (ST-MoE: 0.001); 0 turns it off.
    pub z_loss_coeff: f64,
    /// Each expert takes at most `factor * tokens * top_k / experts` copies of a rank's tokens
    /// (rounded up), dropping the rest, as Megatron does; `None` drops nothing.
    pub capacity_factor: Option<f64>,
    /// With top-k above 1, divide each token's k probabilities by their sum (Mixtral, Qwen3-MoE),
    /// or keep them. Top-1 always keeps its probability (as Switch does): normalised it would be
    /// 1, and the router would learn from the balancing losses alone.
    pub normalize_top_k: bool,
}

impl RouterConfig {
    /// `top_k` of `experts`, aux loss 0.01, no z-loss, dropless, top-k renormalised.
    pub fn new(experts: usize, top_k: usize) -> Self {
        Self {
            experts,
            top_k,
            aux_loss_coeff: 0.01,
            z_loss_coeff: 0.0,
            capacity_factor: None,
            normalize_top_k: true,
        }
    }

    /// Refuses, with a sentence, a router that cannot work.
    pub fn validate(&self) -> Result<(), MoeError> {
        if self.experts == 0 || self.top_k == 0 || self.top_k > self.experts {
            return Err(MoeError::Config(format!(
                "top-{} of {} experts: choose between 1 and {} experts per token",
                self.top_k, self.experts, self.experts
            )));
        }
        for (name, coeff) in [
            ("aux loss", self.aux_loss_coeff),
            ("z-loss", self.z_loss_coeff),
        ] {
            if !(coeff.is_finite() && coeff >= 0.0) {
                return Err(MoeError::Config(format!(
                    "the {name} coefficient {coeff} must be finite and at least 0"
                )));
            }
        }
        if let Some(factor) = self.capacity_factor
            && !(factor.is_finite() && factor > 0.0)
        {
            return Err(MoeError::Config(format!(
                "the capacity factor {factor} must be positive and finite (1.0 or more is usual); leave it out to drop nothing"
            )));
        }
        Ok(())
    }

    /// The most copies of `tokens` tokens one expert takes, if there is a capacity.
    pub fn capacity(&self, tokens: usize) -> Option<usize> {
        self.capacity_factor.map(|factor| {
            let even = (tokens * self.top_k) as f64 / self.experts as f64;
            ((even * factor).ceil() as usize).max(1)
        })
    }
}

/// A router's decisions and losses for a rank's tokens.
#[derive(Debug, Clone)]
pub struct Routed<B: Backend> {
    /// Each token's experts and weights.
    pub routing: Routing<B>,
    /// This rank's load-balancing loss (see the module), already weighted; `[1]`.
    pub aux_loss: Tensor<B, 1>,
    /// This rank's z-loss, already weighted; `[1]`.
    pub z_loss: Tensor<B, 1>,
}

/// Routes `tokens` tokens by their router logits `[tokens, experts]` (whatever their dtype, the
/// softmax and the losses are computed in fp32, and the weights come back in fp32). `batch` is the group over whose ranks the batch
/// is spread, if it is, for the load-balancing loss (every rank of it calls this, with as many
/// tokens).
pub fn route<B: Backend>(
    logits: Tensor<B, 2>,
    config: &RouterConfig,
    batch: Option<&Communicator>,
) -> Result<Routed<B>, MoeError> {
    config.validate()?;
    let [tokens, experts] = logits.dims();
    if experts != config.experts {
        return Err(MoeError::Config(format!(
            "{experts} router logits per token for a layer of {} experts",
            config.experts
        )));
    }
    let device = logits.device();
    let logits = if logits.dtype() == DType::F32 {
        logits
    } else {
        logits.cast(DType::F32)
    };
    let probs = softmax(logits.clone(), 1);
    // The choice carries no gradient; the weights are the chosen probabilities.
    let (_, chosen) = probs.clone().detach().topk_with_indices(config.top_k, 1);
    let weights = probs.clone().gather(1, chosen.clone());
    let weights = match config.normalize_top_k && config.top_k > 1 {
        true => weights.clone() / weights.sum_dim(1),
        false => weights,
    };
    let aux_loss = balance_loss(&probs, &chosen, config, batch, &device)?;
    let z_loss = if config.z_loss_coeff > 0.0 {
        let max = logits.clone().detach().max_dim(1);
        let lse = (logits - max.clone()).exp().sum_dim(1).log() + max;
        (lse.powi_scalar(2).mean() * config.z_loss_coeff).reshape([1])
    } else {
        Tensor::zeros([1], &device)
    };
    debug_assert_eq!(chosen.dims(), [tokens, config.top_k]);
    Ok(Routed {
        routing: Routing {
            experts: chosen,
            weights,
        },
        aux_loss,
        z_loss,
    })
}

/// This rank's share of the batch's load-balancing loss (see the module).
fn balance_loss<B: Backend>(
    probs: &Tensor<B, 2>,
    chosen: &Tensor<B, 2, Int>,
    config: &RouterConfig,
    batch: Option<&Communicator>,
    device: &B::Device,
) -> Result<Tensor<B, 1>, MoeError> {
    let [tokens, experts] = probs.dims();
    if config.aux_loss_coeff == 0.0 {
        return Ok(Tensor::zeros([1], device));
    }
    let ids: Vec<i64> = chosen
        .to_data()
        .convert::<i64>()
        .into_vec()
        .map_err(|e| MoeError::Config(format!("the chosen experts: {e:?}")))?;
    let mut counts = vec![0f32; experts + 1];
    for id in ids {
        counts[id as usize] += 1.0;
    }
    // The batch's copies per expert and its token count, summed over its ranks at once.
    counts[experts] = tokens as f32;
    let mut counts = Tensor::<B, 1>::from_data(TensorData::new(counts, [experts + 1]), device);
    let ranks = batch.map_or(1, Communicator::size);
    if let Some(batch) = batch {
        counts = batch.all_reduce(counts, ReduceOp::Sum)?;
    }
    // A batch without tokens has no loss (not 0 / 0).
    let total = counts.clone().narrow(0, experts, 1).clamp_min(1.0);
    let fraction = counts.narrow(0, 0, experts) / (total.clone() * config.top_k as f64);
    // P_e of the whole batch is the ranks' sums over all its tokens: this rank's sum, scaled
    // so that the mean of the ranks' losses is the batch's.
    let share = probs.clone().sum_dim(0).reshape([experts]) * ranks as f64 / total;
    let loss = (fraction * share).sum() * (config.aux_loss_coeff * experts as f64);
    Ok(loss.reshape([1]))
}
