//! How an API dialect answers one generation: as a whole JSON body or as server-sent events.

use crate::{
    bridge::Piece,
    error::{ApiError, Dialect},
};
use serde_json::Value;
use u_sdk::GenerateSummary;

/// One dialect's answer to one request. The server drives it with the engine's events; each
/// method returns the SSE frames (`event:`/`data:` text) to send, in order.
pub trait Reply: Send + 'static {
    /// The dialect (for error bodies).
    fn dialect(&self) -> Dialect;

    /// Frames sent once the first token has arrived, before it.
    fn opening(&mut self) -> Vec<String>;

    /// Frames for one generated token (none when it carries nothing to send).
    fn piece(&mut self, piece: &Piece) -> Vec<String>;

    /// Frames that end the stream.
    fn closing(&mut self, summary: &GenerateSummary) -> Vec<String>;

    /// The frame that reports an error after the stream has begun.
    fn error(&self, e: &ApiError) -> String {
        sse(None, &e.body(self.dialect()))
    }

    /// The whole, non-streamed response.
    fn whole(&self, pieces: &[Piece], summary: &GenerateSummary) -> Value;
}

/// One server-sent event carrying `value`, with an `event:` line when `event` is named.
pub fn sse(event: Option<&str>, value: &Value) -> String {
    match event {
        Some(e) => format!("event: {e}\ndata: {value}\n\n"),
        None => format!("data: {value}\n\n"),
    }
}

/// The concatenated text of `pieces`.
pub fn text(pieces: &[Piece]) -> String {
    pieces.iter().map(|p| p.text.as_str()).collect()
}

/// A fresh response id: `prefix-` and a hex count unique within this process and time.
pub fn response_id(prefix: &str) -> (String, u64) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    (
        format!("{prefix}{:x}{:06x}", now.as_nanos() & 0xffff_ffff_ffff, n),
        now.as_secs(),
    )
}
