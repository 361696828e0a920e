//! Issue 6, exactness on the fixture models (the tiny random-weight f32 GGUF models of
//! arch-llama's fixtures, run by arch-llama on the CPU kernels, with this cache).
//!
//! (a) A cached prefix — from the prefix tree or a checkpoint, in memory, on the disk tier, and
//! after a restart (a new cache and model over the same directory) — or a graft at the positions
//! it was computed at, continued with the rest of the prompt, gives the logits of a full
//! recompute (≤ 1e-5).
//!
//! (b) A graft at another position gives what the document recomputed alone there gives
//! (≤ 1e-4); see [`a_graft_at_another_position_equals_the_document_recomputed_alone_there`].

mod common;

use abi_stable::std_types::{RSlice, RSliceMut};
use std::path::{Path, PathBuf};
use u_arch_llama::LlamaArchitecture;
use u_cache_kv::{Config, KvCachePlugin};
use u_kernels_cpu::testutil::BackendWith;
use u_sdk::{
    BackendBox, KvCacheBox, ModelBox, Op, OpCall, OpKind, Output, Rows, Segment, SeqChunk, SeqId,
};

/// Every fixture family arch-llama generates (dense, MoE, sliding window, QK norm, llama3 RoPE).
const MODELS: [&str; 8] = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
];

fn gguf(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../arch-llama/tests/fixtures/models")
        .join(name)
        .join("model.gguf")
}

/// The CPU backend with every RoPE position moved by `by`: a model built on it computes a
/// fresh sequence as if it sat at positions `by..` with nothing before it (attention masks and
/// windows are relative to the sequence; only the rotation sees the absolute position).
fn shifted(inner: BackendBox, by: u32) -> BackendBox {
    BackendWith::new(inner)
        .replace(OpKind::Rope, move |inner, call| {
            let moved: Vec<i32> = common::bytes(call.srcs[1])
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) + by as i32)
                .collect();
            let positions = u_sdk::nn::Device::new(inner.clone())
                .unwrap()
                .from_i32(&moved, &[moved.len() as u64])
                .unwrap();
            let srcs = [call.srcs[0], positions.desc()];
            let Op::Rope(params) = &call.op else {
                unreachable!("only Rope is replaced")
            };
            let moved_call = OpCall {
                op: Op::Rope(params),
                srcs: RSlice::from_slice(&srcs),
                dst: call.dst,
            };
            inner.compute(RSlice::from_slice(std::slice::from_ref(&moved_call)))
        })
        .into_box()
}

/// Fixture `name` on the CPU kernels (positions moved by `shift`), its KV in `cache`.
fn build(name: &str, cache: &KvCacheBox, shift: u32) -> ModelBox {
    let weights = u_loader_gguf::open_path(&gguf(name))
        .expect("fixture GGUF")
        .into_box();
    let cpu = u_kernels_cpu::CpuKernels::new(1)
        .expect("kernels")
        .into_box();
    let kernels = if shift == 0 { cpu } else { shifted(cpu, shift) };
    LlamaArchitecture::default()
        .load(weights, kernels, cache.clone())
        .expect("build")
}

fn forward(model: &ModelBox, seq: SeqId, tokens: &[u32], wanted: Output) -> Vec<f32> {
    let config = model.config().unwrap();
    let input = [Segment::Tokens(RSlice::from_slice(tokens))];
    let batch = [SeqChunk::tokens(seq, &input, wanted)];
    let mut out = vec![0f32; wanted.floats(tokens.len(), &config)];
    model
        .forward(
            RSlice::from_slice(&batch),
            RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()
        .expect("forward");
    out
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn disk_cache(dir: &Path) -> KvCacheBox {
    let config = Config {
        dir: Some(dir.to_str().unwrap().to_string()),
        ..Config::default()
    };
    KvCachePlugin::new(config, Some(common::host(dir, ""))).into_box()
}

fn tokens(vocab: usize, n: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 37 + salt * 11 + 5) % vocab) as u32)
        .collect()
}

/// The ways (a) restores the first `split` tokens, each continued with the rest.
fn continuations(
    model: &ModelBox,
    cache: &KvCacheBox,
    prompt: &[u32],
    split: usize,
) -> Vec<(&'static str, Vec<f32>)> {
    let tail = &prompt[split..];
    let restored = cache.load_checkpoint("head".into()).into_result().unwrap();
    let from_checkpoint = forward(model, restored, tail, Output::Logits(Rows::All));
    let found = cache.lookup_prefix(prompt.into()).into_result().unwrap();
    assert_eq!(found.matched as usize, split, "deepest prefix match");
    let from_tree = forward(model, found.seq, tail, Output::Logits(Rows::All));
    for seq in [restored, found.seq] {
        cache.release(seq).into_result().unwrap();
    }
    vec![("checkpoint", from_checkpoint), ("prefix tree", from_tree)]
}

#[test]
fn restored_prefixes_continue_exactly_like_a_full_recompute_in_memory_on_disk_and_after_a_restart()
{
    const TOLERANCE: f32 = 1e-5;
    for name in MODELS {
        let dir = tempfile::tempdir().unwrap();
        let memory = KvCachePlugin::new(Config::default(), None).into_box();
        let disk = disk_cache(dir.path());
        let mut results = Vec::new();
        let mut prompt = Vec::new();
        let mut expected = Vec::new();
        let split = 100; // not a page boundary: the tail continues a shared, partly filled page
        for (tier, cache) in [("memory", &memory), ("disk", &disk)] {
            let model = build(name, cache, 0);
            let vocab = model.config().unwrap().vocab_size as usize;
            prompt = tokens(vocab, 150, 1);
            let full = cache.create().into_result().unwrap();
            expected =
                forward(&model, full, &prompt, Output::Logits(Rows::All))[split * vocab..].to_vec();
            let head = cache.create().into_result().unwrap();
            forward(&model, head, &prompt[..split], Output::Nothing);
            cache
                .save_checkpoint("head".into(), head)
                .into_result()
                .unwrap();
            cache
                .insert_prefix(prompt[..split].into(), head)
                .into_result()
                .unwrap();
            for (how, logits) in continuations(&model, cache, &prompt, split) {
                results.push((format!("{tier} {how}"), max_abs_diff(&logits, &expected)));
            }
            // A graft at the positions the KV was computed at: tokens 40..split of `head` onto a
            // sequence holding tokens 0..40.
            let dst = cache.create().into_result().unwrap();
            forward(&model, dst, &prompt[..40], Output::Nothing);
            model
                .graft(dst, head, 40, split as u64 - 40)
                .into_result()
                .unwrap();
            let grafted = forward(&model, dst, &prompt[split..], Output::Logits(Rows::All));
            results.push((
                format!("{tier} graft in place"),
                max_abs_diff(&grafted, &expected),
            ));
        }
        drop(disk);
        // A restart: a new cache and model over the same directory.
        let cache = disk_cache(dir.path());
        let model = build(name, &cache, 0);
        for (how, logits) in continuations(&model, &cache, &prompt, split) {
            results.push((format!("restart {how}"), max_abs_diff(&logits, &expected)));
        }
        let line: Vec<String> = results
            .iter()
            .map(|(w, d)| format!("{w} Δ={d:.1e}"))
            .collect();
        println!("{name}: {}", line.join(", "));
        for (what, d) in results {
            assert!(
                d <= TOLERANCE,
                "{name}: {what} differs from a recompute by {d}"
            );
        }
    }
}

/// All of `layer`'s keys and values of `seq`.
fn kv(cache: &KvCacheBox, seq: SeqId, layer: u32) -> (Vec<f32>, Vec<f32>) {
    let h = cache.clone();
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for p in h.pages(seq, layer).into_result().unwrap().iter() {
        let (pk, pv) = common::page_f32(p);
        k.extend(pk);
        v.extend(pv);
    }
    (k, v)
}

/// Appends tokens `from..` of `src` to `dst`, unchanged.
fn copy_kv(cache: &KvCacheBox, layers: u32, src: SeqId, from: usize, dst: SeqId) {
    for l in 0..layers {
        let (k, v) = kv(cache, src, l);
        let row = k.len() / cache.len(src).into_result().unwrap() as usize;
        let b = common::backend();
        let (k, v) = (
            common::tensor(&b, &k[from * row..], row),
            common::tensor(&b, &v[from * row..], row),
        );
        cache.append(dst, l, &k, &v).into_result().unwrap();
    }
}

/// The largest difference of keys and of values of tokens `at` of `a` and `b`, relative to the
/// largest magnitude.
fn kv_diff(
    cache: &KvCacheBox,
    layers: u32,
    a: SeqId,
    b: SeqId,
    at: std::ops::Range<usize>,
) -> (f32, f32) {
    let (mut dk, mut dv) = (0f32, 0f32);
    for l in 0..layers {
        let ((ka, va), (kb, vb)) = (kv(cache, a, l), kv(cache, b, l));
        let row = ka.len() / cache.len(a).into_result().unwrap() as usize;
        let r = at.start * row..at.end * row;
        let rel = |x: &[f32], y: &[f32]| {
            let norm = y.iter().fold(0f32, |m, v| m.max(v.abs()));
            max_abs_diff(x, y) / norm
        };
        dk = dk.max(rel(&ka[r.clone()], &kb[r.clone()]));
        dv = dv.max(rel(&va[r.clone()], &vb[r]));
    }
    (dk, dv)
}

/// A document's KV computed alone at positions `p..`, grafted by the model
/// ([`u_sdk::Model::graft`]) onto a conversation of `q ≠ p` tokens, then continued: the logits
/// equal those of the document *recomputed alone at `q..`* after the same conversation.
///
/// "Alone" means the document's tokens attend only to each other, not to the conversation:
/// that is what a cached document is, and a graft cannot make it attend to a conversation it
/// never saw. The reference sequence therefore holds the conversation's KV followed by the
/// document's KV computed by the model in a fresh sequence whose RoPE positions start at `q`
/// ([`shifted`] kernels: every rotation at its absolute position, attention over the document
/// only) — the same model code and kernels, nothing of the graft's re-rotation. The source at
/// `p > 0` is built the same way (positions `p..`, behind `p` rows of filler the document never
/// attended to); `p = 0` is the plain case of a document prefilled in a sequence of its own.
///
/// Since RoPE attention depends only on relative positions, the document's hidden states — so
/// its values and un-rotated keys — are the same at `p` and at `q` up to f32 rounding of the
/// rotated scores; the test checks the grafted KV against the reference (≤ 1e-4 relative) and
/// the continuation's logits (≤ 1e-4), and that a graft without re-rotation (a plain copy) is
/// far off, so the check can tell.
#[test]
fn a_graft_at_another_position_equals_the_document_recomputed_alone_there() {
    const TOLERANCE: f32 = 1e-4;
    let (q, n) = (70usize, 90usize); // conversation and document lengths
    for name in MODELS {
        let cache = KvCachePlugin::new(Config::default(), None).into_box();
        let model = build(name, &cache, 0);
        let cfg = model.config().unwrap();
        let (vocab, layers) = (cfg.vocab_size as usize, cfg.layers);
        let conversation_tokens = tokens(vocab, q, 2);
        let document = tokens(vocab, n, 3);
        let more = tokens(vocab, 6, 4);
        let conversation = cache.create().into_result().unwrap();
        forward(&model, conversation, &conversation_tokens, Output::Nothing);
        // The reference: the conversation, then the document computed alone at q..
        let alone_at_q = cache.create().into_result().unwrap();
        forward(
            &build(name, &cache, q as u32),
            alone_at_q,
            &document,
            Output::Nothing,
        );
        let reference = cache.fork(conversation).into_result().unwrap();
        copy_kv(&cache, layers, alone_at_q, 0, reference);
        let want = forward(&model, reference, &more, Output::Logits(Rows::All));
        let mut line = Vec::new();
        for p in [0usize, 23, 130] {
            // The source: the document computed alone at p.., at index p of its sequence.
            let src = if p == 0 {
                let s = cache.create().into_result().unwrap();
                forward(&model, s, &document, Output::Nothing);
                s
            } else {
                let alone = cache.create().into_result().unwrap();
                forward(
                    &build(name, &cache, p as u32),
                    alone,
                    &document,
                    Output::Nothing,
                );
                let s = cache.create().into_result().unwrap();
                let row = kv(&cache, alone, 0).0.len() / n;
                let filler = common::tensor(&common::backend(), &vec![0.5f32; p * row], row);
                for l in 0..layers {
                    cache.append(s, l, &filler, &filler).into_result().unwrap();
                }
                copy_kv(&cache, layers, alone, 0, s);
                s
            };
            let grafted = cache.fork(conversation).into_result().unwrap();
            model
                .graft(grafted, src, p as u64, n as u64)
                .into_result()
                .unwrap();
            let (dk, dv) = kv_diff(&cache, layers, grafted, reference, q..q + n);
            let got = forward(&model, grafted, &more, Output::Logits(Rows::All));
            let d = max_abs_diff(&got, &want);
            // Without re-rotation: the document's keys keep their old positions.
            let copied = cache.fork(conversation).into_result().unwrap();
            copy_kv(&cache, layers, src, p, copied);
            let naive = max_abs_diff(
                &forward(&model, copied, &more, Output::Logits(Rows::All)),
                &want,
            );
            line.push(format!(
                "{p}→{q}: keys {dk:.1e}, values {dv:.1e}, logits Δ={d:.1e} (no re-rotation: {naive:.1e})"
            ));
            assert!(
                dk <= TOLERANCE && dv <= TOLERANCE,
                "{name} {p}→{q}: KV differs: {dk} {dv}"
            );
            assert!(d <= TOLERANCE, "{name} {p}→{q}: logits differ by {d}");
            assert!(
                naive > 100.0 * TOLERANCE,
                "{name} {p}→{q}: the test cannot tell ({naive})"
            );
        }
        println!("{name}: {}", line.join("; "));
    }
}
