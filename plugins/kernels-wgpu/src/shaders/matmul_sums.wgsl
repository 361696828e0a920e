// The end of both matmul kernels: each lane's sums for the tile's x rows (`acc`), summed over
// the LANES lanes of weight row `row` in three steps, row r of the tile written by lane r.
// Module scope of the including kernel: LANES, ROWS, `partial`, `p`, `y`.
fn write_sums(acc: array<f32, 8>, lane: u32, slot: u32, row: u32, m0: u32, rows_here: u32) {
    let cell = slot * LANES * ROWS;
    for (var r = 0u; r < rows_here; r++) {
        partial[cell + r * LANES + lane] = acc[r];
    }
    workgroupBarrier();
    for (var half = LANES / 2u; half > 0u; half >>= 1u) {
        if (lane < half) {
            for (var r = 0u; r < rows_here; r++) {
                partial[cell + r * LANES + lane] += partial[cell + r * LANES + lane + half];
            }
        }
        workgroupBarrier();
    }
    if (row < p.n && lane < rows_here) {
        y[p.y_off + (m0 + lane) * p.n + row] = partial[cell + lane * LANES];
    }
}
