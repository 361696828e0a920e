//! Re-rotating cached keys to new positions (for grafts).
//!
//! A key cached at position `p` was rotated by the angle `θ_i(p)` per dimension pair `i`; moving
//! it to `q` is one more rotation by `θ_i(q) − θ_i(p)`, since rotations compose. The angles are
//! taken as the CPU kernel forms them (`(pos as f32) × inv_freq[i]` in f32), and the difference,
//! its cosine and sine and the rotation itself are computed in f64, so the result matches a key
//! rotated directly at `q` to f32 rounding. The YaRN `attn_factor` was applied once at `p` and is
//! not applied again.

use u_sdk::{RopeParams, RopeStyle, UError};

/// Checks `rope` against a head dimension.
pub fn check(rope: &RopeParams, head_dim: usize) -> u_sdk::Result<()> {
    let rd = rope.rotary_dim as usize;
    if !rd.is_multiple_of(2) || rd > head_dim || rope.inv_freq.len() != rd / 2 {
        return Err(UError::invalid(format!(
            "graft: rotary_dim {rd} must be even and ≤ head_dim {head_dim} with rotary_dim/2 \
             inverse frequencies (got {})",
            rope.inv_freq.len()
        )));
    }
    Ok(())
}

/// Moves `keys` (one token: heads × head_dim) from position `from` to position `to`.
pub fn rerotate(keys: &mut [f32], head_dim: usize, from: u64, to: u64, rope: &RopeParams) {
    if from == to {
        return;
    }
    let half = rope.rotary_dim as usize / 2;
    let cs: Vec<(f64, f64)> = rope
        .inv_freq
        .iter()
        .map(|&f| {
            let d = (to as f32 * f) as f64 - (from as f32 * f) as f64;
            (d.cos(), d.sin())
        })
        .collect();
    for head in keys.chunks_exact_mut(head_dim) {
        for (i, &(c, s)) in cs.iter().enumerate() {
            let (a, b) = match rope.style {
                RopeStyle::Normal => (2 * i, 2 * i + 1),
                RopeStyle::NeoX => (i, i + half),
            };
            let (x0, x1) = (head[a] as f64, head[b] as f64);
            head[a] = (x0 * c - x1 * s) as f32;
            head[b] = (x0 * s + x1 * c) as f32;
        }
    }
}
