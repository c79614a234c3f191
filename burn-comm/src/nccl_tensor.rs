//! Which burn tensors the NCCL transport moves, and the CUDA tensor behind each: burn's CUDA
//! backend, with or without burn's fusion, at any float precision, and under autodiff at f32,
//! f16 or bf16 with burn's default int (i32) and bool (u8) types.
//! Recognised by the primitive's type, so the collectives keep their `Backend` bound.
//!
//! A fusion tensor is resolved first, which runs the fused work still queued for it; the result
//! is registered back as a fusion tensor. An autodiff tensor's graph is not extended: the result
//! is a new leaf, as on the local transport.

use std::any::{Any, TypeId};

use burn::backend::Autodiff;
use burn::tensor::backend::{AutodiffBackend, Backend, BackendTypes};
use burn::tensor::{BasicOps, Int, Tensor, TensorMetadata, TensorPrimitive, bf16, f16};
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, FloatElement};
use burn_fusion::stream::OperationStreams;
use burn_fusion::{Fusion, FusionTensor, NoOp, get_client};
use burn_ir::{BackendIr, InitOperationIr, OperationIr};

/// burn's CUDA backend at float precision `F` (and its default int and bool types).
pub(crate) type Cuda<F> = CubeBackend<CudaRuntime, F, i32, u8>;

/// A tensor of `Fusion<Cuda<F>>`, of any kind and precision.
type Fused = FusionTensor<FusionCubeRuntime<CudaRuntime>>;

/// The float tensor of `Autodiff<B>` (whatever its checkpointing).
type AutodiffFloat<B> = <Autodiff<B> as BackendTypes>::FloatTensorPrimitive;

/// The CUDA tensor behind `tensor`, or why the NCCL transport cannot move it.
pub(crate) fn to_cube<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
    tensor: Tensor<B, D, K>,
) -> Result<CubeTensor<CudaRuntime>, String> {
    let unsupported = || {
        format!(
            "the NCCL transport moves tensors of burn's CUDA backend (Cuda, with or without \
             fusion and autodiff), not {}; use the local transport for other backends",
            std::any::type_name::<B>()
        )
    };
    let primitive = match cast::<K::Primitive, CubeTensor<CudaRuntime>>(tensor.into_primitive()) {
        Ok(cube) => return Ok(cube),
        Err(other) => other,
    };
    let primitive = match cast::<K::Primitive, Fused>(primitive) {
        Ok(fused) => return Ok(resolve(fused, Kind::of::<K>())),
        Err(other) => other,
    };
    match cast::<K::Primitive, TensorPrimitive<B>>(primitive) {
        Ok(TensorPrimitive::Float(float)) => float_to_cube::<B>(float).ok_or_else(unsupported),
        Ok(TensorPrimitive::QFloat(_)) => {
            Err("quantized tensors cannot be communicated; dequantize them first".into())
        }
        Err(_) => Err(unsupported()),
    }
}

/// The tensor of `B` and kind `K` holding `cube`; `B` is one [`to_cube`] accepted.
pub(crate) fn from_cube<B: Backend, const D: usize, K: BasicOps<B> + 'static>(
    cube: CubeTensor<CudaRuntime>,
) -> Tensor<B, D, K> {
    let primitive = if is::<K::Primitive, CubeTensor<CudaRuntime>>() {
        cast::<_, K::Primitive>(cube).ok()
    } else if is::<K::Primitive, Fused>() {
        cast::<_, K::Primitive>(register(cube, Kind::of::<K>())).ok()
    } else {
        let float = TensorPrimitive::<B>::Float(float_from_cube::<B>(cube));
        cast::<_, K::Primitive>(float).ok()
    };
    Tensor::from_primitive(primitive.expect("to_cube accepted this backend and kind"))
}

fn float_to_cube<B: Backend>(float: B::FloatTensorPrimitive) -> Option<CubeTensor<CudaRuntime>> {
    fn autodiff<P: 'static, F: FloatElement>(p: P) -> Result<CubeTensor<CudaRuntime>, P> {
        cast::<P, AutodiffFloat<Cuda<F>>>(p).map(<Autodiff<Cuda<F>> as AutodiffBackend>::inner)
    }
    fn autodiff_fused<P: 'static, F: FloatElement>(p: P) -> Result<CubeTensor<CudaRuntime>, P> {
        cast::<P, AutodiffFloat<Fusion<Cuda<F>>>>(p).map(|t| {
            resolve(
                <Autodiff<Fusion<Cuda<F>>> as AutodiffBackend>::inner(t),
                Kind::Float,
            )
        })
    }
    cast::<_, CubeTensor<CudaRuntime>>(float)
        .or_else(|p| cast::<_, Fused>(p).map(|fused| resolve(fused, Kind::Float)))
        .or_else(autodiff::<_, f32>)
        .or_else(autodiff::<_, f16>)
        .or_else(autodiff::<_, bf16>)
        .or_else(autodiff_fused::<_, f32>)
        .or_else(autodiff_fused::<_, f16>)
        .or_else(autodiff_fused::<_, bf16>)
        .ok()
}

fn float_from_cube<B: Backend>(cube: CubeTensor<CudaRuntime>) -> B::FloatTensorPrimitive {
    fn leaf<F: FloatElement>(cube: CubeTensor<CudaRuntime>) -> Box<dyn Any> {
        Box::new(<Autodiff<Cuda<F>> as AutodiffBackend>::from_inner(cube))
    }
    fn fused_leaf<F: FloatElement>(cube: CubeTensor<CudaRuntime>) -> Box<dyn Any> {
        let fused = register(cube, Kind::Float);
        Box::new(<Autodiff<Fusion<Cuda<F>>> as AutodiffBackend>::from_inner(
            fused,
        ))
    }
    let float: Box<dyn Any> = match TypeId::of::<B::FloatTensorPrimitive>() {
        t if t == TypeId::of::<CubeTensor<CudaRuntime>>() => Box::new(cube),
        t if t == TypeId::of::<Fused>() => Box::new(register(cube, Kind::Float)),
        t if t == TypeId::of::<AutodiffFloat<Cuda<f32>>>() => leaf::<f32>(cube),
        t if t == TypeId::of::<AutodiffFloat<Cuda<f16>>>() => leaf::<f16>(cube),
        t if t == TypeId::of::<AutodiffFloat<Cuda<bf16>>>() => leaf::<bf16>(cube),
        t if t == TypeId::of::<AutodiffFloat<Fusion<Cuda<f32>>>>() => fused_leaf::<f32>(cube),
        t if t == TypeId::of::<AutodiffFloat<Fusion<Cuda<f16>>>>() => fused_leaf::<f16>(cube),
        t if t == TypeId::of::<AutodiffFloat<Fusion<Cuda<bf16>>>>() => fused_leaf::<bf16>(cube),
        _ => unreachable!("to_cube accepted this backend"),
    };
    *float
        .downcast()
        .expect("the primitive of the type just matched")
}

/// A fusion tensor's kind: which of the fusion client's resolvers applies.
#[derive(Clone, Copy)]
enum Kind {
    Float,
    Int,
    Bool,
}

impl Kind {
    /// The kind of `K`, whose primitive is a fusion tensor itself: int or bool (a float
    /// primitive is a `TensorPrimitive` around one).
    fn of<K: 'static>() -> Self {
        if is::<K, Int>() {
            Kind::Int
        } else {
            Kind::Bool
        }
    }
}

/// The CUDA tensor of a fusion tensor, once the work queued for it has run. The precision of
/// the backend named here does not matter: the tensor keeps its own dtype.
fn resolve(fused: Fused, kind: Kind) -> CubeTensor<CudaRuntime> {
    let client = fused.client.clone();
    match kind {
        Kind::Float => client.resolve_tensor_float::<Cuda<f32>>(fused),
        Kind::Int => client.resolve_tensor_int::<Cuda<f32>>(fused),
        Kind::Bool => client.resolve_tensor_bool::<Cuda<f32>>(fused),
    }
}

/// `cube` as a fusion tensor on its device's fusion client, as burn registers a tensor made
/// from data.
fn register(cube: CubeTensor<CudaRuntime>, kind: Kind) -> Fused {
    let client = get_client::<Cuda<f32>>(&cube.device);
    let (shape, dtype) = (cube.shape(), cube.dtype());
    let handle = match kind {
        Kind::Float => <Cuda<f32> as BackendIr>::float_tensor_handle(cube),
        Kind::Int => <Cuda<f32> as BackendIr>::int_tensor_handle(cube),
        Kind::Bool => <Cuda<f32> as BackendIr>::bool_tensor_handle(cube),
    };
    let init = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            OperationStreams::default(),
            OperationIr::Init(init),
            NoOp::<Cuda<f32>>::new(),
        )
        .remove(0)
}

/// `value` as type `U`, or back as itself when it is not one.
fn cast<T: 'static, U: 'static>(value: T) -> Result<U, T> {
    let boxed: Box<dyn Any> = Box::new(value);
    boxed.downcast::<U>().map(|u| *u).map_err(|back| {
        *back
            .downcast::<T>()
            .expect("a box that is not a U holds the T it was made of")
    })
}

fn is<T: 'static, U: 'static>() -> bool {
    TypeId::of::<T>() == TypeId::of::<U>()
}
