//! A device mesh: the world arranged as a grid with named dimensions.

use crate::{CommError, Communicator};

/// The world arranged as a grid with named dimensions (for example `dp`, `pp`, `tp`), the last
/// varying fastest: with `[("dp", 2), ("tp", 2)]`, ranks 0 and 1 form a `tp` group, so that
/// tensor-parallel peers, which talk the most, are neighbours (same node, NVLink).
///
/// For each dimension the calling rank gets the communicator of the ranks that differ from it
/// only along that dimension.
#[derive(Debug, Clone)]
pub struct DeviceMesh {
    names: Vec<String>,
    sizes: Vec<usize>,
    coords: Vec<usize>,
    groups: Vec<Communicator>,
}

impl DeviceMesh {
    /// Builds the mesh; a collective over `world`, so every rank calls it with the same `dims`.
    ///
    /// Fails when the sizes do not multiply to the world size, when a size is 0 or when a name
    /// repeats.
    pub fn new(world: &Communicator, dims: &[(&str, usize)]) -> Result<Self, CommError> {
        let names: Vec<String> = dims.iter().map(|(n, _)| n.to_string()).collect();
        let sizes: Vec<usize> = dims.iter().map(|&(_, s)| s).collect();
        let layout = describe(dims);
        if let Some((name, _)) = dims.iter().find(|(_, s)| *s == 0) {
            return Err(CommError::Config(format!(
                "mesh dimension '{name}' has size 0 in {layout}; every dimension needs at least 1 rank"
            )));
        }
        for (i, name) in names.iter().enumerate() {
            if names[..i].contains(name) {
                return Err(CommError::Config(format!(
                    "mesh dimension '{name}' appears twice in {layout}; give each dimension its own name"
                )));
            }
        }
        let product: usize = sizes.iter().product();
        if product != world.size() {
            return Err(CommError::Config(format!(
                "the mesh {layout} has {product} ranks but the world has {}; choose sizes whose product is {}",
                world.size(),
                world.size()
            )));
        }
        let coords = unravel(world.rank(), &sizes);
        let mut groups = Vec::with_capacity(dims.len());
        for d in 0..dims.len() {
            // Ranks that agree on every other coordinate share a colour.
            let mut others = coords.clone();
            others[d] = 0;
            let color = ravel(&others, &sizes);
            let fixed: Vec<String> = (0..dims.len())
                .filter(|&i| i != d)
                .map(|i| format!("{}={}", names[i], coords[i]))
                .collect();
            let name = format!("{}[{}]", names[d], fixed.join(","));
            groups.push(world.split(&name, color)?);
        }
        Ok(Self {
            names,
            sizes,
            coords,
            groups,
        })
    }

    fn index(&self, name: &str) -> Result<usize, CommError> {
        self.names.iter().position(|n| n == name).ok_or_else(|| {
            CommError::Config(format!(
                "the mesh has no dimension '{name}'; it has {:?}",
                self.names
            ))
        })
    }

    /// The communicator of this rank's group along dimension `name`.
    pub fn group(&self, name: &str) -> Result<&Communicator, CommError> {
        Ok(&self.groups[self.index(name)?])
    }

    /// The size of dimension `name`.
    pub fn size(&self, name: &str) -> Result<usize, CommError> {
        Ok(self.sizes[self.index(name)?])
    }

    /// This rank's coordinate along dimension `name`.
    pub fn coord(&self, name: &str) -> Result<usize, CommError> {
        Ok(self.coords[self.index(name)?])
    }

    /// The dimension names, slowest first.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The global rank at `coords` (one per dimension, in order).
    pub fn rank_at(&self, coords: &[usize]) -> Result<usize, CommError> {
        if coords.len() != self.sizes.len() || coords.iter().zip(&self.sizes).any(|(c, s)| c >= s) {
            return Err(CommError::Config(format!(
                "coordinates {coords:?} are outside the mesh {}",
                describe(
                    &self
                        .names
                        .iter()
                        .map(String::as_str)
                        .zip(self.sizes.iter().copied())
                        .collect::<Vec<_>>()
                )
            )));
        }
        Ok(ravel(coords, &self.sizes))
    }
}

fn describe(dims: &[(&str, usize)]) -> String {
    let parts: Vec<String> = dims.iter().map(|(n, s)| format!("{n}={s}")).collect();
    parts.join(" x ")
}

/// Row-major index of `coords`, the last dimension fastest.
fn ravel(coords: &[usize], sizes: &[usize]) -> usize {
    coords.iter().zip(sizes).fold(0, |acc, (c, s)| acc * s + c)
}

fn unravel(mut index: usize, sizes: &[usize]) -> Vec<usize> {
    let mut coords = vec![0; sizes.len()];
    for d in (0..sizes.len()).rev() {
        coords[d] = index % sizes[d];
        index /= sizes[d];
    }
    coords
}
