//! Boxing a plugin's objects for the ABI, every method panic-guarded.
//!
//! A panic that unwinds through an `extern "C"` frame aborts the whole process, so no ABI
//! object should be made with the raw `…_TO::from_value`. Each box type has a `new` here that
//! wraps the value in [`Guarded`], whose implementation of the interface runs every method
//! under `catch_unwind`: a panic in any method of any plugin object becomes an
//! [`ErrorKind::Panicked`](crate::ErrorKind::Panicked) error naming the method (or, for the few
//! infallible methods, a stated fallback), and the host and every other request carry on.
//!
//! ```ignore
//! Ok(PluginInstance::Architecture(ArchitectureBox::new(MyArchitecture)))
//! ```

use crate::abi::{
    backend::*, cache::*, error::UError, loader::*, model::*, runner::*, tensor::*, tokenizer::*,
    train::*, transport::*,
};
use crate::guard::panic_error;
use abi_stable::{
    sabi_trait::{TD_CanDowncast, TD_Opaque},
    std_types::{RArc, RBox, ROption, RResult, RSlice, RSliceMut, RStr, RString, RVec, Tuple2},
};
use std::panic::{AssertUnwindSafe, catch_unwind};

/// A plugin object whose interface methods catch panics (see the module documentation).
#[derive(Clone)]
pub struct Guarded<T>(pub T);

/// Runs an interface method's body; a panic becomes an error naming `what`.
fn run<T>(what: &str, body: impl FnOnce() -> RResult<T, UError>) -> RResult<T, UError> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(r) => r,
        Err(payload) => RResult::RErr(panic_error(what, payload.as_ref())),
    }
}

/// Runs an infallible method's body; a panic yields `fallback`.
fn run_or<T>(body: impl FnOnce() -> T, fallback: T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(fallback)
}

impl<T: Loader> Loader for Guarded<T> {
    fn formats(&self) -> RResult<RVec<RString>, UError> {
        run("loader.formats", || self.0.formats())
    }
    fn can_open(&self, path: RStr<'_>, head: RSlice<'_, u8>) -> RResult<bool, UError> {
        run("loader.can_open", || self.0.can_open(path, head))
    }
    fn open(&self, path: RStr<'_>) -> RResult<WeightSetBox, UError> {
        run("loader.open", || self.0.open(path))
    }
}

impl<T: WeightSet> WeightSet for Guarded<T> {
    fn format(&self) -> RResult<RString, UError> {
        run("weights.format", || self.0.format())
    }
    fn architecture(&self) -> RResult<ROption<RString>, UError> {
        run("weights.architecture", || self.0.architecture())
    }
    fn metadata_keys(&self) -> RResult<RVec<RString>, UError> {
        run("weights.metadata_keys", || self.0.metadata_keys())
    }
    fn metadata(&self, key: RStr<'_>) -> RResult<ROption<MetaValue>, UError> {
        run("weights.metadata", || self.0.metadata(key))
    }
    fn tensors(&self) -> RResult<RVec<TensorInfo>, UError> {
        run("weights.tensors", || self.0.tensors())
    }
    fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
        run("weights.tensor", || self.0.tensor(name))
    }
}

impl<T: Buffer> Buffer for Guarded<T> {
    fn byte_len(&self) -> u64 {
        run_or(|| self.0.byte_len(), 0)
    }
    fn host_address(&self) -> usize {
        run_or(|| self.0.host_address(), 0)
    }
    fn read_only(&self) -> bool {
        run_or(|| self.0.read_only(), true)
    }
    fn write(&self, offset: u64, bytes: RSlice<'_, u8>) -> RResult<(), UError> {
        run("buffer.write", || self.0.write(offset, bytes))
    }
    fn read(&self, offset: u64, out: RSliceMut<'_, u8>) -> RResult<(), UError> {
        run("buffer.read", || self.0.read(offset, out))
    }
}

impl<T: Keepalive> Keepalive for Guarded<T> {
    fn describe(&self) -> RString {
        run_or(|| self.0.describe(), RString::from("(describe panicked)"))
    }
}

impl<T: Backend> Backend for Guarded<T> {
    fn info(&self) -> RResult<BackendInfo, UError> {
        run("backend.info", || self.0.info())
    }
    fn buffer_type(&self) -> RResult<BufferType, UError> {
        run("backend.buffer_type", || self.0.buffer_type())
    }
    fn supports(&self, op: OpKind, dtype: crate::DType) -> RResult<bool, UError> {
        run("backend.supports", || self.0.supports(op, dtype))
    }
    fn alloc(&self, bytes: u64) -> RResult<BufferBox, UError> {
        run("backend.alloc", || self.0.alloc(bytes))
    }
    fn import(&self, bytes: RSlice<'_, u8>, owner: KeepaliveBox) -> RResult<BufferBox, UError> {
        run("backend.import", || self.0.import(bytes, owner))
    }
    fn compute(&self, ops: RSlice<'_, OpCall<'_>>) -> RResult<(), UError> {
        run("backend.compute", || self.0.compute(ops))
    }
    fn synchronize(&self) -> RResult<(), UError> {
        run("backend.synchronize", || self.0.synchronize())
    }
}

impl<T: Architecture> Architecture for Guarded<T> {
    fn build(&self, context: BuildContext) -> RResult<ModelBox, UError> {
        run("architecture.build", || self.0.build(context))
    }
    fn gguf_view(&self, weights: WeightSetBox, family: RString) -> RResult<WeightSetBox, UError> {
        run("architecture.gguf_view", || {
            self.0.gguf_view(weights, family)
        })
    }
}

impl<T: Model> Model for Guarded<T> {
    fn config(&self) -> RResult<ModelConfig, UError> {
        run("model.config", || self.0.config())
    }
    fn cache(&self) -> RResult<ROption<KvCacheBox>, UError> {
        run("model.cache", || self.0.cache())
    }
    fn forward(
        &self,
        batch: RSlice<'_, SeqChunk<'_>>,
        out: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        run("model.forward", || self.0.forward(batch, out))
    }
    fn graft(&self, dst: SeqId, src: SeqId, from: u64, count: u64) -> RResult<(), UError> {
        run("model.graft", || self.0.graft(dst, src, from, count))
    }
    fn load_adapter(
        &self,
        name: RStr<'_>,
        weights: WeightSetBox,
        config: RStr<'_>,
    ) -> RResult<AdapterInfo, UError> {
        run("model.load_adapter", || {
            self.0.load_adapter(name, weights, config)
        })
    }
    fn unload_adapter(&self, name: RStr<'_>) -> RResult<bool, UError> {
        run("model.unload_adapter", || self.0.unload_adapter(name))
    }
    fn adapters(&self) -> RResult<RVec<AdapterInfo>, UError> {
        run("model.adapters", || self.0.adapters())
    }
    fn counters(&self) -> RResult<RVec<ModelCounter>, UError> {
        run("model.counters", || self.0.counters())
    }
    fn trainer(&self, spec: TrainSpec) -> RResult<TrainerBox, UError> {
        run("model.trainer", || self.0.trainer(spec))
    }
}

impl<T: Trainer> Trainer for Guarded<T> {
    fn accumulate(&mut self, tokens: RSlice<'_, u32>) -> RResult<f32, UError> {
        run("trainer.accumulate", || self.0.accumulate(tokens))
    }
    fn loss(&self, tokens: RSlice<'_, u32>) -> RResult<f32, UError> {
        run("trainer.loss", || self.0.loss(tokens))
    }
    fn step(&mut self, learning_rate: f32) -> RResult<f32, UError> {
        run("trainer.step", || self.0.step(learning_rate))
    }
    fn gradients(&self) -> RResult<RVec<NamedValues>, UError> {
        run("trainer.gradients", || self.0.gradients())
    }
    fn state(&self) -> RResult<RVec<NamedValues>, UError> {
        run("trainer.state", || self.0.state())
    }
    fn restore(&mut self, state: RVec<NamedValues>) -> RResult<(), UError> {
        run("trainer.restore", || self.0.restore(state))
    }
    fn export(&self) -> RResult<Trained, UError> {
        run("trainer.export", || self.0.export())
    }
}

impl<T: TokenizerFactory> TokenizerFactory for Guarded<T> {
    fn build_from_weights(&self, weights: WeightSetBox) -> RResult<TokenizerBox, UError> {
        run("tokenizer.build_from_weights", || {
            self.0.build_from_weights(weights)
        })
    }
    fn build_from_file(&self, path: RStr<'_>) -> RResult<TokenizerBox, UError> {
        run("tokenizer.build_from_file", || self.0.build_from_file(path))
    }
}

impl<T: Tokenizer> Tokenizer for Guarded<T> {
    fn vocab_size(&self) -> RResult<u32, UError> {
        run("tokenizer.vocab_size", || self.0.vocab_size())
    }
    fn encode(
        &self,
        text: RStr<'_>,
        add_special: bool,
        parse_special: bool,
    ) -> RResult<RVec<u32>, UError> {
        run("tokenizer.encode", || {
            self.0.encode(text, add_special, parse_special)
        })
    }
    fn decode(&self, ids: RSlice<'_, u32>, skip_special: bool) -> RResult<RString, UError> {
        run("tokenizer.decode", || self.0.decode(ids, skip_special))
    }
    fn token_bytes(&self, id: u32) -> RResult<RVec<u8>, UError> {
        run("tokenizer.token_bytes", || self.0.token_bytes(id))
    }
    fn special_tokens(&self) -> RResult<SpecialTokens, UError> {
        run("tokenizer.special_tokens", || self.0.special_tokens())
    }
    fn chat_template(&self) -> RResult<ROption<RString>, UError> {
        run("tokenizer.chat_template", || self.0.chat_template())
    }
    fn gguf_metadata(&self) -> RResult<RVec<Tuple2<RString, MetaValue>>, UError> {
        run("tokenizer.gguf_metadata", || self.0.gguf_metadata())
    }
}

impl<T: KvCache> KvCache for Guarded<T> {
    fn configure(&self, layout: KvLayout, backend: BackendBox) -> RResult<(), UError> {
        run("cache.configure", || self.0.configure(layout, backend))
    }
    fn create(&self) -> RResult<SeqId, UError> {
        run("cache.create", || self.0.create())
    }
    fn fork(&self, seq: SeqId) -> RResult<SeqId, UError> {
        run("cache.fork", || self.0.fork(seq))
    }
    fn release(&self, seq: SeqId) -> RResult<(), UError> {
        run("cache.release", || self.0.release(seq))
    }
    fn len(&self, seq: SeqId) -> RResult<u64, UError> {
        run("cache.len", || self.0.len(seq))
    }
    fn truncate(&self, seq: SeqId, len: u64) -> RResult<(), UError> {
        run("cache.truncate", || self.0.truncate(seq, len))
    }
    fn append(
        &self,
        seq: SeqId,
        layer: u32,
        keys: &TensorDesc,
        values: &TensorDesc,
    ) -> RResult<(), UError> {
        run("cache.append", || self.0.append(seq, layer, keys, values))
    }
    fn pages(&self, seq: SeqId, layer: u32) -> RResult<RVec<KvPage>, UError> {
        run("cache.pages", || self.0.pages(seq, layer))
    }
    fn lookup_prefix(&self, tokens: RSlice<'_, u32>) -> RResult<PrefixMatch, UError> {
        run("cache.lookup_prefix", || self.0.lookup_prefix(tokens))
    }
    fn insert_prefix(&self, tokens: RSlice<'_, u32>, seq: SeqId) -> RResult<(), UError> {
        run("cache.insert_prefix", || self.0.insert_prefix(tokens, seq))
    }
    fn save_checkpoint(&self, name: RStr<'_>, seq: SeqId) -> RResult<(), UError> {
        run("cache.save_checkpoint", || {
            self.0.save_checkpoint(name, seq)
        })
    }
    fn load_checkpoint(&self, name: RStr<'_>) -> RResult<SeqId, UError> {
        run("cache.load_checkpoint", || self.0.load_checkpoint(name))
    }
    fn checkpoints(&self) -> RResult<RVec<crate::CheckpointInfo>, UError> {
        run("cache.checkpoints", || self.0.checkpoints())
    }
    fn delete_checkpoint(&self, name: RStr<'_>) -> RResult<(), UError> {
        run("cache.delete_checkpoint", || self.0.delete_checkpoint(name))
    }
    fn set_dtype(&self, seq: SeqId, dtype: crate::DType) -> RResult<(), UError> {
        run("cache.set_dtype", || self.0.set_dtype(seq, dtype))
    }
    fn stats(&self) -> RResult<KvStats, UError> {
        run("cache.stats", || self.0.stats())
    }
    fn flush_prefixes(&self) -> RResult<u64, UError> {
        run("cache.flush_prefixes", || self.0.flush_prefixes())
    }
}

impl<T: Runner> Runner for Guarded<T> {
    fn start(&self, context: RunnerContext) -> RResult<EngineBox, UError> {
        run("runner.start", || self.0.start(context))
    }
}

impl<T: Engine> Engine for Guarded<T> {
    fn models(&self) -> RResult<RVec<RString>, UError> {
        run("engine.models", || self.0.models())
    }
    fn generate(
        &self,
        request: &GenerateRequest,
        sink: TokenSinkBox,
    ) -> RResult<GenerateSummary, UError> {
        run("engine.generate", || self.0.generate(request, sink))
    }
    fn stats(&self) -> RResult<EngineStats, UError> {
        run("engine.stats", || self.0.stats())
    }
    fn checkpoint(&self, request: &CheckpointRequest) -> RResult<RVec<CheckpointInfo>, UError> {
        run("engine.checkpoint", || self.0.checkpoint(request))
    }
    fn embed(&self, model: RStr<'_>, input: RStr<'_>) -> RResult<RVec<f32>, UError> {
        run("engine.embed", || self.0.embed(model, input))
    }
    fn tokenize(&self, request: &TokenizeRequest) -> RResult<RVec<u32>, UError> {
        run("engine.tokenize", || self.0.tokenize(request))
    }
    fn detokenize(&self, model: RStr<'_>, tokens: RSlice<'_, u32>) -> RResult<RVec<u8>, UError> {
        run("engine.detokenize", || self.0.detokenize(model, tokens))
    }
    fn embed_tokens(&self, model: RStr<'_>, tokens: RSlice<'_, u32>) -> RResult<RVec<f32>, UError> {
        run("engine.embed_tokens", || self.0.embed_tokens(model, tokens))
    }
    fn embed_image(&self, model: RStr<'_>, image: RSlice<'_, u8>) -> RResult<RVec<f32>, UError> {
        run("engine.embed_image", || self.0.embed_image(model, image))
    }
    fn flush_cache(&self, model: RStr<'_>) -> RResult<u64, UError> {
        run("engine.flush_cache", || self.0.flush_cache(model))
    }
    fn load_adapter(&self, name: RStr<'_>, path: RStr<'_>) -> RResult<AdapterInfo, UError> {
        run("engine.load_adapter", || self.0.load_adapter(name, path))
    }
    fn unload_adapter(&self, name: RStr<'_>) -> RResult<bool, UError> {
        run("engine.unload_adapter", || self.0.unload_adapter(name))
    }
    fn transcribe(&self, request: &TranscribeRequest) -> RResult<Transcript, UError> {
        run("engine.transcribe", || self.0.transcribe(request))
    }
    fn generate_image(
        &self,
        request: &ImageRequest,
        sink: ImageSinkBox,
    ) -> RResult<GeneratedImage, UError> {
        run("engine.generate_image", || {
            self.0.generate_image(request, sink)
        })
    }
}

impl<T: TokenSink> TokenSink for Guarded<T> {
    /// A panicking sink cancels its request.
    fn token(&mut self, token: &GeneratedToken<'_>) -> bool {
        run_or(|| self.0.token(token), false)
    }
}

impl<T: ImageSink> ImageSink for Guarded<T> {
    /// A panicking sink cancels its request.
    fn step(&mut self, progress: &ImageProgress) -> bool {
        run_or(|| self.0.step(progress), false)
    }
}

impl<T: Transport> Transport for Guarded<T> {
    fn serve(&self, context: TransportContext) -> RResult<(), UError> {
        run("transport.serve", || self.0.serve(context))
    }
}

macro_rules! guarded_box {
    ($(#[$doc:meta])* $alias:ident = $to:ident<$ptr:ident>: $trait:ident) => {
        impl $alias {
            $(#[$doc])*
            pub fn new<T: $trait + 'static>(value: T) -> Self {
                $to::from_ptr($ptr::new(Guarded(value)), TD_Opaque)
            }
        }
    };
}

guarded_box!(
    /// A loader, panic-guarded.
    LoaderBox = Loader_TO<RBox>: Loader
);
guarded_box!(
    /// A weight set, panic-guarded.
    WeightSetBox = WeightSet_TO<RBox>: WeightSet
);
guarded_box!(
    /// A buffer, panic-guarded.
    BufferBox = Buffer_TO<RArc>: Buffer
);
impl BufferBox {
    /// A buffer, panic-guarded, that its maker can recognise again with
    /// [`BufferBox::downcast`]: a device backend finds its own buffers among an op's operands
    /// (and tells them from a cache's host pages) without asking for addresses.
    pub fn new_recognisable<T: Buffer + 'static>(value: T) -> Self {
        Buffer_TO::from_ptr(RArc::new(Guarded(value)), TD_CanDowncast)
    }

    /// The value inside when this buffer was made by [`BufferBox::new_recognisable`] with a
    /// `T` (in the same plugin); `None` for any other buffer.
    pub fn downcast<T: Buffer + 'static>(&self) -> Option<&T> {
        self.obj.downcast_as::<Guarded<T>>().ok().map(|g| &g.0)
    }
}

guarded_box!(
    /// A keep-alive object, panic-guarded.
    KeepaliveBox = Keepalive_TO<RBox>: Keepalive
);
guarded_box!(
    /// A backend, panic-guarded.
    BackendBox = Backend_TO<RBox>: Backend
);
guarded_box!(
    /// An architecture, panic-guarded.
    ArchitectureBox = Architecture_TO<RBox>: Architecture
);
guarded_box!(
    /// A model, panic-guarded.
    ModelBox = Model_TO<RBox>: Model
);
guarded_box!(
    /// A trainer, panic-guarded.
    TrainerBox = Trainer_TO<RBox>: Trainer
);
guarded_box!(
    /// A tokenizer factory, panic-guarded.
    TokenizerFactoryBox = TokenizerFactory_TO<RBox>: TokenizerFactory
);
guarded_box!(
    /// A tokenizer, panic-guarded.
    TokenizerBox = Tokenizer_TO<RBox>: Tokenizer
);
guarded_box!(
    /// A cache, panic-guarded.
    KvCacheBox = KvCache_TO<RBox>: KvCache
);
guarded_box!(
    /// A runner, panic-guarded.
    RunnerBox = Runner_TO<RBox>: Runner
);
guarded_box!(
    /// An engine, panic-guarded.
    EngineBox = Engine_TO<RBox>: Engine
);
guarded_box!(
    /// A token sink, panic-guarded (a panic cancels the request).
    TokenSinkBox = TokenSink_TO<RBox>: TokenSink
);
guarded_box!(
    /// An image progress sink, panic-guarded (a panic cancels the request).
    ImageSinkBox = ImageSink_TO<RBox>: ImageSink
);
guarded_box!(
    /// A transport, panic-guarded.
    TransportBox = Transport_TO<RBox>: Transport
);
