//! The indexing, masking and reducing operators an exported transformer's graph is full of —
//! `Gather`, `Slice`, `Expand`, `Where`, `Equal`, `Trilu`, `Range`, `ArgMax`, `Flatten`,
//! `ConstantOfShape`, `ReduceMean` — and `MatMul` of two computed operands, as ONNX defines
//! them. Most of them build shapes and masks from integers; they run here, on the host.

use crate::value::{Array, Value, axis, broadcast_dims, expand, zip_broadcast};
use u_sdk::{Result, UError, nn::Device};

/// The most elements a `Range` or `ConstantOfShape` may make (a bound on what a malformed
/// graph can ask for).
const MAX_MADE: usize = 1 << 28;

/// Runs `$body` with `$a` bound to the array of either element type, wrapping the result in
/// the same variant.
macro_rules! either {
    ($value:expr, $a:ident => $body:expr) => {
        match $value {
            Value::F32($a) => Value::F32($body),
            Value::I64($a) => Value::I64($body),
        }
    };
}

/// `data`'s slices along `at` picked by `indices` (negative: from the end), as `Gather`.
pub fn gather(data: &Value, indices: &Array<i64>, at: i64) -> Result<Value> {
    let at = axis(at, data.dims().len())?;
    Ok(either!(data, a => gather_array(a, indices, at)?))
}

fn gather_array<T: Copy>(a: &Array<T>, indices: &Array<i64>, at: usize) -> Result<Array<T>> {
    let (outer, n, inner) = a.around(at);
    let picked = indices
        .data
        .iter()
        .map(|&i| {
            let j = if i < 0 { i + n as i64 } else { i };
            (0..n as i64)
                .contains(&j)
                .then_some(j as usize)
                .ok_or_else(|| UError::invalid(format!("Gather index {i} of an axis of {n}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut data = Vec::with_capacity(outer * picked.len() * inner);
    for o in 0..outer {
        for &j in &picked {
            data.extend_from_slice(&a.data[(o * n + j) * inner..][..inner]);
        }
    }
    let mut dims = a.dims[..at].to_vec();
    dims.extend(&indices.dims);
    dims.extend(&a.dims[at + 1..]);
    Array::new(dims, data)
}

/// The window `starts..ends` by `steps` along `axes` (all axes in order when `None`), clamped
/// as ONNX's `Slice` clamps.
pub fn slice(
    data: &Value,
    starts: &[i64],
    ends: &[i64],
    axes: Option<&[i64]>,
    steps: Option<&[i64]>,
) -> Result<Value> {
    let dims = data.dims().to_vec();
    let rank = dims.len();
    if starts.len() != ends.len()
        || axes.is_some_and(|a| a.len() != starts.len())
        || steps.is_some_and(|s| s.len() != starts.len())
    {
        return Err(UError::invalid(
            "Slice's starts, ends, axes and steps differ in length",
        ));
    }
    // Per axis: first index, step, count.
    let mut window: Vec<(i64, i64, usize)> = dims.iter().map(|&d| (0, 1, d)).collect();
    for k in 0..starts.len() {
        let a = axis(axes.map_or(k as i64, |a| a[k]), rank)?;
        let d = dims[a] as i64;
        let step = steps.map_or(1, |s| s[k]);
        let from_end = |v: i64| if v < 0 { v.saturating_add(d) } else { v };
        let (first, count) = match step {
            0 => return Err(UError::invalid("a Slice step of 0")),
            s if s > 0 => {
                let (b, e) = (
                    from_end(starts[k]).clamp(0, d),
                    from_end(ends[k]).clamp(0, d),
                );
                (b, if e > b { (e - b + s - 1) / s } else { 0 })
            }
            s => {
                let b = from_end(starts[k]).clamp(0, d - 1);
                let e = from_end(ends[k]).clamp(-1, d - 1);
                (b, if b > e { (b - e - s - 1) / -s } else { 0 })
            }
        };
        window[a] = (first, step, count as usize);
    }
    Ok(either!(data, a => slice_array(a, &window)?))
}

fn slice_array<T: Copy>(a: &Array<T>, window: &[(i64, i64, usize)]) -> Result<Array<T>> {
    let rank = a.dims.len();
    let mut strides = vec![1i64; rank];
    for i in (0..rank.saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * a.dims[i + 1] as i64;
    }
    let dims: Vec<usize> = window.iter().map(|w| w.2).collect();
    let total: usize = dims.iter().product();
    let mut data = Vec::with_capacity(total);
    let mut index = vec![0usize; rank];
    for _ in 0..total {
        let at: i64 = (0..rank)
            .map(|i| (window[i].0 + index[i] as i64 * window[i].1) * strides[i])
            .sum();
        data.push(a.data[at as usize]);
        for k in (0..rank).rev() {
            index[k] += 1;
            if index[k] < dims[k] {
                break;
            }
            index[k] = 0;
        }
    }
    Array::new(dims, data)
}

/// `data` broadcast to `shape` (NumPy's rule in both directions), as `Expand`.
pub fn expand_to(data: &Value, shape: &[i64]) -> Result<Value> {
    let shape = shape
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| UError::invalid(format!("Expand to {shape:?}"))))
        .collect::<Result<Vec<_>>>()?;
    let dims = broadcast_dims(data.dims(), &shape)?;
    if dims.iter().product::<usize>() > MAX_MADE {
        return Err(UError::invalid(format!(
            "Expand to {dims:?}: too many elements"
        )));
    }
    Ok(either!(data, a => expand(a, &dims)?))
}

/// 1 where `a` and `b` are equal, else 0, broadcast, as `Equal` (a boolean as integers).
pub fn equal(a: &Value, b: &Value) -> Result<Value> {
    let same = match (a, b) {
        (Value::F32(a), Value::F32(b)) => zip_broadcast(a, b, |x, y| i64::from(x == y))?,
        (Value::I64(a), Value::I64(b)) => zip_broadcast(a, b, |x, y| i64::from(x == y))?,
        _ => return Err(UError::invalid("Equal of a float and an integer value")),
    };
    Ok(Value::I64(same))
}

/// `x` where `condition` is non-zero, else `y`, all three broadcast, as `Where`.
pub fn where_(condition: &Array<i64>, x: &Value, y: &Value) -> Result<Value> {
    let dims = broadcast_dims(&broadcast_dims(&condition.dims, x.dims())?, y.dims())?;
    let c = expand(condition, &dims)?;
    fn pick<T: Copy>(c: &[i64], x: &[T], y: &[T]) -> Vec<T> {
        c.iter()
            .zip(x.iter().zip(y))
            .map(|(&c, (&x, &y))| if c != 0 { x } else { y })
            .collect()
    }
    Ok(match (x, y) {
        (Value::F32(x), Value::F32(y)) => Value::F32(Array::new(
            dims.clone(),
            pick(&c.data, &expand(x, &dims)?.data, &expand(y, &dims)?.data),
        )?),
        (Value::I64(x), Value::I64(y)) => Value::I64(Array::new(
            dims.clone(),
            pick(&c.data, &expand(x, &dims)?.data, &expand(y, &dims)?.data),
        )?),
        _ => return Err(UError::invalid("Where of a float and an integer value")),
    })
}

/// The lower (`upper` false) or upper triangle of the last two axes from diagonal `k`, the
/// rest zero, as `Trilu`.
pub fn trilu(data: &Value, k: i64, upper: bool) -> Result<Value> {
    let dims = data.dims();
    let [.., rows, cols] = *dims else {
        return Err(UError::invalid(format!("Trilu of a {dims:?} value")));
    };
    let keep = move |at: usize| {
        let (i, j) = ((at / cols) % rows.max(1), at % cols.max(1));
        let d = j as i64 - i as i64;
        if upper { d >= k } else { d <= k }
    };
    Ok(either!(data, a => {
        let zero = Default::default();
        let kept = a.data.iter().enumerate().map(|(at, &v)| if keep(at) { v } else { zero });
        Array::new(a.dims.clone(), kept.collect())?
    }))
}

/// `start, start + delta, …` while short of `limit`, as `Range`.
pub fn range(start: &Value, limit: &Value, delta: &Value) -> Result<Value> {
    let scalar = |v: &Value| -> Result<f64> {
        match v {
            Value::F32(a) if a.data.len() == 1 => Ok(f64::from(a.data[0])),
            Value::I64(a) if a.data.len() == 1 => Ok(a.data[0] as f64),
            _ => Err(UError::invalid("Range of a value that is not a scalar")),
        }
    };
    let (s, l, d) = (scalar(start)?, scalar(limit)?, scalar(delta)?);
    let count = ((l - s) / d).ceil();
    if d == 0.0 || !count.is_finite() || count > MAX_MADE as f64 {
        return Err(UError::invalid(format!("Range({s}, {l}, {d})")));
    }
    let count = count.max(0.0) as usize;
    Ok(match start {
        Value::I64(_) => {
            let (s, d) = (s as i64, d as i64);
            Value::I64(Array::new(
                vec![count],
                (0..count as i64).map(|i| s + i * d).collect(),
            )?)
        }
        Value::F32(_) => {
            let (s, d) = (s as f32, d as f32);
            Value::F32(Array::new(
                vec![count],
                (0..count).map(|i| s + i as f32 * d).collect(),
            )?)
        }
    })
}

/// The index of the largest element along `at` (the first of equals, or the last when
/// `last`), the axis kept as size 1 when `keep`, as `ArgMax`.
pub fn arg_max(data: &Value, at: i64, keep: bool, last: bool) -> Result<Value> {
    let values: Vec<f64> = match data {
        Value::F32(a) => a.data.iter().map(|&v| f64::from(v)).collect(),
        Value::I64(a) => a.data.iter().map(|&v| v as f64).collect(),
    };
    let dims = data.dims();
    let at = axis(at, dims.len())?;
    let outer: usize = dims[..at].iter().product();
    let (n, inner) = (dims[at], dims[at + 1..].iter().product::<usize>());
    if n == 0 {
        return Err(UError::invalid("ArgMax over an empty axis"));
    }
    let mut data = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let value = |j: usize| values[(o * n + j) * inner + i];
            let mut best = 0;
            for j in 1..n {
                if value(j) > value(best) || (last && value(j) == value(best)) {
                    best = j;
                }
            }
            data.push(best as i64);
        }
    }
    let mut out = dims.to_vec();
    match keep {
        true => out[at] = 1,
        false => {
            out.remove(at);
        }
    }
    Ok(Value::I64(Array::new(out, data)?))
}

/// `data` as a matrix: the axes before `at` as rows, the rest as columns, as `Flatten`.
pub fn flatten(data: &Value, at: i64) -> Result<Value> {
    let dims = data.dims();
    let rank = dims.len() as i64;
    let at = if at < 0 { at + rank } else { at };
    if !(0..=rank).contains(&at) {
        return Err(UError::invalid(format!(
            "Flatten at {at} of a rank-{rank} value"
        )));
    }
    let rows = dims[..at as usize].iter().product();
    let cols = dims[at as usize..].iter().product();
    data.clone().reshaped(vec![rows, cols])
}

/// A value of the dimensions `shape`, every element `fill`, as `ConstantOfShape`.
pub fn constant_of_shape(shape: &[i64], fill: &Value) -> Result<Value> {
    let dims = shape
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| UError::invalid(format!("ConstantOfShape {shape:?}")))?;
    let total: usize = dims.iter().product();
    if total > MAX_MADE {
        return Err(UError::invalid(format!(
            "ConstantOfShape {shape:?}: too many elements"
        )));
    }
    Ok(either!(fill, a => {
        let v = *a.data.first().ok_or_else(|| UError::invalid("an empty ConstantOfShape value"))?;
        Array::new(dims, vec![v; total])?
    }))
}

/// The mean over `axes` (negative: from the end; empty: every axis), each kept as size 1 when
/// `keep`, as `ReduceMean`.
pub fn reduce_mean(data: &Array<f32>, axes: &[i64], keep: bool) -> Result<Array<f32>> {
    let rank = data.dims.len();
    let mut picked = match axes.is_empty() {
        true => (0..rank).collect::<Vec<_>>(),
        false => axes.iter().map(|&a| axis(a, rank)).collect::<Result<_>>()?,
    };
    picked.sort_unstable();
    picked.dedup();
    let mut values: Vec<f64> = data.data.iter().map(|&v| f64::from(v)).collect();
    let mut dims = data.dims.clone();
    for &at in &picked {
        let outer: usize = dims[..at].iter().product();
        let (n, inner) = (dims[at], dims[at + 1..].iter().product::<usize>());
        let mut reduced = vec![0f64; outer * inner];
        for o in 0..outer {
            for j in 0..n {
                let row = &values[(o * n + j) * inner..][..inner];
                reduced[o * inner..][..inner]
                    .iter_mut()
                    .zip(row)
                    .for_each(|(r, v)| *r += v);
            }
        }
        reduced.iter_mut().for_each(|r| *r /= n.max(1) as f64);
        values = reduced;
        dims[at] = 1;
    }
    if !keep {
        dims = dims
            .iter()
            .enumerate()
            .filter(|(i, _)| !picked.contains(i))
            .map(|(_, &d)| d)
            .collect();
    }
    Array::new(dims, values.into_iter().map(|v| v as f32).collect())
}

/// NumPy's `matmul` of two computed operands of rank ≥ 2: `[…, m, k] · […, k, n]`, the leading
/// axes broadcast, each product through the backend.
pub fn batched_matmul(device: &Device, a: &Array<f32>, b: &Array<f32>) -> Result<Array<f32>> {
    let (ra, rb) = (a.dims.len(), b.dims.len());
    if ra < 2 || rb < 2 || a.dims[ra - 1] != b.dims[rb - 2] {
        return Err(UError::invalid(format!(
            "MatMul of {:?} and {:?}: operands [..., m, k] and [..., k, n] are implemented",
            a.dims, b.dims
        )));
    }
    let (m, k, n) = (a.dims[ra - 2], a.dims[ra - 1], b.dims[rb - 1]);
    let batch = broadcast_dims(&a.dims[..ra - 2], &b.dims[..rb - 2])?;
    let with = |tail: [usize; 2]| batch.iter().copied().chain(tail).collect::<Vec<_>>();
    let a = expand(a, &with([m, k]))?;
    let b = expand(b, &with([k, n]))?;
    let count: usize = batch.iter().product();
    let mut data = Vec::with_capacity(count * m * n);
    for i in 0..count {
        let x = device.from_f32(&a.data[i * m * k..][..m * k], &[m as u64, k as u64])?;
        let bt = crate::value::permute(
            &Array::new(vec![k, n], b.data[i * k * n..][..k * n].to_vec())?,
            &[1, 0],
        )?;
        let w = device.from_f32(&bt.data, &[n as u64, k as u64])?;
        data.extend(x.matmul_t(&w)?.to_vec()?);
    }
    Array::new(with([m, n]), data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(dims: Vec<usize>, data: Vec<i64>) -> Array<i64> {
        Array::new(dims, data).unwrap()
    }

    #[test]
    fn slices_clamp_and_step_both_ways() {
        let a = Value::I64(ints(vec![2, 5], (0..10).collect()));
        let s = slice(&a, &[1], &[i64::MAX], Some(&[1]), Some(&[2])).unwrap();
        assert_eq!(s, Value::I64(ints(vec![2, 2], vec![1, 3, 6, 8])));
        let back = slice(&a, &[-1, -1], &[-2, i64::MIN], None, Some(&[-1, -2])).unwrap();
        assert_eq!(back, Value::I64(ints(vec![1, 3], vec![9, 7, 5])));
        let empty = slice(&a, &[3], &[1], Some(&[1]), None).unwrap();
        assert_eq!(empty.dims(), [2, 0]);
    }

    #[test]
    fn gather_trilu_and_arg_max_follow_onnx() {
        let a = Value::I64(ints(vec![3, 2], vec![1, 2, 3, 4, 5, 6]));
        let g = gather(&a, &ints(vec![2], vec![-1, 0]), 0).unwrap();
        assert_eq!(g, Value::I64(ints(vec![2, 2], vec![5, 6, 1, 2])));
        let m = Value::I64(ints(vec![3, 3], vec![1; 9]));
        let lower = trilu(&m, 0, false).unwrap();
        assert_eq!(
            lower,
            Value::I64(ints(vec![3, 3], vec![1, 0, 0, 1, 1, 0, 1, 1, 1]))
        );
        let strict = trilu(&m, 1, true).unwrap();
        assert_eq!(
            strict,
            Value::I64(ints(vec![3, 3], vec![0, 1, 1, 0, 0, 1, 0, 0, 0]))
        );
        let x = Value::I64(ints(vec![2, 3], vec![4, 9, 9, 7, 1, 7]));
        assert_eq!(
            arg_max(&x, -1, false, false).unwrap(),
            Value::I64(ints(vec![2], vec![1, 0]))
        );
        assert_eq!(
            arg_max(&x, 1, true, true).unwrap(),
            Value::I64(ints(vec![2, 1], vec![2, 2]))
        );
    }

    #[test]
    fn ranges_and_means() {
        let r = range(
            &Value::I64(ints(vec![], vec![2])),
            &Value::I64(ints(vec![], vec![9])),
            &Value::I64(ints(vec![], vec![3])),
        )
        .unwrap();
        assert_eq!(r, Value::I64(ints(vec![3], vec![2, 5, 8])));
        let a = Array::new(vec![2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        assert_eq!(*reduce_mean(&a, &[-1], true).unwrap().data, [2.0, 5.0]);
        assert_eq!(
            reduce_mean(&a, &[], false).unwrap().dims,
            Vec::<usize>::new()
        );
        assert!(
            range(
                &Value::I64(ints(vec![], vec![0])),
                &Value::I64(ints(vec![], vec![1])),
                &Value::I64(ints(vec![], vec![0])),
            )
            .is_err()
        );
    }
}
