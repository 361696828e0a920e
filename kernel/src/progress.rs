//! Progress bars on stderr, when stderr is a terminal: one [`gauge`] drawn by the load bar and
//! by the long commands' [`Line`] (`quantize`, `perplexity`).
//!
//! The load bar appears when a model takes longer than a second to build. The host hands the
//! architecture plugin its weights through [`Watched`], a weight set that forwards every call
//! to the loader's and counts the bytes of the tensors fetched against the bytes of all of
//! them. The bar is one line, redrawn when the percentage moves, and cleared when the model is
//! built (or building fails).

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

/// `[####      ]  40%`: `done` of `total` as a bar and a percentage (all done when `total` is 0).
pub fn gauge(done: u64, total: u64) -> String {
    let fraction = if total == 0 {
        1.0
    } else {
        done.min(total) as f64 / total as f64
    };
    let filled = (fraction * WIDTH as f64) as usize;
    format!(
        "[{}{}] {:3.0}%",
        "#".repeat(filled),
        " ".repeat(WIDTH - filled),
        (fraction * 100.0).floor()
    )
}

/// The load bar's line for `done` of `total` bytes after `secs` seconds.
pub fn bar(done: u64, total: u64, secs: f64) -> String {
    format!("\rloading model {} {secs:.1} s", gauge(done, total))
}

/// A long command's progress line on stderr (drawn only when stderr is a terminal): the gauge,
/// the time left at the rate so far, and what the command says it is doing.
pub struct Line {
    shown: bool,
    total: u64,
    start: Instant,
}

impl Line {
    /// A line for work of `total` units.
    pub fn new(total: u64) -> Line {
        Line {
            shown: std::io::stderr().is_terminal(),
            total,
            start: Instant::now(),
        }
    }

    /// The line for `done` units after `secs` seconds, saying `what`.
    pub fn render(&self, done: u64, secs: f64, what: &str) -> String {
        let left = secs / done.max(1) as f64 * self.total.saturating_sub(done) as f64;
        format!("\r{} {left:4.0} s left  {what}", gauge(done, self.total))
    }

    /// Redraws the line: `done` units, saying `what`.
    pub fn update(&self, done: u64, what: &str) {
        if self.shown {
            let line = self.render(done, self.start.elapsed().as_secs_f64(), what);
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "{line}");
            let _ = err.flush();
        }
    }

    /// Ends the line.
    pub fn finish(&self) {
        if self.shown {
            eprintln!();
        }
    }
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

    #[test]
    fn a_command_line_says_the_time_left_at_the_rate_so_far() {
        let line = Line::new(8);
        assert_eq!(
            line.render(2, 10.0, "2/8 chunks, PPL 12.5000"),
            format!(
                "\r[{}{}]  25%   30 s left  2/8 chunks, PPL 12.5000",
                "#".repeat(7),
                " ".repeat(23)
            )
        );
        assert!(line.render(8, 4.0, "done").contains("100%    0 s left"));
    }
}
