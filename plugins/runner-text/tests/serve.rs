//! The engine as transports see it: [`EngineHandle`] through the ABI's `Engine` interface —
//! continuous batching, prefix cache and breakpoints, back-pressure, cancellation, logprobs,
//! checkpoints — on the llama fixture model with the tiny tokenizer.

mod common;

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RSome, RString},
};
use anyhow::Result;
use std::{
    sync::{Arc, Barrier, Mutex, mpsc},
    thread,
};
use u_runner_text::{EngineHandle, GenerateOptions, Generator, Limits, sampler};
use u_sdk::{
    CacheBreakpoint, ChatTurn, CheckpointOp, CheckpointRequest, EngineBox, ErrorKind, FinishReason,
    GenerateRequest, GenerateSummary, GeneratedToken, KvCacheBox, Output, Rows, Segment, SeqChunk,
    TokenLogprob, TokenSink, TokenSink_TO,
};

/// What a sink saw: ids of generated tokens (pieces with a logprob; the final flush has none),
/// the text, and the logprobs.
#[derive(Default, Debug)]
struct Seen {
    ids: Vec<u32>,
    text: String,
    logprobs: Vec<(TokenLogprob, Vec<TokenLogprob>)>,
}

struct Collect {
    seen: Arc<Mutex<Seen>>,
    /// Return `false` (cancel) once this many tokens arrived.
    cancel_after: Option<usize>,
    /// Told when the first token arrives.
    started: Option<mpsc::Sender<()>>,
}

impl TokenSink for Collect {
    fn token(&mut self, t: &GeneratedToken<'_>) -> bool {
        let mut seen = self.seen.lock().unwrap();
        seen.text.push_str(t.text.as_str());
        if let RSome(lp) = &t.logprob {
            seen.ids.push(t.id);
            seen.logprobs.push((lp.clone(), t.top_logprobs.to_vec()));
        }
        if let Some(tx) = self.started.take() {
            let _ = tx.send(());
        }
        self.cancel_after.is_none_or(|n| seen.ids.len() < n)
    }
}

fn sink(seen: &Arc<Mutex<Seen>>) -> u_sdk::TokenSinkBox {
    TokenSink_TO::from_value(
        Collect {
            seen: seen.clone(),
            cancel_after: None,
            started: None,
        },
        TD_Opaque,
    )
}

/// Runs `request`; returns its summary and what the sink saw.
fn ask(engine: &EngineBox, request: &GenerateRequest) -> Result<(GenerateSummary, Seen)> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let summary = engine.generate(request, sink(&seen)).into_result()?;
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    Ok((summary, seen))
}

/// A greedy request for the served model `tiny` that reports ids (logprobs with no
/// alternatives).
fn greedy(prompt: &str, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        top_logprobs: RSome(0),
        ..GenerateRequest::new("tiny", prompt, max_tokens, sampler::greedy())
    }
}

fn llama_engine(limits: Limits) -> Result<(EngineHandle, KvCacheBox)> {
    let (g, cache) = common::generator(common::safetensors("llama")?)?;
    Ok((EngineHandle::with_limits("tiny", g, limits), cache))
}

fn live_sequences(cache: &KvCacheBox) -> Result<u64> {
    Ok(cache.stats().into_result()?.sequences)
}

/// Prompts of different lengths (up to ~130 tokens) and their budgets.
fn mixed_requests() -> Vec<GenerateRequest> {
    (0..10)
        .map(|i| {
            let prompt = format!(
                "{} request {i}",
                "The quick brown fox jumps over the lazy dog. ".repeat(i % 4 + i / 4)
            );
            greedy(&prompt, 6 + 5 * i as u32)
        })
        .collect()
}

#[test]
fn concurrent_requests_share_passes_and_equal_their_solo_runs() -> Result<()> {
    for (format, file) in [("f32", None), ("q8_0", Some("model.q8_0.gguf"))] {
        let weights = |()| match file {
            None => common::safetensors("llama"),
            Some(f) => common::gguf("llama", f),
        };
        let requests = mixed_requests();
        // Alone: one request at a time through the same interface.
        let (g, cache) = common::generator(weights(())?)?;
        let solo_engine = EngineHandle::new("tiny", g.clone());
        let solo = solo_engine.clone().into_box();
        let mut alone = Vec::new();
        for r in &requests {
            alone.push(ask(&solo, r)?);
        }
        let solo_passes = u_sdk::Engine::stats(&solo_engine).unwrap().forward_passes;
        // The Generator's own single-request path agrees.
        for (r, (summary, seen)) in requests.iter().zip(&alone) {
            let direct = g.generate(&r.prompt, &options(r.max_tokens), &mut |_, _| true)?;
            assert_eq!(direct.tokens, seen.ids, "{format}: {:?}", r.prompt);
            assert_eq!(summary.generated_tokens as usize, seen.ids.len());
        }
        drop((solo, solo_engine, g));
        assert_eq!(live_sequences(&cache)?, 0);

        // Together: all at once, with a small step budget so long prompts prefill in chunks
        // beside running decodes.
        let (g, cache) = common::generator(weights(())?)?;
        let limits = Limits {
            max_running: 16,
            max_queued: 16,
            step_tokens: 24,
        };
        let engine = EngineHandle::with_limits("tiny", g, limits);
        let abi = engine.clone().into_box();
        let gate = Arc::new(Barrier::new(requests.len()));
        let together: Vec<(GenerateSummary, Seen)> = thread::scope(|s| -> Result<_> {
            let handles: Vec<_> = requests
                .iter()
                .map(|r| {
                    let (abi, gate) = (abi.clone(), gate.clone());
                    s.spawn(move || {
                        gate.wait();
                        ask(&abi, r)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })?;
        for (r, ((a, a_seen), (b, b_seen))) in requests.iter().zip(alone.iter().zip(&together)) {
            assert_eq!(a_seen.ids, b_seen.ids, "{format}: {:?}", r.prompt);
            assert_eq!(a_seen.text, b_seen.text);
            assert_eq!(
                (a.finish, a.generated_tokens),
                (b.finish, b.generated_tokens)
            );
            assert_eq!(a.prompt_tokens, b.prompt_tokens);
        }
        let stats = u_sdk::Engine::stats(&engine).unwrap();
        let tokens: u64 = together.iter().map(|t| t.0.generated_tokens as u64).sum();
        println!(
            "{format}: {} requests, {tokens} tokens: {solo_passes} forward passes one at a time, {} batched",
            requests.len(),
            stats.forward_passes
        );
        // At least a quarter fewer passes (half or fewer on an idle machine; on a loaded one
        // the threads reach the engine staggered, so fewer of them share the first steps).
        assert!(
            stats.forward_passes * 4 < solo_passes * 3,
            "{format}: batching did not share passes: {} vs {solo_passes}",
            stats.forward_passes
        );
        assert_eq!(stats.requests, requests.len() as u64);
        assert_eq!(stats.generated_tokens, tokens);
        assert_eq!((stats.running, stats.queued), (0, 0));
        drop((abi, engine));
        assert_eq!(live_sequences(&cache)?, 0);
    }
    Ok(())
}

#[test]
fn a_shared_prefix_is_served_from_the_cache_with_identical_output() -> Result<()> {
    let (engine, cache) = llama_engine(Limits::default())?;
    let g = engine.generator().clone();
    let abi = engine.clone().into_box();
    let system = "You are a helpful assistant who answers briefly. ".repeat(3);
    let first = greedy(&format!("{system}Question: what is a fox?"), 12);
    let second = greedy(&format!("{system}Question: why is the sky blue?"), 12);
    let (a, _) = ask(&abi, &first)?;
    assert_eq!(a.cached_tokens, 0);
    let (b, b_seen) = ask(&abi, &second)?;
    let (ta, tb) = (g.encode(&first.prompt)?, g.encode(&second.prompt)?);
    let common = ta.iter().zip(&tb).take_while(|(x, y)| x == y).count();
    assert!(common > 40, "{common}");
    assert_eq!(b.cached_tokens as usize, common);
    assert_eq!(b.prompt_tokens as usize, tb.len());
    // Identical to an uncached run.
    let uncached = g.generate_tokens(&tb, &options(12), &mut |_, _| true)?;
    assert_eq!(b_seen.ids, uncached.tokens);
    // The same prompt again: everything but its last token comes from the cache.
    let (c, c_seen) = ask(&abi, &second)?;
    assert_eq!(c.cached_tokens as usize, tb.len() - 1);
    assert_eq!(c_seen.ids, b_seen.ids);
    // A follow-up that continues prompt and answer hits the cached answer too.
    let follow = greedy(&format!("{}{} And more?", second.prompt, b_seen.text), 4);
    let (d, _) = ask(&abi, &follow)?;
    assert!(d.cached_tokens as usize > tb.len(), "{d:?}");
    let stats = u_sdk::Engine::stats(&engine).unwrap();
    assert_eq!(
        stats.cached_tokens,
        (b.cached_tokens + c.cached_tokens + d.cached_tokens) as u64
    );
    assert!(stats.kv_bytes > 0);
    assert_eq!(live_sequences(&cache)?, 0);
    Ok(())
}

/// Greedy options for the [`Generator`]'s direct path.
fn options(max_tokens: u32) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        ..GenerateOptions::default()
    }
}

fn turn(role: &str, content: &str) -> ChatTurn {
    ChatTurn::text(role, content)
}

#[test]
fn cache_breakpoints_report_writes_then_reads() -> Result<()> {
    let (engine, cache) = llama_engine(Limits::default())?;
    let g = engine.generator().clone();
    let abi = engine.clone().into_box();
    let system = "Answer every question about foxes, dogs and the weather. ".repeat(2);
    let chat = |question: &str| GenerateRequest {
        messages: vec![turn("system", &system), turn("user", question)].into(),
        cache_breakpoints: vec![CacheBreakpoint {
            turn: 0,
            offset: system.len() as u32,
        }]
        .into(),
        ..greedy("", 8)
    };
    let (a, _) = ask(&abi, &chat("Is the fox quick?"))?;
    // The system turn as rendered: the breakpoint covers exactly its tokens.
    let whole = g.encode(&g.chat_prompt(&[
        u_runner_text::ChatMessage::new("system", &system),
        u_runner_text::ChatMessage::new("user", "Is the fox quick?"),
    ])?)?;
    assert_eq!(a.prompt_tokens as usize, whole.len());
    assert_eq!(a.cached_tokens, 0);
    assert!(a.cache_written_tokens > 20, "{a:?}");
    assert!((a.cache_written_tokens as usize) < whole.len());
    // Another question after the same system turn reads it and writes nothing new.
    let second = chat("Where do dogs sleep?");
    let (b, b_seen) = ask(&abi, &second)?;
    assert!(b.cached_tokens >= a.cache_written_tokens, "{b:?}");
    assert_eq!(b.cache_written_tokens, 0);
    let tokens = g.encode(&g.chat_prompt(&[
        u_runner_text::ChatMessage::new("system", &system),
        u_runner_text::ChatMessage::new("user", "Where do dogs sleep?"),
    ])?)?;
    let uncached = g.generate_tokens(&tokens, &options(8), &mut |_, _| true)?;
    assert_eq!(b_seen.ids, uncached.tokens);
    // A breakpoint mid-text and a bad one.
    let mut mid = chat("Why?");
    mid.cache_breakpoints = vec![CacheBreakpoint { turn: 1, offset: 2 }].into();
    ask(&abi, &mid)?;
    mid.cache_breakpoints = vec![CacheBreakpoint { turn: 5, offset: 0 }].into();
    let e = abi
        .generate(&mid, sink(&Default::default()))
        .into_result()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidInput, "{e}");
    assert_eq!(live_sequences(&cache)?, 0);
    Ok(())
}

/// A request long enough to still be running while the test does something else.
fn long_request() -> GenerateRequest {
    greedy("Hello", 200)
}

/// Attempts for the two tests below: the tiny fixture decodes 200 tokens in a few
/// milliseconds, and the scheduler never waits for a client, so the first request can finish
/// before the test's next move lands. Each attempt either shows the behaviour or the request
/// finished first; the behaviour must show in one of them.
const ATTEMPTS: usize = 20;

#[test]
fn a_full_queue_answers_busy() -> Result<()> {
    let limits = Limits {
        max_running: 1,
        max_queued: 0,
        step_tokens: 64,
    };
    let (engine, cache) = llama_engine(limits)?;
    let abi = engine.clone().into_box();
    let mut refused = None;
    for _ in 0..ATTEMPTS {
        let (tx, rx) = mpsc::channel();
        let runner = {
            let abi = abi.clone();
            thread::spawn(move || {
                let seen = Arc::new(Mutex::new(Seen::default()));
                let sink = TokenSink_TO::from_value(
                    Collect {
                        seen,
                        cancel_after: None,
                        started: Some(tx),
                    },
                    TD_Opaque,
                );
                abi.generate(&long_request(), sink).into_result()
            })
        };
        rx.recv()?;
        let second = abi
            .generate(&greedy("Hi", 4), sink(&Default::default()))
            .into_result();
        let first = runner.join().unwrap()?;
        assert_eq!(
            (first.finish, first.generated_tokens),
            (FinishReason::Length, 200)
        );
        if let Err(e) = second {
            refused = Some(e);
            break;
        }
    }
    let e = refused.expect("the second request was never refused while the first ran");
    assert_eq!(e.kind, ErrorKind::Busy, "{e}");
    assert!(e.message.contains("capacity"), "{e}");
    let stats = u_sdk::Engine::stats(&engine).unwrap();
    assert!(stats.rejected == 1 && stats.requests >= 1, "{stats:?}");
    assert_eq!(stats.queue_capacity, 0);
    // Room again once it finished.
    ask(&abi, &greedy("Hi", 4))?;
    assert_eq!(live_sequences(&cache)?, 0);
    Ok(())
}

#[test]
fn a_cancelling_sink_frees_its_slot() -> Result<()> {
    let (engine, cache) = llama_engine(Limits::default())?;
    let abi = engine.clone().into_box();
    let mut cancelled = false;
    for _ in 0..ATTEMPTS {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let sink = TokenSink_TO::from_value(
            Collect {
                seen: seen.clone(),
                cancel_after: Some(3),
                started: None,
            },
            TD_Opaque,
        );
        let summary = abi.generate(&long_request(), sink).into_result()?;
        assert_eq!(
            seen.lock().unwrap().ids.len(),
            3,
            "nothing forwarded after cancelling"
        );
        if summary.finish == FinishReason::Cancelled {
            assert!(summary.generated_tokens < 200, "{summary:?}");
            cancelled = true;
            break;
        }
        assert_eq!(
            (summary.finish, summary.generated_tokens),
            (FinishReason::Length, 200)
        );
    }
    assert!(cancelled, "no attempt was cancelled before it finished");
    let stats = u_sdk::Engine::stats(&engine).unwrap();
    assert_eq!((stats.running, stats.queued), (0, 0));
    assert_eq!(live_sequences(&cache)?, 0);
    // The engine goes on serving.
    let (s, _) = ask(&abi, &greedy("Hi", 4))?;
    assert_eq!(s.finish, FinishReason::Length);
    Ok(())
}

#[test]
fn a_stop_string_ends_a_request_and_is_reported() -> Result<()> {
    let (engine, _) = llama_engine(Limits::default())?;
    let abi = engine.into_box();
    let (full, full_seen) = ask(&abi, &greedy("Hello, world", 24))?;
    assert_eq!(full.stop_sequence, abi_stable::std_types::RNone);
    let chars: Vec<char> = full_seen.text.chars().collect();
    assert!(chars.len() > 8, "{:?}", full_seen.text);
    let stop: String = chars[6..8].iter().collect();
    let at = full_seen.text.find(&stop).unwrap();
    let mut request = greedy("Hello, world", 24);
    request.stop = vec![
        RString::from("never-produced"),
        RString::from(stop.as_str()),
    ]
    .into();
    let (cut, cut_seen) = ask(&abi, &request)?;
    assert_eq!(cut.finish, FinishReason::Stop);
    assert_eq!(cut.stop_sequence, RSome(RString::from(stop.as_str())));
    assert_eq!(cut_seen.text, full_seen.text[..at]);
    assert!(cut.generated_tokens < full.generated_tokens);
    Ok(())
}

#[test]
fn logprobs_are_a_log_softmax_of_the_logits() -> Result<()> {
    let (engine, _) = llama_engine(Limits::default())?;
    let g = engine.generator().clone();
    let abi = engine.into_box();
    let mut request = greedy("Hello, world", 8);
    request.top_logprobs = RSome(5);
    let (summary, seen) = ask(&abi, &request)?;
    assert_eq!(summary.generated_tokens, 8);
    // Reference: every position's logits from one pass of another model instance.
    let model = common::build(common::safetensors("llama")?)?;
    let prompt = g.encode(&request.prompt)?;
    let all: Vec<u32> = prompt.iter().chain(&seen.ids).copied().collect();
    let vocab = model.config().unwrap().vocab_size as usize;
    let mut logits = vec![0f32; all.len() * vocab];
    let seq = model.cache().unwrap().unwrap().create().into_result()?;
    let input = [Segment::Tokens(all.as_slice().into())];
    let chunk = [SeqChunk::tokens(seq, &input, Output::Logits(Rows::All))];
    model
        .forward(chunk.as_slice().into(), logits.as_mut_slice().into())
        .into_result()?;
    let tok = g.tokenizer().unwrap();
    for (i, (chosen, top)) in seen.logprobs.iter().enumerate() {
        let row = &logits[(prompt.len() - 1 + i) * vocab..][..vocab];
        let lse = row.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
        let lp = |id: u32| (f64::from(row[id as usize]) - lse) as f32;
        assert!((chosen.logprob - lp(chosen.id)).abs() < 1e-4, "{chosen:?}");
        assert_eq!(
            chosen.bytes.to_vec(),
            tok.token_bytes(chosen.id).into_result()?.to_vec()
        );
        assert_eq!(top.len(), 5);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0].id, chosen.id);
        let mut order: Vec<u32> = (0..vocab as u32).collect();
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
        for (t, want) in top.iter().zip(&order) {
            assert_eq!(t.id, *want);
            assert!((t.logprob - lp(t.id)).abs() < 1e-4);
        }
    }
    request.top_logprobs = RSome(21);
    let e = abi
        .generate(&request, sink(&Default::default()))
        .into_result()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidInput);
    Ok(())
}

fn checkpoint(op: CheckpointOp, name: &str) -> CheckpointRequest {
    CheckpointRequest {
        op,
        model: "tiny".into(),
        name: name.into(),
        source: RString::new(),
        target: RString::new(),
        prompt: RString::new(),
        messages: Vec::new().into(),
        owner: Default::default(),
        overwrite: false,
        admin: false,
    }
}

fn listed(abi: &EngineBox) -> Result<Vec<(String, u64)>> {
    Ok(abi
        .checkpoint(&checkpoint(CheckpointOp::List, ""))
        .into_result()?
        .into_iter()
        .map(|c| (c.name.into_string(), c.tokens))
        .collect())
}

#[test]
fn a_resumed_checkpoint_continues_like_the_whole_prompt() -> Result<()> {
    let (engine, cache) = llama_engine(Limits::default())?;
    let g: Arc<Generator> = engine.generator().clone();
    let abi = engine.clone().into_box();
    let tok = g.tokenizer().unwrap().clone();
    let continuation = |text: &str| -> Result<Vec<u32>> {
        Ok(tok.encode(text.into(), false, true).into_result()?.to_vec())
    };
    // Save: prefill a prompt and keep it.
    let saved = abi
        .checkpoint(&CheckpointRequest {
            prompt: "Hello, world".into(),
            ..checkpoint(CheckpointOp::Save, "greeting")
        })
        .into_result()?;
    let head = g.encode("Hello, world")?;
    assert_eq!(saved[0].tokens as usize, head.len());
    let resume = GenerateRequest {
        resume_from: RSome("greeting".into()),
        save_as: RSome("turn1".into()),
        ..greedy(" and more", 10)
    };
    let (s, seen) = ask(&abi, &resume)?;
    let whole: Vec<u32> = [head.clone(), continuation(" and more")?].concat();
    assert_eq!(s.prompt_tokens as usize, whole.len());
    assert_eq!(s.cached_tokens as usize, head.len());
    let direct = g.generate_tokens(&whole, &options(10), &mut |_, _| true)?;
    assert_eq!(seen.ids, direct.tokens);
    // save_as kept prompt and answer: resuming it equals the whole conversation.
    let (s2, seen2) = ask(
        &abi,
        &GenerateRequest {
            resume_from: RSome("turn1".into()),
            ..greedy(" Next", 6)
        },
    )?;
    let longer: Vec<u32> = [whole.clone(), seen.ids.clone(), continuation(" Next")?].concat();
    assert_eq!(s2.cached_tokens as usize, whole.len() + seen.ids.len());
    let direct = g.generate_tokens(&longer, &options(6), &mut |_, _| true)?;
    assert_eq!(seen2.ids, direct.tokens);
    assert_eq!(
        listed(&abi)?,
        vec![
            ("greeting".to_string(), head.len() as u64),
            ("turn1".to_string(), (whole.len() + seen.ids.len()) as u64)
        ]
    );
    // Another engine on the same cache never saw these checkpoints' ids (as after a restart
    // with checkpoints on disk): it still resumes them exactly, and lists their length (the
    // cache knows it).
    let other = EngineHandle::new("tiny", g.clone()).into_box();
    let (s3, seen3) = ask(
        &other,
        &GenerateRequest {
            resume_from: RSome("turn1".into()),
            ..greedy(" Next", 6)
        },
    )?;
    assert_eq!(s3.cached_tokens, s2.cached_tokens);
    assert_eq!(seen3.ids, seen2.ids);
    assert_eq!(
        listed(&other)?[1],
        ("turn1".to_string(), (whole.len() + seen.ids.len()) as u64)
    );
    drop(other);
    let missing = GenerateRequest {
        resume_from: RSome("nope".into()),
        ..greedy("x", 2)
    };
    let e = abi
        .generate(&missing, sink(&Default::default()))
        .into_result()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    assert_eq!(live_sequences(&cache)?, 0);
    Ok(())
}

#[test]
fn checkpoints_fork_graft_list_and_delete() -> Result<()> {
    let (engine, cache) = llama_engine(Limits::default())?;
    let abi = engine.clone().into_box();
    let run = |r: CheckpointRequest| -> Result<Vec<(String, u64)>> {
        Ok(abi
            .checkpoint(&r)
            .into_result()?
            .into_iter()
            .map(|c| (c.name.into_string(), c.tokens))
            .collect())
    };
    let a = run(CheckpointRequest {
        prompt: "Hello".into(),
        ..checkpoint(CheckpointOp::Save, "a")
    })?;
    let b = run(CheckpointRequest {
        messages: vec![turn("user", "Hi there")].into(),
        ..checkpoint(CheckpointOp::Save, "b")
    })?;
    let (na, nb) = (a[0].1, b[0].1);
    // Save on top of a checkpoint appends.
    let ab_text = run(CheckpointRequest {
        prompt: " world".into(),
        source: "a".into(),
        ..checkpoint(CheckpointOp::Save, "a.more")
    })?;
    assert!(ab_text[0].1 > na);
    let fork = run(CheckpointRequest {
        source: "a".into(),
        ..checkpoint(CheckpointOp::Fork, "a2")
    })?;
    assert_eq!(fork, vec![("a2".to_string(), na)]);
    let graft = run(CheckpointRequest {
        source: "b".into(),
        target: "a".into(),
        ..checkpoint(CheckpointOp::Graft, "ab")
    })?;
    assert_eq!(graft, vec![("ab".to_string(), na + nb)]);
    let names: Vec<String> = listed(&abi)?.into_iter().map(|c| c.0).collect();
    assert_eq!(names, ["a", "a.more", "a2", "ab", "b"]);
    assert_eq!(listed(&abi)?[3].1, na + nb);
    // The grafted sequence can be continued.
    let (s, _) = ask(
        &abi,
        &GenerateRequest {
            resume_from: RSome("ab".into()),
            ..greedy(" ok", 4)
        },
    )?;
    assert_eq!(s.cached_tokens as u64, na + nb);
    assert_eq!(run(checkpoint(CheckpointOp::Delete, "a2"))?, vec![]);
    let e = abi
        .checkpoint(&checkpoint(CheckpointOp::Delete, "a2"))
        .into_result()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    assert_eq!(listed(&abi)?.len(), 4);
    let e = abi
        .checkpoint(&checkpoint(CheckpointOp::Save, "empty"))
        .into_result()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidInput, "{e}");
    let e = abi
        .checkpoint(&CheckpointRequest {
            model: "other".into(),
            ..checkpoint(CheckpointOp::List, "")
        })
        .into_result()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    assert_eq!(live_sequences(&cache)?, 0);
    Ok(())
}

#[test]
fn embeddings_are_the_models_mean_hidden_state_normalised() -> Result<()> {
    let (engine, _) = llama_engine(Limits::default())?;
    let g = engine.generator().clone();
    let abi = engine.into_box();
    let e = abi
        .embed("other".into(), "Hello".into())
        .into_result()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    // The reference: another instance's pooled (mean) final hidden state, normalised here.
    let model = common::build(common::safetensors("llama")?)?;
    let tokens = g.encode("Hello, world")?;
    let hidden = model.config().unwrap().hidden as usize;
    let seq = model.cache().unwrap().unwrap().create().into_result()?;
    let input = [Segment::Tokens(tokens.as_slice().into())];
    let chunk = [SeqChunk::tokens(
        seq,
        &input,
        Output::Pooled(u_sdk::Pooling::Mean),
    )];
    let mut mean = vec![0f32; hidden];
    model
        .forward(chunk.as_slice().into(), mean.as_mut_slice().into())
        .into_result()?;
    let v = abi
        .embed("tiny".into(), "Hello, world".into())
        .into_result()?;
    let norm = mean.iter().map(|x| x * x).sum::<f32>().sqrt();
    assert_eq!(v.len(), hidden);
    for (a, b) in v.iter().zip(mean.iter()) {
        assert!((a - b / norm).abs() < 1e-5, "{a} vs {}", b / norm);
    }
    let other = abi.embed("tiny".into(), "Goodbye".into()).into_result()?;
    assert_ne!(v, other);
    Ok(())
}

/// Why batched greedy output equals single-request output: a sequence's logits do not depend on
/// what else shares its pass, bit for bit — a decode row computed alone (kernels-cpu's one-row
/// matmul path) equals the same row inside a multi-row pass (the four-row tiles), for f32 and
/// Q8_0 weights, and attention runs per sequence.
#[test]
fn batch_neighbours_do_not_change_a_sequences_logits() -> Result<()> {
    for file in [None, Some("model.q8_0.gguf")] {
        let weights = match file {
            None => common::safetensors("llama")?,
            Some(f) => common::gguf("llama", f)?,
        };
        let model = common::build(weights)?;
        let cache = model.cache().unwrap().unwrap();
        let vocab = model.config().unwrap().vocab_size as usize;
        let prompt: Vec<u32> = (3..40).collect();
        let others: Vec<Vec<u32>> = vec![(50..90).collect(), vec![7], (10..15).collect()];
        let run = |neighbours: &[Vec<u32>]| -> Result<Vec<f32>> {
            // A decode step of `a` (one row) alone or beside other sequences' chunks.
            let a = cache.create().into_result()?;
            let input = [Segment::Tokens(prompt.as_slice().into())];
            let prefill = [SeqChunk::tokens(a, &input, Output::Nothing)];
            model
                .forward(prefill.as_slice().into(), (&mut [][..]).into())
                .into_result()?;
            let mut seqs = vec![a];
            let mut inputs = vec![[Segment::Tokens([5u32].as_slice().into())]];
            for n in neighbours {
                seqs.push(cache.create().into_result()?);
                inputs.push([Segment::Tokens(n.as_slice().into())]);
            }
            let chunks: Vec<SeqChunk<'_>> = seqs
                .iter()
                .zip(&inputs)
                .map(|(&s, input)| SeqChunk::tokens(s, input, Output::Logits(Rows::Last)))
                .collect();
            let mut logits = vec![0f32; chunks.len() * vocab];
            model
                .forward(chunks.as_slice().into(), logits.as_mut_slice().into())
                .into_result()?;
            for s in seqs {
                cache.release(s).into_result()?;
            }
            logits.truncate(vocab);
            Ok(logits)
        };
        let alone = run(&[])?;
        for k in 1..=others.len() {
            let batched = run(&others[..k])?;
            let diff = alone
                .iter()
                .zip(&batched)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert_eq!(alone, batched, "{file:?}, {k} neighbours: max |Δ| {diff}");
        }
    }
    Ok(())
}
