//! A request's prompt as tokens, and its cache breakpoints as token counts.
//!
//! Locating a breakpoint `(turn, offset)` in the rendered prompt: the conversation is cut after
//! `messages[turn].content[..offset]` and rendered without the generation prompt; the longest
//! common byte prefix of that rendering and the full one (floored to a character boundary) is
//! where the cached block ends in the text — it includes the turn's closing markup when the
//! breakpoint is at the end of the turn and the template renders it alike in both. That text
//! prefix is encoded on its own and the breakpoint is the length of the longest common *token*
//! prefix with the full prompt's tokens: tokenization can only differ near the cut, so this is
//! the most KV that is exactly reusable by any prompt starting with the same text. For a plain
//! `prompt` (no messages) the breakpoint is `turn == 0` and `offset` bytes into the prompt.

use crate::{ChatMessage, Error, Generator, Result};
use u_sdk::{CacheBreakpoint, ChatTurn};

/// The text of a prompt, rendered with the chat template when there are messages.
pub(crate) struct Prompt {
    messages: Vec<ChatMessage>,
    /// The declared tools (OpenAI's shape), rendered with the messages.
    tools: Vec<serde_json::Value>,
    plain: String,
    text: String,
    continuation: bool,
}

impl Prompt {
    /// `prompt` as is, or `messages` (with the declared `tools`, a JSON array; empty for none)
    /// rendered for the assistant's turn (or, with `continue_final`, up to the end of the last
    /// message, which the model continues); a `continuation` (resuming a checkpoint) is encoded
    /// without BOS.
    pub(crate) fn new(
        g: &Generator,
        prompt: &str,
        (messages, tools): (&[ChatTurn], &str),
        continuation: bool,
        continue_final: bool,
    ) -> Result<Self> {
        let messages: Vec<ChatMessage> = messages
            .iter()
            .map(|m| ChatMessage::new(m.role.as_str(), m.content.as_str()))
            .collect();
        let tools: Vec<serde_json::Value> = if tools.trim().is_empty() {
            Vec::new()
        } else {
            serde_json::from_str(tools).map_err(|e| {
                Error::InvalidRequest(format!("`tools` is not a JSON array of tools: {e}"))
            })?
        };
        let text = match messages.last() {
            None => prompt.to_string(),
            Some(last) if continue_final => continued(g, &messages, &tools, &last.content)?,
            Some(_) => g.render_chat(&messages, &tools, true)?,
        };
        Ok(Self {
            messages,
            tools,
            plain: prompt.to_string(),
            text,
            continuation,
        })
    }

    /// The prompt text, rendered.
    pub(crate) fn text(&self) -> &str {
        &self.text
    }

    /// Whether there is no text at all.
    pub(crate) fn is_empty(&self) -> bool {
        self.text.is_empty()
    }

    fn encode(&self, g: &Generator, text: &str) -> Result<Vec<u32>> {
        if self.continuation {
            g.encode_continuation(text)
        } else {
            g.encode(text)
        }
    }

    /// The prompt's tokens and, for each breakpoint that covers any, its token count.
    pub(crate) fn tokens(
        &self,
        g: &Generator,
        breakpoints: &[CacheBreakpoint],
    ) -> Result<(Vec<u32>, Vec<usize>)> {
        let tokens = self.encode(g, &self.text)?;
        let mut counts = Vec::with_capacity(breakpoints.len());
        for bp in breakpoints {
            let bytes = self.breakpoint_bytes(g, bp)?;
            let head = self.encode(g, &self.text[..bytes])?;
            let n = head.iter().zip(&tokens).take_while(|(a, b)| a == b).count();
            if n > 0 {
                counts.push(n);
            }
        }
        Ok((tokens, counts))
    }

    /// Where breakpoint `bp` ends in the prompt text, in bytes.
    fn breakpoint_bytes(&self, g: &Generator, bp: &CacheBreakpoint) -> Result<usize> {
        let (turn, offset) = (bp.turn as usize, bp.offset as usize);
        let content = match self.messages.get(turn) {
            Some(m) => &m.content,
            None if self.messages.is_empty() && turn == 0 => &self.plain,
            None => {
                return Err(Error::InvalidRequest(format!(
                    "cache breakpoint on turn {turn}, but the request has {} messages",
                    self.messages.len()
                )));
            }
        };
        if offset > content.len() || !content.is_char_boundary(offset) {
            return Err(Error::InvalidRequest(format!(
                "cache breakpoint offset {offset} of turn {turn} is not a character boundary \
                 of its {} bytes",
                content.len()
            )));
        }
        if self.messages.is_empty() {
            return Ok(offset);
        }
        let mut cut = self.messages[..=turn].to_vec();
        cut[turn].content.truncate(offset);
        let rendered = g.render_chat(&cut, &self.tools, false)?;
        let mut n = rendered
            .bytes()
            .zip(self.text.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        while !self.text.is_char_boundary(n) {
            n -= 1;
        }
        Ok(n)
    }
}

/// The conversation rendered without a generation prompt and cut right after the last
/// message's content (as transformers' `continue_final_message`), so that generation continues
/// that message instead of opening a new turn.
fn continued(
    g: &Generator,
    messages: &[ChatMessage],
    tools: &[serde_json::Value],
    last: &str,
) -> Result<String> {
    let rendered = g.render_chat(messages, tools, false)?;
    let content = last.trim_end();
    if content.is_empty() {
        return Err(Error::InvalidRequest(
            "the final message to continue is empty".into(),
        ));
    }
    match rendered.rfind(content) {
        Some(at) => Ok(rendered[..at + content.len()].to_string()),
        None => Err(Error::InvalidRequest(
            "the chat template does not render the final message verbatim, so it cannot be \
             continued"
                .into(),
        )),
    }
}

/// Fill-in-the-middle token spellings, as (prefix, suffix, middle): Qwen2.5-Coder and
/// DeepSeek-style `<|fim_…|>`, StarCoder's `<fim_…>`, CodeLlama's `<PRE>`/`<SUF>`/`<MID>`.
const FIM: [[&str; 3]; 3] = [
    ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"],
    ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"],
    ["<PRE>", "<SUF>", "<MID>"],
];

/// `prompt` and `suffix` as a fill-in-the-middle prompt (prefix-suffix-middle order) in the
/// model's own FIM tokens; refused when its vocabulary has none.
pub(crate) fn fill_in_the_middle(g: &Generator, prompt: &str, suffix: &str) -> Result<String> {
    let tok = g.tokenizer().ok_or(Error::NoTokenizer)?;
    let single = |s: &str| -> bool {
        let ids = tok.encode(s.into(), false, true).into_result();
        match ids.as_ref().map(|ids| ids.as_slice()) {
            Ok([id]) => tok
                .token_bytes(*id)
                .into_result()
                .is_ok_and(|b| b.as_slice() == s.as_bytes()),
            _ => false,
        }
    };
    let [pre, suf, mid] = FIM
        .into_iter()
        .find(|names| names.iter().all(|n| single(n)))
        .ok_or_else(|| {
            Error::Unsupported(
                "`suffix` needs fill-in-the-middle tokens, and this model has none".into(),
            )
        })?;
    Ok(format!("{pre}{prompt}{suf}{suffix}{mid}"))
}
