//! A test architecture that panics on demand.
//!
//! It builds a toy decoder over any weight set with a `[vocab, hidden]` embedding table: each
//! position appends one zero row of KV, and the logits of a position are one-hot at the next
//! token id (`token + 1` modulo the vocabulary), so its greedy output is predictable. Its
//! `[plugins.config]` names the methods that panic instead — `panic_in = ["build", "config",
//! "cache", "forward", "graft"]` — and `trigger = N` limits `forward`'s panic to passes whose
//! input holds token `N`, so a server can be seen to go on serving the requests that do not.
//! Every object is boxed with the SDK's guarded constructors, which is what this plugin tests.

use abi_stable::std_types::{ROption, RResult, RSlice, RSliceMut, RString, RVec};
use std::collections::BTreeSet;
use u_sdk::{
    Architecture, ArchitectureBox, AttentionMask, BuildContext, DType, HostBox, KvCacheBox,
    KvLayout, Model, ModelBox, ModelConfig, ModelKind, Output, PluginInfo, PluginInstance, Pooling,
    Rows, Segment, SeqChunk, SeqId, UError, nn::Device,
};

u_sdk::export_plugin! {
    manifest: "plugin.toml",
    describe: describe,
    instantiate: instantiate,
}

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "panicking toy decoder (test plugin)".into(),
        details: RVec::new(),
    }
}

/// Which methods panic, and the token that arms `forward`.
#[derive(Clone, Debug, Default)]
struct Panics {
    methods: BTreeSet<String>,
    trigger: Option<u32>,
}

impl Panics {
    fn at(&self, method: &str) {
        if self.methods.contains(method) {
            panic!("arch-panicky was told to panic in {method}");
        }
    }
}

fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    let config: toml::Table = toml::from_str(host.config().as_str())
        .map_err(|e| UError::invalid(format!("arch-panicky config: {e}")))?;
    let methods = config
        .get("panic_in")
        .and_then(|v| v.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|m| m.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let trigger = config
        .get("trigger")
        .and_then(|v| v.as_integer())
        .map(|t| t as u32);
    Ok(PluginInstance::Architecture(ArchitectureBox::new(Panicky(
        Panics { methods, trigger },
    ))))
}

#[derive(Clone)]
struct Panicky(Panics);

impl Architecture for Panicky {
    fn build(&self, context: BuildContext) -> RResult<ModelBox, UError> {
        self.0.at("build");
        (|| {
            let cache = context
                .cache
                .into_option()
                .ok_or_else(|| UError::invalid("arch-panicky: no cache"))?;
            let tensors = context.weights.tensors().into_result()?;
            let table = tensors
                .iter()
                .find(|t| t.name.ends_with("embed_tokens.weight") || t.name == "token_embd.weight")
                .ok_or_else(|| UError::invalid("arch-panicky: no embedding table"))?;
            let vocab = table.shape.first().copied().unwrap_or(0) as u32;
            let hidden = table.shape.get(1).copied().unwrap_or(0) as u32;
            let device = Device::new(context.backend)?;
            cache
                .configure(
                    KvLayout {
                        layers: 1,
                        kv_heads: 1,
                        head_dim: 1,
                        dtype: DType::F32,
                        model_id: "arch-panicky".into(),
                    },
                    device.backend().clone(),
                )
                .into_result()?;
            Ok(ModelBox::new(Toy {
                panics: self.0.clone(),
                device,
                cache,
                vocab,
                hidden,
            }))
        })()
        .into()
    }

    fn gguf_view(
        &self,
        weights: u_sdk::WeightSetBox,
        _family: RString,
    ) -> RResult<u_sdk::WeightSetBox, UError> {
        self.0.at("gguf_view");
        u_sdk::weights::gguf_as_is("arch-panicky", weights)
    }
}

struct Toy {
    panics: Panics,
    device: Device,
    cache: KvCacheBox,
    vocab: u32,
    hidden: u32,
}

impl Model for Toy {
    fn config(&self) -> RResult<ModelConfig, UError> {
        self.panics.at("config");
        RResult::ROk(ModelConfig {
            kind: ModelKind::Decoder,
            family: "llama".into(),
            vocab_size: self.vocab,
            hidden: self.hidden,
            layers: 1,
            context_length: 4096,
            experts: 0,
            attention: AttentionMask::Causal,
            pooling: Pooling::Last,
            context_shape: [0, 0],
            image: ROption::RNone,
            image_token: u_sdk::NO_IMAGE_TOKEN,
            planes: abi_stable::std_types::ROption::RNone,
        })
    }

    fn cache(&self) -> RResult<ROption<KvCacheBox>, UError> {
        self.panics.at("cache");
        RResult::ROk(ROption::RSome(self.cache.clone()))
    }

    fn forward(
        &self,
        batch: RSlice<'_, SeqChunk<'_>>,
        mut out: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        let tokens = |c: &SeqChunk<'_>| -> Vec<u32> {
            c.input
                .iter()
                .flat_map(|s| match s {
                    Segment::Tokens(t) => t.to_vec(),
                    Segment::Embeddings(_) | Segment::Image(_) | Segment::Planes(_) => Vec::new(),
                })
                .collect()
        };
        let armed = match self.panics.trigger {
            Some(t) => batch.iter().any(|c| tokens(c).contains(&t)),
            None => true,
        };
        if armed {
            self.panics.at("forward");
        }
        (|| {
            let out = out.as_mut_slice();
            out.fill(0.0);
            let mut at = 0;
            for chunk in batch.iter() {
                let ids = tokens(chunk);
                let zeros = self
                    .device
                    .from_f32(&vec![0.0; ids.len()], &[ids.len() as u64, 1])?;
                self.cache
                    .append(chunk.seq, 0, zeros.desc(), zeros.desc())
                    .into_result()?;
                let rows: &[u32] = match chunk.output {
                    Output::Logits(Rows::All) => &ids,
                    Output::Logits(Rows::Last) => &ids[ids.len().saturating_sub(1)..],
                    Output::Nothing => &[],
                    _ => return Err(UError::unsupported("arch-panicky: logits only")),
                };
                for &t in rows {
                    out[at + ((t + 1) % self.vocab) as usize] = 10.0;
                    at += self.vocab as usize;
                }
            }
            Ok(())
        })()
        .into()
    }

    fn graft(&self, _dst: SeqId, _src: SeqId, _from: u64, _count: u64) -> RResult<(), UError> {
        self.panics.at("graft");
        RResult::RErr(UError::unsupported("arch-panicky: no grafts"))
    }
}
