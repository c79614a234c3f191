//! Where a run's starting weights come from, drawn from the seed or read from a Hugging Face
//! checkpoint, handed out part by part: each rank builds only the parts its plan gives it (its
//! pipeline stages, or ZeRO-3's units), each holding only its tensor-parallel slices, and reads
//! only those slices from disk.

use std::ops::Range;

use burn::tensor::TensorData;
use burn::tensor::backend::Backend;

use crate::checkpoint::{Resumed, check_resumable};
use crate::config::LlamaConfig;
use crate::hf::{self, HfCheckpoint};
use crate::model::{Llama, seeded_matrix};
use crate::parallel_plan::{ParallelPlan, Slices};
use crate::train::{TrainConfig, TrainError};

/// What a rank holds of one parameter.
#[derive(Debug, Clone)]
pub struct Block<'a> {
    /// The parameter's path in the whole model, as burn's visitors name it
    /// (`layers.5.mlp.up_proj`).
    pub path: &'a str,
    /// The whole parameter's shape, in burn's layout.
    pub whole: &'a [usize],
    /// The elements this rank holds along each dimension it does not hold whole (a
    /// tensor-parallel slice, a rank's experts); empty when it holds them all.
    pub split: Vec<(usize, Range<usize>)>,
}

impl Block<'_> {
    /// The elements this rank holds along `dim`.
    pub fn range(&self, dim: usize) -> Range<usize> {
        self.split
            .iter()
            .find(|(d, _)| *d == dim)
            .map_or(0..self.whole[dim], |(_, range)| range.clone())
    }
}

/// A block's values, f32: in burn's layout, or in its transpose's (Hugging Face stores
/// matrices `[out, in]`).
pub struct Loaded {
    pub data: TensorData,
    pub transposed: bool,
}

/// Gives the values of a parameter's block.
pub trait ParamSource: Sync {
    /// The values of `block`; none to keep what the model is built with (a norm's ones).
    fn block(&self, block: &Block<'_>) -> Result<Option<Loaded>, String>;
}

/// `Llama::init`'s weights: each matrix drawn from the seed and its name, the norms' ones.
pub struct Seeded<'a> {
    pub config: &'a LlamaConfig,
    pub seed: u64,
}

impl ParamSource for Seeded<'_> {
    fn block(&self, block: &Block<'_>) -> Result<Option<Loaded>, String> {
        let drawn = |name: &str, [rows, columns]: [usize; 2]| {
            let whole = seeded_matrix(self.config, self.seed, name, [rows, columns]);
            // This rank's rows and columns: the block's last two dimensions.
            let last = block.whole.len() - 2;
            let whole = narrow(whole, 0, block.range(last));
            narrow(whole, 1, block.range(last + 1))
        };
        let data = match *block.whole {
            [rows, columns] => drawn(&hf::name(block.path), [rows, columns]),
            // Stacked experts, each drawn by its own name.
            [_, rows, columns] if hf::is_experts(block.path) => stack(
                block
                    .range(0)
                    .map(|j| drawn(&hf::expert_name(block.path, j), [rows, columns]))
                    .collect(),
            ),
            _ => return Ok(None),
        };
        Ok(Some(Loaded {
            data,
            transposed: false,
        }))
    }
}

/// f32 matrices of one shape, stacked along a new first dimension.
pub(crate) fn stack(matrices: Vec<TensorData>) -> TensorData {
    let mut shape = vec![matrices.len()];
    shape.extend(matrices.first().map_or(vec![0, 0], |m| m.shape.to_vec()));
    let values: Vec<f32> = matrices
        .into_iter()
        .flat_map(|m| m.to_vec::<f32>().expect("matrices read as f32"))
        .collect();
    TensorData::new(values, shape)
}

/// The elements `range` along `dim` of an f32 matrix.
fn narrow(matrix: TensorData, dim: usize, range: Range<usize>) -> TensorData {
    let [rows, columns] = [matrix.shape[0], matrix.shape[1]];
    if range == (0..matrix.shape[dim]) {
        return matrix;
    }
    let values = matrix.to_vec::<f32>().expect("a drawn matrix is f32");
    let (kept, shape) = if dim == 0 {
        let kept = values[range.start * columns..range.end * columns].to_vec();
        (kept, [range.len(), columns])
    } else {
        let kept = values
            .chunks_exact(columns)
            .flat_map(|row| row[range.clone()].iter().copied())
            .collect();
        (kept, [rows, range.len()])
    };
    TensorData::new(kept, shape)
}

/// A run's starting weights.
pub enum Weights<'a> {
    /// Drawn from the seed, as `Llama::init`.
    Seeded(Seeded<'a>),
    /// Read from a Hugging Face checkpoint (checked against the config when opened).
    Checkpoint(HfCheckpoint),
    /// Read from a training checkpoint, to resume from it.
    Resumed(Resumed),
}

impl<'a> Weights<'a> {
    /// `config`'s starting weights: the newest training checkpoint when it resumes and there is
    /// one, else its `--init-from` checkpoint, else drawn from its seed.
    pub fn of(config: &'a TrainConfig) -> Result<Self, TrainError> {
        if let Some(checkpoints) = &config.checkpoint {
            let latest = burn_checkpoint::Checkpoint::latest(&checkpoints.dir)
                .map_err(|e| TrainError::Config(e.to_string()))?;
            match latest {
                Some(latest) if checkpoints.resume => {
                    check_resumable(config, &latest)?;
                    return Ok(Self::Resumed(Resumed(latest)));
                }
                // Another run's checkpoints would be mixed with this one's.
                Some(latest) => {
                    return Err(TrainError::Config(format!(
                        "{} already holds checkpoints (the newest after step {}); pass --resume to continue that run, or choose an empty --checkpoint-dir",
                        checkpoints.dir.display(),
                        latest.step()
                    )));
                }
                None => {}
            }
        }
        let Some(dir) = &config.init_from else {
            return Ok(Self::Seeded(Seeded {
                config: &config.model,
                seed: config.seed,
            }));
        };
        if !hf::load_config(dir)
            .map_err(TrainError::Config)?
            .same_model(&config.model)
        {
            return Err(TrainError::Config(format!(
                "{} holds a model of another shape than the one asked for; drop --model or pick the matching preset",
                dir.display()
            )));
        }
        let checkpoint = HfCheckpoint::open(dir, &config.model).map_err(|error| {
            let record = dir.join(format!("{}.mpk", hf::RECORD));
            TrainError::Config(match record.exists() {
                // Only safetensors can be read a slice at a time.
                true => format!("{error}; --init-from reads the safetensors that `llama train --save` writes beside {}", record.display()),
                false => error,
            })
        })?;
        Ok(Self::Checkpoint(checkpoint))
    }

    fn source(&self) -> &dyn ParamSource {
        match self {
            Self::Seeded(seeded) => seeded,
            Self::Checkpoint(checkpoint) => checkpoint,
            Self::Resumed(resumed) => resumed,
        }
    }

    /// The training checkpoint these weights resume from, if they do.
    pub fn resumed(&self) -> Option<&burn_checkpoint::Checkpoint> {
        match self {
            Self::Resumed(Resumed(checkpoint)) => Some(checkpoint),
            _ => None,
        }
    }

    /// The parts `keep` of the model of `plan` cut at `ranges` (as `Llama::cut` cuts), each
    /// holding this rank's slices at `at`; no other part and no other slice is built or read.
    pub fn parts<B: Backend>(
        &self,
        model: &LlamaConfig,
        plan: &ParallelPlan,
        ranges: &[Range<usize>],
        keep: &[usize],
        at: Slices<'_>,
        device: &B::Device,
    ) -> Result<Vec<Llama<B>>, TrainError> {
        self.each_part(model, plan, ranges, keep, at, device)
            .collect()
    }

    /// [`parts`](Self::parts), each read only when it is asked for.
    pub fn each_part<'s, B: Backend>(
        &'s self,
        model: &LlamaConfig,
        plan: &'s ParallelPlan,
        ranges: &[Range<usize>],
        keep: &'s [usize],
        at: Slices<'s>,
        device: &B::Device,
    ) -> impl Iterator<Item = Result<Llama<B>, TrainError>> + 's {
        let mut parts: Vec<Option<Llama<B>>> = Llama::shell(model, device)
            .cut(ranges)
            .into_iter()
            .map(Some)
            .collect();
        keep.iter().map(move |&s| {
            let part = parts[s].take().expect("each part is kept once");
            plan.load(part, at, self.source())
        })
    }

    /// The whole model, unsplit.
    pub fn whole<B: Backend>(
        &self,
        model: &LlamaConfig,
        device: &B::Device,
    ) -> Result<Llama<B>, TrainError> {
        let plan = ParallelPlan::new(&TrainConfig::new(model.clone(), 1))?;
        let all = 0..model.num_hidden_layers;
        let mut parts = self.parts(model, &plan, &[all], &[0], Slices::default(), device)?;
        Ok(parts.remove(0))
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};
    use burn_comm::launch;
    use burn_ddp::params::slots;
    use burn_tensor_parallel::TensorParallel;

    use super::*;

    type AD = Autodiff<Flex>;

    /// Every parameter's name and values, in visiting order.
    fn values(part: &Llama<AD>) -> Vec<(String, TensorData)> {
        slots::<AD, Llama<AD>>(part)
            .into_iter()
            .map(|slot| (slot.name, slot.value.into_data()))
            .collect()
    }

    #[test]
    fn every_rank_builds_and_reads_only_its_slices_of_the_same_model() {
        let ranges = [0..1, 1..3, 3..4];
        for tied in [false, true] {
            let config = LlamaConfig::preset("tiny")
                .unwrap()
                .with_tie_word_embeddings(tied);
            let whole = Llama::<AD>::init(&config, 5, &Default::default());
            let dir =
                std::env::temp_dir().join(format!("llama-weights-{}-{tied}", std::process::id()));
            // Sharded, so parts are read from several files.
            hf::save(&whole, &config, &dir, 1_000_000).unwrap();
            for tp in [1, 2, 4] {
                let results = launch(tp, |ctx| {
                    let group = (tp > 1).then(|| TensorParallel::new(ctx.world().clone()));
                    let group = group.as_ref();
                    let mut train = TrainConfig::new(config.clone(), 1);
                    train.tp = tp;
                    let plan = ParallelPlan::new(&train)?;
                    let device = Default::default();
                    let expected = whole
                        .clone()
                        .cut(&ranges)
                        .into_iter()
                        .map(|part| plan.shard(part, group))
                        .collect::<Result<Vec<_>, _>>()?;
                    let seeded = Weights::Seeded(Seeded {
                        config: &config,
                        seed: 5,
                    });
                    let checkpoint =
                        HfCheckpoint::open(&dir, &config).map_err(TrainError::Config)?;
                    let read = Weights::Checkpoint(checkpoint);
                    for weights in [&seeded, &read] {
                        let parts: Vec<_> = weights.parts(
                            &config,
                            &plan,
                            &ranges,
                            &[0, 1, 2],
                            Slices::tp(group),
                            &device,
                        )?;
                        assert_eq!(parts.len(), expected.len());
                        for (part, want) in parts.iter().zip(&expected) {
                            assert_eq!(part.part().layers, want.part().layers);
                            assert_eq!(values(part), values(want), "tp {tp}, tied {tied}");
                        }
                    }
                    // The last part alone reads exactly what it holds.
                    let checkpoint =
                        HfCheckpoint::open(&dir, &config).map_err(TrainError::Config)?;
                    let shell = Llama::<AD>::shell(&config, &device).cut(&ranges).remove(2);
                    let last = plan.load(shell, Slices::tp(group), &checkpoint)?;
                    let held: usize = slots::<AD, Llama<AD>>(&last)
                        .iter()
                        .map(|s| s.bytes())
                        .sum();
                    assert_eq!(checkpoint.bytes_read(), held as u64);
                    Ok::<_, TrainError>(held)
                });
                // What the plan gives a rank of the last part: a 1/tp of most matrices, the
                // shared key/value blocks' 2/tp at tp 4, the norms whole.
                let mut train = TrainConfig::new(config.clone(), 1);
                train.tp = tp;
                let plan = ParallelPlan::new(&train).unwrap();
                let last = whole.clone().cut(&ranges).remove(2);
                let share: usize = slots::<AD, Llama<AD>>(&last)
                    .iter()
                    .map(|slot| {
                        let rule = plan.rule(&slot.name).unwrap();
                        let shape = rule.placement.shape_per_rank(&rule.shape, tp, 1);
                        shape.iter().product::<usize>() * 4
                    })
                    .sum();
                for result in results {
                    assert_eq!(result.unwrap(), share, "tp {tp}");
                }
            }
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}
