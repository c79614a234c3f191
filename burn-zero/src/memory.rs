//! Bytes of model state per rank: what an engine holds, and what the ZeRO paper's formulas
//! (Rajbhandari et al., 2020, section 5) predict. For Ψ parameters with 2-byte parameters and
//! gradients and fp32 master weights and Adam moments (K = 12): DDP holds 16Ψ, ZeRO-1
//! 4Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N.

use std::fmt;
use std::ops::Add;

/// How much of the model state is sharded over the data-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ZeroStage {
    /// Nothing: every rank holds everything (DDP).
    Replicated = 0,
    /// Optimizer state (P_os).
    OptimizerState = 1,
    /// Optimizer state and gradients (P_os+g).
    Gradients = 2,
    /// Optimizer state, gradients and parameters (P_os+g+p).
    Parameters = 3,
}

impl ZeroStage {
    /// Every stage, 0 to 3.
    pub const ALL: [ZeroStage; 4] = [
        ZeroStage::Replicated,
        ZeroStage::OptimizerState,
        ZeroStage::Gradients,
        ZeroStage::Parameters,
    ];

    /// The stage numbered `n` (0 to 3).
    pub fn from_number(n: usize) -> Option<Self> {
        Self::ALL.get(n).copied()
    }

    /// Its number, 0 to 3.
    pub fn number(self) -> usize {
        self as usize
    }
}

impl fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ZeroStage::Replicated => f.write_str("0 (DDP)"),
            stage => write!(f, "{}", stage.number()),
        }
    }
}

/// Bytes of model state on one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelStateBytes {
    /// Parameters in the compute dtype (whole, or this rank's shard under ZeRO-3).
    pub params: usize,
    /// Gradients (whole, or this rank's shard from ZeRO-2 on).
    pub grads: usize,
    /// Optimizer state: Adam's moments, plus fp32 master weights when the parameters are not
    /// fp32 themselves.
    pub optimizer: usize,
    /// Optimizer state offloaded to host memory (ZeRO-Offload), not counted in the others.
    pub host: usize,
}

impl ModelStateBytes {
    /// Their sum on the device (offloaded state left out).
    pub fn total(&self) -> usize {
        self.params + self.grads + self.optimizer
    }
}

impl Add for ModelStateBytes {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            params: self.params + other.params,
            grads: self.grads + other.grads,
            optimizer: self.optimizer + other.optimizer,
            host: self.host + other.host,
        }
    }
}

/// Element sizes of a training setup, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Precision {
    /// Of a parameter as the forward uses it.
    pub param: usize,
    /// Of a gradient as reduced and kept.
    pub grad: usize,
}

impl Precision {
    /// Everything fp32.
    pub const F32: Precision = Precision { param: 4, grad: 4 };
    /// bf16 or f16 parameters and gradients, fp32 master weights and moments.
    pub const HALF: Precision = Precision { param: 2, grad: 2 };

    /// Adam's bytes per parameter (K in the paper): the two fp32 moments, plus an fp32 master
    /// copy when the parameters are narrower than fp32.
    pub fn optimizer(&self) -> usize {
        8 + if self.param < 4 { 4 } else { 0 }
    }
}

/// The paper's model-state bytes per rank for `params` parameters on `dp` data-parallel ranks
/// at `stage`: each sharded part is divided by `dp`, the rest is whole.
pub fn estimate(params: u64, dp: usize, stage: ZeroStage, precision: Precision) -> ModelStateBytes {
    let psi = params as f64;
    let part = |bytes: usize, sharded: bool| -> usize {
        let whole = bytes as f64 * psi;
        (if sharded { whole / dp as f64 } else { whole }).round() as usize
    };
    ModelStateBytes {
        params: part(precision.param, stage >= ZeroStage::Parameters),
        grads: part(precision.grad, stage >= ZeroStage::Gradients),
        optimizer: part(precision.optimizer(), stage >= ZeroStage::OptimizerState),
        host: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_papers_mixed_precision_figures() {
        // Section 5.1's example: Ψ = 7.5 B, N = 64: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.
        let gb = |stage| estimate(7_500_000_000, 64, stage, Precision::HALF).total() as f64 / 1e9;
        let figures: Vec<f64> = ZeroStage::ALL.iter().map(|&s| gb(s)).collect();
        let paper = [120.0, 31.4, 16.6, 1.88];
        for (got, want) in figures.iter().zip(paper) {
            assert!((got - want).abs() / want < 0.01, "{figures:?} vs {paper:?}");
        }
    }

    #[test]
    fn fp32_needs_no_master_copy() {
        let e = estimate(1000, 4, ZeroStage::OptimizerState, Precision::F32);
        assert_eq!((e.params, e.grads, e.optimizer), (4000, 4000, 2000));
        let e = estimate(1000, 4, ZeroStage::Parameters, Precision::F32);
        assert_eq!(e.total(), 16 * 1000 / 4);
    }
}
