//! OpenAI requests answered with several choices: `n > 1`, `best_of`, batched prompts on
//! `/v1/completions`, and `echo`.
//!
//! Each prompt is one group of candidates. The group's first candidate starts alone; once it
//! reports its first event its prompt is in the prefix cache (the runner records it when the
//! prefill ends), and the other candidates start then, so they share the prompt's KV pages
//! (a fork in the cache) instead of prefilling it again. With `best_of` above `n` the `n`
//! candidates with the highest total log-probability are returned, as OpenAI ranks them.

use crate::{
    bridge::{self, Event, Piece},
    error::ApiError,
    openai::{self, Meta},
    reply::Reply,
};
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use u_sdk::{EngineBox, GenerateRequest, GenerateSummary};

/// An event of candidate `candidate` of prompt `group`.
pub struct Tagged {
    /// The prompt's index.
    pub group: usize,
    /// The candidate's index within its group.
    pub candidate: usize,
    /// What it reported.
    pub event: Event,
}

/// Starts every group's candidates (each group's first one alone, the rest once it reported);
/// their events arrive, tagged, on the returned channel.
pub fn start(engine: EngineBox, groups: Vec<Vec<GenerateRequest>>) -> mpsc::Receiver<Tagged> {
    let (tx, rx) = mpsc::channel(64);
    for (group, requests) in groups.into_iter().enumerate() {
        let (engine, tx) = (engine.clone(), tx.clone());
        tokio::spawn(async move {
            let mut requests = requests.into_iter();
            let Some(first) = requests.next() else {
                return;
            };
            let mut events = bridge::start(engine.clone(), first);
            let Some(event) = events.recv().await else {
                return;
            };
            let failed = matches!(event, Event::Failed(_));
            let tagged = |candidate, event| Tagged {
                group,
                candidate,
                event,
            };
            if tx.send(tagged(0, event)).await.is_err() || failed {
                return;
            }
            tokio::spawn(forward(events, group, 0, tx.clone()));
            for (i, r) in requests.enumerate() {
                tokio::spawn(forward(
                    bridge::start(engine.clone(), r),
                    group,
                    i + 1,
                    tx.clone(),
                ));
            }
        });
    }
    rx
}

async fn forward(
    mut events: mpsc::Receiver<Event>,
    group: usize,
    candidate: usize,
    tx: mpsc::Sender<Tagged>,
) {
    while let Some(event) = events.recv().await {
        let tagged = Tagged {
            group,
            candidate,
            event,
        };
        if tx.send(tagged).await.is_err() {
            return;
        }
    }
}

/// The usage of a whole request: each prompt counted once (its first candidate's counts), the
/// tokens of every candidate.
fn usage(summaries: &[Vec<Option<GenerateSummary>>]) -> Value {
    let (mut prompt, mut cached, mut completion) = (0u64, 0u64, 0u64);
    for group in summaries {
        if let Some(Some(s)) = group.first() {
            prompt += u64::from(s.prompt_tokens);
            cached += u64::from(s.cached_tokens);
        }
        completion += group
            .iter()
            .flatten()
            .map(|s| u64::from(s.generated_tokens))
            .sum::<u64>();
    }
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// Sum of a candidate's token log-probabilities (its rank for `best_of`).
fn score(pieces: &[Piece]) -> f64 {
    pieces
        .iter()
        .filter_map(|p| p.logprob.as_ref())
        .map(|l| f64::from(l.logprob))
        .sum()
}

/// Runs every candidate to the end and answers the whole response; `echoes[g]` is prompt
/// `g`'s text when it is echoed.
pub async fn whole(
    mut events: mpsc::Receiver<Tagged>,
    meta: &Meta,
    sizes: (usize, usize, usize),
    echoes: &[Option<String>],
) -> Result<Value, ApiError> {
    let (groups, candidates, n) = sizes;
    let mut pieces = vec![vec![Vec::new(); candidates]; groups];
    let mut summaries = vec![vec![None; candidates]; groups];
    let mut left = groups * candidates;
    while left > 0 {
        let Some(t) = events.recv().await else {
            return Err(ApiError::status(500, "server_error", "the engine stopped"));
        };
        match t.event {
            Event::Piece(p) => pieces[t.group][t.candidate].push(p),
            Event::Done(s) => {
                summaries[t.group][t.candidate] = Some(s);
                left -= 1;
            }
            Event::Failed(e) => return Err(ApiError::from_engine(&e)),
        }
    }
    let mut choices = Vec::with_capacity(groups * n);
    for g in 0..groups {
        let mut ranked: Vec<usize> = (0..candidates).collect();
        if candidates > n {
            ranked.sort_by(|&a, &b| score(&pieces[g][b]).total_cmp(&score(&pieces[g][a])));
        }
        for (rank, &c) in ranked.iter().take(n).enumerate() {
            let index = (g * n + rank) as u32;
            let choice = meta.choice_meta(index, echoes[g].clone());
            if let Some(s) = &summaries[g][c] {
                choices.push(choice.choice(&pieces[g][c], s));
            }
        }
    }
    Ok(meta.envelope(choices, usage(&summaries)))
}

/// Streams every candidate's chunks (each with its choice's index) as they come, then the
/// usage chunk and `[DONE]`. Returns early (dropping every candidate's channel, which cancels
/// them) when the client goes away.
pub async fn stream(
    first: Tagged,
    mut events: mpsc::Receiver<Tagged>,
    meta: Meta,
    sizes: (usize, usize),
    echoes: Vec<Option<String>>,
    tx: mpsc::Sender<Bytes>,
) {
    let (groups, n) = sizes;
    let mut metas: Vec<Vec<(Meta, bool)>> = (0..groups)
        .map(|g| {
            (0..n)
                .map(|c| {
                    (
                        meta.choice_meta((g * n + c) as u32, echoes[g].clone()),
                        false,
                    )
                })
                .collect()
        })
        .collect();
    let mut summaries = vec![vec![None; n]; groups];
    let mut left = groups * n;
    let mut next = Some(first);
    while left > 0 {
        let t = match next.take() {
            Some(t) => t,
            None => match events.recv().await {
                Some(t) => t,
                None => return,
            },
        };
        let (m, opened) = &mut metas[t.group][t.candidate];
        let mut frames = if *opened {
            Vec::new()
        } else {
            *opened = true;
            m.opening()
        };
        match t.event {
            Event::Piece(p) => frames.extend(m.piece(&p)),
            Event::Done(s) => {
                frames.push(m.finish_frame(&s));
                summaries[t.group][t.candidate] = Some(s);
                left -= 1;
            }
            Event::Failed(e) => {
                let _ = tx
                    .send(Bytes::from(m.error(&ApiError::from_engine(&e))))
                    .await;
                return;
            }
        }
        for f in frames {
            if tx.send(Bytes::from(f)).await.is_err() {
                return;
            }
        }
    }
    for f in meta.end_frames(usage(&summaries)) {
        if tx.send(Bytes::from(f)).await.is_err() {
            return;
        }
    }
}

/// Prompt `g`'s text for `echo`: as sent, or its token ids' bytes (lossy UTF-8).
pub fn echo_text(
    engine: &EngineBox,
    model: &str,
    prompt: &openai::PromptInput,
) -> Result<String, ApiError> {
    match prompt {
        openai::PromptInput::Text(t) => Ok(t.clone()),
        openai::PromptInput::Tokens(ids) => {
            let bytes = engine
                .detokenize(model.into(), ids.as_slice().into())
                .into_result()
                .map_err(|e| ApiError::from_engine(&e))?;
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        }
    }
}
