//! Running the blocking engine off the async runtime and streaming its tokens back.

use tokio::sync::mpsc;
use u_sdk::{
    EngineBox, GenerateRequest, GenerateSummary, GeneratedToken, TokenLogprob, TokenSink,
    TokenSinkBox, UError,
};

/// One generated token as the transport keeps it.
#[derive(Debug, Clone, Default)]
pub struct Piece {
    /// The text it completes (may be empty while held back).
    pub text: String,
    /// Its log-probability, when asked for.
    pub logprob: Option<TokenLogprob>,
    /// The most likely alternatives, when asked for.
    pub top: Vec<TokenLogprob>,
}

/// What a running generation reports.
#[derive(Debug)]
pub enum Event {
    /// A generated token (or held-back text at the end).
    Piece(Piece),
    /// Generation ended.
    Done(GenerateSummary),
    /// Generation failed (possibly before any text).
    Failed(UError),
}

struct ChannelSink(mpsc::Sender<Event>);

impl TokenSink for ChannelSink {
    fn token(&mut self, token: &GeneratedToken<'_>) -> bool {
        let logprob = token.logprob.clone().into_option();
        if token.text.is_empty() && logprob.is_none() {
            return !self.0.is_closed();
        }
        let piece = Piece {
            text: token.text.to_string(),
            logprob,
            top: token.top_logprobs.to_vec(),
        };
        // A dropped receiver (the client went away) cancels the generation.
        self.0.blocking_send(Event::Piece(piece)).is_ok()
    }
}

/// Starts `request` on a blocking thread; its events arrive on the returned channel, the last
/// one always `Done` or `Failed` (unless the receiver was dropped).
pub fn start(engine: EngineBox, request: GenerateRequest) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel(64);
    tokio::task::spawn_blocking(move || {
        let sink = TokenSinkBox::new(ChannelSink(tx.clone()));
        let event = match engine.generate(&request, sink).into_result() {
            Ok(summary) => Event::Done(summary),
            Err(e) => Event::Failed(e),
        };
        let _ = tx.blocking_send(event);
    });
    rx
}
