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

/// How an all-to-all's received buffer becomes its result, where `split_dim` and `concat_dim`
/// differ. The buffer is contiguous in the input's shape `dims` with `split_dim` swapped to the
/// front, holding in rank order the `size` parts the ranks sent. Read as `view` (the front dim
/// cut into `[size, part]`, which moves no data) and permuted by `axes` (the input's axes in
/// order, the rank axis just before `concat_dim`), it is the result, of shape `out`, once made
/// contiguous: the parts concatenated along `concat_dim`.
pub(crate) struct Concat {
    pub view: Vec<usize>,
    pub axes: Vec<usize>,
    pub out: Vec<usize>,
}

/// See [`Concat`].
pub(crate) fn concat_blocks(
    dims: &[usize],
    split_dim: usize,
    concat_dim: usize,
    size: usize,
) -> Concat {
    let mut received = dims.to_vec();
    received.swap(0, split_dim);
    let mut view = vec![size, received[0] / size];
    view.extend_from_slice(&received[1..]);
    // Where each of the input's axes sits in the view: the part of `split_dim` at 1, axis 0 where
    // the swap put it, every other axis one further on than in the input.
    let place = |axis: usize| match axis {
        _ if axis == split_dim => 1,
        0 => split_dim + 1,
        _ => axis + 1,
    };
    let mut axes: Vec<usize> = (0..dims.len()).map(place).collect();
    axes.insert(concat_dim, 0);
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

    fn swapped(mut dims: [usize; 3], dim: usize) -> [usize; 3] {
        dims.swap(0, dim);
        dims
    }

    /// A tensor whose every element is its own flat index.
    fn counting(dims: [usize; 3]) -> T3 {
        let n = dims.iter().product::<usize>() as i64;
        Tensor::<Flex, 1, Int>::arange(0..n, &Default::default()).reshape(dims)
    }

    #[test]
    fn blocks_concatenate_along_every_other_dim_as_narrow_and_cat_would() {
        let cases = [
            (0, 1, 2),
            (0, 2, 3),
            (1, 0, 2),
            (2, 0, 3),
            (1, 2, 2),
            (2, 1, 3),
        ];
        // A last dim of 1 too: a strided reshape once went wrong there.
        for base in [[2, 3, 4], [2, 3, 1]] {
            for (split_dim, concat_dim, size) in cases {
                let mut dims = base;
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
                // As NCCL leaves it: contiguous, with `split_dim` in front.
                let received = blocks
                    .swap_dims(0, split_dim)
                    .reshape(swapped(dims, split_dim));
                let got: T3 = received.reshape(view).permute(axes).reshape(out);
                assert_eq!(
                    got.into_data(),
                    expected.into_data(),
                    "{dims:?}, split {split_dim}, concat {concat_dim}, size {size}"
                );
            }
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
