//! Which cubecl runtime, if any, holds a backend's float tensors: the kernels run there and
//! every other backend takes the plain-burn fallback. Deciding by the tensor primitive's type,
//! not by a trait bound, keeps the strategies' generic code free of a kernel bound.

use std::any::{Any, TypeId};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

/// Whether `B`'s float tensors are `R`'s cubecl tensors (a `CubeBackend<R, ..>`).
pub(crate) fn holds<B: Backend, R: CubeRuntime>() -> bool {
    TypeId::of::<B::FloatTensorPrimitive>() == TypeId::of::<CubeTensor<R>>()
}

/// `tensor`'s cubecl tensor; only after [`holds`] said yes.
pub(crate) fn into_cube<B: Backend, R: CubeRuntime, const D: usize>(
    tensor: Tensor<B, D>,
) -> CubeTensor<R> {
    let primitive: Box<dyn Any> = Box::new(tensor.into_primitive().tensor());
    *primitive
        .downcast()
        .expect("into_cube is called only for the runtime that holds the backend's tensors")
}

/// The burn tensor of a cubecl tensor of `B`'s runtime.
pub(crate) fn from_cube<B: Backend, R: CubeRuntime, const D: usize>(
    tensor: CubeTensor<R>,
) -> Tensor<B, D> {
    let primitive: Box<dyn Any> = Box::new(tensor);
    let primitive = *primitive
        .downcast::<B::FloatTensorPrimitive>()
        .expect("from_cube is called only for the runtime that holds the backend's tensors");
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
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
