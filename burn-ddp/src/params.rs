//! A module's float parameters as a flat list: names, shapes, and the closures that read their
//! gradients out of burn's containers and put averaged ones back. Public for the strategies
//! built on data parallelism (burn-zero shards the same list).

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_comm::{CommError, Communicator};

use crate::experts::ExpertGroup;

type Inner<B> = <B as AutodiffBackend>::InnerBackend;
/// Takes a parameter's gradient out of a backward result, flattened.
pub type Take<B> = Box<
    dyn Fn(&mut <B as AutodiffBackend>::Gradients) -> Option<Tensor<Inner<B>, 1>> + Send + Sync,
>;
/// Takes a parameter's gradient out of gradients gathered by id (an optimizer's input),
/// flattened.
pub type TakeParam<B> =
    Box<dyn Fn(&mut GradientsParams) -> Option<Tensor<Inner<B>, 1>> + Send + Sync>;
/// Registers a flat gradient for a parameter, in the parameter's own shape.
pub type Put<B> = Box<dyn Fn(&mut GradientsParams, Tensor<Inner<B>, 1>) + Send + Sync>;

/// One float parameter of a module, in the module's visiting order.
pub struct ParamSlot<B: AutodiffBackend> {
    /// The parameter's path in the module, such as `layers.0.mlp.up_proj.weight`.
    pub name: String,
    /// The parameter's id, which its gradients are keyed by.
    pub id: ParamId,
    /// Frozen parameters (`require_grad` off) are kept equal but get no gradient.
    pub require_grad: bool,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Number of elements.
    pub numel: usize,
    /// Element type.
    pub dtype: DType,
    /// Where the parameter lives.
    pub device: burn::tensor::Device<Inner<B>>,
    /// The parameter's value, flattened.
    pub value: Tensor<Inner<B>, 1>,
    /// Removes this parameter's gradient from a backward result, flattened.
    pub take: Take<B>,
    /// Removes this parameter's gradient from gradients gathered by id, flattened.
    pub take_param: TakeParam<B>,
    /// Registers a flat gradient for this parameter, in its own shape.
    pub put: Put<B>,
}

impl<B: AutodiffBackend> ParamSlot<B> {
    /// Size of the parameter's value.
    pub fn bytes(&self) -> usize {
        self.numel * self.dtype.size()
    }
}

/// The float parameters of `module`, in visiting order.
pub fn slots<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> Vec<ParamSlot<B>> {
    let mut collector = Collector { slots: Vec::new() };
    visit_params(module, &mut collector);
    collector.slots
}

/// Sees each float parameter of a module with its path, as burn's visitors name the modules
/// on the way to it (`layers.3.mlp.up_proj`).
pub trait ParamVisitor<B: Backend> {
    fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>);
}

/// Shows `visitor` every float parameter of `module`, in visiting order, with its path.
pub fn visit_params<B: Backend, M: Module<B>, V: ParamVisitor<B>>(module: &M, visitor: &mut V) {
    struct Paths<'v, V> {
        path: Vec<String>,
        visitor: &'v mut V,
    }
    impl<B: Backend, V: ParamVisitor<B>> ModuleVisitor<B> for Paths<'_, V> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }

        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }

        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.visitor.visit(&self.path.join("."), param);
        }
    }
    module.visit(&mut Paths {
        path: Vec::new(),
        visitor,
    });
}

/// The float parameters of `module` that are trained, in visiting order.
pub fn trainable<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> Vec<ParamSlot<B>> {
    slots(module)
        .into_iter()
        .filter(|s| s.require_grad)
        .collect()
}

/// Every rank's `codes` (one per parameter): `result[i][r]` is rank `r`'s code for parameter
/// `i`. One all-gather, so every rank decides the same thing from the same numbers.
pub fn gather_codes<B: Backend>(
    comm: &Communicator,
    codes: &[i32],
    device: &burn::tensor::Device<B>,
) -> Result<Vec<Vec<i32>>, CommError> {
    let n = codes.len();
    let codes: Vec<i64> = codes.iter().map(|&c| c as i64).collect();
    let all = from_ints(comm.all_gather(to_ints::<B>(&codes, device), 0)?);
    Ok((0..n)
        .map(|i| (0..comm.size()).map(|r| all[r * n + i] as i32).collect())
        .collect())
}

/// Small integers (shapes, orders, flags) as a tensor, to pass them through a collective.
pub fn to_ints<B: Backend>(values: &[i64], device: &burn::tensor::Device<B>) -> Tensor<B, 1, Int> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

/// The values of a tensor made by [`to_ints`], after its trip.
pub fn from_ints<B: Backend>(tensor: Tensor<B, 1, Int>) -> Vec<i64> {
    tensor
        .into_data()
        .convert::<i64>()
        .to_vec()
        .expect("an int tensor converts to i64")
}

/// Indices of consecutive runs of one dtype in `slots`.
pub fn dtype_runs<B: AutodiffBackend>(slots: &[&ParamSlot<B>]) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let mut start = 0;
    for i in 1..=slots.len() {
        if i == slots.len() || slots[i].dtype != slots[start].dtype {
            runs.push(start..i);
            start = i;
        }
    }
    runs
}

struct Collector<B: AutodiffBackend> {
    slots: Vec<ParamSlot<B>>,
}

impl<B: AutodiffBackend> ParamVisitor<B> for Collector<B> {
    fn visit<const D: usize>(&mut self, path: &str, param: &Param<Tensor<B, D>>) {
        let tensor = param.val();
        let shape = tensor.dims();
        let numel = shape.iter().product();
        let id: ParamId = param.id;
        let inner = tensor.clone().inner();
        self.slots.push(ParamSlot {
            name: path.to_string(),
            id,
            require_grad: tensor.is_require_grad(),
            shape: shape.to_vec(),
            numel,
            dtype: inner.dtype(),
            device: inner.device(),
            value: inner.reshape([numel]),
            take: Box::new(move |grads| tensor.grad_remove(grads).map(|g| g.reshape([numel]))),
            take_param: Box::new(move |grads| {
                grads.remove::<Inner<B>, D>(id).map(|g| g.reshape([numel]))
            }),
            put: Box::new(move |grads, flat| grads.register(id, flat.reshape(shape))),
        });
    }
}

/// Replaces every float parameter of `module`, in visiting order, by the next of `values`
/// (flat), keeping its id and whether it requires a gradient.
pub fn load<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: M,
    values: Vec<Tensor<Inner<B>, 1>>,
) -> M {
    let mut loader = Loader {
        values: values.into_iter(),
    };
    module.map(&mut loader)
}

/// `module` with every float parameter (frozen ones too) replaced by `root`'s, so every replica
/// starts equal.
pub fn broadcast<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: M,
    comm: &Communicator,
    root: usize,
) -> Result<M, CommError> {
    let mut values = Vec::new();
    for slot in slots::<B, M>(&module) {
        values.push(comm.broadcast(slot.value, root)?);
    }
    Ok(load::<B, M>(module, values))
}

/// [`broadcast`] from rank 0 of `comm`, except that `experts`' parameters come from rank 0 of
/// the ranks holding the same experts (see [`ExpertGroup`]).
pub fn broadcast_grouped<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: M,
    comm: &Communicator,
    experts: Option<&ExpertGroup>,
) -> Result<M, CommError> {
    let mut values = Vec::new();
    for slot in slots::<B, M>(&module) {
        let from = match experts {
            Some(experts) if experts.params.contains(&slot.id) => &experts.comm,
            _ => comm,
        };
        values.push(from.broadcast(slot.value, 0)?);
    }
    Ok(load::<B, M>(module, values))
}

struct Loader<B: AutodiffBackend> {
    values: std::vec::IntoIter<Tensor<Inner<B>, 1>>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Loader<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let flat = self
            .values
            .next()
            .expect("one value per parameter, in visiting order");
        param.map(|tensor| {
            let require_grad = tensor.is_require_grad();
            let value = Tensor::from_inner(flat.reshape(tensor.dims()));
            if require_grad {
                value.require_grad()
            } else {
                value
            }
        })
    }
}

/// Joins flat tensors end to end: [`burn_kernels::pack`], one launch per 32 parts on burn's
/// CUDA backend (feature `cuda`), `cat` elsewhere.
pub fn concat<B: Backend>(parts: Vec<Tensor<B, 1>>) -> Tensor<B, 1> {
    burn_kernels::pack(parts)
}

/// Cuts `flat` into consecutive pieces of the given lengths.
pub fn split<B: Backend>(flat: Tensor<B, 1>, lengths: &[usize]) -> Vec<Tensor<B, 1>> {
    let mut start = 0;
    lengths
        .iter()
        .map(|&len| {
            let piece = flat.clone().narrow(0, start, len);
            start += len;
            piece
        })
        .collect()
}
