//! Gradient-ready hooks for burn's autodiff, so gradient communication overlaps backward.
//!
//! burn 0.21 runs backward as a tape ordered by node depth (deepest first) and offers no hook
//! when a parameter's gradient is complete. We add a chain of no-op nodes, one per depth,
//! joined to the loss. Within a depth, burn runs steps in the order its graph walk found them
//! (a stack), and the join lists the chain first so that the walk finds the real graph first:
//! each probe runs right after the real nodes of its depth and calls a hook with the gradients
//! computed so far. A parameter's gradient is complete once backward has passed all the nodes
//! that use it, so the hook can take it and start its bucket's all-reduce while backward goes
//! on below. (Were the order within a depth ever different, a probe would only see a gradient
//! one depth later; the caller also collects everything after backward, so results never
//! depend on it.)

use std::fmt;
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorPrimitive};

/// Called during backward, once per depth of the graph, with the gradients so far.
pub type DepthHook<B> = Arc<dyn Fn(&mut <B as AutodiffBackend>::Gradients) + Send + Sync>;

/// Autodiff backends that can call a hook at every depth of backward.
pub trait BackwardHooks: AutodiffBackend {
    /// `loss`, same value, whose backward calls `hook` after each depth of the graph, from the
    /// deepest to depth 1 (nodes whose inputs are all parameters or data). The hook does not see
    /// the gradients of depth-1 nodes: collect those from backward's result.
    fn with_depth_hooks(loss: Tensor<Self, 1>, hook: DepthHook<Self>) -> Tensor<Self, 1>;

    /// Whether backward of `loss` reaches anything (burn's `is_require_grad` is true only for
    /// leaves).
    fn is_tracked(loss: &Tensor<Self, 1>) -> bool;
}

struct Hook<G>(Arc<dyn Fn(&mut G) + Send + Sync>);

impl<G> Clone for Hook<G> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<G> fmt::Debug for Hook<G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DepthHook")
    }
}

/// A no-op node one deeper than its parent; its backward calls the hook.
#[derive(Debug)]
struct Probe;

impl<B: Backend> Backward<B, 1> for Probe {
    type State = Hook<Gradients>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        (ops.state.0)(grads);
    }
}

/// Joins the probe chain and the loss (in that order: burn's graph walk is a stack, so the
/// loss's graph is walked first and its steps come first within each depth). The loss's
/// gradient passes through; the chain gets none.
#[derive(Debug)]
struct Join;

impl<B: Backend> Backward<B, 2> for Join {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let Some(loss) = &ops.parents[1] {
            grads.register::<B>(loss.id, grad);
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> BackwardHooks for Autodiff<B, C> {
    fn is_tracked(loss: &Tensor<Self, 1>) -> bool {
        !loss
            .clone()
            .into_primitive()
            .tensor()
            .node
            .requirement
            .is_none()
    }

    fn with_depth_hooks(loss: Tensor<Self, 1>, hook: DepthHook<Self>) -> Tensor<Self, 1> {
        let device = loss.device();
        let loss = loss.into_primitive().tensor();
        let depth = loss.node.order;
        let mut chain = Tensor::<Self, 1>::zeros([1], &device)
            .require_grad()
            .into_primitive()
            .tensor();
        // Probes at depths 1 ..= depth - 1: one per depth below the loss.
        for _ in 1..depth {
            let value = chain.primitive.clone();
            chain = match Probe
                .prepare::<C>([chain.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(Hook(hook.clone()), value),
                OpsKind::UnTracked(prep) => prep.finish(value),
            };
        }
        let value = loss.primitive.clone();
        let joined = match Join
            .prepare::<C>([chain.node.clone(), loss.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), value),
            OpsKind::UnTracked(prep) => prep.finish(value),
        };
        Tensor::from_primitive(TensorPrimitive::Float(joined))
    }
}
