//! Resizing a position table as PyTorch's `interpolate(mode="bicubic", align_corners=False,
//! antialias=False)` does (what transformers' DINOv2 calls on every forward whose image is not
//! the table's size, and what an ONNX export of it runs as `Resize` with cubic mode, half-pixel
//! coordinates and a = −0.75).

/// Keys' cubic convolution parameter PyTorch uses.
const A: f32 = -0.75;

/// The weights of the four taps around a sample `t ∈ [0, 1)` past the tap at index 1.
fn weights(t: f32) -> [f32; 4] {
    // |x| ≤ 1 and 1 < |x| < 2 pieces of the kernel.
    let near = |x: f32| ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0;
    let far = |x: f32| ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A;
    [far(t + 1.0), near(t), near(1.0 - t), far(2.0 - t)]
}

/// For each output index along an axis of `from` → `to` samples: the four clamped input
/// indices and their weights.
fn taps(from: usize, to: usize) -> Vec<([usize; 4], [f32; 4])> {
    let scale = from as f32 / to as f32;
    (0..to)
        .map(|i| {
            let src = scale * (i as f32 + 0.5) - 0.5;
            let base = src.floor();
            let at = |k: i64| (base as i64 - 1 + k).clamp(0, from as i64 - 1) as usize;
            ([at(0), at(1), at(2), at(3)], weights(src - base))
        })
        .collect()
}

/// `plane` (`from.0` rows of `from.1`, row-major) resized to `to.0 × to.1`: along the width
/// first for each of the four rows a sample needs, then along the height, in `f32` as PyTorch's
/// CPU kernel computes it; borders repeat the edge.
pub fn bicubic(plane: &[f32], from: (usize, usize), to: (usize, usize)) -> Vec<f32> {
    let (rows, cols) = (taps(from.0, to.0), taps(from.1, to.1));
    let mut out = Vec::with_capacity(to.0 * to.1);
    for (ys, wy) in &rows {
        for (xs, wx) in &cols {
            let across = |y: usize| {
                let line = &plane[y * from.1..(y + 1) * from.1];
                (0..4).fold(0f32, |acc, k| acc + line[xs[k]] * wx[k])
            };
            let v = (0..4).fold(0f32, |acc, k| acc + across(ys[k]) * wy[k]);
            out.push(v);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_size_is_the_identity_and_constants_stay_constant() {
        let plane: Vec<f32> = (0..12).map(|v| v as f32 * 0.37 - 1.0).collect();
        let same = bicubic(&plane, (3, 4), (3, 4));
        for (a, b) in same.iter().zip(&plane) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        let flat = bicubic(&[2.5; 30], (5, 6), (3, 7));
        assert!(flat.iter().all(|v| (v - 2.5).abs() < 1e-5), "{flat:?}");
    }

    /// `torch.nn.functional.interpolate(torch.arange(16.).reshape(1, 1, 4, 4) ** 2 / 10,
    /// size=(3, 5), mode="bicubic", align_corners=False)` (torch 2.15.0).
    #[test]
    fn equals_torch_on_a_small_plane() {
        let plane: Vec<f32> = (0..16).map(|v| (v * v) as f32 / 10.0).collect();
        let want = [
            0.1340898_f32,
            0.2469617_f32,
            0.5101849_f32,
            0.9600082_f32,
            1.38558_f32,
            3.321025_f32,
            4.171927_f32,
            5.4125_f32,
            6.839675_f32,
            8.003274_f32,
            13.18944_f32,
            14.77837_f32,
            16.9963_f32,
            19.40083_f32,
            21.30245_f32,
        ];
        let got = bicubic(&plane, (4, 4), (3, 5));
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-4, "{got:?}");
        }
    }
}
