//! IDEFICS' text side (family `idefics`, issue #18 "Flamingo-style gated cross-attention
//! layers") against transformers on the tiny random-weight checkpoints of
//! `tests/fixtures/idefics_tiny/` (its generator, `gen_idefics_tiny.py`, beside it): fed the
//! fixture's image features (the vision tower's rows, or the perceiver resampler's latents) as
//! its cross-attention context, the decoder's logits equal `IdeficsForVisionText2Text`'s within
//! [`TOL`] — the whole prompt in one pass, and in two chunks where the second reads the image's
//! keys and values kept by the first; two sequences with different images share a pass and
//! stay apart; contexts of another width, missing contexts and the rest of what the decoder
//! does not support are refused with errors that say why.

mod support;

use abi_stable::std_types::{ROption, RSlice};
use anyhow::Result;
use serde_json::Value;
use std::path::{Path, PathBuf};
use support::{build, cache_kv, max_abs_diff, run};
use u_sdk::abi_stable;
use u_sdk::{
    CrossContext, ModelBox, ModelConfig, ModelKind, Output, Rows, Segment, SeqChunk, SeqExtras,
    SeqId,
};

/// Stated tolerance against transformers (f32 both sides; measured 2.2e-6).
const TOL: f32 = 1e-4;

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/idefics_tiny")
        .join(case)
}

fn model(case: &str) -> Result<ModelBox> {
    use u_loader_safetensors::{SafetensorsModel, SafetensorsWeights, StdFs};
    let m = SafetensorsModel::open(&StdFs, &fixture(case).join("model"))?;
    build(SafetensorsWeights::new(m).into_box(), cache_kv())
}

/// One prompt of the fixture: its ids, its image's features (the context rows), the logits of
/// every position, and which positions see the image (the processor's mask).
struct Prompt {
    ids: Vec<u32>,
    context: Vec<f32>,
    logits: Vec<f32>,
    sees_image: Vec<bool>,
}

struct Expected {
    image_token: u32,
    rows: u32,
    width: u32,
    prompts: Vec<Prompt>,
}

fn floats(v: &Value) -> Vec<f32> {
    fn flat(v: &Value, out: &mut Vec<f32>) {
        match v {
            Value::Array(a) => a.iter().for_each(|x| flat(x, out)),
            Value::Number(n) => out.push(n.as_f64().unwrap_or(f64::NAN) as f32),
            _ => {}
        }
    }
    let mut out = Vec::new();
    flat(v, &mut out);
    out
}

fn expected(case: &str) -> Result<Expected> {
    let e: Value = serde_json::from_slice(&std::fs::read(fixture(case).join("expected.json"))?)?;
    let int = |v: &Value| v.as_u64().unwrap() as u32;
    let prompts = e["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Prompt {
            ids: c["input_ids"].as_array().unwrap().iter().map(int).collect(),
            context: floats(&c["image_hidden_states"]),
            logits: floats(&c["logits"]),
            sees_image: floats(&c["image_attention_mask"])
                .iter()
                .map(|&m| m == 1.0)
                .collect(),
        })
        .collect();
    Ok(Expected {
        image_token: int(&e["image_token_id"]),
        rows: int(&e["rows_per_image"]),
        width: int(&e["vision_width"]),
        prompts,
    })
}

fn new_seq(model: &ModelBox) -> Result<SeqId> {
    Ok(model
        .cache()
        .into_result()?
        .into_option()
        .unwrap()
        .create()
        .into_result()?)
}

/// A chunk of `input` for `seq` that cross-attends to the image of `kv`, bringing `context`
/// (empty once `kv` holds it).
fn chunk<'a>(
    seq: SeqId,
    input: &'a [Segment<'a>],
    kv: SeqId,
    context: &'a [f32],
    output: Output,
) -> SeqChunk<'a> {
    SeqChunk {
        seq,
        input: RSlice::from_slice(input),
        output,
        extras: SeqExtras {
            cross: ROption::RSome(CrossContext {
                kv,
                rows: RSlice::from_slice(context),
            }),
            ..SeqExtras::default()
        },
    }
}

fn tokens(ids: &[u32]) -> [Segment<'_>; 1] {
    [Segment::Tokens(RSlice::from_slice(ids))]
}

fn check_config(config: &ModelConfig, e: &Expected, vocab: u32, hidden: u32, layers: u32) {
    assert_eq!(config.kind, ModelKind::CrossDecoder);
    assert_eq!(config.family.as_str(), "idefics");
    assert_eq!(
        (config.vocab_size, config.hidden, config.layers),
        (vocab, hidden, layers)
    );
    assert_eq!(config.context_shape, [e.rows, e.width]);
    // The token the runner marks an image with; it stays a token for a cross-decoder.
    assert_eq!(config.image_token, e.image_token);
    assert!(config.image.is_none());
}

/// The fixture's own record of the processor's mask: the tokens from `<image>` on see it.
#[test]
fn the_fixture_mask_is_the_rule_the_decoder_follows() -> Result<()> {
    for case in ["plain", "resampler"] {
        let e = expected(case)?;
        for p in &e.prompts {
            let at = p.ids.iter().position(|&t| t == e.image_token).unwrap();
            let rule: Vec<bool> = (0..p.ids.len()).map(|i| i >= at).collect();
            assert_eq!(p.sees_image, rule, "{case}");
        }
    }
    Ok(())
}

#[test]
fn the_decoder_is_a_cross_decoder_over_one_images_features() -> Result<()> {
    let e = expected("plain")?;
    let config = model("plain")?.config().into_result()?;
    // 296 tokens + 4 additional (the decoupled embedding), 4 Llama blocks of 64.
    check_config(&config, &e, 300, 64, 4);
    // 16 patches and the class row, 32 wide.
    assert_eq!(config.context_shape, [17, 32]);
    let e = expected("resampler")?;
    let config = model("resampler")?.config().into_result()?;
    check_config(&config, &e, 100, 32, 2);
    // The resampler's 5 latents.
    assert_eq!(config.context_shape, [5, 32]);
    Ok(())
}

/// Every prompt of `case` in one pass gives transformers' logits; returns the largest
/// difference.
fn whole_prompts_match(case: &str) -> Result<f32> {
    let e = expected(case)?;
    let model = model(case)?;
    let config = model.config().into_result()?;
    let mut worst = 0f32;
    for p in &e.prompts {
        let input = tokens(&p.ids);
        let (seq, kv) = (new_seq(&model)?, new_seq(&model)?);
        let c = chunk(seq, &input, kv, &p.context, Output::Logits(Rows::All));
        let logits = run(&model, &config, &[c])?;
        worst = worst.max(max_abs_diff(&logits, &p.logits));
    }
    eprintln!(
        "idefics {case}: max |diff| {worst:.2e} over {} prompts",
        e.prompts.len()
    );
    assert!(worst <= TOL, "{case}: max |diff| {worst}");
    Ok(worst)
}

#[test]
fn the_context_gives_transformers_logits() -> Result<()> {
    whole_prompts_match("plain")?;
    Ok(())
}

/// Vector gates, Q/K norms in the cross-attention, a block before every layer, and the
/// resampler's latents as the context.
#[test]
fn resampled_features_with_vector_gates_and_qk_norms_give_transformers_logits() -> Result<()> {
    whole_prompts_match("resampler")?;
    Ok(())
}

#[test]
fn a_second_chunk_reads_the_image_keys_and_values_the_first_kept() -> Result<()> {
    let e = expected("plain")?;
    let model = model("plain")?;
    let config = model.config().into_result()?;
    let vocab = config.vocab_size as usize;
    for p in &e.prompts {
        let at = p.ids.iter().position(|&t| t == e.image_token).unwrap();
        // The first chunk ends just after the `<image>` token (and its fake token).
        let (head, tail) = p.ids.split_at(at + 2);
        let (seq, kv) = (new_seq(&model)?, new_seq(&model)?);
        let (head, tail) = (tokens(head), tokens(tail));
        let first = run(
            &model,
            &config,
            &[chunk(seq, &head, kv, &p.context, Output::Logits(Rows::All))],
        )?;
        let rest = run(
            &model,
            &config,
            &[chunk(seq, &tail, kv, &[], Output::Logits(Rows::All))],
        )?;
        let split: Vec<f32> = first.into_iter().chain(rest).collect();
        assert_eq!(split.len(), p.ids.len() * vocab);
        let diff = max_abs_diff(&split, &p.logits);
        eprintln!("idefics, two chunks: max |diff| {diff:.2e}");
        assert!(diff <= TOL, "max |diff| {diff}");
        // Token by token after the first chunk, as a decoding loop runs.
        let (seq, kv) = (new_seq(&model)?, new_seq(&model)?);
        let head = tokens(&p.ids[..at + 1]);
        run(
            &model,
            &config,
            &[chunk(seq, &head, kv, &p.context, Output::Nothing)],
        )?;
        for (i, id) in p.ids.iter().enumerate().skip(at + 1) {
            let one = [*id];
            let input = tokens(&one);
            let logits = run(
                &model,
                &config,
                &[chunk(seq, &input, kv, &[], Output::Logits(Rows::Last))],
            )?;
            let diff = max_abs_diff(&logits, &p.logits[i * vocab..(i + 1) * vocab]);
            assert!(diff <= TOL, "position {i}: max |diff| {diff}");
        }
    }
    Ok(())
}

#[test]
fn two_sequences_with_different_images_share_a_pass_and_stay_apart() -> Result<()> {
    let e = expected("plain")?;
    let model = model("plain")?;
    let config = model.config().into_result()?;
    let [a, b] = &e.prompts[..] else {
        panic!("two prompts")
    };
    let (ia, ib) = (tokens(&a.ids), tokens(&b.ids));
    let (sa, ka, sb, kb) = (
        new_seq(&model)?,
        new_seq(&model)?,
        new_seq(&model)?,
        new_seq(&model)?,
    );
    let logits = run(
        &model,
        &config,
        &[
            chunk(sa, &ia, ka, &a.context, Output::Logits(Rows::All)),
            chunk(sb, &ib, kb, &b.context, Output::Logits(Rows::All)),
        ],
    )?;
    let n = a.logits.len();
    let (da, db) = (
        max_abs_diff(&logits[..n], &a.logits),
        max_abs_diff(&logits[n..], &b.logits),
    );
    eprintln!("idefics, two sequences in one pass: max |diff| {da:.2e}, {db:.2e}");
    assert!(da <= TOL && db <= TOL, "{da} {db}");
    // And with the images swapped the logits are not those of the fixture: the image matters.
    let (sa, ka) = (new_seq(&model)?, new_seq(&model)?);
    let swapped = run(
        &model,
        &config,
        &[chunk(sa, &ia, ka, &b.context, Output::Logits(Rows::All))],
    )?;
    assert!(max_abs_diff(&swapped, &a.logits) > 1e-2);
    Ok(())
}

/// The error of a pass over `chunks`, which must fail, and then the sequences are as before.
fn refused(model: &ModelBox, chunks: &[SeqChunk<'_>]) -> String {
    let config = model.config().into_result().unwrap();
    let cache = model.cache().into_result().unwrap().into_option().unwrap();
    let before: Vec<u64> = chunks
        .iter()
        .map(|c| cache.len(c.seq).into_result().unwrap())
        .collect();
    let err = run(model, &config, chunks).expect_err("refused");
    for (c, len) in chunks.iter().zip(before) {
        assert_eq!(cache.len(c.seq).into_result().unwrap(), len);
    }
    err.to_string()
}

#[test]
fn what_the_decoder_does_not_read_is_refused_clearly() -> Result<()> {
    let e = expected("plain")?;
    let model = model("plain")?;
    let p = &e.prompts[0];
    let at = p.ids.iter().position(|&t| t == e.image_token).unwrap();
    let input = tokens(&p.ids);
    let logits = Output::Logits(Rows::Last);
    let says = |err: String, what: &str| {
        assert!(err.contains(what), "`{err}` does not say `{what}`");
    };
    let (seq, kv) = (new_seq(&model)?, new_seq(&model)?);

    // A context of the wrong width: rows of 31, not 32.
    let narrow = vec![0.5f32; 17 * 31];
    says(
        refused(&model, &[chunk(seq, &input, kv, &narrow, logits)]),
        "17 rows of 32",
    );
    // No context at all.
    says(
        refused(&model, &[SeqChunk::tokens(seq, &input, logits)]),
        "without a cross context",
    );
    // A context sequence that holds nothing, and no rows.
    says(
        refused(&model, &[chunk(seq, &input, kv, &[], logits)]),
        "holds no image features",
    );
    // Features brought with text that has no `<image>` token.
    let before = tokens(&p.ids[..at]);
    says(
        refused(&model, &[chunk(seq, &before, kv, &p.context, logits)]),
        "holds no `<image>` token",
    );
    // Non-finite features.
    let mut nan = p.context.clone();
    nan[3] = f32::NAN;
    says(
        refused(&model, &[chunk(seq, &input, kv, &nan, logits)]),
        "not finite",
    );
    // Two images in one sequence.
    let mut two = p.ids.clone();
    two.push(e.image_token);
    let two = tokens(&two);
    says(
        refused(&model, &[chunk(seq, &two, kv, &p.context, logits)]),
        "one image per sequence",
    );
    // An end-of-document token after the image (eos, 2).
    let mut eod = p.ids.clone();
    eod.extend([2, 7]);
    let eod = tokens(&eod);
    says(
        refused(&model, &[chunk(seq, &eod, kv, &p.context, logits)]),
        "end-of-document",
    );
    // The sequence's own id as its context's.
    says(
        refused(&model, &[chunk(seq, &input, seq, &p.context, logits)]),
        "the chunk's own",
    );
    // Nothing above left the context sequence holding features: a good pass still runs, and
    // bringing features again to a sequence that holds them is refused.
    let config = model.config().into_result()?;
    let ok = run(
        &model,
        &config,
        &[chunk(seq, &input, kv, &p.context, logits)],
    )?;
    let vocab = config.vocab_size as usize;
    let last = p.ids.len() - 1;
    assert!(max_abs_diff(&ok, &p.logits[last * vocab..]) <= TOL);
    let (seq2, _) = (new_seq(&model)?, ());
    says(
        refused(&model, &[chunk(seq2, &input, kv, &p.context, logits)]),
        "already holds",
    );
    // A second `<image>` in a later chunk.
    let again = [e.image_token];
    let again = tokens(&again);
    says(
        refused(&model, &[chunk(seq, &again, kv, &[], logits)]),
        "one image per sequence",
    );
    Ok(())
}

/// IDEFICS' gated blocks have no GGUF form: converting the checkpoint is refused.
#[test]
fn conversion_to_gguf_is_refused() -> Result<()> {
    use u_loader_safetensors::{SafetensorsModel, SafetensorsWeights, StdFs};
    use u_sdk::Architecture;
    let m = SafetensorsModel::open(&StdFs, &fixture("plain").join("model"))?;
    let arch = u_arch_llama::LlamaArchitecture::default();
    let err = arch
        .gguf_view(SafetensorsWeights::new(m).into_box(), "idefics".into())
        .into_result()
        .err()
        .expect("refused");
    assert!(err.message.contains("no GGUF form"), "{err}");
    Ok(())
}

/// A plain Llama still refuses a cross context.
#[test]
fn a_decoder_only_model_still_refuses_a_context() -> Result<()> {
    let llava = {
        use u_loader_safetensors::{SafetensorsModel, SafetensorsWeights, StdFs};
        let dir =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llava_tiny/model");
        let m = SafetensorsModel::open(&StdFs, &dir)?;
        build(SafetensorsWeights::new(m).into_box(), cache_kv())?
    };
    let (seq, kv) = (new_seq(&llava)?, new_seq(&llava)?);
    let ids = [1u32, 5, 6];
    let input = tokens(&ids);
    let context = [0.0f32; 4];
    let err = refused(
        &llava,
        &[chunk(seq, &input, kv, &context, Output::Logits(Rows::Last))],
    );
    assert!(err.contains("no cross-attention context"), "{err}");
    Ok(())
}
