//! Parameters packed end to end into flat buffers ("units"), each padded so that it splits into
//! one equal shard per data-parallel rank. Rank `r` owns part `r` of every unit: its shard of
//! the whole model is those parts, one after the other.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};

use burn_ddp::reducer::Buckets;

use crate::ZeroError;

/// One flat buffer: some parameters of one dtype, end to end, then zeros up to `padded`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatUnit {
    /// Indices of the parameters it holds, in buffer order.
    pub params: Vec<usize>,
    /// Where each parameter starts in the buffer.
    pub offsets: Vec<usize>,
    /// Elements of the parameters.
    pub numel: usize,
    /// Elements of the buffer: `numel` rounded up to a multiple of the group size.
    pub padded: usize,
    /// Element type of every parameter in it.
    pub dtype: DType,
}

/// How a module's parameters are packed into units and sharded over `world` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatLayout {
    /// The units, in the order they are reduced and gathered.
    pub units: Vec<FlatUnit>,
    /// Elements of every parameter, by index.
    pub numels: Vec<usize>,
    /// Ranks the buffers are sharded over.
    pub world: usize,
}

impl FlatLayout {
    /// Packs parameters (`numels[i]` elements of `dtypes[i]`) into the given units (lists of
    /// parameter indices); every parameter must be in exactly one unit, and a unit holds one
    /// dtype.
    pub fn new(
        numels: &[usize],
        dtypes: &[DType],
        units: Vec<Vec<usize>>,
        world: usize,
    ) -> Result<Self, ZeroError> {
        if world == 0 {
            return Err(ZeroError::Config("a group has at least one rank".into()));
        }
        let mut seen = vec![false; numels.len()];
        let mut flat = Vec::with_capacity(units.len());
        for params in units {
            let Some(&first) = params.first() else {
                return Err(ZeroError::Config(
                    "a unit holds at least one parameter".into(),
                ));
            };
            let mut offsets = Vec::with_capacity(params.len());
            let mut numel = 0;
            for &p in &params {
                if p >= numels.len() || std::mem::replace(&mut seen[p], true) {
                    return Err(ZeroError::Config(format!(
                        "parameter {p} is missing or in two units; every parameter belongs to exactly one"
                    )));
                }
                if dtypes[p] != dtypes[first] {
                    return Err(ZeroError::Config(format!(
                        "a unit mixes {:?} and {:?}; a flat buffer holds one dtype",
                        dtypes[first], dtypes[p]
                    )));
                }
                offsets.push(numel);
                numel += numels[p];
            }
            let padded = numel.div_ceil(world).max(1) * world;
            flat.push(FlatUnit {
                params,
                offsets,
                numel,
                padded,
                dtype: dtypes[first],
            });
        }
        if let Some(p) = seen.iter().position(|s| !s) {
            return Err(ZeroError::Config(format!(
                "parameter {p} is in no unit; every parameter belongs to exactly one"
            )));
        }
        Ok(Self {
            units: flat,
            numels: numels.to_vec(),
            world,
        })
    }

    /// Units of consecutive parameters in `order` holding at most `cap_bytes` each (a larger
    /// parameter gets a unit of its own), a new one wherever the dtype changes.
    pub fn bucketed(
        numels: &[usize],
        dtypes: &[DType],
        order: &[usize],
        cap_bytes: usize,
        world: usize,
    ) -> Result<Self, ZeroError> {
        let units = Buckets::packed(order, numels, dtypes, cap_bytes).members;
        Self::new(numels, dtypes, units, world)
    }

    /// The units as the gradient reducer's buckets: their parameters and padded lengths.
    pub fn buckets(&self) -> Buckets {
        Buckets {
            members: self.units.iter().map(|u| u.params.clone()).collect(),
            lengths: self.units.iter().map(|u| u.padded).collect(),
        }
    }

    /// Elements of each rank's part of `unit`.
    pub fn shard_len(&self, unit: usize) -> usize {
        self.units[unit].padded / self.world
    }

    /// Elements of a rank's whole shard (its part of every unit).
    pub fn total_shard_len(&self) -> usize {
        (0..self.units.len()).map(|u| self.shard_len(u)).sum()
    }

    /// Where `rank`'s part of `unit` lies in the unit's buffer.
    pub fn shard_range(&self, unit: usize, rank: usize) -> Range<usize> {
        let len = self.shard_len(unit);
        rank * len..(rank + 1) * len
    }

    /// `unit`'s parameters (flat, in the unit's order) joined into its padded buffer.
    pub fn flatten<B: Backend>(&self, unit: usize, parts: Vec<Tensor<B, 1>>) -> Tensor<B, 1> {
        let u = &self.units[unit];
        let device = parts[0].device();
        let mut parts = parts;
        if u.padded > u.numel {
            parts.push(Tensor::zeros([u.padded - u.numel], (&device, u.dtype)));
        }
        burn_ddp::params::concat(parts)
    }

    /// `unit`'s buffer cut back into its parameters, flat, in the unit's order.
    pub fn unflatten<B: Backend>(&self, unit: usize, flat: Tensor<B, 1>) -> Vec<Tensor<B, 1>> {
        let u = &self.units[unit];
        u.params
            .iter()
            .zip(&u.offsets)
            .map(|(&p, &offset)| flat.clone().narrow(0, offset, self.numels[p]))
            .collect()
    }

    /// `rank`'s part of `unit`, cut from the parameters' values (flat, by parameter index, in
    /// any one dtype) without joining the whole buffer.
    pub fn shard_of<B: Backend>(
        &self,
        unit: usize,
        rank: usize,
        values: &[Tensor<B, 1>],
    ) -> Tensor<B, 1> {
        let u = &self.units[unit];
        let range = self.shard_range(unit, rank);
        let mut parts = Vec::new();
        let mut covered = range.start;
        for (&p, &offset) in u.params.iter().zip(&u.offsets) {
            let (start, end) = (
                offset.max(range.start),
                (offset + self.numels[p]).min(range.end),
            );
            if start < end {
                parts.push(values[p].clone().narrow(0, start - offset, end - start));
                covered = end;
            }
        }
        let first = &values[u.params[0]];
        if covered < range.end {
            let like = (&first.device(), first.dtype());
            parts.push(Tensor::zeros([range.end - covered], like));
        }
        burn_ddp::params::concat(parts)
    }

    /// The parameters `rank`'s part of `unit` holds elements of: for each, the parameter, the
    /// range of its elements (row-major), and where they start in the part.
    pub fn pieces(&self, unit: usize, rank: usize) -> Vec<(usize, Range<usize>, usize)> {
        let u = &self.units[unit];
        let range = self.shard_range(unit, rank);
        u.params
            .iter()
            .zip(&u.offsets)
            .filter_map(|(&p, &offset)| {
                let (start, end) = (
                    offset.max(range.start),
                    (offset + self.numels[p]).min(range.end),
                );
                (start < end).then(|| (p, start - offset..end - offset, start - range.start))
            })
            .collect()
    }

    /// Rank `rank`'s whole shard cut into its parts, one per unit.
    pub fn split_shard<B: Backend>(&self, shard: Tensor<B, 1>) -> Vec<Tensor<B, 1>> {
        let lengths: Vec<usize> = (0..self.units.len()).map(|u| self.shard_len(u)).collect();
        burn_ddp::params::split(shard, &lengths)
    }
}

/// `part` as a copy of its own: a part cut from inside one parameter is a view that would keep
/// the whole parameter alive.
pub(crate) fn compact<B: Backend>(part: Tensor<B, 1>) -> Tensor<B, 1> {
    let (device, dtype) = (part.device(), part.dtype());
    Tensor::from_data(part.into_data(), (&device, dtype))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    type B = Flex;

    fn values(numels: &[usize]) -> Vec<Tensor<B, 1>> {
        let mut next = 0.0;
        numels
            .iter()
            .map(|&n| {
                let v: Vec<f32> = (0..n)
                    .map(|_| {
                        next += 1.0;
                        next
                    })
                    .collect();
                Tensor::from_data(TensorData::new(v, [n]), &Default::default())
            })
            .collect()
    }

    fn floats(t: Tensor<B, 1>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    #[test]
    fn a_compacted_part_keeps_its_dtype() {
        let whole = values(&[6]).remove(0).cast(burn::tensor::FloatDType::BF16);
        let part = compact(whole.narrow(0, 2, 3));
        assert_eq!(part.dtype(), DType::BF16);
        assert_eq!(
            floats(part.cast(burn::tensor::FloatDType::F32)),
            [3.0, 4.0, 5.0]
        );
    }

    #[test]
    fn pads_each_unit_to_a_multiple_of_the_group_and_shards_it() {
        let f = DType::F32;
        let layout = FlatLayout::new(&[3, 4, 2], &[f; 3], vec![vec![1, 0], vec![2]], 3).unwrap();
        assert_eq!(layout.units[0].offsets, vec![0, 4]);
        assert_eq!((layout.units[0].numel, layout.units[0].padded), (7, 9));
        assert_eq!((layout.units[1].numel, layout.units[1].padded), (2, 3));
        assert_eq!(layout.shard_range(0, 2), 6..9);
        assert_eq!(layout.total_shard_len(), 4);

        let v = values(&[3, 4, 2]);
        let flat = layout.flatten(0, vec![v[1].clone(), v[0].clone()]);
        assert_eq!(floats(flat.clone()), [4., 5., 6., 7., 1., 2., 3., 0., 0.]);
        let back = layout.unflatten(0, flat);
        assert_eq!(floats(back[0].clone()), floats(v[1].clone()));
        assert_eq!(floats(back[1].clone()), floats(v[0].clone()));
        // Each rank's part, cut straight from the parameters, equals the buffer's part.
        let parts: Vec<Vec<f32>> = (0..3).map(|r| floats(layout.shard_of(0, r, &v))).collect();
        assert_eq!(
            parts,
            [vec![4., 5., 6.], vec![7., 1., 2.], vec![3., 0., 0.]]
        );
        assert_eq!(floats(layout.shard_of(1, 2, &v)), [0.]);
    }

    #[test]
    fn buckets_split_on_the_cap_and_the_dtype_and_every_parameter_is_placed_once() {
        let (f, h) = (DType::F32, DType::F16);
        let layout =
            FlatLayout::bucketed(&[10, 10, 30, 5], &[f, f, h, f], &[3, 2, 1, 0], 80, 2).unwrap();
        let units: Vec<_> = layout.units.iter().map(|u| u.params.clone()).collect();
        assert_eq!(units, [vec![3], vec![2], vec![1, 0]]);
        let missing = FlatLayout::new(&[1, 1], &[f, f], vec![vec![0]], 2).unwrap_err();
        assert!(missing.to_string().contains("in no unit"), "{missing}");
        let twice = FlatLayout::new(&[1, 1], &[f, f], vec![vec![0, 1], vec![1]], 2).unwrap_err();
        assert!(twice.to_string().contains("two units"), "{twice}");
        let mixed = FlatLayout::new(&[1, 1], &[f, h], vec![vec![0, 1]], 2).unwrap_err();
        assert!(mixed.to_string().contains("one dtype"), "{mixed}");
    }
}
