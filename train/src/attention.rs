//! Causal multi-head self-attention with grouped KV heads, forward and backward, as compute
//! interface operations (the inference kernel is a fused flash attention with no backward).
//!
//! For each query head `h` (KV head `g = h / (heads / kv_heads)`), with `T` tokens:
//! `P = softmax(s·Q_h·K_gᵀ + M)` (`M` masks the future), `O_h = P·V_g`. Backward, from `dO_h`:
//! `dV_g += Pᵀ·dO_h`, `dP = dO_h·V_gᵀ`, `dS = s·softmax′(P, dP)`, `dQ_h = dS·K_g`,
//! `dK_g += dSᵀ·Q_h`. Heads are cut from the transposed projections, where each head's values
//! are whole rows (`[heads × head_dim, T]`).

use u_sdk::{
    DType, Result, UError,
    nn::{Device, Tensor},
};

/// The heads of one attention.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (dividing `heads`).
    pub kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// The factor of `Q·Kᵀ` (usually `1/√head_dim`).
    pub scale: f32,
}

impl Shape {
    fn check(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<usize> {
        let t = q.rows();
        let ok = self.kv_heads > 0
            && self.heads.is_multiple_of(self.kv_heads)
            && q.row_len() == self.heads * self.head_dim
            && k.row_len() == self.kv_heads * self.head_dim
            && v.row_len() == k.row_len()
            && k.rows() == t
            && v.rows() == t
            && t > 0;
        if !ok {
            return Err(UError::invalid(format!(
                "attention of {self:?} over q {:?}, k {:?}, v {:?}",
                q.dims(),
                k.dims(),
                v.dims()
            )));
        }
        Ok(t)
    }

    /// The KV head query head `h` reads.
    fn group(&self, h: usize) -> usize {
        h / (self.heads / self.kv_heads)
    }

    /// Rows of head `h` in a transposed projection.
    fn rows(&self, h: usize) -> std::ops::Range<usize> {
        h * self.head_dim..(h + 1) * self.head_dim
    }
}

fn zeros(dev: &Device, dims: &[u64]) -> Result<Tensor> {
    dev.from_f32(&vec![0.0; dims.iter().product::<u64>() as usize], dims)
}

/// `0` where token `i` may see token `j` (`j ≤ i`), `−∞` elsewhere.
fn causal_mask(dev: &Device, t: usize) -> Result<Tensor> {
    let mut m = vec![0f32; t * t];
    for i in 0..t {
        m[i * t + i + 1..(i + 1) * t].fill(f32::NEG_INFINITY);
    }
    dev.from_f32(&m, &[t as u64, t as u64])
}

/// The attention output `[T, heads × head_dim]` and each head's weights `P` `[T, T]`.
pub fn forward(q: &Tensor, k: &Tensor, v: &Tensor, s: &Shape) -> Result<(Tensor, Vec<Tensor>)> {
    let t = s.check(q, k, v)?;
    let dev = q.device();
    let (qt, kt, vt) = (q.transpose()?, k.transpose()?, v.transpose()?);
    let mask = causal_mask(dev, t)?;
    let out_t = dev.alloc(DType::F32, &[(s.heads * s.head_dim) as u64, t as u64])?;
    let mut probs = Vec::with_capacity(s.heads);
    for h in 0..s.heads {
        let g = s.group(h);
        let qh = qt.rows_range(s.rows(h))?.transpose()?;
        let kh = kt.rows_range(s.rows(g))?.transpose()?;
        let p = qh.matmul_t(&kh)?.scale(s.scale)?;
        p.add_assign(&mask)?;
        p.softmax_assign()?;
        // O_hᵀ = V_gᵀ·Pᵀ
        vt.rows_range(s.rows(g))?
            .matmul_t(&p)?
            .copy_into(None, &out_t.rows_range(s.rows(h))?)?;
        probs.push(p);
    }
    Ok((out_t.transpose()?, probs))
}

/// `[dQ, dK, dV]` from the output's gradient `dy`.
pub fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    probs: &[Tensor],
    dy: &Tensor,
    s: &Shape,
) -> Result<[Tensor; 3]> {
    let t = s.check(q, k, v)?;
    let dev = q.device();
    let (qt, kt, vt, dyt) = (
        q.transpose()?,
        k.transpose()?,
        v.transpose()?,
        dy.transpose()?,
    );
    let tt = t as u64;
    let dqt = dev.alloc(DType::F32, &[(s.heads * s.head_dim) as u64, tt])?;
    let kv_dims = [(s.kv_heads * s.head_dim) as u64, tt];
    let (dkt, dvt) = (zeros(dev, &kv_dims)?, zeros(dev, &kv_dims)?);
    for (h, p) in probs.iter().enumerate() {
        let g = s.group(h);
        let do_t = dyt.rows_range(s.rows(h))?;
        // dV_gᵀ += dO_hᵀ·P
        dvt.rows_range(s.rows(g))?
            .add_assign(&do_t.matmul_t(&p.transpose()?)?)?;
        // dP = dO_h·V_gᵀ
        let dp = do_t
            .transpose()?
            .matmul_t(&vt.rows_range(s.rows(g))?.transpose()?)?;
        let ds = p.softmax_backward(&dp)?.scale(s.scale)?;
        // dQ_hᵀ = K_gᵀ·dSᵀ, dK_gᵀ += Q_hᵀ·dS
        kt.rows_range(s.rows(g))?
            .matmul_t(&ds)?
            .copy_into(None, &dqt.rows_range(s.rows(h))?)?;
        dkt.rows_range(s.rows(g))?
            .add_assign(&qt.rows_range(s.rows(h))?.matmul_t(&ds.transpose()?)?)?;
    }
    Ok([dqt.transpose()?, dkt.transpose()?, dvt.transpose()?])
}
