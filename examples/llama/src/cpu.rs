//! Training and resaving on burn's CPU backend (`Autodiff<Flex>`), compiled once, here.
//!
//! A release build shares no generic code between crates: every binary, bench and test that
//! names `train::<Autodiff<Flex>>` compiles the whole training stack again, about a minute each
//! on two cores. These functions are not generic, so callers link to this crate's copy.

use std::path::Path;

use burn::backend::{Autodiff, Flex};

use crate::data::Dataset;
use crate::model::Llama;
use crate::train::{StepMetrics, TrainConfig, TrainError};

/// [`crate::train::train`] on the CPU.
#[inline(never)]
pub fn train(
    config: &TrainConfig,
    data: &dyn Dataset,
    on_step: &mut (dyn FnMut(&StepMetrics) + Send),
) -> Result<Llama<Flex>, TrainError> {
    crate::train::train::<Autodiff<Flex>>(config, data, &Default::default(), on_step)
}

/// [`crate::train::resave`] on the CPU.
#[inline(never)]
pub fn resave(config: &TrainConfig, data: &dyn Dataset, to: &Path) -> Result<usize, TrainError> {
    crate::train::resave::<Autodiff<Flex>>(config, data, &Default::default(), to)
}
