//! The data: points on three interleaved spirals, labelled by their arm, generated from a seed so
//! every rank (and every run) sees the same dataset.

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

/// Number of spiral arms, and so of classes.
pub const CLASSES: usize = 3;

/// One point and its arm.
#[derive(Clone, Debug)]
pub struct Point {
    pub xy: [f32; 2],
    pub arm: i64,
}

/// A batch: points `[n, 2]` and arms `[n]`.
#[derive(Clone, Debug)]
pub struct PointBatch<B: Backend> {
    pub xy: Tensor<B, 2>,
    pub arms: Tensor<B, 1, Int>,
}

/// Makes tensors of points on the batch's device.
#[derive(Clone, Default)]
pub struct PointBatcher;

impl<B: Backend> Batcher<B, Point, PointBatch<B>> for PointBatcher {
    fn batch(&self, points: Vec<Point>, device: &B::Device) -> PointBatch<B> {
        let n = points.len();
        let xy: Vec<f32> = points.iter().flat_map(|p| p.xy).collect();
        let arms: Vec<i64> = points.iter().map(|p| p.arm).collect();
        PointBatch {
            xy: Tensor::from_data(TensorData::new(xy, [n, 2]), device),
            arms: Tensor::from_data(TensorData::new(arms, [n]), device),
        }
    }
}

/// `len` points from `seed`, the arms taking turns.
pub fn spirals(len: usize, seed: u64) -> InMemDataset<Point> {
    let points = (0..len as u64)
        .map(|i| {
            let arm = (i % CLASSES as u64) as i64;
            let r = uniform(seed, 2 * i);
            let angle = r * 3.0 * std::f32::consts::PI
                + arm as f32 * 2.0 * std::f32::consts::PI / CLASSES as f32
                + (uniform(seed, 2 * i + 1) - 0.5) * 0.4;
            Point {
                xy: [r * angle.cos(), r * angle.sin()],
                arm,
            }
        })
        .collect();
    InMemDataset::new(points)
}

/// A number in [0, 1) from `(seed, i)` (splitmix64): no shared generator, so no thread order.
fn uniform(seed: u64, i: u64) -> f32 {
    let mut z = seed
        .wrapping_mul(0x9e3779b97f4a7c15)
        .wrapping_add(i)
        .wrapping_add(0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
}
