//! The values a graph computes with: float and integer arrays, row-major, with NumPy-style
//! broadcasting for the elementwise operators.

use std::sync::Arc;
use u_sdk::{Result, UError};

/// A row-major array. The elements are shared: a reshape or an unchanged value costs no
/// copy.
#[derive(Clone, Debug, PartialEq)]
pub struct Array<T> {
    /// Dimensions, outermost first (empty: a scalar).
    pub dims: Vec<usize>,
    /// The elements.
    pub data: Arc<Vec<T>>,
}

impl<T: Copy> Array<T> {
    /// `data` shaped `dims`, checked.
    pub fn new(dims: Vec<usize>, data: Vec<T>) -> Result<Self> {
        if dims.iter().product::<usize>() != data.len() {
            return Err(UError::invalid(format!(
                "{} elements cannot have the shape {dims:?}",
                data.len()
            )));
        }
        Ok(Self {
            dims,
            data: Arc::new(data),
        })
    }

    /// The same elements under other dimensions of the same count.
    pub fn reshaped(self, dims: Vec<usize>) -> Result<Self> {
        if dims.iter().product::<usize>() != self.data.len() {
            return Err(UError::invalid(format!(
                "{} elements cannot have the shape {dims:?}",
                self.data.len()
            )));
        }
        Ok(Self {
            dims,
            data: self.data,
        })
    }

    /// The product of the dimensions before `axis`, `dims[axis]`, and the product after.
    pub fn around(&self, axis: usize) -> (usize, usize, usize) {
        let outer = self.dims[..axis].iter().product();
        let inner = self.dims[axis + 1..].iter().product();
        (outer, self.dims[axis], inner)
    }
}

/// A value of the graph.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Floats (FLOAT; FLOAT16, BFLOAT16 and DOUBLE initializers are widened or narrowed to it).
    F32(Array<f32>),
    /// Integers (INT64, INT32): shapes, axes, indices.
    I64(Array<i64>),
}

impl Value {
    /// Its dimensions.
    pub fn dims(&self) -> &[usize] {
        match self {
            Value::F32(a) => &a.dims,
            Value::I64(a) => &a.dims,
        }
    }

    /// The floats, or an error naming `what` for integers.
    pub fn floats(&self, what: &str) -> Result<&Array<f32>> {
        match self {
            Value::F32(a) => Ok(a),
            Value::I64(_) => Err(UError::invalid(format!(
                "{what}: integers where floats are read"
            ))),
        }
    }

    /// The integers, or an error naming `what` for floats.
    pub fn ints(&self, what: &str) -> Result<&Array<i64>> {
        match self {
            Value::I64(a) => Ok(a),
            Value::F32(_) => Err(UError::invalid(format!(
                "{what}: floats where integers are read"
            ))),
        }
    }

    /// The same elements under `dims`.
    pub fn reshaped(self, dims: Vec<usize>) -> Result<Value> {
        Ok(match self {
            Value::F32(a) => Value::F32(a.reshaped(dims)?),
            Value::I64(a) => Value::I64(a.reshaped(dims)?),
        })
    }
}

/// An axis that may count from the end (`-1`: the last) as an index into `rank` axes.
pub fn axis(axis: i64, rank: usize) -> Result<usize> {
    let a = if axis < 0 { axis + rank as i64 } else { axis };
    if (0..rank as i64).contains(&a) {
        Ok(a as usize)
    } else {
        Err(UError::invalid(format!(
            "axis {axis} of a rank-{rank} value"
        )))
    }
}

/// The dimensions two operands broadcast to (NumPy's rule).
pub fn broadcast_dims(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    (0..rank)
        .map(|i| {
            let da = (i + a.len()).checked_sub(rank).map_or(1, |j| a[j]);
            let db = (i + b.len()).checked_sub(rank).map_or(1, |j| b[j]);
            match (da, db) {
                (x, y) if x == y => Ok(x),
                (1, y) => Ok(y),
                (x, 1) => Ok(x),
                _ => Err(UError::invalid(format!(
                    "shapes {a:?} and {b:?} do not broadcast"
                ))),
            }
        })
        .collect()
}

/// Strides of `dims` laid out under the broadcast `out` dimensions (0 where it repeats).
fn broadcast_strides(dims: &[usize], out: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; out.len()];
    let mut stride = 1;
    for (i, &d) in dims.iter().enumerate().rev() {
        let o = i + out.len() - dims.len();
        strides[o] = if d == 1 { 0 } else { stride };
        stride *= d;
    }
    strides
}

/// `a` broadcast to `dims` (which must be a broadcast of its dimensions): the repeated
/// elements written out.
pub fn expand<T: Copy>(a: &Array<T>, dims: &[usize]) -> Result<Array<T>> {
    if broadcast_dims(&a.dims, dims)? != dims {
        return Err(UError::invalid(format!(
            "{:?} does not broadcast to {dims:?}",
            a.dims
        )));
    }
    if a.dims == dims {
        return Ok(a.clone());
    }
    let strides = broadcast_strides(&a.dims, dims);
    let total: usize = dims.iter().product();
    let mut data = Vec::with_capacity(total);
    let mut index = vec![0usize; dims.len()];
    for _ in 0..total {
        data.push(
            a.data[index
                .iter()
                .zip(&strides)
                .map(|(i, s)| i * s)
                .sum::<usize>()],
        );
        for k in (0..dims.len()).rev() {
            index[k] += 1;
            if index[k] < dims[k] {
                break;
            }
            index[k] = 0;
        }
    }
    Array::new(dims.to_vec(), data)
}

/// `f` of the two operands elementwise, broadcast.
pub fn zip_broadcast<T: Copy, U: Copy>(
    a: &Array<T>,
    b: &Array<T>,
    f: impl Fn(T, T) -> U,
) -> Result<Array<U>> {
    if a.dims == b.dims {
        let data = a
            .data
            .iter()
            .zip(b.data.iter())
            .map(|(&x, &y)| f(x, y))
            .collect();
        return Array::new(a.dims.clone(), data);
    }
    let dims = broadcast_dims(&a.dims, &b.dims)?;
    let total: usize = dims.iter().product();
    let mut data = Vec::with_capacity(total);
    if total == 0 {
        return Array::new(dims, data);
    }
    let (sa, sb) = (
        broadcast_strides(&a.dims, &dims),
        broadcast_strides(&b.dims, &dims),
    );
    let last = dims.len().saturating_sub(1);
    let (width, la, lb) = match dims.last() {
        Some(&w) => (w, sa[last], sb[last]),
        None => (1, 0, 0),
    };
    let mut index = vec![0usize; last];
    loop {
        let oa: usize = index.iter().zip(&sa).map(|(i, s)| i * s).sum();
        let ob: usize = index.iter().zip(&sb).map(|(i, s)| i * s).sum();
        match (la, lb) {
            (1, 1) => data.extend(
                a.data[oa..oa + width]
                    .iter()
                    .zip(&b.data[ob..ob + width])
                    .map(|(&x, &y)| f(x, y)),
            ),
            (1, 0) => {
                let y = b.data[ob];
                data.extend(a.data[oa..oa + width].iter().map(|&x| f(x, y)));
            }
            (0, 1) => {
                let x = a.data[oa];
                data.extend(b.data[ob..ob + width].iter().map(|&y| f(x, y)));
            }
            _ => data.extend((0..width).map(|j| f(a.data[oa + j * la], b.data[ob + j * lb]))),
        }
        let mut k = last;
        loop {
            if k == 0 {
                return Array::new(dims, data);
            }
            k -= 1;
            index[k] += 1;
            if index[k] < dims[k] {
                break;
            }
            index[k] = 0;
        }
    }
}

/// `a[i] = f(a[i], b[…])` over `a`, `b` broadcast to `a`'s dimensions (which must be the
/// broadcast's): the result written over `a`, no new buffer when `a` holds its elements alone.
pub fn zip_broadcast_into(
    a: &mut Array<f32>,
    b: &Array<f32>,
    f: impl Fn(f32, f32) -> f32,
) -> Result<()> {
    if broadcast_dims(&a.dims, &b.dims)? != a.dims {
        return Err(UError::invalid(format!(
            "{:?} does not broadcast into {:?}",
            b.dims, a.dims
        )));
    }
    let dims = a.dims.clone();
    let data = Arc::make_mut(&mut a.data);
    if dims == b.dims {
        data.iter_mut()
            .zip(b.data.iter())
            .for_each(|(x, &y)| *x = f(*x, y));
        return Ok(());
    }
    let (Some(&width), Some(last)) = (dims.last(), dims.len().checked_sub(1)) else {
        // Scalars: one element each.
        data.iter_mut().for_each(|x| *x = f(*x, b.data[0]));
        return Ok(());
    };
    let sb = broadcast_strides(&b.dims, &dims);
    let lb = sb[last];
    let mut index = vec![0usize; last];
    for row in data.chunks_mut(width.max(1)) {
        let ob: usize = index.iter().zip(&sb).map(|(i, s)| i * s).sum();
        match lb {
            1 => row
                .iter_mut()
                .zip(&b.data[ob..ob + width])
                .for_each(|(x, &y)| *x = f(*x, y)),
            _ => {
                let y = b.data[ob];
                row.iter_mut().for_each(|x| *x = f(*x, y));
            }
        }
        for k in (0..last).rev() {
            index[k] += 1;
            if index[k] < dims[k] {
                break;
            }
            index[k] = 0;
        }
    }
    Ok(())
}

/// The axes of a rank-`dims.len()` array reordered by `perm` (output axis `i` is input axis
/// `perm[i]`).
pub fn permute<T: Copy>(a: &Array<T>, perm: &[usize]) -> Result<Array<T>> {
    let rank = a.dims.len();
    let mut seen = vec![false; rank];
    if perm.len() != rank
        || perm
            .iter()
            .any(|&p| p >= rank || std::mem::replace(&mut seen[p], true))
    {
        return Err(UError::invalid(format!(
            "{perm:?} is not a permutation of {rank} axes"
        )));
    }
    let mut strides = vec![1usize; rank];
    for i in (0..rank.saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * a.dims[i + 1];
    }
    let dims: Vec<usize> = perm.iter().map(|&p| a.dims[p]).collect();
    let moved: Vec<usize> = perm.iter().map(|&p| strides[p]).collect();
    let total = a.data.len();
    let mut data = Vec::with_capacity(total);
    let (Some(&width), Some(&step)) = (dims.last(), moved.last()) else {
        return Array::new(dims, a.data.to_vec());
    };
    let outer = rank - 1;
    let mut index = vec![0usize; outer];
    for _ in 0..total / width.max(1) {
        let at: usize = index.iter().zip(&moved).map(|(i, s)| i * s).sum();
        data.extend((0..width).map(|j| a.data[at + j * step]));
        for k in (0..outer).rev() {
            index[k] += 1;
            if index[k] < dims[k] {
                break;
            }
            index[k] = 0;
        }
    }
    Array::new(dims, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_follows_numpy() {
        let a = Array::new(vec![2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let column = Array::new(vec![2, 1], vec![10.0f32, 20.0]).unwrap();
        let row = Array::new(vec![3], vec![100.0f32, 200.0, 300.0]).unwrap();
        let sum = zip_broadcast(&a, &column, |x, y| x + y).unwrap();
        assert_eq!(*sum.data, [11.0, 12.0, 13.0, 24.0, 25.0, 26.0]);
        let mut over = a.clone();
        zip_broadcast_into(&mut over, &column, |x, y| x + y).unwrap();
        assert_eq!(*over.data, [11.0, 12.0, 13.0, 24.0, 25.0, 26.0]);
        let mut over = a.clone();
        zip_broadcast_into(&mut over, &row, |x, y| x * y).unwrap();
        assert_eq!(*over.data, [100.0, 400.0, 900.0, 400.0, 1000.0, 1800.0]);
        assert!(zip_broadcast_into(&mut column.clone(), &row, |x, y| x + y).is_err());
        let sum = zip_broadcast(&column, &row, |x, y| x + y).unwrap();
        assert_eq!(sum.dims, [2, 3]);
        assert_eq!(*sum.data, [110.0, 210.0, 310.0, 120.0, 220.0, 320.0]);
        let bad = Array::new(vec![2], vec![1.0f32, 2.0]).unwrap();
        assert!(zip_broadcast(&a, &bad, |x, y| x + y).is_err());
    }

    #[test]
    fn permute_moves_axes() {
        let a = Array::new(vec![2, 3], vec![1, 2, 3, 4, 5, 6]).unwrap();
        let t = permute(&a, &[1, 0]).unwrap();
        assert_eq!(
            (t.dims, t.data.to_vec()),
            (vec![3, 2], vec![1, 4, 2, 5, 3, 6])
        );
        assert!(permute(&a, &[0, 0]).is_err());
    }
}
