//! Shapes and axis orders by which a transport on device memory (NCCL) lays out a collective's
//! result: metadata only, so they are tested here on the CPU, with burn's own tensors.

use crate::call::Op;

/// The shape of collective `op`'s result for an input of `dims` in a group of `size`.
pub(crate) fn result_shape(op: Op, dims: &[usize], size: usize) -> Vec<usize> {
    let mut out = dims.to_vec();
    match op {
        Op::AllGather { dim } => out[dim] *= size,
        Op::ReduceScatter { dim, .. } => out[dim] /= size,
        Op::AllToAll {
            split_dim,
            concat_dim,
        } => {
            out[split_dim] /= size;
            out[concat_dim] *= size;
        }
        Op::AllReduce(_) | Op::Broadcast { .. } | Op::Barrier | Op::Split => {}
    }
    out
}

/// The axis order that swaps axes `a` and `b` of a tensor of `rank` axes.
pub(crate) fn swap(rank: usize, a: usize, b: usize) -> Vec<usize> {
    let mut axes: Vec<usize> = (0..rank).collect();
    axes.swap(a, b);
    axes
}

/// How an all-to-all's received blocks become its result. The blocks are a tensor of `dims`
/// whose `split_dim` holds, in rank order, the `size` parts the ranks sent. Viewed as `view`
/// (that dim cut into `[size, part]`) and permuted by `axes` (the rank axis moved just before
/// `concat_dim`), it reshapes to `out`: the parts concatenated along `concat_dim`.
pub(crate) struct Concat {
    pub view: Vec<usize>,
    pub axes: Vec<usize>,
    pub out: Vec<usize>,
}

/// See [`Concat`]; `split_dim` and `concat_dim` differ.
pub(crate) fn concat_blocks(
    dims: &[usize],
    split_dim: usize,
    concat_dim: usize,
    size: usize,
) -> Concat {
    let mut view = dims.to_vec();
    view[split_dim] /= size;
    view.insert(split_dim, size);
    // The view's axes: the rank axis sits at `split_dim`; the original axes after it move by one.
    let shifted = |axis: usize| if axis < split_dim { axis } else { axis + 1 };
    let mut axes: Vec<usize> = (0..dims.len()).map(shifted).collect();
    let before = axes
        .iter()
        .position(|&axis| axis == shifted(concat_dim))
        .expect("concat_dim is an axis");
    axes.insert(before, split_dim);
    Concat {
        view,
        axes,
        out: result_shape(
            Op::AllToAll {
                split_dim,
                concat_dim,
            },
            dims,
            size,
        ),
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::{Int, Tensor};

    use super::*;

    type T3 = Tensor<Flex, 3, Int>;

    /// A tensor whose every element is its own flat index.
    fn counting(dims: [usize; 3]) -> T3 {
        let n = dims.iter().product::<usize>() as i64;
        Tensor::<Flex, 1, Int>::arange(0..n, &Default::default()).reshape(dims)
    }

    #[test]
    fn blocks_concatenate_along_every_other_dim_as_narrow_and_cat_would() {
        for (split_dim, concat_dim, size) in [(0, 1, 2), (0, 2, 3), (1, 0, 2), (2, 0, 3), (1, 2, 2)]
        {
            let mut dims = [2, 3, 4];
            dims[split_dim] = size * (split_dim + 1);
            let blocks = counting(dims);
            let part = dims[split_dim] / size;
            let expected = Tensor::cat(
                (0..size)
                    .map(|k| blocks.clone().narrow(split_dim, k * part, part))
                    .collect(),
                concat_dim,
            );
            let layout = concat_blocks(&dims, split_dim, concat_dim, size);
            let view: [usize; 4] = layout.view.clone().try_into().unwrap();
            let axes: [usize; 4] = layout.axes.clone().try_into().unwrap();
            let out: [usize; 3] = layout.out.clone().try_into().unwrap();
            let got: T3 = blocks.reshape(view).permute(axes).reshape(out);
            assert_eq!(
                got.into_data(),
                expected.into_data(),
                "split {split_dim}, concat {concat_dim}, size {size}"
            );
        }
    }

    #[test]
    fn a_result_has_the_shape_of_its_collective() {
        let dims = [4, 6];
        let shape = |op| result_shape(op, &dims, 2);
        assert_eq!(shape(Op::AllGather { dim: 1 }), [4, 12]);
        let sum = crate::ReduceOp::Sum;
        assert_eq!(shape(Op::ReduceScatter { op: sum, dim: 0 }), [2, 6]);
        let (split_dim, concat_dim) = (0, 1);
        assert_eq!(
            shape(Op::AllToAll {
                split_dim,
                concat_dim
            }),
            [2, 12]
        );
        assert_eq!(shape(Op::AllReduce(sum)), [4, 6]);
        assert_eq!(swap(3, 0, 2), [2, 1, 0]);
    }
}
