//! What a rank hands in to a save: pieces of tensors, each a box of its tensor, whose elements
//! are in host memory already or are read from a tensor when the piece is written.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use burn::prelude::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::region::Region;

/// One piece of a tensor a rank holds: the box `region` of the tensor `name` shaped `shape`.
#[derive(Debug, Clone)]
pub struct Shard {
    pub name: String,
    pub shape: Vec<usize>,
    pub region: Region,
    /// The box's elements, shaped as its extents.
    pub data: ShardData,
}

impl Shard {
    /// All of the tensor `name`.
    pub fn whole(name: impl Into<String>, data: impl Into<ShardData>) -> Self {
        let data = data.into();
        let shape = data.shape().to_vec();
        Self {
            name: name.into(),
            region: Region::whole(&shape),
            shape,
            data,
        }
    }
}

/// A piece's elements.
#[derive(Clone)]
pub struct ShardData {
    dtype: DType,
    shape: Vec<usize>,
    source: Source,
}

#[derive(Clone)]
enum Source {
    Host(TensorData),
    /// Read when written. A burn tensor is a value: the training goes on with new tensors
    /// (or, on the host backends, copies before writing into a buffer still shared), so
    /// this one keeps the elements it had when handed in.
    Later(Arc<dyn Fn() -> Result<TensorData, String> + Send + Sync>),
}

impl ShardData {
    /// `tensor`'s elements, read when the piece is written (by the thread that writes it),
    /// not now: a save in the background then costs the step that hands it in no copy, and a
    /// piece another rank writes is never read. Until then `tensor`'s memory stays held:
    /// on a device whose memory is short, copy to the host first ([`ShardData::to_host`]).
    pub fn read_later<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Self {
        Self {
            dtype: tensor.dtype(),
            shape: tensor.dims().to_vec(),
            source: Source::Later(Arc::new(move || {
                tensor.clone().try_into_data().map_err(|e| format!("{e:?}"))
            })),
        }
    }

    /// The same elements in host memory, read now if they were to be read later.
    pub fn to_host(self) -> Result<Self, String> {
        match self.source {
            Source::Host(_) => Ok(self),
            Source::Later(_) => Ok(Self::from(self.read()?.into_owned())),
        }
    }

    /// The same elements, row-major, shaped `shape`.
    ///
    /// # Panics
    /// When `shape` holds another number of elements.
    pub fn reshaped(self, shape: Vec<usize>) -> Self {
        let count = |s: &[usize]| s.iter().product::<usize>();
        assert_eq!(
            count(&shape),
            count(&self.shape),
            "a piece of shape {:?} cannot be shaped {shape:?}",
            self.shape
        );
        let shaped = shape.clone();
        let source = match self.source {
            Source::Host(data) => Source::Host(TensorData {
                shape: shaped.into(),
                ..data
            }),
            Source::Later(read) => Source::Later(Arc::new(move || {
                read().map(|data| TensorData {
                    shape: shaped.clone().into(),
                    ..data
                })
            })),
        };
        Self {
            dtype: self.dtype,
            shape,
            source,
        }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The elements (read now from a tensor handed in to be read later), or why the device
    /// could not give them.
    pub fn read(&self) -> Result<Cow<'_, TensorData>, String> {
        match &self.source {
            Source::Host(data) => Ok(Cow::Borrowed(data)),
            Source::Later(read) => read().map(Cow::Owned),
        }
    }
}

impl From<TensorData> for ShardData {
    fn from(data: TensorData) -> Self {
        Self {
            dtype: data.dtype,
            shape: data.shape.to_vec(),
            source: Source::Host(data),
        }
    }
}

impl fmt::Debug for ShardData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let held = match self.source {
            Source::Host(_) => "host",
            Source::Later(_) => "read when written",
        };
        f.debug_struct("ShardData")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("held", &held)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn a_tensor_read_later_keeps_the_elements_it_had_when_handed_in() {
        let device = Default::default();
        let mut w =
            Tensor::<Flex, 2>::from_data(TensorData::new(vec![1f32, 2., 3., 4.], [2, 2]), &device);
        let data = ShardData::read_later(w.clone());
        // The training goes on: an update that could be made in place while `w` is unique.
        w = w.mul_scalar(10.0).add_scalar(1.0);
        assert_eq!(
            w.into_data().to_vec::<f32>().unwrap(),
            vec![11., 21., 31., 41.]
        );
        assert_eq!((data.dtype(), data.shape()), (DType::F32, &[2, 2][..]));
        let read = data.read().unwrap().into_owned();
        assert_eq!(read.to_vec::<f32>().unwrap(), vec![1., 2., 3., 4.]);
        assert_eq!(read.shape.to_vec(), vec![2, 2]);
        let host = data.clone().to_host().unwrap();
        assert_eq!(
            host.read().unwrap().to_vec::<f32>().unwrap(),
            vec![1., 2., 3., 4.]
        );
        let flat = data.reshaped(vec![4]);
        assert_eq!(flat.shape(), &[4]);
        let read = flat.read().unwrap().into_owned();
        assert_eq!(read.shape.to_vec(), vec![4]);
        assert_eq!(read.to_vec::<f32>().unwrap(), vec![1., 2., 3., 4.]);
    }
}
