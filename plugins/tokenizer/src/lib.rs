//! # u-tokenizer — text ↔ token ids for U
//!
//! A `tokenizer` plugin. It builds tokenizers from a GGUF file's `tokenizer.ggml.*` metadata
//! or from a HF `tokenizer.json`, and hands the model's chat template to the runner (which
//! renders it with `u-chat-template`).
//!
//! Design choice: a GGUF model is tokenized exactly as llama.cpp tokenizes it, by our own
//! implementation of llama.cpp's algorithms ([`llama`]): every tokenizer type it has
//! (SentencePiece BPE `llama`, byte-pair `gpt2`/`gemma4`/`whitespace` with every
//! `tokenizer.ggml.pre` pre-tokenizer of llama.cpp 0.3.36, WordPiece `bert`, unigram `t5`, RWKV
//! `rwkv`) and its special-token rules. A `tokenizer.json` runs HF's `tokenizers` pipeline as
//! is ([`json`]). Conformance is proven on llama.cpp's own test vectors and on llama.cpp's
//! output for every pre-tokenizer name (`tests/`). Decoding is ours ([`Tok::token_bytes`]): it
//! is defined by each token's raw bytes, so streamed pieces and whole decodes agree byte for
//! byte.
//!
//! - [`vocab`]: reading and checking GGUF metadata; malformed metadata is an [`u_sdk::UError`].
//! - [`Tok`]: a built tokenizer (encode, decode, token bytes, special tokens, template).
//! - [`plugin`]: the [`u_sdk::TokenizerFactory`] the host instantiates.
#![deny(missing_docs)]
// `#[sabi_trait]` impls expand inside const blocks, which this lint flags.
#![allow(non_local_definitions)]

mod core;
pub mod export;
pub mod gguf;
pub mod json;
pub mod llama;
pub mod plugin;
pub mod vocab;

pub use core::{PieceScheme, Tok};
pub use plugin::Factory;

use abi_stable::std_types::RVec;
use u_sdk::{HostBox, PluginInfo, PluginInstance};

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "tokenizers from GGUF metadata as llama.cpp tokenizes (SentencePiece, byte-pair with every llama.cpp pre-tokenizer, WordPiece, unigram, RWKV) or tokenizer.json; chat templates".into(),
        details: RVec::from(vec![
            "models=llama,gpt2,gemma4,whitespace,bert,t5,rwkv,tokenizer.json".into(),
        ]),
    }
}

/// Creates the plugin's tokenizer factory (the `instantiate` entry of the root module).
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    Ok(PluginInstance::Tokenizer(Factory::new(host).into_box()))
}

u_sdk::export_plugin! {
    manifest: "plugin.toml",
    describe: describe,
    instantiate: instantiate,
}
