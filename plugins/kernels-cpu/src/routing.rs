//! Mixture-of-experts routing: the `k` largest router scores per token, and the weighted
//! scatter of expert outputs back to their tokens' rows.

use u_sdk::{Result, UError};

/// For each row of `row_len` values of `x`, the indices of its `k` largest values, largest
/// first, ties to the lower index (as `torch.topk`), into `out` (`rows × k`).
pub fn top_k(x: &[f32], row_len: usize, k: usize, out: &mut [i32]) -> Result<()> {
    if row_len == 0 || k == 0 || k > row_len || !x.len().is_multiple_of(row_len) {
        return Err(UError::invalid(format!(
            "top_k: k {k} of rows of {row_len} ({} values)",
            x.len()
        )));
    }
    if out.len() != x.len() / row_len * k {
        return Err(UError::invalid(format!(
            "top_k: out holds {} indices for {} rows of k {k}",
            out.len(),
            x.len() / row_len
        )));
    }
    let mut order: Vec<usize> = Vec::with_capacity(row_len);
    for (row, o) in x.chunks_exact(row_len).zip(out.chunks_exact_mut(k)) {
        order.clear();
        order.extend(0..row_len);
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        for (o, &i) in o.iter_mut().zip(&order) {
            *o = i as i32;
        }
    }
    Ok(())
}

/// `out[ids[i]] += weights[i] · rows[i]` for rows of `row_len` values.
pub fn scatter_add(
    rows: &[f32],
    ids: &[i32],
    weights: &[f32],
    row_len: usize,
    out: &mut [f32],
) -> Result<()> {
    let n = ids.len();
    if row_len == 0 || rows.len() != n * row_len || weights.len() != n {
        return Err(UError::invalid(format!(
            "scatter_add: {} values of rows of {row_len}, {n} indices, {} weights",
            rows.len(),
            weights.len()
        )));
    }
    let targets = out.len() / row_len;
    for ((row, &id), &w) in rows.chunks_exact(row_len).zip(ids).zip(weights) {
        let t = usize::try_from(id)
            .ok()
            .filter(|&t| t < targets)
            .ok_or_else(|| {
                UError::invalid(format!(
                    "scatter_add: index {id} is outside the {targets} destination rows"
                ))
            })?;
        let o = &mut out[t * row_len..(t + 1) * row_len];
        o.iter_mut().zip(row).for_each(|(o, y)| *o += w * y);
    }
    Ok(())
}
