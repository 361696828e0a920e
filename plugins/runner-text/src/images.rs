//! Images in chat requests, for a decoder that reads them through an image encoder (LLaVA-style
//! prefix fusion, Liu et al. 2023, *Visual Instruction Tuning*): each image becomes the rows the
//! encoder makes of it (vision tower and projector), standing in the prompt where the model's
//! image token is.
//!
//! 1. The turns' images are marked in their text: the image token's own text (`<image>`) is
//!    put at each image's offset, and the conversation is rendered and tokenized as usual; the
//!    prompt must then hold exactly one image token per image, in order (a template that drops
//!    or repeats them, or a user who typed the marker, is refused).
//! 2. Each image file is decoded and preprocessed as the encoder's image processor says
//!    (`u-image`), and encoded — unless its bytes' SHA-256 is in the encoder-output cache, a
//!    byte-bounded LRU: a repeated image costs no encoding.
//! 3. For a decoder (LLaVA), each image token becomes
//!    [`ImageSpec::rows`](u_sdk::ImageSpec::rows) positions. Their ids
//!    in the sequence are not tokens but a fingerprint of the image ([`image_ids`]: ids with
//!    the top bit set, which no vocabulary reaches, carrying the hash): the prefix cache keys on
//!    them, so KV is reused exactly when the same image stands at the same place after the same
//!    tokens — the second request with an image reports its positions as cached — and never
//!    across different images. Forward passes feed those positions the image's rows
//!    ([`u_sdk::Segment::Embeddings`]), never the ids.
//! 4. For a cross-decoder (IDEFICS, Flamingo-style gated cross-attention), the image token
//!    stays a token and the image's rows become the sequence's cross-attention context
//!    ([`u_sdk::CrossContext`]), brought by the pass that holds the token and kept in the
//!    model's cache for the rest. One image a request; the prompt is not shared with the prefix
//!    cache (every position from the image on depends on it).

use crate::{Error, Result};
use sha2::{Digest, Sha256};
use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
};
use u_sdk::{
    ChatTurn, ImageInput, ImageSpec, ModelBox, ModelConfig, ModelKind, Output, Rows, Segment,
    SeqChunk, TokenizerBox,
};

/// The bit that marks a sequence id as part of an image (token ids stay below it).
pub(crate) const IMAGE_ID_BIT: u32 = 1 << 31;

/// Whether `id` stands for a row of an image rather than a token.
pub(crate) fn is_image_id(id: u32) -> bool {
    id & IMAGE_ID_BIT != 0
}

/// The ids an image with SHA-256 `hash` takes in a sequence, one per row: its hash, 31 bits a
/// position over the first eight (248 bits), then mixed with the row index.
pub(crate) fn image_ids(hash: &[u8; 32], rows: usize) -> Vec<u32> {
    (0..rows)
        .map(|r| {
            let word = u32::from_le_bytes(
                hash[(r % 8) * 4..(r % 8) * 4 + 4]
                    .try_into()
                    .expect("four bytes"),
            );
            IMAGE_ID_BIT | ((word ^ ((r / 8) as u32).wrapping_mul(0x9e37_79b1)) & !IMAGE_ID_BIT)
        })
        .collect()
}

/// An image's rows and where they stand in a prompt.
#[derive(Clone, Debug)]
pub(crate) struct ImageSpan {
    /// The first position, in the prompt.
    pub start: usize,
    /// `rows × hidden` floats.
    pub rows: Arc<[f32]>,
}

impl ImageSpan {
    /// Positions it covers.
    pub(crate) fn len(&self, hidden: usize) -> usize {
        self.rows.len() / hidden.max(1)
    }
}

/// The input of positions `start..start + tokens.len()` of a sequence whose images stand at
/// `images` (absolute positions): token runs as tokens, image positions as their rows.
pub(crate) fn segments<'a>(
    start: usize,
    tokens: &'a [u32],
    images: &'a [ImageSpan],
    hidden: usize,
) -> Vec<Segment<'a>> {
    let end = start + tokens.len();
    let mut out = Vec::new();
    let mut at = start;
    for image in images {
        let (from, to) = (image.start, image.start + image.len(hidden));
        if to <= at || from >= end {
            continue;
        }
        if from > at {
            out.push(Segment::Tokens(tokens[at - start..from - start].into()));
            at = from;
        }
        let upto = to.min(end);
        out.push(Segment::Embeddings(
            image.rows[(at - from) * hidden..(upto - from) * hidden].into(),
        ));
        at = upto;
    }
    if at < end {
        out.push(Segment::Tokens(tokens[at - start..].into()));
    }
    out
}

/// Encoder outputs by image hash, the least recently used dropped past the byte budget.
#[derive(Default)]
struct EncodedCache {
    rows: HashMap<[u8; 32], Arc<[f32]>>,
    order: VecDeque<[u8; 32]>,
    bytes: usize,
    hits: u64,
}

impl EncodedCache {
    fn get(&mut self, hash: &[u8; 32]) -> Option<Arc<[f32]>> {
        let rows = self.rows.get(hash)?.clone();
        self.order.retain(|h| h != hash);
        self.order.push_back(*hash);
        self.hits += 1;
        Some(rows)
    }

    fn put(&mut self, hash: [u8; 32], rows: Arc<[f32]>, budget: usize) {
        let size = rows.len() * 4;
        if size > budget || self.rows.contains_key(&hash) {
            return;
        }
        while self.bytes + size > budget {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(r) = self.rows.remove(&old) {
                self.bytes -= r.len() * 4;
            }
        }
        self.bytes += size;
        self.order.push_back(hash);
        self.rows.insert(hash, rows);
    }
}

/// What an image-reading engine is given: the image encoder and how images are read.
pub(crate) struct Vision {
    encoder: ModelBox,
    /// The decoder cross-attends to the image (its context) instead of reading its rows.
    cross: bool,
    /// The encoder's blocks: its rows are its state after the last.
    layers: u32,
    spec: ImageSpec,
    token: u32,
    marker: String,
    hidden: usize,
    limits: u_image::Limits,
    cache_bytes: usize,
    cache: Mutex<EncodedCache>,
}

/// How a runner reads images: the largest image and the encoder-output cache's bytes.
#[derive(Clone, Copy, Debug)]
pub struct ImageSettings {
    /// What an image file may be (`max_image_pixels`).
    pub limits: u_image::Limits,
    /// Bytes of encoder outputs kept for repeated images (`image_cache_bytes`).
    pub cache_bytes: usize,
}

impl Default for ImageSettings {
    /// PIL's pixel limit and 256 MiB of encoder outputs.
    fn default() -> Self {
        Self {
            limits: u_image::Limits::default(),
            cache_bytes: 256 << 20,
        }
    }
}

impl Vision {
    /// The image side of `decoder` (a model whose config names an image token) with `encoder`,
    /// which must make rows of its width; the marker text is the image token's own.
    pub(crate) fn new(
        decoder: &ModelConfig,
        encoder: ModelBox,
        tokenizer: &TokenizerBox,
        settings: ImageSettings,
    ) -> Result<Vision> {
        let plugin = |op| move |e| Error::plugin(op, e);
        let config = encoder
            .config()
            .into_result()
            .map_err(plugin("encoder.config"))?;
        let cross = decoder.kind == ModelKind::CrossDecoder;
        let [context_rows, context_width] = decoder.context_shape;
        let width = if cross { context_width } else { decoder.hidden };
        let spec = config.image.into_option().filter(|s| {
            config.kind == ModelKind::Encoder
                && config.hidden == width
                && (!cross || s.rows == context_rows)
        });
        let spec = spec.ok_or_else(|| {
            Error::Unsupported(format!(
                "the image encoder (`{}`) is not an image encoder of width {width}{}",
                config.family,
                if cross {
                    format!(" making {context_rows} rows")
                } else {
                    String::new()
                }
            ))
        })?;
        let marker = tokenizer
            .token_bytes(decoder.image_token)
            .into_result()
            .map_err(plugin("tokenizer.token_bytes"))?;
        let marker = String::from_utf8(marker.into_vec())
            .map_err(|_| Error::Unsupported("the image token's text is not UTF-8".into()))?;
        Ok(Vision {
            encoder,
            spec,
            token: decoder.image_token,
            marker,
            hidden: width as usize,
            cross,
            layers: config.layers,
            limits: settings.limits,
            cache_bytes: settings.cache_bytes,
            cache: Mutex::new(EncodedCache::default()),
        })
    }

    /// `turns` with each image's marker put at its offset, and the images in prompt order.
    pub(crate) fn mark<'t>(&self, turns: &'t [ChatTurn]) -> Result<(Vec<ChatTurn>, Vec<&'t [u8]>)> {
        let mut marked = Vec::with_capacity(turns.len());
        let mut images = Vec::new();
        for (i, turn) in turns.iter().enumerate() {
            let content = turn.content.as_str();
            let mut text = String::with_capacity(content.len());
            let mut at = 0;
            for image in turn.images.iter() {
                let offset = image.offset as usize;
                if offset < at || offset > content.len() || !content.is_char_boundary(offset) {
                    return Err(Error::InvalidRequest(format!(
                        "an image of message {i} stands at offset {offset}, not at a character \
                         boundary after the one before it"
                    )));
                }
                text.push_str(&content[at..offset]);
                text.push_str(&self.marker);
                images.push(image.data.as_slice());
                at = offset;
            }
            text.push_str(&content[at..]);
            marked.push(ChatTurn::text(turn.role.as_str(), &text));
        }
        Ok((marked, images))
    }

    /// The rows of an image file, from the cache or encoded now.
    fn rows(&self, bytes: &[u8]) -> Result<([u8; 32], Arc<[f32]>)> {
        let hash: [u8; 32] = Sha256::digest(bytes).into();
        if let Some(rows) = self.lock().get(&hash) {
            return Ok((hash, rows));
        }
        let image = u_image::decode(bytes, &self.limits)
            .map_err(|e| Error::InvalidRequest(format!("an image: {e}")))?;
        let pixels = u_image::preprocess(&image, &self.spec)
            .map_err(|e| Error::InvalidRequest(format!("an image: {e}")))?;
        let input = [Segment::Image(ImageInput {
            pixels: pixels.as_slice().into(),
            rows: self.spec.rows,
        })];
        let output = Output::Hidden {
            layer: self.layers,
            rows: Rows::All,
        };
        let chunk = [SeqChunk::tokens(0, &input, output)];
        let mut rows = vec![0f32; self.spec.rows as usize * self.hidden];
        self.encoder
            .forward(chunk.as_slice().into(), rows.as_mut_slice().into())
            .into_result()
            .map_err(|e| Error::plugin("encoder.forward", e))?;
        let rows: Arc<[f32]> = rows.into();
        self.lock().put(hash, rows.clone(), self.cache_bytes);
        Ok((hash, rows))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, EncodedCache> {
        // The cache holds no invariant a panicking holder could break half-way.
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the decoder cross-attends to the image instead of reading its rows.
    pub(crate) fn is_cross(&self) -> bool {
        self.cross
    }

    /// For a cross-decoder: the context of a prompt (`tokens`) holding one image token for
    /// its one image.
    pub(crate) fn context(&self, tokens: &[u32], images: &[&[u8]]) -> Result<Arc<[f32]>> {
        let found = tokens.iter().filter(|&&t| t == self.token).count();
        match (images, found) {
            ([image], 1) => Ok(self.rows(image)?.1),
            ([_], _) => Err(Error::InvalidRequest(format!(
                "the prompt holds {found} image markers (`{}`) for 1 image: the chat template \
                 must keep the image once, and text may not contain the marker",
                self.marker
            ))),
            _ => Err(Error::Unsupported(format!(
                "{} images: this model (cross-attention fusion) reads one image a request",
                images.len()
            ))),
        }
    }

    /// The image token's id.
    pub(crate) fn token(&self) -> u32 {
        self.token
    }

    /// Encoder-cache hits so far.
    pub(crate) fn cache_hits(&self) -> u64 {
        self.lock().hits
    }

    /// `tokens` (a rendered prompt holding one image token per image of `images`, in order)
    /// with each image token replaced by the image's ids, `breakpoints` (token counts) moved
    /// past the rows added before them, and the images' spans.
    pub(crate) fn expand(
        &self,
        tokens: Vec<u32>,
        images: &[&[u8]],
        breakpoints: Vec<usize>,
    ) -> Result<(Vec<u32>, Vec<usize>, Vec<ImageSpan>)> {
        let found = tokens.iter().filter(|&&t| t == self.token).count();
        if found != images.len() {
            return Err(Error::InvalidRequest(format!(
                "the prompt holds {found} image markers (`{}`) for {} images: the chat template \
                 must keep each image once, and text may not contain the marker",
                self.marker,
                images.len()
            )));
        }
        let per = self.spec.rows as usize;
        let mut out = Vec::with_capacity(tokens.len() + images.len() * per);
        let mut spans = Vec::with_capacity(images.len());
        let mut moved = breakpoints;
        let mut next = images.iter();
        for (i, t) in tokens.into_iter().enumerate() {
            if t != self.token {
                out.push(t);
                continue;
            }
            let bytes = next.next().expect("counted above");
            let (hash, rows) = self.rows(bytes)?;
            spans.push(ImageSpan {
                start: out.len(),
                rows,
            });
            out.extend(image_ids(&hash, per));
            for b in moved.iter_mut().filter(|b| **b > i) {
                *b += per - 1;
            }
        }
        Ok((out, moved, spans))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_ids_differ_by_image_and_never_look_like_tokens() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let (ia, ib) = (image_ids(&a, 20), image_ids(&b, 20));
        assert!(ia.iter().chain(&ib).all(|&id| is_image_id(id)));
        assert!(ia.iter().zip(&ib).all(|(x, y)| x != y));
        assert_eq!(ia, image_ids(&a, 20));
        assert!(!is_image_id(u32::MAX >> 1));
    }

    #[test]
    fn segments_split_tokens_and_image_rows() {
        let hidden = 2;
        let image = ImageSpan {
            start: 3,
            rows: (0..6).map(|v| v as f32).collect::<Vec<_>>().into(),
        };
        let tokens = [10, 11, 12, 90, 91, 92, 13];
        let images = [image];
        let whole = segments(0, &tokens, &images, hidden);
        let shape: Vec<(char, usize)> = whole
            .iter()
            .map(|s| match s {
                Segment::Tokens(t) => ('t', t.len()),
                Segment::Embeddings(e) => ('e', e.len() / hidden),
                Segment::Image(_) | Segment::Planes(_) => ('i', 0),
            })
            .collect();
        assert_eq!(shape, [('t', 3), ('e', 3), ('t', 1)]);
        // A chunk that starts inside the image: its remaining rows.
        let part = segments(4, &tokens[4..6], &images, hidden);
        match part.as_slice() {
            [Segment::Embeddings(e)] => assert_eq!(e.as_slice(), [2.0, 3.0, 4.0, 5.0]),
            _ => panic!("one embedding segment"),
        }
    }

    #[test]
    fn the_encoder_cache_keeps_to_its_budget_least_recently_used_first() {
        let mut c = EncodedCache::default();
        let rows = |n: usize| -> Arc<[f32]> { vec![0f32; n].into() };
        c.put([1; 32], rows(10), 100);
        c.put([2; 32], rows(10), 100);
        assert!(c.get(&[1; 32]).is_some());
        c.put([3; 32], rows(10), 100);
        assert!(c.get(&[2; 32]).is_none(), "the least recently used went");
        assert!(c.get(&[1; 32]).is_some() && c.get(&[3; 32]).is_some());
        c.put([4; 32], rows(100), 100);
        assert!(
            c.get(&[4; 32]).is_none(),
            "larger than the budget: not kept"
        );
        assert_eq!(c.bytes, 80);
    }
}
