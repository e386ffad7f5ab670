//! The paged KV cache: fixed-size blocks of positions in one flat buffer, a block table per
//! sequence, reference-counted blocks so sequences forked from one prompt share its blocks.
//!
//! A block holds `P` positions of every layer's keys and values, laid out `(L, 2, P, K*D)`, so a
//! sequence's position `t` lives in block `table[t / P]` at slot `t % P`. [`BlockTables`] owns the
//! bookkeeping and no storage; [`PagedKv`] pairs it with the storage (a view of the `kv_cache`
//! buffer) for the length of one model call and implements the model's [`KvCache`].
//!
//! Sharing: [`BlockTables::fork`] gives a new sequence the same blocks (each block's count goes
//! up). Before a sequence writes into a block that others hold, [`BlockTables::prepare_append`]
//! copies that block to a fresh one (copy-on-write); only the last, partly filled block of a
//! prompt is ever copied, since full blocks are never written again.

use miles_core::model::{KvCache, LlamaConfig, ModelError};

use crate::InferError;

/// A sequence's positions and the blocks that hold them.
#[derive(Clone, Debug, Default)]
struct SeqTable {
    blocks: Vec<usize>,
    len: usize,
}

/// Block tables, reference counts and the free list of a paged KV cache.
#[derive(Clone, Debug)]
pub struct BlockTables {
    block_size: usize,
    block_floats: usize,
    layer_floats: usize,
    kv_dim: usize,
    refs: Vec<u32>,
    free: Vec<usize>,
    seqs: Vec<Option<SeqTable>>,
}

impl BlockTables {
    /// Tables for `num_blocks` blocks of `block_size` positions under `config`.
    pub fn new(config: &LlamaConfig, num_blocks: usize, block_size: usize) -> Self {
        let kv_dim = config.kv_dim();
        let layer_floats = 2 * block_size * kv_dim;
        Self {
            block_size,
            block_floats: config.num_layers * layer_floats,
            layer_floats,
            kv_dim,
            refs: vec![0; num_blocks],
            // Popped from the back: hand out low block indices first.
            free: (0..num_blocks).rev().collect(),
            seqs: Vec::new(),
        }
    }

    /// Floats one block takes in the storage buffer.
    pub fn block_floats(config: &LlamaConfig, block_size: usize) -> usize {
        config.num_layers * 2 * block_size * config.kv_dim()
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the cache.
    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks no sequence holds.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Floats the storage buffer must hold.
    pub fn storage_floats(&self) -> usize {
        self.num_blocks() * self.block_floats
    }

    /// Blocks needed to hold `positions` positions.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_size)
    }

    /// A new empty sequence; returns its id.
    pub fn add_seq(&mut self) -> usize {
        match self.seqs.iter().position(Option::is_none) {
            Some(id) => {
                self.seqs[id] = Some(SeqTable::default());
                id
            }
            None => {
                self.seqs.push(Some(SeqTable::default()));
                self.seqs.len() - 1
            }
        }
    }

    /// A new sequence holding the same positions and blocks as `src`; returns its id.
    ///
    /// # Errors
    /// [`InferError::Internal`] for an unknown `src`.
    pub fn fork(&mut self, src: usize) -> Result<usize, InferError> {
        let table = self.table(src)?.clone();
        for &block in &table.blocks {
            self.refs[block] += 1;
        }
        let id = self.add_seq();
        self.seqs[id] = Some(table);
        Ok(id)
    }

    /// Drops sequence `seq`, freeing the blocks no other sequence holds.
    ///
    /// # Errors
    /// [`InferError::Internal`] for an unknown `seq`.
    pub fn free_seq(&mut self, seq: usize) -> Result<(), InferError> {
        let table = self
            .seqs
            .get_mut(seq)
            .and_then(Option::take)
            .ok_or_else(|| unknown(seq))?;
        for block in table.blocks {
            self.release(block);
        }
        Ok(())
    }

    /// Drops every sequence: all blocks are free.
    pub fn clear(&mut self) {
        self.seqs.clear();
        self.refs.fill(0);
        self.free = (0..self.refs.len()).rev().collect();
    }

    /// Positions cached for `seq`.
    ///
    /// # Errors
    /// [`InferError::Internal`] for an unknown `seq`.
    pub fn seq_len(&self, seq: usize) -> Result<usize, InferError> {
        Ok(self.table(seq)?.len)
    }

    /// Live sequences.
    pub fn live_seqs(&self) -> usize {
        self.seqs.iter().flatten().count()
    }

    /// Blocks that appending one position to `seq` takes: one for a new block or for the copy of
    /// a shared last block, else none.
    ///
    /// # Errors
    /// [`InferError::Internal`] for an unknown `seq`.
    pub fn append_cost(&self, seq: usize) -> Result<usize, InferError> {
        let table = self.table(seq)?;
        match table.blocks.get(table.len / self.block_size) {
            None => Ok(1),
            Some(&last) => Ok(usize::from(self.refs[last] > 1)),
        }
    }

    /// Makes the slot of `seq`'s next position writable: takes a fresh block when the last is
    /// full, or copies a last block that other sequences share (copy-on-write). Returns `false`,
    /// changing nothing, when no block is free.
    ///
    /// # Errors
    /// [`InferError::Internal`] for an unknown `seq`.
    pub fn prepare_append(&mut self, seq: usize, storage: &mut [f32]) -> Result<bool, InferError> {
        let floats = self.block_floats;
        self.prepare_append_with(seq, |from, to| {
            copy_host_block(storage, floats, from, to);
            Ok(())
        })
    }

    /// [`prepare_append`](Self::prepare_append) for storage the tables cannot reach (a device
    /// cache): `copy_block(from, to)` copies a shared block into a fresh one.
    ///
    /// # Errors
    /// [`InferError::Internal`] for an unknown `seq`; the copy's error, and the tables are
    /// unchanged then.
    pub fn prepare_append_with(
        &mut self,
        seq: usize,
        copy_block: impl FnOnce(usize, usize) -> Result<(), InferError>,
    ) -> Result<bool, InferError> {
        if self.append_cost(seq)? == 0 {
            return Ok(true);
        }
        let Some(fresh) = self.free.pop() else {
            return Ok(false);
        };
        let bs = self.block_size;
        let table = self.seqs[seq].as_mut().ok_or_else(|| unknown(seq))?;
        let slot = table.len / bs;
        if slot == table.blocks.len() {
            table.blocks.push(fresh);
        } else {
            let shared = table.blocks[slot];
            if let Err(error) = copy_block(shared, fresh) {
                self.free.push(fresh);
                return Err(error);
            }
            table.blocks[slot] = fresh;
            self.release(shared);
        }
        self.refs[fresh] = 1;
        Ok(true)
    }

    /// Gives the empty sequence `seq` the blocks of its first `positions` positions at once (a
    /// prompt about to be prefilled), so that growing it to that length takes no block. Returns
    /// `false`, changing nothing, when too few blocks are free.
    ///
    /// # Errors
    /// [`InferError::Internal`] for an unknown or non-empty `seq`.
    pub fn reserve(&mut self, seq: usize, positions: usize) -> Result<bool, InferError> {
        let need = self.blocks_for(positions);
        let table = self.table(seq)?;
        if table.len != 0 || !table.blocks.is_empty() {
            return Err(InferError::Internal(format!(
                "kv sequence {seq} already holds {} positions; reserve only empty sequences",
                table.len
            )));
        }
        if need > self.free.len() {
            return Ok(false);
        }
        let blocks = self.free.split_off(self.free.len() - need);
        for &block in &blocks {
            self.refs[block] = 1;
        }
        // The free list pops from the back: keep the order in which pops would have come.
        let table = self.seqs[seq].as_mut().ok_or_else(|| unknown(seq))?;
        table.blocks = blocks.into_iter().rev().collect();
        Ok(true)
    }

    /// Counts `n` more positions of `seq` as cached, once their slots are writable (reserved, or
    /// prepared with [`prepare_append`](Self::prepare_append)); returns the first new position.
    /// For a device cache, whose kernels write the keys and values themselves.
    ///
    /// # Errors
    /// [`InferError::Internal`] for an unknown `seq` or a slot that is not writable; nothing
    /// changes then.
    pub fn advance(&mut self, seq: usize, n: usize) -> Result<usize, InferError> {
        let bs = self.block_size;
        let table = self.table(seq)?;
        let first = table.len;
        if n == 0 {
            return Ok(first);
        }
        let end = first + n;
        let writable = table.blocks.len() * bs >= end
            && (first / bs..end.div_ceil(bs)).all(|b| self.refs[table.blocks[b]] == 1);
        if !writable {
            return Err(InferError::Internal(format!(
                "kv sequence {seq} cannot grow from {first} to {end} positions: its slots are not prepared"
            )));
        }
        let table = self.seqs[seq].as_mut().ok_or_else(|| unknown(seq))?;
        table.len = end;
        Ok(first)
    }

    /// The blocks holding `seq`'s positions, in order.
    ///
    /// # Errors
    /// [`InferError::Internal`] for an unknown `seq`.
    pub fn blocks(&self, seq: usize) -> Result<&[usize], InferError> {
        Ok(&self.table(seq)?.blocks)
    }

    fn release(&mut self, block: usize) {
        debug_assert!(self.refs[block] > 0, "block {block} released twice");
        self.refs[block] -= 1;
        if self.refs[block] == 0 {
            self.free.push(block);
        }
    }

    fn table(&self, seq: usize) -> Result<&SeqTable, InferError> {
        self.seqs
            .get(seq)
            .and_then(Option::as_ref)
            .ok_or_else(|| unknown(seq))
    }

    /// The first float of `layer`'s keys (`half` 0) or values (`half` 1) of `seq` at `pos`.
    fn offset(&self, layer: usize, seq: usize, pos: usize, half: usize) -> usize {
        // Callers index below `len`, which `KvCache::key` requires of them.
        let block = self.seqs[seq]
            .as_ref()
            .map_or(0, |t| t.blocks[pos / self.block_size]);
        block * self.block_floats
            + layer * self.layer_floats
            + (half * self.block_size + pos % self.block_size) * self.kv_dim
    }
}

/// Copies block `from` of a host cache over block `to`.
pub(crate) fn copy_host_block(storage: &mut [f32], block_floats: usize, from: usize, to: usize) {
    storage.copy_within(
        from * block_floats..(from + 1) * block_floats,
        to * block_floats,
    );
}

fn unknown(seq: usize) -> InferError {
    InferError::Internal(format!("kv sequence {seq} is not live in the block tables"))
}

/// The paged cache for one model call: the tables and a view of the storage buffer.
pub struct PagedKv<'a> {
    /// The bookkeeping.
    pub tables: &'a mut BlockTables,
    /// The blocks, `(blocks, L, 2, P, K*D)`.
    pub storage: &'a mut [f32],
}

impl KvCache for PagedKv<'_> {
    fn len(&self, seq: usize) -> Result<usize, ModelError> {
        self.tables
            .table(seq)
            .map(|t| t.len)
            .map_err(|e| ModelError::KvCache(e.to_string()))
    }

    fn grow(&mut self, seq: usize) -> Result<usize, ModelError> {
        let ready = self
            .tables
            .prepare_append(seq, self.storage)
            .map_err(|e| ModelError::KvCache(e.to_string()))?;
        if !ready {
            return Err(ModelError::KvCache(format!(
                "no free block for sequence {seq}; the engine reserves blocks before each step"
            )));
        }
        let table = self.tables.seqs[seq]
            .as_mut()
            .ok_or_else(|| ModelError::KvCache(unknown(seq).to_string()))?;
        table.len += 1;
        Ok(table.len - 1)
    }

    fn write(
        &mut self,
        layer: usize,
        seq: usize,
        pos: usize,
        key: &[f32],
        value: &[f32],
    ) -> Result<(), ModelError> {
        let kvd = self.tables.kv_dim;
        if pos >= self.len(seq)? || key.len() != kvd || value.len() != kvd {
            return Err(ModelError::KvCache(format!(
                "cannot write layer {layer} position {pos} of sequence {seq}: call grow first"
            )));
        }
        let k = self.tables.offset(layer, seq, pos, 0);
        let v = self.tables.offset(layer, seq, pos, 1);
        self.storage[k..k + kvd].copy_from_slice(key);
        self.storage[v..v + kvd].copy_from_slice(value);
        Ok(())
    }

    fn key(&self, layer: usize, seq: usize, pos: usize) -> &[f32] {
        let o = self.tables.offset(layer, seq, pos, 0);
        &self.storage[o..o + self.tables.kv_dim]
    }

    fn value(&self, layer: usize, seq: usize, pos: usize) -> &[f32] {
        let o = self.tables.offset(layer, seq, pos, 1);
        &self.storage[o..o + self.tables.kv_dim]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tables(blocks: usize, block_size: usize) -> (BlockTables, Vec<f32>) {
        let config = LlamaConfig::preset("tiny").unwrap();
        let t = BlockTables::new(&config, blocks, block_size);
        let storage = vec![0.0; t.storage_floats()];
        (t, storage)
    }

    fn append(kv: &mut PagedKv<'_>, seq: usize, value: f32) {
        let pos = kv.grow(seq).unwrap();
        let kvd = kv.tables.kv_dim;
        for layer in 0..2 {
            let key: Vec<f32> = (0..kvd).map(|i| value + i as f32 + layer as f32).collect();
            let val: Vec<f32> = key.iter().map(|x| -x).collect();
            kv.write(layer, seq, pos, &key, &val).unwrap();
        }
    }

    #[test]
    fn forks_share_full_blocks_and_copy_the_partial_one_on_write() {
        let (mut t, mut storage) = tables(8, 4);
        let prompt = t.add_seq();
        assert!(t.prepare_append(prompt, &mut storage).unwrap());
        assert_eq!(
            t.append_cost(prompt).unwrap(),
            0,
            "a prepared slot costs nothing more"
        );
        let mut kv = PagedKv {
            tables: &mut t,
            storage: &mut storage,
        };
        for i in 0..6 {
            append(&mut kv, prompt, 10.0 * i as f32 + 1.0);
        }
        assert_eq!(t.free_blocks(), 6);
        let a = t.fork(prompt).unwrap();
        let b = t.fork(prompt).unwrap();
        assert_eq!(t.free_blocks(), 6, "forks take no block");
        assert_eq!(
            t.append_cost(a).unwrap(),
            1,
            "the shared partial block is copied"
        );
        let mut kv = PagedKv {
            tables: &mut t,
            storage: &mut storage,
        };
        append(&mut kv, a, 500.0);
        append(&mut kv, b, 900.0);
        for pos in 0..6 {
            assert_eq!(kv.key(1, a, pos), kv.key(1, prompt, pos), "position {pos}");
            assert_eq!(
                kv.value(0, b, pos),
                kv.value(0, prompt, pos),
                "position {pos}"
            );
        }
        assert_eq!(kv.key(0, a, 6)[0], 500.0);
        assert_eq!(kv.key(0, b, 6)[0], 900.0);
        assert_eq!(kv.len(prompt).unwrap(), 6, "the prompt did not grow");
        assert_eq!(t.free_blocks(), 4, "one copy per fork");
        t.free_seq(prompt).unwrap();
        t.free_seq(a).unwrap();
        assert_eq!(
            t.free_blocks(),
            6,
            "b still holds the first block and its copy"
        );
        t.free_seq(b).unwrap();
        assert_eq!(t.free_blocks(), 8);
        assert!(matches!(t.free_seq(b), Err(InferError::Internal(_))));
    }

    #[test]
    fn reserved_prompts_advance_without_taking_blocks_and_forks_copy_through_the_callback() {
        let (mut t, _) = tables(6, 4);
        let prompt = t.add_seq();
        assert!(!t.reserve(prompt, 25).unwrap(), "7 blocks do not fit in 6");
        assert_eq!(t.free_blocks(), 6, "a refused reservation takes nothing");
        assert!(t.reserve(prompt, 6).unwrap());
        assert_eq!(
            t.blocks(prompt).unwrap(),
            [0, 1],
            "the blocks appends would take"
        );
        assert!(matches!(t.reserve(prompt, 1), Err(InferError::Internal(_))));
        assert_eq!(t.advance(prompt, 6).unwrap(), 0);
        assert_eq!(t.seq_len(prompt).unwrap(), 6);
        assert!(
            matches!(t.advance(prompt, 3), Err(InferError::Internal(_))),
            "positions 6..9 reach a block never prepared"
        );
        let fork = t.fork(prompt).unwrap();
        assert!(
            matches!(t.advance(fork, 1), Err(InferError::Internal(_))),
            "the shared partial block must be copied first"
        );
        let mut copies = Vec::new();
        let ready = t
            .prepare_append_with(fork, |from, to| {
                copies.push((from, to));
                Ok(())
            })
            .unwrap();
        assert!(ready);
        assert_eq!(
            copies,
            [(1, 2)],
            "the partial block 1 goes to fresh block 2"
        );
        assert_eq!(t.blocks(fork).unwrap(), [0, 2]);
        assert_eq!(t.advance(fork, 1).unwrap(), 6);
        let copied = t.prepare_append_with(prompt, |_, _| panic!("nothing to copy"));
        assert!(
            copied.unwrap(),
            "the prompt's own partial block is no longer shared"
        );
        let other = t.fork(fork).unwrap();
        let free = t.free_blocks();
        let err = t.prepare_append_with(other, |_, _| Err(InferError::Internal("copy".into())));
        assert!(matches!(err, Err(InferError::Internal(_))));
        assert_eq!(t.free_blocks(), free, "a failed copy takes no block");
        assert_eq!(t.blocks(other).unwrap(), [0, 2]);
    }

    #[test]
    fn a_full_cache_refuses_to_grow_and_changes_nothing() {
        let (mut t, mut storage) = tables(2, 2);
        let s = t.add_seq();
        let mut kv = PagedKv {
            tables: &mut t,
            storage: &mut storage,
        };
        for i in 0..4 {
            append(&mut kv, s, i as f32 + 1.0);
        }
        assert!(matches!(kv.grow(s), Err(ModelError::KvCache(_))));
        assert_eq!(kv.len(s).unwrap(), 4);
        assert!(!t.prepare_append(s, &mut storage).unwrap());
        t.clear();
        assert_eq!((t.free_blocks(), t.live_seqs()), (2, 0));
    }
}
