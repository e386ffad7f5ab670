//! Token embedding lookup.

use rayon::prelude::*;

/// `out (N, C)` = rows `ids (N)` of `table (V, C)`; ids were checked against `V` by the caller.
pub fn embedding_forward(out: &mut [f32], ids: &[u32], table: &[f32], c: usize) {
    out.par_chunks_mut(c)
        .zip(ids.par_iter())
        .for_each(|(o, &id)| {
            let start = id as usize * c;
            o.copy_from_slice(&table[start..start + c]);
        });
}

/// Backward of [`embedding_forward`]: `dtable (V, C) +=` each row of `dout (N, C)` at its id.
pub fn embedding_backward(dtable: &mut [f32], dout: &[f32], ids: &[u32], c: usize) {
    for (d, &id) in dout.chunks(c).zip(ids) {
        let start = id as usize * c;
        for (t, d) in dtable[start..start + c].iter_mut().zip(d) {
            *t += d;
        }
    }
}

/// The rows of `ids` grouped by id, for a backward pass that sums each id's rows in a fixed
/// order: `order` lists the rows by ascending id (rows of one id ascending), and `starts[s]` is
/// where the `s`-th distinct id's rows begin in `order`; `starts` has `ids.len() + 1` entries,
/// those past the last distinct id equal to `ids.len()` (empty groups).
pub fn embedding_rows(ids: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let n = ids.len();
    let mut order: Vec<u32> = (0..n as u32).collect();
    order.sort_by_key(|&row| ids[row as usize]);
    let mut starts = Vec::with_capacity(n + 1);
    for (i, &row) in order.iter().enumerate() {
        if i == 0 || ids[row as usize] != ids[order[i - 1] as usize] {
            starts.push(i as u32);
        }
    }
    starts.resize(n + 1, n as u32);
    (order, starts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedding_rows_group_each_id_in_row_order_and_pad_the_starts() {
        let (order, starts) = embedding_rows(&[5, 2, 5, 0, 2, 5]);
        assert_eq!(order, [3, 1, 4, 0, 2, 5]);
        assert_eq!(starts, [0, 1, 3, 6, 6, 6, 6]);
        assert_eq!(embedding_rows(&[]), (vec![], vec![0]));
        assert_eq!(embedding_rows(&[7]), (vec![0], vec![0, 1]));
    }
}
