//! A Mixture-of-Experts feed-forward layer, usable where a SwiGLU MLP is: a router over `E`
//! experts, each a SwiGLU, of which this rank holds its expert-parallel share. The router's
//! weight is held whole by every rank; each expert's weights by its rank alone, or, under
//! expert tensor parallelism, a slice of them by each of the ranks splitting it.

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::activation::silu;
use burn::tensor::backend::Backend;
use burn_comm::Communicator;
use burn_comm::parallel::CommBackend;

use crate::{
    Dispatch, DispatchStats, ExpertParallel, MoeError, RouterConfig, dispatch_combine, route,
};

/// The layer: the router `[hidden, experts]` and this rank's experts, stacked.
#[derive(Module, Debug)]
pub struct Moe<B: Backend> {
    /// `[hidden, experts]`, on every rank.
    pub router: Param<Tensor<B, 2>>,
    /// `[local experts, hidden, intermediate / etp]` (column-parallel over the `etp` ranks
    /// splitting each expert, if any).
    pub gate: Param<Tensor<B, 3>>,
    /// `[local experts, hidden, intermediate / etp]` (column-parallel).
    pub up: Param<Tensor<B, 3>>,
    /// `[local experts, intermediate / etp, hidden]` (row-parallel).
    pub down: Param<Tensor<B, 3>>,
    #[module(skip)]
    config: RouterConfig,
    #[module(skip)]
    ep: ExpertParallel,
    #[module(skip)]
    dispatch: Dispatch,
}

/// What a forward gives: the output and what the loss and the metrics add.
#[derive(Debug, Clone)]
pub struct MoeOutput<B: Backend> {
    /// `[tokens, hidden]`.
    pub output: Tensor<B, 2>,
    /// The load-balancing loss, weighted (see [`crate::router`]).
    pub aux_loss: Tensor<B, 1>,
    /// The router z-loss, weighted.
    pub z_loss: Tensor<B, 1>,
    /// Copies per expert and dropped copies of this rank's tokens.
    pub stats: DispatchStats,
}

impl<B: Backend> Moe<B> {
    /// The layer holding these weights: the router `[hidden, experts]` and local experts'
    /// `gate`, `up` (`[local, hidden, intermediate / etp]`) and `down` (`[local, intermediate /
    /// etp, hidden]`), `etp` the ranks each expert is split over. Every expert is on this rank
    /// until [`with_expert_parallel`](Self::with_expert_parallel) says how they are split;
    /// the shapes are checked there, and at each forward against the split it is given.
    pub fn from_parts(
        router: Param<Tensor<B, 2>>,
        [gate, up, down]: [Param<Tensor<B, 3>>; 3],
        config: RouterConfig,
    ) -> Self {
        Self {
            ep: ExpertParallel::unsplit(config.experts),
            router,
            gate,
            up,
            down,
            config,
            dispatch: Dispatch::Unpadded,
        }
    }

    /// The layer with its experts split as `ep` says; the weights it holds must be this
    /// rank's share of them (a layer built whole and cut by a plan, then given its groups).
    pub fn with_expert_parallel(mut self, ep: ExpertParallel) -> Result<Self, MoeError> {
        self.check_share(&ep)?;
        self.ep = ep;
        Ok(self)
    }

    /// Fails unless the weights held are this rank's share of the layer split as `ep` says.
    fn check_share(&self, ep: &ExpertParallel) -> Result<(), MoeError> {
        self.config.validate()?;
        let [hidden, experts] = self.router.dims();
        let [local, h, f] = self.gate.dims();
        if experts != self.config.experts
            || ep.experts() != experts
            || [local, h] != [ep.local_count(), hidden]
            || self.up.dims() != [local, h, f]
            || self.down.dims() != [local, f, h]
        {
            return Err(MoeError::Config(format!(
                "a router {:?} and local experts gate {:?}, up {:?}, down {:?} are not one rank's share of a layer of {} experts split over {} rank(s) ({} each)",
                self.router.dims(),
                self.gate.dims(),
                self.up.dims(),
                self.down.dims(),
                self.config.experts,
                ep.size(),
                ep.local_count(),
            )));
        }
        Ok(())
    }

    /// Sends the rows padded to the capacity (an equal all-to-all) instead of exactly. The
    /// capacity comes from a rank's token count, so every rank must then hold as many tokens
    /// (and the router a capacity factor).
    pub fn with_dispatch(mut self, dispatch: Dispatch) -> Self {
        self.dispatch = dispatch;
        self
    }

    /// The router's settings.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// How the experts are split.
    pub fn expert_parallel(&self) -> &ExpertParallel {
        &self.ep
    }
}

impl<B: CommBackend> Moe<B> {
    /// This rank's layer from the whole one: the router, and every expert's `gate`, `up`
    /// (`[experts, hidden, intermediate]`) and `down` (`[experts, intermediate, hidden]`), of
    /// which it keeps its experts (and, under expert tensor parallelism, its slice of each).
    pub fn from_full(
        router: Tensor<B, 2>,
        [gate, up, down]: [Tensor<B, 3>; 3],
        config: RouterConfig,
        ep: ExpertParallel,
    ) -> Result<Self, MoeError> {
        let [hidden, experts] = router.dims();
        let [e, h, f] = gate.dims();
        let (tp, tp_rank) = (ep.tensor_parallel_size(), ep.tensor_parallel_rank());
        if experts != config.experts
            || ep.experts() != experts
            || [e, h] != [experts, hidden]
            || up.dims() != [e, h, f]
            || down.dims() != [e, f, h]
            || !f.is_multiple_of(tp)
        {
            return Err(MoeError::Config(format!(
                "a router {:?} and experts gate {:?}, up {:?}, down {:?} do not make one layer of {} experts ({} split over {} rank(s), each expert over {tp})",
                router.dims(),
                gate.dims(),
                up.dims(),
                down.dims(),
                config.experts,
                ep.experts(),
                ep.size(),
            )));
        }
        let mine = ep.local_experts();
        let slice = f / tp;
        let features = tp_rank * slice..(tp_rank + 1) * slice;
        let local = |w: Tensor<B, 3>, dim: usize| {
            w.narrow(0, mine.start, mine.len())
                .narrow(dim, features.start, features.len())
        };
        Self::from_parts(
            Param::from_tensor(router),
            [local(gate, 2), local(up, 2), local(down, 1)].map(Param::from_tensor),
            config,
        )
        .with_expert_parallel(ep)
    }

    /// `x` `[tokens, hidden]` through the router and the experts it picks. `batch` is the group
    /// the batch is spread over, if it is (for the load-balancing loss; see [`route`]).
    pub fn forward(
        &self,
        x: Tensor<B, 2>,
        batch: Option<&Communicator>,
    ) -> Result<MoeOutput<B>, MoeError> {
        self.forward_in(x, &self.ep, batch)
    }

    /// [`forward`](Self::forward) with the experts split as `ep` says (a model that keeps its
    /// groups apart from its weights, as a plan does), which the weights must match.
    pub fn forward_in(
        &self,
        x: Tensor<B, 2>,
        ep: &ExpertParallel,
        batch: Option<&Communicator>,
    ) -> Result<MoeOutput<B>, MoeError> {
        self.check_share(ep)?;
        let dtype = x.dtype();
        let logits = x.clone().matmul(self.router.val());
        let routed = route(logits, &self.config, batch)?;
        let mut routing = routed.routing;
        routing.weights = routing.weights.cast(dtype);
        let capacity = self.config.capacity(x.dims()[0]);
        // An expert given no rows runs on none: burn's autodiff loses the gradient of an
        // empty tensor through `select` and `cat`, so its weights are tied into the balancing
        // loss instead (adding zero), and always get their gradient, zero.
        let mut idle = Vec::new();
        let (output, stats) =
            dispatch_combine(x, &routing, ep, capacity, self.dispatch, |j, rows| {
                if rows.dims()[0] == 0 {
                    idle.push(self.weights_zero(j));
                    return Ok(rows);
                }
                Ok(self.expert(j, rows))
            })?;
        let aux_loss = match idle.into_iter().reduce(|a, b| a + b) {
            Some(idle) => {
                let dtype = routed.aux_loss.dtype();
                routed.aux_loss + idle.cast(dtype)
            }
            None => routed.aux_loss,
        };
        Ok(MoeOutput {
            output,
            aux_loss,
            z_loss: routed.z_loss,
            stats,
        })
    }

    /// Local expert `j` on `rows` `[n, hidden]`, `n` at least 1: `down(silu(gate(x)) * up(x))`.
    /// The matmuls take the expert's weights as a `[1, .., ..]` view of the stack: reshaped to
    /// a matrix, burn would copy them, and its autodiff keep the copies until backward.
    fn expert(&self, j: usize, rows: Tensor<B, 2>) -> Tensor<B, 2> {
        let [n, hidden] = rows.dims();
        let rows = rows.unsqueeze::<3>();
        let gate = rows.clone().matmul(self.weights(&self.gate, j));
        let up = rows.matmul(self.weights(&self.up, j));
        (silu(gate) * up)
            .matmul(self.weights(&self.down, j))
            .reshape([n, hidden])
    }

    /// Local expert `j`'s matrix of the stack `w`, `[1, .., ..]` (a view).
    fn weights(&self, w: &Param<Tensor<B, 3>>, j: usize) -> Tensor<B, 3> {
        w.val().narrow(0, j, 1)
    }

    /// Zero, `[1]`, as the sum of every weight of local expert `j` times zero: its weights in
    /// the graph (kept by nothing but their shapes), their gradient zero. Multiplied before
    /// summing, so no 16-bit sum can overflow.
    fn weights_zero(&self, j: usize) -> Tensor<B, 1> {
        [&self.gate, &self.up, &self.down]
            .map(|w| (self.weights(w, j) * 0.0).sum())
            .into_iter()
            .reduce(|a, b| a + b)
            .expect("three matrices")
    }
}
