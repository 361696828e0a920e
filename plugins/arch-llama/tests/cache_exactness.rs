//! Issue 6, exactness: the model sees no difference between a cached and a recomputed prefix.
//! KV restored from a named checkpoint or found in the prefix tree, then continued, gives the
//! same logits as running the whole prompt from scratch (≤ 1e-5, f32).

mod support;

use support::*;
use u_sdk::{Output, Rows};

const TOLERANCE: f32 = 1e-5;

#[test]
fn restored_and_prefix_matched_kv_continue_exactly_like_a_recompute() {
    for name in MODELS {
        let (vocab, cases) = cases(name).unwrap();
        // The prompt followed by its greedy continuation: a longer, realistic token sequence.
        let prompt: Vec<u32> = cases[0]
            .prompt
            .iter()
            .chain(&cases[0].generated)
            .copied()
            .collect();
        let prompt = &prompt;
        assert!(prompt.len() >= 8, "{name}: sequence too short to split");
        let split = prompt.len() / 2;
        let (head, tail) = prompt.split_at(split);
        let cache = cache_kv();
        let model = build(safetensors(name).unwrap(), cache.clone()).unwrap();

        let full = cache.create().into_result().unwrap();
        let reference = forward(&model, &[(full, prompt, Output::Logits(Rows::All))]).unwrap();
        let expected = &reference[split * vocab..];

        let doc = cache.create().into_result().unwrap();
        forward(&model, &[(doc, head, Output::Nothing)]).unwrap();
        cache
            .save_checkpoint("doc".into(), doc)
            .into_result()
            .unwrap();
        cache.insert_prefix(head.into(), doc).into_result().unwrap();

        let restored = cache.load_checkpoint("doc".into()).into_result().unwrap();
        let from_checkpoint =
            forward(&model, &[(restored, tail, Output::Logits(Rows::All))]).unwrap();
        let d1 = max_abs_diff(&from_checkpoint, expected);

        let found = cache
            .lookup_prefix(prompt.as_slice().into())
            .into_result()
            .unwrap();
        assert_eq!(
            found.matched as usize, split,
            "{name}: deepest prefix match"
        );
        let from_tree = forward(&model, &[(found.seq, tail, Output::Logits(Rows::All))]).unwrap();
        let d2 = max_abs_diff(&from_tree, expected);

        println!("{name}: checkpoint Δ={d1:.2e}, prefix tree Δ={d2:.2e}");
        assert!(
            d1 <= TOLERANCE,
            "{name}: checkpoint restore differs by {d1}"
        );
        assert!(
            d2 <= TOLERANCE,
            "{name}: prefix-tree restore differs by {d2}"
        );
        // The original sequence is untouched by its forks' writes.
        assert_eq!(cache.len(doc).into_result().unwrap() as usize, split);
    }
}
