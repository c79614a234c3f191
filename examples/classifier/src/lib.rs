//! A plain burn-train project, a classifier of generated spirals, that trains on one device
//! and, by adding burn-parallel-train, data-parallel on several ranks.

pub mod data;
pub mod model;
pub mod train;

pub use model::Classifier;
pub use train::{Evaluation, TrainConfig, evaluate, train};
