//! # u-tokenizer — text ↔ token ids for U
//!
//! A `tokenizer` plugin. It builds tokenizers from a GGUF file's `tokenizer.ggml.*` metadata
//! (`llama` SentencePiece BPE with byte fallback, `gpt2` byte-level BPE with the pre-tokenizer
//! `tokenizer.ggml.pre` names, `bert` WordPiece) or from a HF `tokenizer.json`, and hands the
//! model's chat template to the engine (which renders it with `u-chat-template`).
//!
//! Design choice: encoding is HF `tokenizers` throughout — GGUF vocabularies are translated
//! into its models, normalizers and pre-tokenizers ([`gguf`]) rather than re-implemented, and
//! `tokenizer.json` loads as is ([`json`]). Conformance is proven on llama.cpp's vocabulary
//! test vectors (`tests/vocab.rs`). Decoding is ours ([`Tok::token_bytes`]): it is defined by
//! each token's raw bytes, so streamed pieces and whole decodes agree byte for byte.
//!
//! - [`vocab`]: reading and checking GGUF metadata; malformed metadata is an [`u_sdk::UError`].
//! - [`Tok`]: a built tokenizer (encode, decode, token bytes, special tokens, template).
//! - [`plugin`]: the [`u_sdk::TokenizerFactory`] the host instantiates.
#![deny(missing_docs)]
// `#[sabi_trait]` impls expand inside const blocks, which this lint flags.
#![allow(non_local_definitions)]

mod core;
pub mod gguf;
pub mod json;
pub mod plugin;
pub mod vocab;

pub use core::{PieceScheme, Tok};
pub use plugin::Factory;

use abi_stable::std_types::RVec;
use u_sdk::{HostBox, PluginInfo, PluginInstance};

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "tokenizers from GGUF metadata (llama/SentencePiece, gpt2/byte-level BPE, bert/WordPiece) or tokenizer.json; chat templates".into(),
        details: RVec::from(vec!["models=llama,gpt2,bert,tokenizer.json".into()]),
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
