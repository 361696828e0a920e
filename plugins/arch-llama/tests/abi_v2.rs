//! The model interface's inputs and extras: embedding rows stand where token embeddings would
//! (a sequence fed its own token embeddings as rows gives the logits of its ids, on GGUF F32,
//! GGUF Q8_0 — a quantized table — and safetensors), and per-sequence steering vectors change
//! only their own sequence in a shared pass, by exactly `strength · vector` after the blocks
//! they name.

mod support;

use abi_stable::std_types::RSlice;
use anyhow::Result;
use support::{build, cache_kv, max_abs_diff, run};
use u_sdk::{ModelBox, Output, Rows, Segment, SeqChunk, SeqExtras, Steering, WeightSetBox};

/// The embedding table's rows for `ids`, dequantized as stored.
fn embedding_rows(weights: &WeightSetBox, name: &str, ids: &[u32]) -> Result<Vec<f32>> {
    let view = weights.tensor(name.into()).into_result()?;
    let table = u_sdk::quant::dequantize_view(&view)?;
    let hidden = view.row_len() as usize;
    Ok(ids
        .iter()
        .flat_map(|&i| table[i as usize * hidden..(i as usize + 1) * hidden].to_vec())
        .collect())
}

fn new_seq(model: &ModelBox) -> Result<u64> {
    Ok(model
        .cache()
        .into_result()?
        .into_option()
        .unwrap()
        .create()
        .into_result()?)
}

#[test]
fn embedding_rows_give_the_logits_of_their_ids() -> Result<()> {
    let prompt: Vec<u32> = vec![3, 17, 42, 99, 5, 64, 1, 7, 120, 33];
    for (what, weights, table) in [
        ("gguf f32", support::gguf("llama")?, "token_embd.weight"),
        (
            "gguf q8_0",
            support::gguf_q8_0("llama")?,
            "token_embd.weight",
        ),
        (
            "safetensors",
            support::safetensors("llama")?,
            "model.embed_tokens.weight",
        ),
        (
            "safetensors qwen3",
            support::safetensors("qwen3")?,
            "model.embed_tokens.weight",
        ),
    ] {
        let rows = embedding_rows(&weights, table, &prompt)?;
        let model = build(weights, cache_kv())?;
        let config = model.config().into_result()?;
        let hidden = config.hidden as usize;
        let all = Output::Logits(Rows::All);
        let ids_in = [Segment::Tokens(RSlice::from_slice(&prompt))];
        let by_ids = run(
            &model,
            &config,
            &[SeqChunk::tokens(new_seq(&model)?, &ids_in, all)],
        )?;
        let rows_in = [Segment::Embeddings(RSlice::from_slice(&rows))];
        let by_rows = run(
            &model,
            &config,
            &[SeqChunk::tokens(new_seq(&model)?, &rows_in, all)],
        )?;
        // A soft prompt: the first four positions as rows, the rest as ids, in one chunk.
        let mixed_in = [
            Segment::Embeddings(RSlice::from_slice(&rows[..4 * hidden])),
            Segment::Tokens(RSlice::from_slice(&prompt[4..])),
        ];
        let mixed = run(
            &model,
            &config,
            &[SeqChunk::tokens(new_seq(&model)?, &mixed_in, all)],
        )?;
        let (d, m) = (
            max_abs_diff(&by_ids, &by_rows),
            max_abs_diff(&by_ids, &mixed),
        );
        eprintln!("{what}: rows vs ids |Δ| {d:.1e}, mixed {m:.1e}");
        assert!(d <= 1e-6 && m <= 1e-6, "{what}: {d} {m}");
    }
    Ok(())
}

#[test]
fn a_steering_vector_changes_only_its_own_sequence_by_exactly_itself() -> Result<()> {
    let model = build(support::safetensors("llama")?, cache_kv())?;
    let config = model.config().into_result()?;
    let hidden = config.hidden as usize;
    let prompt: Vec<u32> = vec![9, 8, 7, 6, 5, 4];
    let input = [Segment::Tokens(RSlice::from_slice(&prompt))];
    let vector: Vec<f32> = (0..hidden).map(|i| ((i * 7) % 5) as f32 - 2.0).collect();
    let steer = [Steering {
        first_layer: 0,
        last_layer: 0,
        strength: 0.5,
        vector: RSlice::from_slice(&vector),
    }];
    let steered = SeqExtras {
        steering: RSlice::from_slice(&steer),
        ..SeqExtras::default()
    };
    let pass = |output: Output, extras_on: Option<usize>| -> Result<Vec<f32>> {
        let seqs = [new_seq(&model)?, new_seq(&model)?, new_seq(&model)?];
        let chunks: Vec<SeqChunk<'_>> = seqs
            .iter()
            .enumerate()
            .map(|(i, &s)| SeqChunk {
                extras: if extras_on == Some(i) {
                    steered
                } else {
                    SeqExtras::default()
                },
                ..SeqChunk::tokens(s, &input, output)
            })
            .collect();
        run(&model, &config, &chunks)
    };
    let logits = Output::Logits(Rows::Last);
    let (plain, with) = (pass(logits, None)?, pass(logits, Some(1))?);
    let vocab = config.vocab_size as usize;
    let row = |v: &[f32], i: usize| v[i * vocab..(i + 1) * vocab].to_vec();
    assert_eq!(row(&plain, 0), row(&with, 0), "a neighbour changed");
    assert_eq!(row(&plain, 2), row(&with, 2), "a neighbour changed");
    let moved = max_abs_diff(&row(&plain, 1), &row(&with, 1));
    assert!(
        moved > 1e-3,
        "the steered sequence did not change ({moved})"
    );
    // After block 0 the steered state is the plain one plus strength · vector, exactly.
    let after0 = Output::Hidden {
        layer: 0,
        rows: Rows::All,
    };
    let (plain, with) = (pass(after0, None)?, pass(after0, Some(1))?);
    let n = prompt.len() * hidden;
    let want: Vec<f32> = plain[n..2 * n]
        .iter()
        .enumerate()
        .map(|(i, &x)| x + 0.5 * vector[i % hidden])
        .collect();
    assert!(max_abs_diff(&with[n..2 * n], &want) <= 1e-6);
    assert_eq!(&plain[..n], &with[..n]);
    eprintln!("steering: own logits moved by {moved:.3}, neighbours bit-identical");
    // A vector of the wrong width, or past the last block, is refused.
    let short = [Steering {
        vector: RSlice::from_slice(&vector[..3]),
        ..steer[0]
    }];
    let bad = SeqExtras {
        steering: RSlice::from_slice(&short),
        ..SeqExtras::default()
    };
    let chunk = [SeqChunk {
        extras: bad,
        ..SeqChunk::tokens(new_seq(&model)?, &input, logits)
    }];
    let e = run(&model, &config, &chunk).unwrap_err();
    assert!(e.to_string().contains("steering"), "{e}");
    Ok(())
}
