//! Opening one model through a deployment, for `u-runner generate`, `tokenize`, `bench` and the
//! deployment's `[model]` under `serve`: the model path is granted to the loader and tokenizer
//! plugins, the process is locked down to the union of the grants, and only then are the
//! plugins instantiated and wired — loader → weight set → the architecture that declares its
//! family (with the backend and cache) → model → the runner for its task → engine, and the
//! tokenizer from `tokenizer.json` or the weight set's metadata. The host knows interfaces and
//! signed manifests only: no model math, no templates, no sampling.

use crate::{
    LoadReport, LoadedPlugin, OpenReport, inspect, instantiate, open_deployment, progress, sandbox,
    single_file,
};
use abi_stable::std_types::{ROption, RResult};
use anyhow::{Context, Result, anyhow, bail};
use std::path::{Path, PathBuf};
use u_attest::{
    Deployment,
    deployment::{PathGrant, absolute},
};
use u_sdk::{
    ArchitectureBox, BackendBox, BackendInfo, BuildContext, EngineBox, ExtraKind, KvCacheBox,
    ModelBox, ModelConfig, ModelKind, PluginInstance, RunnerBox, RunnerContext, RunnerExtra,
    ServingLimits, TokenizerBox, TokenizerFactoryBox, WeightSetBox,
    manifest::{PluginKind, Task},
};

/// What to build from the model.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Only the tokenizer (for `tokenize`).
    Tokenizer,
    /// The model served by its runner (for `generate` and `serve`).
    Engine,
    /// The model alone, and the tokenizer (for `bench`, which calls `Model::forward`).
    Model,
    /// The weight set and the kernels plugin's backend, no tokenizer or model (for
    /// `quantize`).
    Weights,
}

/// A model opened through the deployment's plugins, inside the sandbox.
pub struct Opened {
    /// The weights as the loader mapped them.
    pub weights: WeightSetBox,
    /// The loader plugin that opened them.
    pub loader: String,
    /// The tokenizer, if the model has one.
    pub tokenizer: Option<TokenizerBox>,
    /// The architecture plugin that built the model, and what the model says it is.
    pub built: Option<(String, ModelConfig)>,
    /// The built model itself (for [`Want::Model`]; a runner owns it otherwise).
    pub model: Option<ModelBox>,
    /// The backend the model computes on.
    pub backend: Option<BackendInfo>,
    /// The kernels plugin's backend itself (for [`Want::Weights`]).
    pub kernels: Option<BackendBox>,
    /// For [`Want::Weights`]: the format the weights were stored in when `weights` is their
    /// architecture's GGUF view of them.
    pub converted_from: Option<String>,
    /// The runner plugin serving the model and its engine (for [`Want::Engine`]).
    pub engine: Option<(String, EngineBox)>,
    /// What the sandbox achieved.
    pub sandbox: sandbox::Status,
}

/// Read grants covering `model` (the attestation's function, so the proof lists exactly these).
pub use u_attest::deployment::model_grants;

/// Grants read access to `model` to the loader and tokenizer plugins of `opened`; returns the
/// grants, which the host's own sandbox plan needs too (it reads the model's first bytes to pick
/// a loader). `model` must be absolute.
pub fn grant_model(opened: &mut OpenReport, model: &Path) -> Vec<PathGrant> {
    grant_reads(opened, model_grants(model))
}

/// Grants read access to the deployment's adapters, control vectors and soft prompts
/// ([`Deployment::model_extras`]) as [`grant_model`] does to the model.
pub fn grant_extras(opened: &mut OpenReport, deployment: &Deployment) -> Vec<PathGrant> {
    let grants = deployment.model_extras().flat_map(model_grants).collect();
    grant_reads(opened, grants)
}

fn grant_reads(opened: &mut OpenReport, grants: Vec<PathGrant>) -> Vec<PathGrant> {
    for p in &mut opened.opened {
        if matches!(
            p.verified.manifest.kind,
            PluginKind::Loader | PluginKind::Tokenizer
        ) {
            p.grants.fs_read.extend(grants.iter().cloned());
        }
    }
    grants
}

/// Verifies the deployment, grants `model` to its loaders and tokenizers, locks the process
/// down, instantiates the plugins and opens the model.
pub fn open(deployment: &Deployment, model: &Path, threads: u32, want: Want) -> Result<Opened> {
    open_writing(deployment, model, threads, want, Vec::new())
}

/// [`open`], with the host itself also left able to write beneath `writes` after lock-down
/// (where a command such as `train` puts its checkpoints and results).
pub fn open_writing(
    deployment: &Deployment,
    model: &Path,
    threads: u32,
    want: Want,
    writes: Vec<PathGrant>,
) -> Result<Opened> {
    let model = absolute(model);
    if !model.exists() {
        bail!("model {} does not exist", model.display());
    }
    let mut opened = open_deployment(deployment);
    let mut grants = grant_model(&mut opened, &model);
    grants.extend(grant_extras(&mut opened, deployment));
    crate::loading::start_workers(&mut opened, threads);
    let mut plan = sandbox::Plan::default();
    for p in opened.opened.iter().filter(|p| !p.in_worker()) {
        plan.add(&p.grants);
    }
    plan.read.extend(grants);
    plan.read.extend(writes.iter().cloned());
    plan.write.extend(writes);
    let status = sandbox::lock_down(&plan);
    let report = instantiate(opened, threads);
    for r in &report.refused {
        eprintln!("u-runner: plugin {} refused: {}", r.plugin, r.reason);
    }
    let name = served_name(&model);
    build(&report, &model, want, status, deployment, &name)
}

/// The name a model is served under: its directory's name, or its file name without the
/// extension.
pub fn served_name(model: &Path) -> String {
    let name = if model.is_dir() {
        model.file_name()
    } else {
        model.file_stem()
    };
    name.map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// Opens `model` with the loaded plugins of `report` and, for [`Want::Model`] and
/// [`Want::Engine`], builds it with the architecture that declares its family (the one the
/// deployment's `[model] architecture` names, when it names one) and, for [`Want::Engine`],
/// starts the runner for its task. `status` is what the caller's lock-down achieved.
pub fn build(
    report: &LoadReport,
    model: &Path,
    want: Want,
    status: sandbox::Status,
    deployment: &Deployment,
    name: &str,
) -> Result<Opened> {
    if model.join(MODEL_INDEX).is_file() && want != Want::Weights {
        return build_pipeline(report, model, want, status, deployment, name);
    }
    let (loader, weights) = open_weights(model, &inspect::loaders(report))?;
    let factory = first(report, |i| match i {
        PluginInstance::Tokenizer(t) => Some(t.clone()),
        _ => None,
    });
    let tokenizer = match &factory {
        Some((_, f)) if want != Want::Weights => build_tokenizer(f, model, &weights)?,
        _ => None,
    };
    let mut opened = Opened {
        weights,
        loader,
        tokenizer,
        built: None,
        model: None,
        backend: None,
        kernels: None,
        converted_from: None,
        engine: None,
        sandbox: status,
    };
    if want == Want::Tokenizer {
        return Ok(opened);
    }
    if want == Want::Weights {
        // Converting weights needs every conversion (quantizing copies): the fallback has them
        // where a GPU plugin is preferred.
        let chosen = crate::compute::backend_for(report, deployment)?;
        opened.kernels = Some(chosen.fallback.map_or(chosen.backend, |(_, f)| f));
        let format = opened.weights.format().into_result();
        let format = format.map_err(|e| anyhow!("{}: {e}", opened.loader))?;
        if format != "gguf" {
            as_gguf(report, deployment, &mut opened)?;
            opened.converted_from = Some(format.into_string());
            if let Some((_, f)) = &factory {
                opened.tokenizer = build_tokenizer(f, model, &opened.weights)?;
            }
        }
        return Ok(opened);
    }
    let (family, arch_name, architecture) = architecture_of(report, deployment, &opened)?;
    let chosen = crate::compute::backend_for(report, deployment)?;
    let cache: Option<KvCacheBox> = first(report, |i| match i {
        PluginInstance::Cache(c) => Some(c.clone()),
        _ => None,
    })
    .map(|(_, c)| c);
    let watched = progress::watch(&opened.weights);
    let build_on = |backend: &BackendBox, fallback: Option<&BackendBox>| {
        build_model(
            &arch_name,
            &architecture,
            BuildContext {
                weights: watched.weights.clone(),
                family: family.clone().unwrap_or_default().into(),
                backend: backend.clone(),
                fallback: fallback.cloned().into(),
                cache: cache.clone().into(),
            },
        )
    };
    let fallback = chosen.fallback.as_ref().map(|(_, f)| f);
    let built = build_on(&chosen.backend, fallback);
    let (backend, fallback, (model_box, config)) = match (built, &chosen.fallback) {
        (Ok(built), _) => (chosen.backend.clone(), fallback, built),
        (Err(e), Some((fallback_name, fallback))) => {
            eprintln!(
                "u-runner: {}: {e:#}; the model is built on {fallback_name} instead",
                chosen.name
            );
            (fallback.clone(), None, build_on(fallback, None)?)
        }
        (Err(e), None) => return Err(e),
    };
    opened.backend = Some(
        backend
            .info()
            .into_result()
            .map_err(|e| anyhow!("kernels: {e}"))?,
    );
    // A decoder that reads images needs its encoder; another model (a CLIP text tower) gets
    // one where an architecture declares its family's `.vision`.
    let vision = format!("{}.vision", config.family);
    let image_encoder = match config.image_token {
        u_sdk::NO_IMAGE_TOKEN if !declares(report, &vision) => None,
        _ => Some(image_encoder(
            report,
            &config,
            &watched.weights,
            &backend,
            fallback,
        )?),
    };
    drop(watched);
    for (adapter, path) in &deployment.adapters {
        load_adapter(report, &model_box, adapter, path)?;
    }
    if want == Want::Engine {
        let draft = match &deployment.draft_model {
            Some(path) => Some(draft_model(report, path, &config, &backend, fallback)?),
            None => None,
        };
        opened.engine = Some(start_runner(
            report,
            name,
            Models {
                model: model_box,
                image_encoder,
                draft,
                pipeline: None,
                device: device_name(opened.backend.as_ref()),
            },
            &config,
            opened.tokenizer.clone(),
            deployment,
        )?);
    } else {
        opened.model = Some(model_box);
    }
    opened.built = Some((arch_name, config));
    Ok(opened)
}

/// The index of a diffusers pipeline folder, naming its components.
const MODEL_INDEX: &str = "model_index.json";

/// The components a diffusers pipeline folder's `model_index.json` lists (those not `null`).
fn pipeline_components(dir: &Path) -> Result<(String, Vec<String>)> {
    let path = dir.join(MODEL_INDEX);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let index: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let listed: Vec<String> = index
        .as_object()
        .with_context(|| format!("{} is not a JSON object", path.display()))?
        .iter()
        .filter(|(_, v)| {
            v.as_array()
                .is_some_and(|a| a.iter().all(|x| x.is_string()))
        })
        .map(|(k, _)| k.clone())
        .collect();
    let denoiser = ["unet", "transformer"]
        .into_iter()
        .find(|d| listed.iter().any(|l| l == d))
        .with_context(|| {
            format!(
                "{} lists no denoiser (`unet` or `transformer`)",
                path.display()
            )
        })?;
    Ok((denoiser.to_string(), listed))
}

/// Builds a diffusers pipeline folder (`model_index.json`): its denoiser (`unet/` or
/// `transformer/`) is the model, `vae/` (the decoder, and the encoder where an architecture
/// declares `<family>.encoder`) and `text_encoder/` or `image_encoder/` where listed (a
/// class-conditioned DiT has neither) its components, each built by the architecture declaring
/// its family; the tokenizer comes from `tokenizer/` where listed; `model_index.json`, the
/// `feature_extractor`'s `preprocessor_config.json` and the scheduler's and the components'
/// configuration files (where a component has one) and the tokenizer's `tokenizer_config.json`
/// go to the runner as text. A diffusers ONNX pipeline's decoder is its `vae_decoder/`. A
/// component folder holding only its
/// `config.json` is read from the pipeline's single-file checkpoint ([`single_file`]).
fn build_pipeline(
    report: &LoadReport,
    dir: &Path,
    want: Want,
    status: sandbox::Status,
    deployment: &Deployment,
    name: &str,
) -> Result<Opened> {
    let loaders = inspect::loaders(report);
    let chosen = crate::compute::backend_for(report, deployment)?;
    let (backend, fallback) = (chosen.backend, chosen.fallback.map(|(_, f)| f));
    let part = |component: &str, weights: &WeightSetBox, suffix: &str| {
        let family = weights
            .architecture()
            .into_result()
            .ok()
            .and_then(|a| a.into_option())
            .map(|a| format!("{a}{suffix}"))
            .with_context(|| format!("{}: the `{component}` names no class", dir.display()))?;
        let (arch_name, architecture) = choose_architecture(report, Some(&family), None)?;
        let context = BuildContext {
            weights: weights.clone(),
            family: family.as_str().into(),
            backend: backend.clone(),
            fallback: fallback.clone().into(),
            cache: ROption::RNone,
        };
        let (model, config) = build_model(&arch_name, &architecture, context)?;
        anyhow::Ok((arch_name, model, config))
    };
    let (denoiser, listed) = pipeline_components(dir)?;
    let lists = |component: &str| listed.iter().any(|l| l == component);
    let mut parts = single_file::Components::new(dir, &loaders);
    let (loader, weights) = parts.open(&denoiser)?;
    let (arch_name, unet, config) = part(&denoiser, &weights, "")?;
    let factory = first(report, |i| match i {
        PluginInstance::Tokenizer(t) => Some(t.clone()),
        _ => None,
    });
    let mut tokenizers = Vec::new();
    for name in ["tokenizer", "tokenizer_2", "tokenizer_3"] {
        if let (Some((_, f)), true) = (&factory, lists(name))
            && let Some(t) = build_tokenizer(f, &dir.join(name), &weights)?
        {
            tokenizers.push(u_sdk::PipelineTokenizer {
                name: name.into(),
                tokenizer: t,
            });
        }
    }
    let tokenizer = tokenizers
        .iter()
        .find(|t| t.name.as_str() == "tokenizer")
        .map(|t| t.tokenizer.clone());
    let mut opened = Opened {
        weights,
        loader,
        tokenizer,
        built: None,
        model: None,
        backend: Some(
            backend
                .info()
                .into_result()
                .map_err(|e| anyhow!("kernels: {e}"))?,
        ),
        kernels: None,
        converted_from: None,
        engine: None,
        sandbox: status,
    };
    if want != Want::Engine {
        opened.model = Some(unet);
    } else {
        let mut components = Vec::new();
        let mut configs = Vec::new();
        let encoders = [
            "text_encoder",
            "text_encoder_2",
            "text_encoder_3",
            "image_encoder",
        ]
        .into_iter()
        .filter(|c| lists(c));
        let processor = ["feature_extractor"]
            .into_iter()
            .filter(|c| lists(c))
            .map(|c| (c, dir.join(c).join("preprocessor_config.json")));
        // A diffusers ONNX pipeline names its decoder `vae_decoder` (its `vae_encoder` graph
        // draws the latent inside, so it is not built) and has no component configurations.
        let decoder = ["vae", "vae_decoder"]
            .into_iter()
            .find(|c| lists(c))
            .unwrap_or("vae");
        let component_configs = [denoiser.as_str(), decoder]
            .into_iter()
            .chain(encoders.clone())
            .map(|c| (c, dir.join(c).join("config.json")))
            .chain([("tokenizer", dir.join("tokenizer/tokenizer_config.json"))])
            .filter(|(_, path)| path.is_file());
        let files = [
            ("model_index", dir.join(MODEL_INDEX)),
            ("scheduler", dir.join("scheduler/scheduler_config.json")),
        ]
        .into_iter()
        .chain(processor)
        .chain(component_configs);
        for (component, path) in files {
            configs.push(u_sdk::PipelineConfig {
                component: component.into(),
                json: std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?
                    .into(),
            });
        }
        for component in encoders.chain([decoder]) {
            let (_, weights) = parts.open(component)?;
            let (_, model, built) = part(component, &weights, "")?;
            components.push(u_sdk::PipelineComponent {
                name: component.into(),
                model,
            });
            if declares(report, &format!("{}.encoder", built.family)) {
                let (_, model, _) = part(component, &weights, ".encoder")?;
                components.push(u_sdk::PipelineComponent {
                    name: format!("{component}.encoder").into(),
                    model,
                });
            }
        }
        let models = Models {
            model: unet,
            image_encoder: None,
            draft: None,
            device: device_name(opened.backend.as_ref()),
            pipeline: Some(u_sdk::PipelineParts {
                components: components.into(),
                configs: configs.into(),
                tokenizers: tokenizers.into(),
            }),
        };
        let tokenizer = opened.tokenizer.clone();
        opened.engine = Some(start_runner(
            report, name, models, &config, tokenizer, deployment,
        )?);
    }
    opened.built = Some((arch_name, config));
    Ok(opened)
}

/// The first loaded plugin whose instance `pick` accepts, with its name.
fn first<T>(
    report: &LoadReport,
    pick: impl Fn(&PluginInstance) -> Option<T>,
) -> Option<(String, T)> {
    report
        .loaded
        .iter()
        .find_map(|p| pick(&p.instance).map(|t| (p.verified.manifest.name.clone(), t)))
}

/// The architecture for `family`: the deployment's choice when it names one (which must
/// declare the family), else the one loaded plugin whose signed manifest declares it. Two
/// plugins declaring it without a choice is an error naming both.
fn choose_architecture(
    report: &LoadReport,
    family: Option<&str>,
    choice: Option<&str>,
) -> Result<(String, ArchitectureBox)> {
    let archs: Vec<(&LoadedPlugin, &ArchitectureBox)> = report
        .loaded
        .iter()
        .filter_map(|p| match &p.instance {
            PluginInstance::Architecture(a) => Some((p, a)),
            _ => None,
        })
        .collect();
    let names = |ps: &[&LoadedPlugin]| {
        if ps.is_empty() {
            "none".to_string()
        } else {
            ps.iter()
                .map(|p| {
                    format!(
                        "{} ({})",
                        p.verified.manifest.name,
                        p.verified.manifest.families.join(", ")
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        }
    };
    let all: Vec<&LoadedPlugin> = archs.iter().map(|(p, _)| *p).collect();
    let shown = family.unwrap_or("(unnamed architecture)");
    if let Some(choice) = choice {
        let (p, a) = archs
            .iter()
            .find(|(p, _)| p.verified.manifest.name == choice)
            .ok_or_else(|| {
                anyhow!(
                    "the deployment's [model] architecture is `{choice}`, but no architecture \
                     plugin of that name is loaded (loaded: {})",
                    names(&all)
                )
            })?;
        if let Some(f) = family
            && !p.verified.manifest.builds(f)
        {
            bail!(
                "the deployment's [model] architecture `{choice}` does not declare the model's \
                 family `{f}` (it declares {})",
                p.verified.manifest.families.join(", ")
            );
        }
        return Ok((choice.to_string(), (*a).clone()));
    }
    let claiming: Vec<&(&LoadedPlugin, &ArchitectureBox)> = match family {
        Some(f) => archs
            .iter()
            .filter(|(p, _)| p.verified.manifest.builds(f))
            .collect(),
        None => archs.iter().collect(),
    };
    match claiming.as_slice() {
        [(p, a)] => Ok((p.verified.manifest.name.clone(), (*a).clone())),
        [] => bail!(
            "no architecture plugin in the deployment builds `{shown}` (loaded: {})",
            names(&all)
        ),
        many => bail!(
            "architecture plugins {} all claim the family `{shown}`; name the one to use with \
             `architecture = \"…\"` in the deployment's [model] table",
            many.iter()
                .map(|(p, _)| format!("`{}`", p.verified.manifest.name))
                .collect::<Vec<_>>()
                .join(" and ")
        ),
    }
}

/// The family the opened weights name, and the architecture plugin (name, entry) that builds it.
fn architecture_of(
    report: &LoadReport,
    deployment: &Deployment,
    opened: &Opened,
) -> Result<(Option<String>, String, ArchitectureBox)> {
    let family = opened
        .weights
        .architecture()
        .into_result()
        .map_err(|e| anyhow!("{}: {e}", opened.loader))?
        .into_option()
        .map(|a| a.to_string());
    let (name, architecture) = choose_architecture(
        report,
        family.as_deref(),
        deployment.architecture.as_deref(),
    )?;
    Ok((family, name, architecture))
}

/// Replaces the weights with their architecture plugin's GGUF view (for `quantize` from an HF
/// checkpoint).
fn as_gguf(report: &LoadReport, deployment: &Deployment, opened: &mut Opened) -> Result<()> {
    let (family, name, architecture) = architecture_of(report, deployment, opened)?;
    opened.weights = architecture
        .gguf_view(opened.weights.clone(), family.unwrap_or_default().into())
        .into_result()
        .map_err(|e| anyhow!("{name}: {e}"))?;
    Ok(())
}

/// The draft model of speculative decoding (`[model] draft`): opened by the deployment's
/// loaders, built by the architecture declaring its family, over a KV cache of its own (a
/// second instance of the cache plugin, whose layout is the draft's). It must be a decoder of
/// the served model's vocabulary.
fn draft_model(
    report: &LoadReport,
    path: &Path,
    served: &ModelConfig,
    backend: &BackendBox,
    fallback: Option<&BackendBox>,
) -> Result<ModelBox> {
    let shown = path.display();
    let (loader, weights) = open_weights(path, &inspect::loaders(report))
        .with_context(|| format!("the draft model {shown}"))?;
    let family = weights
        .architecture()
        .into_result()
        .map_err(|e| anyhow!("{loader}: {e}"))?
        .into_option()
        .map(|a| a.to_string());
    let (arch_name, architecture) = choose_architecture(report, family.as_deref(), None)
        .with_context(|| format!("the draft model {shown}"))?;
    let cache = report
        .loaded
        .iter()
        .find(|p| matches!(p.instance, PluginInstance::Cache(_)))
        .map(|p| match p.another_instance() {
            Ok(PluginInstance::Cache(c)) => Ok(c),
            Ok(_) => Err(anyhow!("{}: not a cache the second time", p.path.display())),
            Err(e) => Err(anyhow!("{e}")),
        })
        .transpose()?;
    let (model, config) = build_model(
        &arch_name,
        &architecture,
        BuildContext {
            weights,
            family: family.unwrap_or_default().into(),
            backend: backend.clone(),
            fallback: fallback.cloned().into(),
            cache: cache.into(),
        },
    )
    .with_context(|| format!("the draft model {shown}"))?;
    if config.kind != ModelKind::Decoder || config.vocab_size != served.vocab_size {
        bail!(
            "the draft model {shown} is a {:?} of {} tokens; drafting for this model needs a \
             decoder of its {} tokens",
            config.kind,
            config.vocab_size,
            served.vocab_size
        );
    }
    Ok(model)
}

fn build_model(
    arch_name: &str,
    architecture: &ArchitectureBox,
    context: BuildContext,
) -> Result<(ModelBox, ModelConfig)> {
    let model = match architecture.build(context) {
        RResult::ROk(m) => m,
        RResult::RErr(e) => bail!("{arch_name}: cannot build the model: {e}"),
    };
    let config = model
        .config()
        .into_result()
        .map_err(|e| anyhow!("{arch_name}: {e}"))?;
    Ok((model, config))
}

/// Whether a loaded architecture plugin declares `family`.
fn declares(report: &LoadReport, family: &str) -> bool {
    report.loaded.iter().any(|p| {
        matches!(p.instance, PluginInstance::Architecture(_)) && p.verified.manifest.builds(family)
    })
}

/// The image encoder of a model (a decoder that reads images among its tokens,
/// `config.image_token`, or an embedding model of text and images), built from the same weights
/// by the architecture declaring `<family>.vision` (LLaVA's vision tower and projector, CLIP's
/// vision tower and projection); it must make rows or vectors of the model's width.
fn image_encoder(
    report: &LoadReport,
    config: &ModelConfig,
    weights: &WeightSetBox,
    backend: &BackendBox,
    fallback: Option<&BackendBox>,
) -> Result<ModelBox> {
    let family = format!("{}.vision", config.family);
    let (name, architecture) = choose_architecture(report, Some(&family), None).map_err(|e| {
        anyhow!(
            "`{}` reads images, so its image encoder is needed: {e}",
            config.family
        )
    })?;
    let (encoder, encoded) = build_model(
        &name,
        &architecture,
        BuildContext {
            weights: weights.clone(),
            family: family.as_str().into(),
            backend: backend.clone(),
            fallback: fallback.cloned().into(),
            cache: ROption::RNone,
        },
    )?;
    // A cross-decoder reads the encoder's rows as its context; the others as their own rows.
    let width = match config.kind {
        ModelKind::CrossDecoder => config.context_shape[1],
        _ => config.hidden,
    };
    if encoded.kind != ModelKind::Encoder || encoded.hidden != width {
        bail!(
            "{name}: the `{family}` image encoder is a {:?} model of width {}; `{}` needs an \
             encoder of width {width}",
            encoded.kind,
            encoded.hidden,
            config.family,
        );
    }
    Ok(encoder)
}

/// The task a model of `kind` is served for: a cross-decoder with an image encoder chats
/// about images (Flamingo-style), one without transcribes (Whisper).
fn task_for(kind: ModelKind, has_image_encoder: bool) -> Option<Task> {
    match kind {
        ModelKind::Decoder => Some(Task::TextGeneration),
        ModelKind::Encoder => Some(Task::Embeddings),
        ModelKind::CrossDecoder if has_image_encoder => Some(Task::TextGeneration),
        ModelKind::CrossDecoder => Some(Task::Transcription),
        ModelKind::Denoiser => Some(Task::ImageGeneration),
        ModelKind::Autoencoder => None,
    }
}

/// The models a runner starts with: the served one, its image encoder, its draft model and,
/// for a diffusion pipeline, its other parts; and the device they run on.
struct Models {
    model: ModelBox,
    image_encoder: Option<ModelBox>,
    draft: Option<ModelBox>,
    pipeline: Option<u_sdk::PipelineParts>,
    device: String,
}

/// How reports name the device of `backend`: `"<device> (<backend>)"`.
pub fn device_name(backend: Option<&BackendInfo>) -> String {
    backend.map_or_else(String::new, |b| format!("{} ({})", b.device, b.name))
}

/// Starts the first loaded runner whose signed manifest declares the model's task, with the
/// deployment's serving limits, control vectors, soft prompts and adapter directories.
fn start_runner(
    report: &LoadReport,
    name: &str,
    Models {
        model,
        image_encoder,
        draft,
        pipeline,
        device,
    }: Models,
    config: &ModelConfig,
    tokenizer: Option<TokenizerBox>,
    deployment: &Deployment,
) -> Result<(String, EngineBox)> {
    let serving = &deployment.serving;
    let task = task_for(config.kind, image_encoder.is_some()).ok_or_else(|| {
        anyhow!(
            "no runner task serves a {:?} model (`{}`) yet",
            config.kind,
            config.family
        )
    })?;
    let (runner_name, runner): (String, RunnerBox) = report
        .loaded
        .iter()
        .find_map(|p| match &p.instance {
            PluginInstance::Runner(r) if p.verified.manifest.tasks.contains(&task) => {
                Some((p.verified.manifest.name.clone(), r.clone()))
            }
            _ => None,
        })
        .ok_or_else(|| anyhow!("the deployment loads no runner plugin for the task `{task}`"))?;
    let context = RunnerContext {
        name: name.into(),
        model,
        tokenizer: tokenizer.into(),
        limits: ServingLimits {
            max_running: serving.max_running.unwrap_or(0),
            max_queued: serving.max_queued.unwrap_or(0),
            step_tokens: serving.step_tokens.unwrap_or(0),
            adapter_bytes: serving.adapter_budget_bytes.unwrap_or(0),
        },
        aliases: serving.aliases.iter().map(|a| a.as_str().into()).collect(),
        extras: runner_extras(report, deployment)?.into(),
        adapter_opener: adapter_opener(report, deployment).into(),
        image_encoder: image_encoder.into(),
        draft_model: draft.into(),
        pipeline: pipeline.into(),
        device: device.into(),
    };
    match runner.start(context) {
        RResult::ROk(engine) => Ok((runner_name, engine)),
        RResult::RErr(e) => bail!("{runner_name}: cannot serve `{name}`: {e}"),
    }
}

/// The weights and config text of a file loaded beside the model: a PEFT directory
/// (`adapter_model.safetensors` and `adapter_config.json`), its safetensors file (the config
/// beside it, when there is one), or a GGUF file (its metadata is its config), opened by the
/// deployment's loaders.
fn open_extra(
    loaders: &[(String, u_sdk::LoaderBox)],
    what: &str,
    path: &Path,
) -> Result<(WeightSetBox, String)> {
    let weights_path = match path.is_dir() {
        true => path.join("adapter_model.safetensors"),
        false => path.to_path_buf(),
    };
    let config_path = weights_path.with_file_name("adapter_config.json");
    let config = match weights_path.extension().is_some_and(|e| e == "gguf") {
        true => String::new(),
        false if !path.is_dir() && !config_path.exists() => String::new(),
        false => std::fs::read_to_string(&config_path)
            .with_context(|| format!("{what}: {}", config_path.display()))?,
    };
    let (_, weights) = open_weights(&weights_path, loaders).with_context(|| what.to_string())?;
    Ok((weights, config))
}

/// Opens adapters for the runner at run time: the deployment's loaders, only under its
/// `adapter_dirs` (read-granted, so the sandbox lets the loaders read them).
#[derive(Clone)]
struct DirOpener {
    loaders: Vec<(String, u_sdk::LoaderBox)>,
    dirs: Vec<PathBuf>,
}

impl u_sdk::AdapterOpener for DirOpener {
    fn open(
        &self,
        path: abi_stable::std_types::RStr<'_>,
    ) -> RResult<u_sdk::OpenedAdapter, u_sdk::UError> {
        let path = Path::new(path.as_str());
        let inside =
            std::fs::canonicalize(path).is_ok_and(|p| self.dirs.iter().any(|d| p.starts_with(d)));
        if !inside {
            return RResult::RErr(u_sdk::UError::new(
                u_sdk::ErrorKind::PermissionDenied,
                format!(
                    "{} is not in a directory the deployment allows adapters from ({})",
                    path.display(),
                    self.dirs
                        .iter()
                        .map(|d| d.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        match open_extra(&self.loaders, &format!("adapter {}", path.display()), path) {
            Ok((weights, config)) => RResult::ROk(u_sdk::OpenedAdapter {
                weights,
                config: config.into(),
            }),
            Err(e) => RResult::RErr(u_sdk::UError::invalid(format!("{e:#}"))),
        }
    }
}

/// The runner's adapter opener, when the deployment allows adapter directories.
fn adapter_opener(report: &LoadReport, deployment: &Deployment) -> Option<u_sdk::AdapterOpenerBox> {
    if deployment.adapter_dirs.is_empty() {
        return None;
    }
    let dirs = deployment
        .adapter_dirs
        .iter()
        .map(|d| std::fs::canonicalize(d).unwrap_or_else(|_| d.clone()))
        .collect();
    Some(u_sdk::AdapterOpenerBox::from_value(
        DirOpener {
            loaders: inspect::loaders(report),
            dirs,
        },
        abi_stable::sabi_trait::TD_Opaque,
    ))
}

/// The deployment's control vectors and soft prompts, read for the runner.
fn runner_extras(report: &LoadReport, deployment: &Deployment) -> Result<Vec<RunnerExtra>> {
    let kinds = [
        (
            ExtraKind::ControlVector,
            &deployment.control_vectors,
            "control vector",
        ),
        (
            ExtraKind::SoftPrompt,
            &deployment.soft_prompts,
            "soft prompt",
        ),
    ];
    let mut extras = Vec::new();
    for (kind, list, what) in kinds {
        for (name, path) in list {
            let (weights, config) =
                open_extra(&inspect::loaders(report), &format!("{what} `{name}`"), path)?;
            extras.push(RunnerExtra {
                name: name.as_str().into(),
                kind,
                weights,
                config: config.into(),
            });
        }
    }
    Ok(extras)
}

/// Loads adapter `name` from `path` into `model` (see [`open_extra`] for the forms a path
/// takes: a PEFT directory, its safetensors file, a llama.cpp GGUF LoRA).
fn load_adapter(report: &LoadReport, model: &ModelBox, name: &str, path: &Path) -> Result<()> {
    let start = std::time::Instant::now();
    let (weights, config) = open_extra(
        &inspect::loaders(report),
        &format!("adapter `{name}`"),
        path,
    )?;
    let info = model
        .load_adapter(name.into(), weights, config.as_str().into())
        .into_result()
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    tracing::info!(
        adapter = name,
        rank = info.rank,
        targets = %info.targets.iter().map(|t| t.as_str()).collect::<Vec<_>>().join(","),
        bytes = info.bytes,
        ms = format!("{:.1}", start.elapsed().as_secs_f64() * 1e3),
        "adapter loaded"
    );
    Ok(())
}

/// Opens `model` (a file or folder) with the first of `loaders` that recognises it.
pub fn open_weights(
    model: &Path,
    loaders: &[(String, u_sdk::LoaderBox)],
) -> Result<(String, WeightSetBox)> {
    let file = inspect::model_entry_file(model);
    let path = file.display().to_string();
    let head = read_head(&file);
    let mut chosen = None;
    for (name, loader) in loaders {
        match loader.can_open(path.as_str().into(), head.as_slice().into()) {
            RResult::ROk(true) => {
                chosen = Some((name, loader));
                break;
            }
            RResult::ROk(false) => {}
            RResult::RErr(e) => bail!("{name}: {e}"),
        }
    }
    let (name, loader) = chosen.ok_or_else(|| {
        if loaders.is_empty() {
            anyhow!(
                "no loader plugin is loaded, so {path} cannot be opened: the deployment names \
                 none, or each was refused (the refusals are logged above)"
            )
        } else {
            let names: Vec<&str> = loaders.iter().map(|(n, _)| n.as_str()).collect();
            anyhow!(
                "no loader in the deployment recognises {path} (loaded: {})",
                names.join(", ")
            )
        }
    })?;
    match loader.open(path.as_str().into()) {
        RResult::ROk(w) => Ok((name.clone(), w)),
        RResult::RErr(e) => bail!("{name}: {e}"),
    }
}

fn read_head(file: &Path) -> Vec<u8> {
    use std::io::Read;
    let mut head = Vec::new();
    if let Ok(f) = std::fs::File::open(file) {
        let _ = f.take(4096).read_to_end(&mut head);
    }
    head
}

/// A GGUF file's own vocabulary first; otherwise a `tokenizer.json` in (or beside) the model.
fn build_tokenizer(
    factory: &TokenizerFactoryBox,
    model: &Path,
    weights: &WeightSetBox,
) -> Result<Option<TokenizerBox>> {
    let json: PathBuf = if model.is_dir() {
        model.join("tokenizer.json")
    } else {
        model.with_file_name("tokenizer.json")
    };
    let has_vocab = matches!(
        weights.metadata("tokenizer.ggml.model".into()),
        RResult::ROk(ROption::RSome(_))
    );
    if has_vocab {
        return match factory.build_from_weights(weights.clone()) {
            RResult::ROk(t) => Ok(Some(t)),
            RResult::RErr(e) => bail!("tokenizer from the model's metadata: {e}"),
        };
    }
    if json.is_file() {
        return match factory.build_from_file(json.display().to_string().as_str().into()) {
            RResult::ROk(t) => Ok(Some(t)),
            RResult::RErr(e) => bail!("tokenizer {}: {e}", json.display()),
        };
    }
    Ok(None)
}
