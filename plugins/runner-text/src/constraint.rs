//! Structured outputs: a request's [`Constraint`] (a JSON Schema, a regular expression or a
//! Lark grammar) compiled by [llguidance](https://github.com/guidance-ai/llguidance) — the
//! matcher llama.cpp, vLLM and SGLang use — into a [`Guide`] that masks, before each draw,
//! every token the grammar cannot take next, and that says when the grammar is complete.
//!
//! The token trie llguidance walks is built once per model ([`Grammars`], on the first
//! constrained request) from the tokenizer's raw bytes of every id; special tokens (those a
//! `skip_special` decode drops) are marked as llguidance expects, so no grammar produces them
//! as text, and the model's end-of-sequence ids are what an accepting grammar allows to end.
//! A guide computes its next mask while the batch's forward pass runs ([`Guide::prepare`] on a
//! worker thread, see `batch`); [`Guide::apply`] only clears the masked logits.

use crate::{Error, Generator, Result};
use llguidance::{
    Matcher, ParserFactory,
    api::TopLevelGrammar,
    toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie},
};
use serde_json::Value;
use std::sync::Arc;
use u_sdk::Constraint;

/// The compiler of one model's constraints: llguidance's parser factory over the model's
/// token trie.
pub(crate) struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// Builds the token trie from `g`'s tokenizer: the bytes of every id of the model's
    /// vocabulary (ids past the tokenizer's are never allowed).
    pub(crate) fn new(g: &Generator) -> Result<Self> {
        let tok = g.tokenizer().ok_or(Error::NoTokenizer)?;
        let eos: Vec<u32> = g.special().eos.iter().copied().collect();
        let Some(&first) = eos.first() else {
            return Err(Error::Unsupported(
                "structured outputs need an end-of-sequence token; this tokenizer has none".into(),
            ));
        };
        let vocab = g.config().vocab_size;
        let known = tok
            .vocab_size()
            .into_result()
            .map_err(|e| Error::plugin("tokenizer.vocab_size", e))?
            .min(vocab);
        let mut words = Vec::with_capacity(vocab as usize);
        for id in 0..vocab {
            if id >= known {
                words.push(Vec::new());
                continue;
            }
            let bytes = g.token_bytes(id)?;
            let text = tok
                .decode([id][..].into(), true)
                .into_result()
                .map_err(|e| Error::plugin("tokenizer.decode", e))?;
            let special = eos.contains(&id) || (text.is_empty() && !bytes.is_empty());
            words.push(match special {
                true => [&[TokTrie::SPECIAL_TOKEN_MARKER][..], &bytes].concat(),
                false => bytes,
            });
        }
        let info = TokRxInfo {
            vocab_size: vocab,
            tok_eos: first,
            tok_bos: g.special().bos.into_option(),
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::Unsupported(format!("structured outputs: {e}")))?;
        factory.quiet();
        Ok(Self { factory })
    }

    /// Compiles `constraint` (`None` for free text); a grammar llguidance cannot compile is an
    /// invalid request naming the problem.
    pub(crate) fn compile(&self, constraint: &Constraint) -> Result<Option<Guide>> {
        let invalid = |what: &str, e: &dyn std::fmt::Display| {
            Error::InvalidRequest(format!("invalid {what}: {e}"))
        };
        let (what, grammar) = match constraint {
            Constraint::None => return Ok(None),
            Constraint::JsonSchema(text) => {
                let schema: Value =
                    serde_json::from_str(text).map_err(|e| invalid("JSON schema", &e))?;
                (
                    "JSON schema",
                    TopLevelGrammar::from_json_schema(compact(schema)),
                )
            }
            Constraint::Regex(rx) => ("regex", TopLevelGrammar::from_regex(rx)),
            Constraint::Lark(lark) => ("grammar", TopLevelGrammar::from_lark(lark.to_string())),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| invalid(what, &e))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(invalid(what, &e));
        }
        Ok(Some(Guide {
            matcher,
            mask: None,
        }))
    }
}

/// A JSON schema with llguidance's compact JSON (no free whitespace: a small model cannot
/// wander into endless newlines) unless the schema sets its own `x-guidance` options.
fn compact(mut schema: Value) -> Value {
    if let Value::Object(o) = &mut schema
        && !o.contains_key("x-guidance")
    {
        o.insert(
            "x-guidance".into(),
            serde_json::json!({"whitespace_flexible": false}),
        );
    }
    schema
}

/// One request's compiled constraint: the grammar's state and the mask for the next token.
pub(crate) struct Guide {
    matcher: Matcher,
    mask: Option<std::result::Result<SimpleVob, String>>,
}

impl Guide {
    /// Computes the mask for the next token unless it is known already (the state changes
    /// only when a token is committed). Runs on a worker thread beside the forward pass.
    pub(crate) fn prepare(&mut self) {
        if self.mask.is_none() {
            self.mask = Some(
                self.matcher
                    .compute_mask_or_eos()
                    .map_err(|e| e.to_string()),
            );
        }
    }

    /// Sets every logit the grammar does not allow next to −∞; `false` when it allows
    /// nothing (the grammar is finished or stuck).
    pub(crate) fn apply(&mut self, logits: &mut [f32]) -> Result<bool> {
        self.prepare();
        let mask = match self.mask.take() {
            Some(Ok(mask)) => mask,
            Some(Err(e)) => return Err(Error::InvalidRequest(format!("constraint: {e}"))),
            None => return Ok(false),
        };
        let mut any = false;
        for (id, l) in logits.iter_mut().enumerate() {
            if id < mask.len() && mask.is_allowed(id as u32) {
                any |= *l > f32::NEG_INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(any)
    }

    /// Advances the grammar by the drawn token; `true` when it takes no more tokens.
    pub(crate) fn commit(&mut self, id: u32) -> Result<bool> {
        self.mask = None;
        self.matcher
            .consume_token(id)
            .map_err(|e| Error::InvalidRequest(format!("constraint: {e}")))?;
        Ok(self.matcher.is_stopped())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_json_unless_the_schema_says_otherwise() {
        let s = compact(serde_json::json!({"type": "object"}));
        assert_eq!(s["x-guidance"]["whitespace_flexible"], false);
        let own = serde_json::json!({"type": "object", "x-guidance": {"lenient": true}});
        assert_eq!(compact(own.clone()), own);
        assert_eq!(compact(Value::Bool(true)), Value::Bool(true));
    }
}
