//! Megatron's two linear layers. A column-parallel linear splits the output features, so each
//! rank computes its own columns from the whole input; a row-parallel linear splits the input
//! features, so each rank computes a partial sum of the whole output and the group adds them.
//! A column-parallel layer followed by a row-parallel one (attention's projections, the MLP)
//! needs no communication in between.
//!
//! Weights are `[in, out]`, as `x.matmul(w)` wants.

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_comm::Communicator;
pub use burn_comm::parallel::matmul;
use burn_comm::parallel::{
    CommBackend, copy_to_parallel_region, gather_from_parallel_region, scatter_to_parallel_region,
};

use crate::{TensorParallel, TpError};

/// `x + b`, `b` broadcast over every dimension but the last.
fn add_bias<B: Backend, const D: usize>(x: Tensor<B, D>, bias: Tensor<B, 1>) -> Tensor<B, D> {
    let mut shape = [1; D];
    shape[D - 1] = bias.dims()[0];
    x + bias.reshape(shape)
}

/// A linear layer whose output features are split over the group: rank `r` holds columns
/// `r * out/tp .. (r+1) * out/tp` of the weight (and of the bias).
///
/// The input must be entered into the parallel region ([`TensorParallel::enter`]), which
/// [`forward`](Self::forward) does; several column-parallel layers that share one input go
/// through [`forward_many`](Self::forward_many), which enters it once (and keeps the overlap
/// of communication when the group has it, where `enter` then
/// [`forward_entered`](Self::forward_entered) would not).
#[derive(Module, Debug)]
pub struct ColumnParallelLinear<B: Backend> {
    /// This rank's columns, `[in, out / tp]`.
    pub weight: Param<Tensor<B, 2>>,
    /// This rank's part of the bias, `[out / tp]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// All-gather the output features, so every rank gets all of them.
    pub gather_output: bool,
    /// How many ranks hold the same columns (1 unless built by
    /// [`from_full_replicated`](Self::from_full_replicated)).
    pub replication: usize,
    #[module(skip)]
    tp: TensorParallel,
    /// The ranks that hold the same columns as this one, when there are several: their
    /// gradients are summed.
    #[module(skip)]
    replicas: Option<Communicator>,
}

impl<B: CommBackend> ColumnParallelLinear<B> {
    /// This rank's columns of `weight` (`[in, out]`) and `bias` (`[out]`). `gather_output` is
    /// refused under sequence parallelism, where what leaves a parallel region is split by
    /// sequence, not gathered.
    pub fn from_full(
        weight: Tensor<B, 2>,
        bias: Option<Tensor<B, 1>>,
        tp: &TensorParallel,
        gather_output: bool,
    ) -> Result<Self, TpError> {
        if gather_output && tp.sequence_parallel() {
            return Err(TpError::Config(
                "a column-parallel linear cannot gather its output under sequence parallelism; follow it with a row-parallel linear, or gather the sequence yourself".into(),
            ));
        }
        tp.check_divides(
            "the output features of a column-parallel linear",
            weight.dims()[1],
        )?;
        // One block per rank: nothing is shared.
        let layer = Self::from_full_replicated(weight, bias, tp, tp.size())?;
        Ok(Self {
            gather_output,
            ..layer
        })
    }

    /// Splits the output features into `blocks` parts, a divisor of the group's ranks, and
    /// gives each part to `tp / blocks` neighbouring ranks, whose gradients are then summed.
    /// This is how grouped-query attention shares its key/value heads when there are fewer of
    /// them than ranks. A collective when `blocks < tp`: every rank of the group calls it.
    pub fn from_full_replicated(
        weight: Tensor<B, 2>,
        bias: Option<Tensor<B, 1>>,
        tp: &TensorParallel,
        blocks: usize,
    ) -> Result<Self, TpError> {
        let weight = tp.block_of(weight, 1, blocks)?;
        let replication = tp.size() / blocks;
        let replicas = match replication {
            1 => None,
            _ => Some(tp.replica_group(blocks)?),
        };
        Ok(Self {
            weight: Param::from_tensor(weight),
            bias: bias
                .map(|b| Ok::<_, TpError>(Param::from_tensor(tp.block_of(b, 0, blocks)?)))
                .transpose()?,
            gather_output: false,
            replication,
            tp: tp.clone(),
            replicas,
        })
    }

    /// `enter(x) @ weight (+ bias)`: enters the parallel region, as one collective matmul when
    /// the group overlaps communication; all-gathers the features when `gather_output`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, TpError> {
        let y = self.tp.enter_matmul(x, self.shared(self.weight.val())?)?;
        self.finish(y)
    }

    /// `x @ weight (+ bias)` for an input already in the parallel region; all-gathers the
    /// features when `gather_output`.
    pub fn forward_entered<const D: usize>(
        &self,
        x: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, TpError> {
        self.finish(matmul(x, self.shared(self.weight.val())?))
    }

    /// Several column-parallel layers of one group on one input (attention's q, k and v, the
    /// MLP's gate and up): the input enters the region once. When the group overlaps
    /// communication, their weights are joined so that one collective matmul serves them all.
    pub fn forward_many<const D: usize, const N: usize>(
        layers: [&Self; N],
        x: Tensor<B, D>,
    ) -> Result<[Tensor<B, D>; N], TpError> {
        let Some(tp) = layers.first().map(|layer| &layer.tp) else {
            return Ok(std::array::from_fn(|_| unreachable!("no layers")));
        };
        debug_assert!(
            layers
                .iter()
                .all(|layer| layer.tp.comm().group_name() == tp.comm().group_name()),
            "forward_many takes layers of one tensor-parallel group"
        );
        let weights = layers
            .iter()
            .map(|layer| layer.shared(layer.weight.val()))
            .collect::<Result<Vec<_>, _>>()?;
        let weights: [Tensor<B, 2>; N] = weights
            .try_into()
            .unwrap_or_else(|_| unreachable!("one weight per layer"));
        let outputs = tp
            .enter_matmul_many(x, weights)?
            .into_iter()
            .zip(layers)
            .map(|(y, layer)| layer.finish(y))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(outputs
            .try_into()
            .unwrap_or_else(|_| unreachable!("one output per layer")))
    }

    /// Adds the bias to this rank's columns, and all-gathers them when `gather_output`.
    fn finish<const D: usize>(&self, mut y: Tensor<B, D>) -> Result<Tensor<B, D>, TpError> {
        if let Some(bias) = &self.bias {
            y = add_bias(y, self.shared(bias.val())?);
        }
        if self.gather_output {
            y = gather_from_parallel_region(y, self.tp.comm(), D - 1)?;
        }
        Ok(y)
    }

    /// A weight as the computation sees it: the gradient is summed over the replicas.
    fn shared<const D: usize>(&self, w: Tensor<B, D>) -> Result<Tensor<B, D>, TpError> {
        Ok(match &self.replicas {
            Some(replicas) => copy_to_parallel_region(w, replicas)?,
            None => w,
        })
    }

    /// The full weight `[in, out]` and bias, gathered from the group (a collective).
    pub fn full(&self) -> Result<(Tensor<B, 2>, Option<Tensor<B, 1>>), TpError> {
        let blocks = self.tp.size() / self.replication;
        let weight = self
            .tp
            .gather_blocks(self.weight.val().detach(), 1, blocks)?;
        let bias = match &self.bias {
            Some(b) => Some(self.tp.gather_blocks(b.val().detach(), 0, blocks)?),
            None => None,
        };
        Ok((weight, bias))
    }
}

/// A linear layer whose input features are split over the group: rank `r` holds rows
/// `r * in/tp .. (r+1) * in/tp` of the weight, multiplies its part of the input, and the group
/// sums the results ([`TensorParallel::exit`]: all-reduce, or reduce-scatter under SP). The
/// bias is held in full and added once, after the sum.
#[derive(Module, Debug)]
pub struct RowParallelLinear<B: Backend> {
    /// This rank's rows, `[in / tp, out]`.
    pub weight: Param<Tensor<B, 2>>,
    /// The whole bias, `[out]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// The input is already split over the group (it comes from a column-parallel layer);
    /// otherwise each rank takes its own part of a full input.
    pub input_is_parallel: bool,
    #[module(skip)]
    tp: TensorParallel,
}

impl<B: CommBackend> RowParallelLinear<B> {
    /// This rank's rows of `weight` (`[in, out]`), and the whole `bias`. Under sequence
    /// parallelism the input must come already split by features (`input_is_parallel`): a
    /// full input there is split by sequence.
    pub fn from_full(
        weight: Tensor<B, 2>,
        bias: Option<Tensor<B, 1>>,
        tp: &TensorParallel,
        input_is_parallel: bool,
    ) -> Result<Self, TpError> {
        if !input_is_parallel && tp.sequence_parallel() {
            return Err(TpError::Config(
                "under sequence parallelism a row-parallel linear takes the output of a column-parallel one (input_is_parallel); a full input there is split by sequence".into(),
            ));
        }
        tp.check_divides(
            "the input features of a row-parallel linear",
            weight.dims()[0],
        )?;
        Ok(Self {
            weight: Param::from_tensor(tp.block_of(weight, 0, tp.size())?),
            bias: bias
                .map(|b| Ok::<_, TpError>(Param::from_tensor(tp.block_of(b, 0, 1)?)))
                .transpose()?,
            input_is_parallel,
            tp: tp.clone(),
        })
    }

    /// `x @ weight`, summed over the group (one collective matmul when the group overlaps
    /// communication), `+ bias`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Result<Tensor<B, D>, TpError> {
        let x = if self.input_is_parallel {
            x
        } else {
            scatter_to_parallel_region(x, self.tp.comm(), D - 1)?
        };
        let y = self.tp.matmul_exit(x, self.weight.val())?;
        Ok(match &self.bias {
            Some(bias) => add_bias(y, self.tp.replicated(bias.val())?),
            None => y,
        })
    }

    /// The full weight `[in, out]` and bias, gathered from the group (a collective).
    pub fn full(&self) -> Result<(Tensor<B, 2>, Option<Tensor<B, 1>>), TpError> {
        let weight = self
            .tp
            .gather_blocks(self.weight.val().detach(), 0, self.tp.size())?;
        Ok((weight, self.bias.as_ref().map(|b| b.val().detach())))
    }
}
