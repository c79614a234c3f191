//! What a rank asks of its group: used to check that every rank asks the same thing, and to
//! name the call in errors.

use std::fmt;

use burn::tensor::DType;

/// How values from the ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum, in rank order.
    Sum,
    /// Element-wise sum in rank order, divided by the group size (floating point only).
    Avg,
    /// Element-wise maximum (NaN wins).
    Max,
    /// Element-wise minimum (NaN wins).
    Min,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        };
        f.write_str(name)
    }
}

/// The operation of a collective call, with the arguments every rank must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    AllReduce(ReduceOp),
    AllGather { dim: usize },
    ReduceScatter { op: ReduceOp, dim: usize },
    Broadcast { root: usize },
    AllToAll { split_dim: usize, concat_dim: usize },
    Barrier,
    Split,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::AllReduce(op) => write!(f, "all_reduce({op})"),
            Op::AllGather { dim } => write!(f, "all_gather(dim {dim})"),
            Op::ReduceScatter { op, dim } => write!(f, "reduce_scatter({op}, dim {dim})"),
            Op::Broadcast { root } => write!(f, "broadcast(root {root})"),
            Op::AllToAll {
                split_dim,
                concat_dim,
            } => write!(
                f,
                "all_to_all(split dim {split_dim}, concat dim {concat_dim})"
            ),
            Op::Barrier => f.write_str("barrier"),
            Op::Split => f.write_str("split"),
        }
    }
}

/// One rank's call: the operation and the tensor it brings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Call {
    pub op: Op,
    pub dtype: Option<DType>,
    pub shape: Vec<usize>,
}

impl Call {
    pub fn new(op: Op, dtype: DType, shape: &[usize]) -> Self {
        Self {
            op,
            dtype: Some(dtype),
            shape: shape.to_vec(),
        }
    }

    /// A call that carries no tensor (barrier, split).
    pub fn bare(op: Op) -> Self {
        Self {
            op,
            dtype: None,
            shape: Vec::new(),
        }
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.dtype {
            Some(dtype) => write!(f, "{} on {:?} {:?}", self.op, dtype, self.shape),
            None => write!(f, "{}", self.op),
        }
    }
}
