//! The flat units of the model and how each is sharded over the data-parallel ranks.
//!
//! A unit is a contiguous block of the [`ParamLayout`]: the embedding, each decoder layer, and
//! the head (final norm, plus the LM head when it is not tied to the embedding). Each unit is
//! padded to a multiple of the rank count and cut into equal shards; rank `r` holds shard `r` of
//! every unit, and its shards sit one after another in one flat buffer.

use std::ops::Range;

use miles_core::model::{LlamaConfig, ParamKind, ParamLayout};

/// What a unit holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitKind {
    /// The token embedding (also the LM head when tied).
    Embedding,
    /// A decoder layer.
    Layer(usize),
    /// The final norm and the untied LM head.
    Head,
}

/// One unit: its block of the full parameter buffer and its shard in each rank's flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    /// What it holds.
    pub kind: UnitKind,
    /// Its elements in the full parameter buffer.
    pub range: Range<usize>,
    /// Elements of one rank's shard (the unit padded to a multiple of the ranks, divided).
    pub shard_len: usize,
    /// Where its shard starts in a rank's flat shard buffer.
    pub shard_offset: usize,
}

impl Unit {
    /// Its shard's elements in a rank's flat shard buffer.
    pub fn shard_range(&self) -> Range<usize> {
        self.shard_offset..self.shard_offset + self.shard_len
    }

    /// Elements of the padded unit (`ranks * shard_len`).
    pub fn padded_len(&self, ranks: usize) -> usize {
        self.shard_len * ranks
    }
}

/// Every unit of a model sharded over `ranks` data-parallel ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitPlan {
    units: Vec<Unit>,
    ranks: usize,
    tied: bool,
    shard_total: usize,
}

impl UnitPlan {
    /// The units of `layout` (of `config`) over `ranks` ranks (at least one).
    pub fn new(config: &LlamaConfig, layout: &ParamLayout, ranks: usize) -> UnitPlan {
        let ranks = ranks.max(1);
        let mut blocks = vec![(UnitKind::Embedding, layout.range(ParamKind::Embedding, 0))];
        blocks.extend((0..config.num_layers).map(|l| (UnitKind::Layer(l), layout.layer_range(l))));
        blocks.push((
            UnitKind::Head,
            layout.range(ParamKind::FinalNorm, 0).start..layout.len(),
        ));
        let mut shard_offset = 0;
        let units = blocks
            .into_iter()
            .map(|(kind, range)| {
                let shard_len = range.len().div_ceil(ranks);
                let unit = Unit {
                    kind,
                    range,
                    shard_len,
                    shard_offset,
                };
                shard_offset += shard_len;
                unit
            })
            .collect();
        UnitPlan {
            units,
            ranks,
            tied: config.tie_word_embeddings,
            shard_total: shard_offset,
        }
    }

    /// The units in forward order: embedding, layers, head.
    pub fn units(&self) -> &[Unit] {
        &self.units
    }

    /// The embedding unit.
    pub fn embedding(&self) -> &Unit {
        &self.units[0]
    }

    /// The unit of decoder layer `layer`.
    pub fn layer(&self, layer: usize) -> &Unit {
        &self.units[1 + layer]
    }

    /// The head unit.
    pub fn head(&self) -> &Unit {
        &self.units[self.units.len() - 1]
    }

    /// The data-parallel ranks.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Whether the LM head is the embedding (so the head pass also gathers the embedding unit).
    pub fn tied(&self) -> bool {
        self.tied
    }

    /// Elements of one rank's flat shard buffer (every unit's shard).
    pub fn shard_total(&self) -> usize {
        self.shard_total
    }

    /// Elements of the gathered-parameter buffer: the largest unit, or the head plus the
    /// embedding when tied (the head pass needs both at once).
    pub fn gathered_len(&self) -> usize {
        let r = self.ranks;
        let largest = self
            .units
            .iter()
            .map(|u| u.padded_len(r))
            .max()
            .unwrap_or(0);
        let tied_head = if self.tied {
            self.head().padded_len(r) + self.embedding().padded_len(r)
        } else {
            0
        };
        largest.max(tied_head)
    }

    /// Elements of the gathered-gradient buffer: the largest unit's full gradient, plus, when
    /// tied, the embedding's, which the head starts and the embedding pass finishes.
    pub fn gathered_grad_len(&self) -> usize {
        let r = self.ranks;
        let largest = self
            .units
            .iter()
            .map(|u| u.padded_len(r))
            .max()
            .unwrap_or(0);
        if self.tied {
            largest + self.embedding().padded_len(r)
        } else {
            largest
        }
    }

    /// Copies rank `rank`'s shards of every unit out of a full buffer (padding as zeros).
    pub fn shard_of(&self, full: &[f32], rank: usize, shards: &mut [f32]) {
        for unit in &self.units {
            let dst = &mut shards[unit.shard_range()];
            dst.fill(0.0);
            let start = unit.range.start + rank * unit.shard_len;
            let end = (start + unit.shard_len).min(unit.range.end);
            if start < end {
                dst[..end - start].copy_from_slice(&full[start..end]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_of_every_rank_cover_each_parameter_exactly_once() {
        for (preset, ranks) in [("tiny", 1), ("tiny", 3), ("small", 4)] {
            let c = LlamaConfig::preset(preset).unwrap();
            let layout = ParamLayout::new(&c);
            let plan = UnitPlan::new(&c, &layout, ranks);
            assert_eq!(plan.units().len(), c.num_layers + 2);
            let full: Vec<f32> = (0..layout.len()).map(|i| i as f32 + 1.0).collect();
            let mut seen = vec![0u32; layout.len()];
            for rank in 0..ranks {
                let mut shards = vec![0.0; plan.shard_total()];
                plan.shard_of(&full, rank, &mut shards);
                for x in shards.into_iter().filter(|&x| x != 0.0) {
                    seen[x as usize - 1] += 1;
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "{preset} over {ranks}");
            let covered: usize = plan.units().iter().map(|u| u.range.len()).sum();
            assert_eq!(covered, layout.len());
        }
    }

    #[test]
    fn gathered_buffers_fit_every_pass() {
        let c = LlamaConfig::preset("tiny").unwrap();
        let plan = UnitPlan::new(&c, &ParamLayout::new(&c), 3);
        let (e, h) = (plan.embedding().padded_len(3), plan.head().padded_len(3));
        assert!(plan.tied());
        assert!(plan.gathered_len() >= e + h);
        assert!(plan.gathered_grad_len() >= e + plan.layer(0).padded_len(3));
    }
}
