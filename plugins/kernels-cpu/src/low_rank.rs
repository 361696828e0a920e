//! Low-rank adapter deltas for a batch whose rows run under different adapters
//! ([`u_sdk::Op::LowRank`]): per row and per entry of its table, `t = s · A[c..c+r] · x`, then
//! `out += Bᵀ[c..c+r]ᵀ · t`. Each row reads only its own adapters' rows of the stacks, so the
//! cost is the rows' own ranks, however the adapters interleave in the batch.
//!
//! The dot products and row updates are [`VecOps`]' (one fixed summation order, vectorized for
//! the ISA), so the result is the same on every machine.

use crate::vecops::VecOps;
use u_sdk::{Result, UError};

/// Adds the adapters' deltas to `out` (`[rows, outputs]`) with `vec`'s helpers: `x` `[rows, inputs]`, `a` `[ΣR,
/// inputs]`, `bt` `[ΣR, outputs]`, `table` `[rows, 3·k]` (first column, rank, scale per entry).
pub fn low_rank(
    vec: &VecOps,
    x: &[f32],
    a: &[f32],
    bt: &[f32],
    table: &[f32],
    inputs: usize,
    out: &mut [f32],
) -> Result<()> {
    let bad = |why: String| UError::invalid(format!("low_rank: {why}"));
    if inputs == 0 || !x.len().is_multiple_of(inputs) || !a.len().is_multiple_of(inputs) {
        return Err(bad(format!(
            "{} inputs, {} of x, {} of A",
            inputs,
            x.len(),
            a.len()
        )));
    }
    let (rows, columns) = (x.len() / inputs, a.len() / inputs);
    let outputs = out.len().checked_div(rows).unwrap_or(0);
    if columns == 0 || bt.len() != columns * outputs || out.len() != rows * outputs {
        return Err(bad(format!(
            "{rows} rows, {columns} columns: Bᵀ holds {} values, the output {}",
            bt.len(),
            out.len()
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    let per_row = table.len() / rows;
    if table.len() != rows * per_row || !per_row.is_multiple_of(3) {
        return Err(bad(format!(
            "a table of {} values for {rows} rows",
            table.len()
        )));
    }
    let mut t = vec![0f32; columns];
    for (i, entries) in table.chunks_exact(per_row.max(1)).enumerate().take(rows) {
        let xi = &x[i * inputs..(i + 1) * inputs];
        let oi = &mut out[i * outputs..(i + 1) * outputs];
        for e in entries.chunks_exact(3) {
            let (first, rank, scale) = (e[0] as usize, e[1] as usize, e[2]);
            if rank == 0 || scale == 0.0 {
                continue;
            }
            if first + rank > columns || e[0] < 0.0 || e[1] < 0.0 {
                return Err(bad(format!(
                    "row {i}: columns {}..{} of {columns}",
                    e[0],
                    e[0] + e[1]
                )));
            }
            for (c, tc) in t[..rank].iter_mut().enumerate() {
                *tc = scale * vec.dot(&a[(first + c) * inputs..(first + c + 1) * inputs], xi);
            }
            for (c, &tc) in t[..rank].iter().enumerate() {
                vec.axpy(
                    oi,
                    tc,
                    &bt[(first + c) * outputs..(first + c + 1) * outputs],
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the plain sums in f64: two rows under different adapters (one with two entries),
    /// one under none.
    #[test]
    fn each_row_gets_its_own_adapters_delta() {
        let (inputs, outputs, columns) = (37, 5, 6);
        let f = |i: usize| ((i * 7919) % 97) as f32 / 97.0 - 0.5;
        let x: Vec<f32> = (0..3 * inputs).map(f).collect();
        let a: Vec<f32> = (0..columns * inputs).map(|i| f(i + 11)).collect();
        let bt: Vec<f32> = (0..columns * outputs).map(|i| f(i + 29)).collect();
        // Adapter 0: columns 0..2, adapter 1: columns 2..6.
        let table = [
            0.0, 2.0, 1.0, 0.0, 0.0, 0.0, //
            2.0, 4.0, 0.5, 0.0, 2.0, 2.0, //
            0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
        ];
        let mut out = vec![1.0f32; 3 * outputs];
        let vec = VecOps::new(crate::isa::Isa::detect());
        low_rank(&vec, &x, &a, &bt, &table, inputs, &mut out).unwrap();
        for (i, entries) in table.chunks(6).enumerate() {
            for o in 0..outputs {
                let mut want = 1.0f64;
                for e in entries.chunks(3) {
                    for c in e[0] as usize..(e[0] + e[1]) as usize {
                        let t: f64 = (0..inputs)
                            .map(|k| a[c * inputs + k] as f64 * x[i * inputs + k] as f64)
                            .sum();
                        want += e[2] as f64 * t * bt[c * outputs + o] as f64;
                    }
                }
                assert!(
                    (out[i * outputs + o] as f64 - want).abs() < 1e-5,
                    "row {i} out {o}"
                );
            }
        }
        assert!(
            out[2 * outputs..].iter().all(|&v| v == 1.0),
            "a row without adapters is untouched"
        );
        let e = low_rank(
            &vec,
            &x,
            &a,
            &bt,
            &[5.0, 4.0, 1.0],
            inputs,
            &mut out[..outputs],
        );
        let e = e.unwrap_err();
        assert!(e.message.contains("low_rank"), "{e}");
    }
}
