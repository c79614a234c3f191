//! The SwiGLU MLP of Llama, `down(silu(gate(x)) * up(x))`, with its hidden features split over
//! the group: gate and up are column-parallel, down is row-parallel, and the element-wise
//! product in between needs no communication.

use burn::module::Module;
use burn::tensor::Tensor;
use burn::tensor::activation::silu;
use burn::tensor::backend::Backend;
use burn_comm::parallel::CommBackend;

use crate::{ColumnParallelLinear, RowParallelLinear, TensorParallel, TpError};

/// SwiGLU with its intermediate features split over the group.
#[derive(Module, Debug)]
pub struct ParallelSwiGlu<B: Backend> {
    /// `[hidden, intermediate / tp]`.
    pub gate_proj: ColumnParallelLinear<B>,
    /// `[hidden, intermediate / tp]`.
    pub up_proj: ColumnParallelLinear<B>,
    /// `[intermediate / tp, hidden]`.
    pub down_proj: RowParallelLinear<B>,
    #[module(skip)]
    tp: TensorParallel,
}

impl<B: CommBackend> ParallelSwiGlu<B> {
    /// This rank's part of the full `gate` and `up` (`[hidden, intermediate]`) and `down`
    /// (`[intermediate, hidden]`).
    pub fn from_full(
        gate: Tensor<B, 2>,
        up: Tensor<B, 2>,
        down: Tensor<B, 2>,
        tp: &TensorParallel,
    ) -> Result<Self, TpError> {
        tp.check_divides("the intermediate size of the MLP", gate.dims()[1])?;
        Ok(Self {
            gate_proj: ColumnParallelLinear::from_full(gate, None, tp, false)?,
            up_proj: ColumnParallelLinear::from_full(up, None, tp, false)?,
            down_proj: RowParallelLinear::from_full(down, None, tp, true)?,
            tp: tp.clone(),
        })
    }

    /// `[batch, seq, hidden]` (under SP, this rank's part of the sequence) to the same shape.
    pub fn forward(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>, TpError> {
        let [gate, up] = ColumnParallelLinear::forward_many([&self.gate_proj, &self.up_proj], x)?;
        self.down_proj.forward(silu(gate) * up)
    }

    /// The full `gate`, `up` and `down`, gathered from the group (a collective).
    pub fn full(&self) -> Result<[Tensor<B, 2>; 3], TpError> {
        Ok([
            self.gate_proj.full()?.0,
            self.up_proj.full()?.0,
            self.down_proj.full()?.0,
        ])
    }
}
