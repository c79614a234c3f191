//! A Mixture-of-Experts feed-forward layer, usable where a SwiGLU MLP is: a router over `E`
//! experts, each a SwiGLU, of which this rank holds its expert-parallel share. The router's
//! weight is held whole by every rank; each expert's weights by its rank alone.

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
    /// `[local experts, hidden, intermediate]`.
    pub gate: Param<Tensor<B, 3>>,
    /// `[local experts, hidden, intermediate]`.
    pub up: Param<Tensor<B, 3>>,
    /// `[local experts, intermediate, hidden]`.
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

impl<B: CommBackend> Moe<B> {
    /// This rank's layer from the whole one: the router, and every expert's `gate`, `up`
    /// (`[experts, hidden, intermediate]`) and `down` (`[experts, intermediate, hidden]`), of
    /// which it keeps its experts.
    pub fn from_full(
        router: Tensor<B, 2>,
        [gate, up, down]: [Tensor<B, 3>; 3],
        config: RouterConfig,
        ep: ExpertParallel,
    ) -> Result<Self, MoeError> {
        config.validate()?;
        let [hidden, experts] = router.dims();
        let [e, h, f] = gate.dims();
        if experts != config.experts
            || ep.experts() != experts
            || [e, h] != [experts, hidden]
            || up.dims() != [e, h, f]
            || down.dims() != [e, f, h]
        {
            return Err(MoeError::Config(format!(
                "a router {:?} and experts gate {:?}, up {:?}, down {:?} do not make one layer of {} experts ({} split)",
                router.dims(),
                gate.dims(),
                up.dims(),
                down.dims(),
                config.experts,
                ep.experts()
            )));
        }
        let mine = ep.local_experts();
        let local = |w: Tensor<B, 3>| Param::from_tensor(w.narrow(0, mine.start, mine.len()));
        Ok(Self {
            router: Param::from_tensor(router),
            gate: local(gate),
            up: local(up),
            down: local(down),
            config,
            ep,
            dispatch: Dispatch::Unpadded,
        })
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

    /// `x` `[tokens, hidden]` through the router and the experts it picks. `batch` is the group
    /// the batch is spread over, if it is (for the load-balancing loss; see [`route`]).
    pub fn forward(
        &self,
        x: Tensor<B, 2>,
        batch: Option<&Communicator>,
    ) -> Result<MoeOutput<B>, MoeError> {
        let dtype = x.dtype();
        let logits = x.clone().matmul(self.router.val());
        let routed = route(logits, &self.config, batch)?;
        let mut routing = routed.routing;
        routing.weights = routing.weights.cast(dtype);
        let capacity = self.config.capacity(x.dims()[0]);
        let (output, stats) =
            dispatch_combine(x, &routing, &self.ep, capacity, self.dispatch, |j, rows| {
                Ok(self.expert(j, rows))
            })?;
        Ok(MoeOutput {
            output,
            aux_loss: routed.aux_loss,
            z_loss: routed.z_loss,
            stats,
        })
    }

    /// Local expert `j` on `rows` `[n, hidden]`: `down(silu(gate(x)) * up(x))`.
    fn expert(&self, j: usize, rows: Tensor<B, 2>) -> Tensor<B, 2> {
        let weight = |w: &Param<Tensor<B, 3>>| {
            let [_, a, b] = w.dims();
            w.val().narrow(0, j, 1).reshape([a, b])
        };
        let gate = rows.clone().matmul(weight(&self.gate));
        let up = rows.matmul(weight(&self.up));
        (silu(gate) * up).matmul(weight(&self.down))
    }
}
