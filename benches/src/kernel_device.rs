//! `--device` of the kernel benches: the plain-burn fallback on CPU, the kernel on wgpu or CUDA
//! where the build has that runtime.

use burn::backend::Flex;
use burn::tensor::backend::Backend;
use clap::ValueEnum;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum KernelDevice {
    Cpu,
    Wgpu,
    Cuda,
}

/// A bench written once for any backend.
pub trait KernelBench {
    type Output;

    /// Runs on `B`, whose device is called `name` in the output.
    fn run<B: Backend>(&self, name: &str) -> Self::Output;
}

impl KernelDevice {
    /// Runs `bench` on this device's backend; stops with the feature to build with where the
    /// build lacks it.
    pub fn run<T: KernelBench>(self, bench: &T) -> T::Output {
        match self {
            KernelDevice::Cpu => bench.run::<Flex>("cpu"),
            #[cfg(feature = "wgpu")]
            KernelDevice::Wgpu => bench.run::<burn::backend::Wgpu>("wgpu"),
            #[cfg(feature = "cuda")]
            KernelDevice::Cuda => bench.run::<burn::backend::Cuda>("cuda"),
            #[allow(unreachable_patterns)]
            other => panic!(
                "this binary was built without {other:?}; rebuild with `--features {}`",
                format!("{other:?}").to_lowercase()
            ),
        }
    }
}
