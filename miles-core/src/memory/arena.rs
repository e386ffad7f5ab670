//! The allocator inside one region's arena: first-fit over a free list of aligned blocks, and a
//! count of blocks per granule so physical memory is committed and released granule by granule.

use std::collections::BTreeMap;
use std::ops::Range;

/// Alignment of every block: enough for any element type and for vector loads.
pub(crate) const BLOCK_ALIGN: usize = 256;

/// Blocks of one arena of `len` bytes, in granules of `granule` bytes.
#[derive(Debug)]
pub(crate) struct Arena {
    len: usize,
    granule: usize,
    /// Free blocks: offset -> length, coalesced.
    free: BTreeMap<usize, usize>,
    /// Live blocks touching each granule.
    users: Vec<u32>,
}

impl Arena {
    pub(crate) fn new(len: usize, granule: usize) -> Arena {
        let mut free = BTreeMap::new();
        if len > 0 {
            free.insert(0, len);
        }
        Arena {
            len,
            granule,
            free,
            users: vec![0; len / granule],
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Size of the block that holds `len` bytes; `None` when it does not fit a `usize`.
    pub(crate) fn block_size(len: usize) -> Option<usize> {
        len.max(1).checked_next_multiple_of(BLOCK_ALIGN)
    }

    /// Take a block of `size` bytes (a multiple of [`BLOCK_ALIGN`]); returns its offset.
    pub(crate) fn alloc(&mut self, size: usize) -> Option<usize> {
        let (&offset, &len) = self.free.iter().find(|&(_, &len)| len >= size)?;
        self.free.remove(&offset);
        if len > size {
            self.free.insert(offset + size, len - size);
        }
        Some(offset)
    }

    /// Give a block back, merging it with free neighbours.
    pub(crate) fn free(&mut self, offset: usize, size: usize) {
        let mut start = offset;
        let mut len = size;
        if let Some((&prev, &prev_len)) = self.free.range(..offset).next_back()
            && prev + prev_len == offset
        {
            self.free.remove(&prev);
            start = prev;
            len += prev_len;
        }
        if let Some(&next_len) = self.free.get(&(offset + size)) {
            self.free.remove(&(offset + size));
            len += next_len;
        }
        self.free.insert(start, len);
    }

    /// Count a block as a user of its granules; returns the granule runs that had no user
    /// before (to commit).
    pub(crate) fn pin(&mut self, offset: usize, size: usize) -> Vec<Range<usize>> {
        let granules = self.granules_of(offset, size);
        let fresh: Vec<usize> = granules.clone().filter(|&g| self.users[g] == 0).collect();
        granules.for_each(|g| self.users[g] += 1);
        runs_of(fresh)
    }

    /// Stop counting a block as a user of its granules; returns the granule runs left without
    /// users (to release).
    pub(crate) fn unpin(&mut self, offset: usize, size: usize) -> Vec<Range<usize>> {
        let granules = self.granules_of(offset, size);
        granules.clone().for_each(|g| self.users[g] -= 1);
        runs_of(granules.filter(|&g| self.users[g] == 0).collect())
    }

    /// Runs of granules that have users (the committed memory).
    pub(crate) fn committed(&self) -> Vec<Range<usize>> {
        runs_of(
            (0..self.users.len())
                .filter(|&g| self.users[g] > 0)
                .collect(),
        )
    }

    fn granules_of(&self, offset: usize, size: usize) -> Range<usize> {
        offset / self.granule..(offset + size).div_ceil(self.granule)
    }
}

/// Ascending indices grouped into contiguous runs.
fn runs_of(indices: Vec<usize>) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for index in indices {
        match runs.last_mut() {
            Some(run) if run.end == index => run.end += 1,
            _ => runs.push(index..index + 1),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_never_overlap_and_coalesce_when_freed() {
        let mut arena = Arena::new(8 * 1024, 1024);
        let a = arena.alloc(512).unwrap();
        let b = arena.alloc(1536).unwrap();
        let c = arena.alloc(256).unwrap();
        assert!(a + 512 <= b && b + 1536 <= c);
        assert_eq!(arena.pin(a, 512), vec![0..1]);
        assert_eq!(arena.pin(b, 1536), vec![1..2]);
        assert_eq!(arena.pin(c, 256), vec![2..3]);
        assert_eq!(arena.committed(), vec![0..3]);
        assert_eq!(arena.unpin(b, 1536), vec![1..2]);
        arena.free(b, 1536);
        assert_eq!(arena.unpin(a, 512), vec![0..1]);
        arena.free(a, 512);
        assert_eq!(arena.committed(), vec![2..3]);
        assert_eq!(arena.alloc(2048), Some(0));
        assert_eq!(arena.alloc(8 * 1024), None);
    }
}
