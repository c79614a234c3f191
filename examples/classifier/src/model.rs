//! The model: a small MLP, trained and validated through burn-train's `TrainStep` and
//! `InferenceStep`, as in burn's own examples.

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_parallel_train::BackwardHooks;
use burn_train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};

use crate::data::{CLASSES, PointBatch};

/// Points to arms: two hidden layers.
#[derive(Module, Debug)]
pub struct Classifier<B: Backend> {
    input: Linear<B>,
    hidden: Linear<B>,
    output: Linear<B>,
    activation: Relu,
}

impl<B: Backend> Classifier<B> {
    /// A classifier with `width` units per hidden layer.
    pub fn new(width: usize, device: &B::Device) -> Self {
        Self {
            input: LinearConfig::new(2, width).init(device),
            hidden: LinearConfig::new(width, width).init(device),
            output: LinearConfig::new(width, CLASSES).init(device),
            activation: Relu::new(),
        }
    }

    /// Logits `[n, CLASSES]` of points `[n, 2]`.
    pub fn forward(&self, xy: Tensor<B, 2>) -> Tensor<B, 2> {
        let h = self.activation.forward(self.input.forward(xy));
        let h = self.activation.forward(self.hidden.forward(h));
        self.output.forward(h)
    }

    /// The loss and logits of a batch.
    pub fn classify(&self, batch: PointBatch<B>) -> ClassificationOutput<B> {
        let logits = self.forward(batch.xy);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.arms.clone());
        ClassificationOutput::new(loss, logits, batch.arms)
    }
}

// `BackwardHooks` is every burn autodiff backend; `backward` needs it to overlap.
impl<B: BackwardHooks> TrainStep for Classifier<B> {
    type Input = PointBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: PointBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let output = self.classify(batch);
        // burn's `TrainOutput::new(self, output.loss.backward(), output)`, with the gradient
        // all-reduce overlapping backward when trained data-parallel.
        burn_parallel_train::backward(self, output.loss.clone(), output)
    }
}

impl<B: Backend> InferenceStep for Classifier<B> {
    type Input = PointBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: PointBatch<B>) -> ClassificationOutput<B> {
        self.classify(batch)
    }
}
