//! Which cubecl runtime, if any, holds a backend's float tensors: the kernels run there and
//! every other backend takes the plain-burn fallback. Deciding by the tensor primitive's type,
//! not by a trait bound, keeps the strategies' generic code free of a kernel bound.

use std::any::{Any, TypeId};

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorPrimitive};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

/// Whether `B`'s float tensors are `R`'s cubecl tensors (a `CubeBackend<R, ..>`).
pub(crate) fn holds<B: Backend, R: CubeRuntime>() -> bool {
    TypeId::of::<B::FloatTensorPrimitive>() == TypeId::of::<CubeTensor<R>>()
}

/// `value` as the type it is known to be: a primitive of the runtime [`holds`] found.
fn same<T: 'static, U: 'static>(value: T) -> U {
    let value: Box<dyn Any> = Box::new(value);
    *value
        .downcast()
        .expect("called only for the runtime that holds the backend's tensors")
}

/// `tensor`'s cubecl tensor; only after [`holds`] said yes.
pub(crate) fn into_cube<B: Backend, R: CubeRuntime, const D: usize>(
    tensor: Tensor<B, D>,
) -> CubeTensor<R> {
    same(tensor.into_primitive().tensor())
}

/// An int tensor's cubecl tensor (the backend's int tensors live on the same runtime).
pub(crate) fn int_into_cube<B: Backend, R: CubeRuntime, const D: usize>(
    tensor: Tensor<B, D, Int>,
) -> CubeTensor<R> {
    same(tensor.into_primitive())
}

/// The burn tensor of a cubecl tensor of `B`'s runtime.
pub(crate) fn from_cube<B: Backend, R: CubeRuntime, const D: usize>(
    tensor: CubeTensor<R>,
) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(same(tensor)))
}

/// Calls `$kernel::<B, R>($args)` and returns its result from the enclosing function when `B`
/// is the cubecl backend of a runtime this build has (`cuda`, `wgpu`); else does nothing.
macro_rules! on_cube {
    ($backend:ty, $($kernel:ident)::+($($arg:expr),* $(,)?)) => {
        #[cfg(feature = "cuda")]
        if $crate::cube::holds::<$backend, cubecl::cuda::CudaRuntime>() {
            return $($kernel)::+::<$backend, cubecl::cuda::CudaRuntime>($($arg),*);
        }
        #[cfg(feature = "wgpu")]
        if $crate::cube::holds::<$backend, cubecl::wgpu::WgpuRuntime>() {
            return $($kernel)::+::<$backend, cubecl::wgpu::WgpuRuntime>($($arg),*);
        }
    };
}
pub(crate) use on_cube;
