//! [`KernelBackend`]: the fused operations that take part in training, with their backward
//! written by hand on `Autodiff` (burn's backend-extension pattern). Below `Autodiff` each runs
//! as a kernel where the backend's tensors are a cubecl runtime's own (`CubeBackend`, not
//! `Fusion`) and the build has that runtime, and as plain burn everywhere else, so
//! implementing the trait takes no code.

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArrayTensor, QuantElement, SharedArray,
};
use burn::backend::{Flex, NdArray};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorPrimitive};

use crate::cross_entropy::{row_stats, row_stats_backward};

/// One rank's part of a vocabulary-parallel cross-entropy, per row of its logits `[n, part]`.
#[derive(Debug, Clone)]
pub struct CrossEntropyStats<B: Backend> {
    /// The row's largest logit `[n]`. It carries no gradient: it is taken out for stability.
    pub max: Tensor<B, 1>,
    /// `[n, 2]`: the row's `sum_j exp(logit_j - max)`, and its target's logit (0 where another
    /// rank holds the target). Differentiable, with `max` held constant, which is exact for
    /// any use that does not change with the shift, as the cross-entropy does not.
    pub sums: Tensor<B, 2>,
}

/// A backend on which the fused operations run and, on `Autodiff`, differentiate.
pub trait KernelBackend: Backend {
    /// The cross-entropy statistics of `logits` (`[n, part]`, fp32), with `targets` the
    /// target's column in this part or -1 where it lies in another rank's (see
    /// [`row_stats`]): one read of the logits forward, one write of their gradient backward.
    fn cross_entropy_stats(
        logits: Tensor<Self, 2>,
        targets: Tensor<Self, 1, Int>,
    ) -> CrossEntropyStats<Self> {
        let stats = row_stats(logits, targets);
        CrossEntropyStats {
            max: stats.max,
            sums: Tensor::stack(vec![stats.sum_exp, stats.target], 1),
        }
    }
}

impl KernelBackend for Flex {}

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> KernelBackend
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>>,
    NdArrayTensor: From<SharedArray<I>>,
{
}

/// The cubecl backends, with and without burn's fusion.
#[cfg(feature = "cubecl")]
mod cubecl_backends {
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_fusion::{Fusion, FusionBackend};

    use super::KernelBackend;

    impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> KernelBackend
        for CubeBackend<R, F, I, BT>
    {
    }

    impl<B: FusionBackend> KernelBackend for Fusion<B> {}
}

/// The backward of [`KernelBackend::cross_entropy_stats`].
#[derive(Debug)]
struct CrossEntropyStatsBackward;

impl<B: Backend> Backward<B, 1> for CrossEntropyStatsBackward {
    /// The logits' node, then the row maxima and the targets.
    type State = (NodeId, FloatTensor<B>, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, saved: &mut Checkpointer) {
        let (logits, max, targets) = ops.state;
        let logits = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(
            saved.retrieve_node_output(logits),
        ));
        let max = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(max));
        let targets = Tensor::<B, 1, Int>::from_primitive(targets);
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let grad = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(grad));
            row_stats_backward(logits, max, targets, grad)
                .into_primitive()
                .tensor()
        });
    }
}

impl<B: KernelBackend, C: CheckpointStrategy> KernelBackend for Autodiff<B, C> {
    fn cross_entropy_stats(
        logits: Tensor<Self, 2>,
        targets: Tensor<Self, 1, Int>,
    ) -> CrossEntropyStats<Self> {
        let logits = logits.into_primitive().tensor();
        let inner =
            Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(logits.primitive.clone()));
        // Autodiff's int tensors are its inner backend's.
        let targets = Tensor::<B, 1, Int>::from_primitive(targets.into_primitive());
        let stats = B::cross_entropy_stats(inner, targets.clone());
        let max = stats.max.into_primitive().tensor();
        let sums = stats.sums.into_primitive().tensor();
        let sums = match CrossEntropyStatsBackward
            .prepare::<C>([logits.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = (
                    prep.checkpoint(&logits),
                    max.clone(),
                    targets.into_primitive(),
                );
                prep.finish(state, sums)
            }
            OpsKind::UnTracked(prep) => prep.finish(sums),
        };
        CrossEntropyStats {
            max: Tensor::from_primitive(TensorPrimitive::Float(
                <Self as AutodiffBackend>::from_inner(max),
            )),
            sums: Tensor::from_primitive(TensorPrimitive::Float(sums)),
        }
    }
}
