//! A load progress bar on stderr, when stderr is a terminal and a model takes longer than a
//! second to build.
//!
//! The host hands the architecture plugin its weights through [`Watched`], a weight set that
//! forwards every call to the loader's and counts the bytes of the tensors fetched against the
//! bytes of all of them. The bar is one line, redrawn when the percentage moves, and cleared
//! when the model is built (or building fails).

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{ROption, RResult, RStr, RString, RVec},
};
use std::{
    io::{IsTerminal, Write},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};
use u_sdk::{MetaValue, TensorInfo, TensorView, UError, WeightSet, WeightSetBox};

/// How long loading runs before the bar appears.
const QUIET: Duration = Duration::from_secs(1);

/// The bar's width in characters.
const WIDTH: usize = 30;

/// The line drawn for `done` of `total` bytes after `secs` seconds.
pub fn bar(done: u64, total: u64, secs: f64) -> String {
    let fraction = if total == 0 {
        1.0
    } else {
        done.min(total) as f64 / total as f64
    };
    let filled = (fraction * WIDTH as f64) as usize;
    format!(
        "\rloading model [{}{}] {:3.0}% {secs:.1} s",
        "#".repeat(filled),
        " ".repeat(WIDTH - filled),
        fraction * 100.0
    )
}

struct Count {
    total: u64,
    done: AtomicU64,
    percent: AtomicU64,
    started: Instant,
    drawn: AtomicBool,
    /// Building is over: a model that fetches tensors later draws nothing.
    over: AtomicBool,
}

impl Count {
    fn add(&self, bytes: u64) {
        if self.over.load(Ordering::Relaxed) {
            return;
        }
        let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        let percent = done.min(self.total) * 100 / self.total.max(1);
        let elapsed = self.started.elapsed();
        if elapsed < QUIET || self.percent.swap(percent, Ordering::Relaxed) == percent {
            return;
        }
        self.drawn.store(true, Ordering::Relaxed);
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "{}", bar(done, self.total, elapsed.as_secs_f64()));
        let _ = err.flush();
    }
}

#[derive(Clone)]
struct Counting {
    inner: WeightSetBox,
    count: Arc<Count>,
}

impl WeightSet for Counting {
    fn format(&self) -> RResult<RString, UError> {
        self.inner.format()
    }

    fn architecture(&self) -> RResult<ROption<RString>, UError> {
        self.inner.architecture()
    }

    fn metadata_keys(&self) -> RResult<RVec<RString>, UError> {
        self.inner.metadata_keys()
    }

    fn metadata(&self, key: RStr<'_>) -> RResult<ROption<MetaValue>, UError> {
        self.inner.metadata(key)
    }

    fn tensors(&self) -> RResult<RVec<TensorInfo>, UError> {
        self.inner.tensors()
    }

    fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
        let view = self.inner.tensor(name);
        if let RResult::ROk(v) = &view {
            self.count.add(v.data.len() as u64);
        }
        view
    }
}

/// Weights handed to an architecture while the bar watches; dropping it clears the bar.
pub struct Watched {
    /// The weights to build from (the loader's own when stderr is not a terminal).
    pub weights: WeightSetBox,
    count: Option<Arc<Count>>,
}

/// Watches the building of a model from `weights`.
pub fn watch(weights: &WeightSetBox) -> Watched {
    let total = match weights.tensors() {
        RResult::ROk(t) if std::io::stderr().is_terminal() => {
            t.iter().map(|t| t.byte_len).sum::<u64>()
        }
        _ => {
            return Watched {
                weights: weights.clone(),
                count: None,
            };
        }
    };
    let count = Arc::new(Count {
        total,
        done: AtomicU64::new(0),
        percent: AtomicU64::new(0),
        started: Instant::now(),
        drawn: AtomicBool::new(false),
        over: AtomicBool::new(false),
    });
    let counting = Counting {
        inner: weights.clone(),
        count: count.clone(),
    };
    Watched {
        weights: WeightSetBox::from_value(counting, TD_Opaque),
        count: Some(count),
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        if let Some(c) = &self.count {
            c.over.store(true, Ordering::Relaxed);
            if c.drawn.load(Ordering::Relaxed) {
                eprint!("\r\x1b[K");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bar_fills_with_the_fraction() {
        assert_eq!(
            bar(0, 100, 1.25),
            format!("\rloading model [{}]   0% 1.2 s", " ".repeat(30))
        );
        assert_eq!(
            bar(50, 100, 2.0),
            format!(
                "\rloading model [{}{}]  50% 2.0 s",
                "#".repeat(15),
                " ".repeat(15)
            )
        );
        assert!(bar(200, 100, 3.0).contains(&format!("[{}] 100%", "#".repeat(30))));
        assert!(bar(0, 0, 0.0).contains("100%"));
    }
}
