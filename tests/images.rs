//! Image generation through the signed host (issue #19), on the tiny random-weight Stable
//! Diffusion folder of `tests/fixtures/diffusion_tiny/sd/` (diffusers' layout, made by
//! `gen_diffusion_tiny.py`): loader-safetensors opens each component, arch-diffusion and
//! arch-clip build them, runner-image runs the pipeline. The class-conditioned DiT folder
//! beside it (`dit_pipeline/`) draws the class asked for, by label or by name; the image
//! variations folder (`sd_variations/`, a CLIP image encoder built by arch-vit) varies the
//! image given; the Stable Diffusion 3 folder (`sd3_pipeline/`: an MMDiT, two CLIP text
//! encoders and a T5) and the FLUX folder (`flux_pipeline/`) draw their prompts; a single-file
//! checkpoint in Stable Diffusion's original layout (`sd_single_file/`) draws as `sd/`; a
//! diffusers ONNX pipeline folder (`sd_onnx/`) draws through arch-onnx.
//! - `u-runner image` writes a PNG of the pipeline's size; the same seed gives the same bytes,
//!   another seed another image; an initial image (`--init-image`) is refined; a folder without
//!   its `vae/` and `--steps 0` are clear errors.
//! - Served by `u-runner serve`, the official `openai` client's `images.generate` returns the
//!   same PNG as the command line for the same seed, over TCP and the Unix socket; an edited
//!   prompt hands off from that trajectory (marked approximate); a streamed request reports
//!   every step, then the image; bad requests get 4xx answers.

use base64::Engine as _;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use u_conformance::{
    bin, plugin, root, run,
    serving::{Options, Server, http, post, python_client_both, start_with, terrain_onnx},
    text,
};

fn sd() -> PathBuf {
    root().join("tests/fixtures/diffusion_tiny/sd")
}

const PROMPT: &str = "a photo of a red cat";

fn image(model: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(bin("u-runner"));
    cmd.arg("image")
        .args(["--prompt", PROMPT, "--threads", "2", "--model"])
        .arg(model)
        .arg("--out")
        .arg(out)
        .arg("--deployment")
        .arg(root().join("manifests/dev.toml"))
        .args(extra);
    run(&mut cmd)
}

/// Width and height of a PNG file.
fn png_size(png: &[u8]) -> (u32, u32) {
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "a PNG signature");
    let be = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
    (be(16), be(20))
}

#[test]
fn the_command_line_writes_a_seeded_png() {
    let dir = tempfile::tempdir().unwrap();
    let out = |name: &str| dir.path().join(name);
    let first = image(&sd(), &out("a.png"), &["--steps", "4", "--seed", "7"]);
    assert!(first.status.success(), "{}", text(&first));
    assert!(text(&first).contains("4 steps"), "{}", text(&first));
    let a = std::fs::read(out("a.png")).unwrap();
    assert_eq!(png_size(&a), (32, 32), "the pipeline's own size");
    let again = image(&sd(), &out("b.png"), &["--steps", "4", "--seed", "7"]);
    assert!(again.status.success(), "{}", text(&again));
    assert_eq!(
        a,
        std::fs::read(out("b.png")).unwrap(),
        "same seed, same bytes"
    );
    let other = image(
        &sd(),
        &out("c.png"),
        &["--steps", "2", "--seed", "8", "--width", "48"],
    );
    assert!(other.status.success(), "{}", text(&other));
    assert_eq!(png_size(&std::fs::read(out("c.png")).unwrap()), (48, 32));

    let init = root().join("tests/fixtures/diffusion_tiny/init.png");
    let refined = image(
        &sd(),
        &out("d.png"),
        &[
            "--init-image",
            init.to_str().unwrap(),
            "--strength",
            "0.5",
            "--steps",
            "4",
        ],
    );
    assert!(refined.status.success(), "{}", text(&refined));
    assert_eq!(png_size(&std::fs::read(out("d.png")).unwrap()), (32, 32));

    let zero = image(&sd(), &out("e.png"), &["--steps", "0"]);
    assert!(!zero.status.success());
    assert!(text(&zero).contains("0 steps"), "{}", text(&zero));
    assert!(
        !out("e.png").exists(),
        "nothing is written for a failed run"
    );

    // A pipeline folder without its autoencoder.
    let broken = dir.path().join("broken");
    for part in ["unet", "text_encoder", "tokenizer", "scheduler"] {
        let to = broken.join(part);
        std::fs::create_dir_all(&to).unwrap();
        for f in std::fs::read_dir(sd().join(part)).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, to.join(f.file_name().unwrap())).unwrap();
        }
    }
    std::fs::copy(
        sd().join("model_index.json"),
        broken.join("model_index.json"),
    )
    .unwrap();
    let missing = image(&broken, &out("f.png"), &["--steps", "1"]);
    assert!(!missing.status.success());
    assert!(text(&missing).contains("vae"), "{}", text(&missing));
}

/// A single-file checkpoint in Stable Diffusion's original layout, placed in a diffusers folder
/// that holds only the configuration (`sd_single_file/`, written by `gen_single_file.py`, which
/// checks that diffusers' `from_single_file` reads it as `sd/`), draws what `sd/` draws, byte
/// for byte; without a checkpoint, or with two, the folder is a clear error.
#[test]
fn a_single_file_checkpoint_draws_as_its_diffusers_folder() {
    let dir = tempfile::tempdir().unwrap();
    let out = |name: &str| dir.path().join(name);
    let single = root().join("tests/fixtures/diffusion_tiny/sd_single_file");
    let args = ["--steps", "4", "--seed", "7"];
    let drawn = |model: &Path, name: &str| {
        let run = image(model, &out(name), &args);
        assert!(run.status.success(), "{}: {}", model.display(), text(&run));
        std::fs::read(out(name)).unwrap()
    };
    assert_eq!(drawn(&single, "a.png"), drawn(&sd(), "b.png"));

    let copy = dir.path().join("config_only");
    for entry in std::fs::read_dir(&single).unwrap() {
        let from = entry.unwrap().path();
        let to = copy.join(from.strip_prefix(&single).unwrap());
        match from.is_dir() {
            true => {
                std::fs::create_dir_all(&to).unwrap();
                for f in std::fs::read_dir(&from).unwrap() {
                    let f = f.unwrap().path();
                    std::fs::copy(&f, to.join(f.file_name().unwrap())).unwrap();
                }
            }
            false if from.extension().is_some_and(|e| e == "safetensors") => {}
            false => {
                std::fs::copy(&from, &to).unwrap();
            }
        }
    }
    let none = image(&copy, &out("c.png"), &args);
    assert!(!none.status.success());
    assert!(
        text(&none).contains("holds 0 single-file checkpoints"),
        "{}",
        text(&none)
    );
    for name in ["one.safetensors", "two.safetensors"] {
        std::fs::copy(single.join("tiny-sd-ldm.safetensors"), copy.join(name)).unwrap();
    }
    let two = image(&copy, &out("d.png"), &args);
    assert!(!two.status.success());
    assert!(
        text(&two).contains("holds 2 single-file checkpoints"),
        "{}",
        text(&two)
    );
    assert!(!out("c.png").exists() && !out("d.png").exists());
}

/// A diffusers ONNX pipeline folder (`sd_onnx/`, exported by `gen_onnx_pipeline.py`: graphs,
/// no component configuration) draws its prompt through loader-onnx and arch-onnx: a seeded
/// PNG of the size asked (its default is 512, as diffusers' ONNX pipelines'), the same bytes
/// for the same seed; it cannot start from an image (its exported encoder draws its latent
/// inside the graph, so it is not built).
#[test]
fn a_diffusers_onnx_pipeline_draws_its_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let out = |name: &str| dir.path().join(name);
    let folder = root().join("tests/fixtures/diffusion_tiny/sd_onnx");
    let args = [
        "--steps", "4", "--seed", "3", "--width", "16", "--height", "8",
    ];
    let drawn = |name: &str, extra: &[&str]| {
        let run = image(&folder, &out(name), &[&args[..], extra].concat());
        assert!(run.status.success(), "{}", text(&run));
        std::fs::read(out(name)).unwrap()
    };
    let a = drawn("a.png", &[]);
    assert_eq!(png_size(&a), (16, 8));
    assert_eq!(a, drawn("b.png", &[]), "same seed, same bytes");
    assert_ne!(a, drawn("c.png", &["--negative-prompt", "blurry"]));
    let init = root().join("tests/fixtures/diffusion_tiny/init.png");
    let refined = image(
        &folder,
        &out("d.png"),
        &["--steps", "2", "--init-image", init.to_str().unwrap()],
    );
    assert!(!refined.status.success());
    assert!(
        text(&refined).contains("cannot start from an image"),
        "{}",
        text(&refined)
    );
}

/// `u-runner image` without a prompt, 4 steps at guidance 4, on a pipeline without a text
/// encoder (the class-conditioned DiT, the image variations); on one thread, as the test
/// deployments serve (the last bits follow the thread count).
fn promptless_image(model: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(bin("u-runner"));
    cmd.args(["image", "--threads", "1", "--steps", "4", "--guidance", "4"])
        .arg("--model")
        .arg(model)
        .arg("--out")
        .arg(out)
        .arg("--deployment")
        .arg(root().join("manifests/dev.toml"))
        .args(extra);
    run(&mut cmd)
}

/// `promptless_image` on `folder` with `same` twice — one PNG of `size`, byte for byte — and
/// with `other`, another PNG; the first PNG.
fn alike_and_not(folder: &Path, same: &[&str], other: &[&str], size: (u32, u32)) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let made = |name: &str, args: &[&str]| {
        let out = dir.path().join(name);
        let run = promptless_image(folder, &out, args);
        assert!(run.status.success(), "{args:?}: {}", text(&run));
        std::fs::read(out).unwrap()
    };
    let a = made("a.png", same);
    assert_eq!(png_size(&a), size);
    assert_eq!(a, made("b.png", same), "{same:?} twice: the same bytes");
    assert_ne!(a, made("c.png", other), "{other:?}: another image");
    a
}

/// `promptless_image` on `folder` with `args` fails saying `says`, and writes nothing.
fn refused(folder: &Path, args: &[&str], says: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.png");
    let run = promptless_image(folder, &out, args);
    assert!(!run.status.success(), "{args:?}");
    assert!(text(&run).contains(says), "{args:?}: {}", text(&run));
    assert!(!out.exists(), "nothing is written for a failed run");
}

#[test]
fn a_dit_pipeline_draws_the_class_asked_for() {
    let dit = root().join("tests/fixtures/diffusion_tiny/dit_pipeline");
    let dir = tempfile::tempdir().unwrap();
    let out = |name: &str| dir.path().join(name);
    let class = |label| ["--conditioning", label, "--seed", "5"];
    let a = alike_and_not(&dit, &class("3"), &class("7"), (16, 16));
    // The label's name in `id2label` is the same class.
    let named = promptless_image(
        &dit,
        &out("b.png"),
        &["--prompt", "tiger shark", "--seed", "5"],
    );
    assert!(named.status.success(), "{}", text(&named));
    assert_eq!(a, std::fs::read(out("b.png")).unwrap(), "class 3 by name");
    refused(&dit, &[], "needs a class");
    refused(
        &dit,
        &["--conditioning", "1000"],
        "one class label in 0..1000",
    );
    refused(
        &dit,
        &["--prompt", "a photo of a red cat"],
        "no class is named",
    );

    // A `model_index.json` that lists no denoiser.
    let broken = dir.path().join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(
        broken.join("model_index.json"),
        r#"{"_class_name": "DiTPipeline", "vae": ["diffusers", "AutoencoderKL"]}"#,
    )
    .unwrap();
    refused(&broken, &["--conditioning", "3"], "lists no denoiser");
}

#[test]
fn an_image_variation_pipeline_varies_the_image_given() {
    let folder = root().join("tests/fixtures/diffusion_tiny/sd_variations");
    let source = root().join("tests/fixtures/diffusion_tiny/init.png");
    let image = source.to_str().unwrap();
    let seeded = |seed| ["--init-image", image, "--seed", seed];
    let a = alike_and_not(&folder, &seeded("5"), &seeded("6"), (32, 32));
    refused(
        &folder,
        &["--init-image", image, "--prompt", "a cat"],
        "reads only the image",
    );
    refused(&folder, &[], "needs the image to vary");

    // Served: the openai client's `images.create_variation` uploads the image (multipart) and
    // gets the command line's PNG for the same seed.
    let server = serve_model(
        &folder,
        "loader-safetensors",
        &["arch-vit", "arch-diffusion", "runner-image"],
    );
    let script = r#"
import json, os
c = openai_client()
with open(os.environ["U_IMAGE"], "rb") as f:
    r = c.images.create_variation(image=f, model="sd_variations", response_format="b64_json",
                                  extra_body={"steps": 4, "seed": 5, "guidance_scale": 4})
print(json.dumps({"png": r.data[0].b64_json, "seed": r.data[0].model_extra["seed"]}))
"#;
    for answer in python_client_both(script, &[("U_IMAGE", image)], &server) {
        let served = base64::engine::general_purpose::STANDARD
            .decode(answer["png"].as_str().unwrap())
            .unwrap();
        assert_eq!(answer["seed"], 5);
        assert_eq!(served, a, "served = command line for the same seed");
    }
    // A JSON body is a 400 saying the form is multipart.
    let (status, reply) = post(server.port, "/v1/images/variations", b"{}");
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("multipart"),
        "{reply}"
    );
}

#[test]
fn a_stable_diffusion_3_pipeline_draws_its_prompt() {
    let folder = root().join("tests/fixtures/diffusion_tiny/sd3_pipeline");
    let seeded = ["--prompt", PROMPT, "--seed", "5"];
    let negative = [
        "--prompt",
        PROMPT,
        "--seed",
        "5",
        "--negative-prompt",
        "two dogs!",
    ];
    alike_and_not(&folder, &seeded, &negative, (16, 16));
    let wide = ["--prompt", PROMPT, "--width", "24"];
    alike_and_not(&folder, &wide, &seeded, (24, 16));
}

#[test]
fn a_flux_pipeline_draws_its_prompt() {
    let folder = root().join("tests/fixtures/diffusion_tiny/flux_pipeline");
    let sized = ["--prompt", "two dogs!", "--width", "16", "--height", "16"];
    let seeded = |seed| [&sized[..], &["--seed", seed]].concat();
    alike_and_not(&folder, &seeded("5"), &seeded("6"), (16, 16));
    let negative = [&sized[..], &["--negative-prompt", "blue sky"]].concat();
    refused(&folder, &negative, "no negative prompt");
}

/// `u-runner serve` of `model`, read by `loader`, with the `plugins` it needs beside the
/// test deployment's own.
fn serve_model(model: &Path, loader: &str, plugins: &[&str]) -> Server {
    let extra: String = plugins
        .iter()
        .map(|p| format!("[[plugins]]\npath = \"{}\"\n\n", plugin(p).display()))
        .collect();
    let options = Options {
        plugins: extra,
        ..Options::default()
    };
    start_with(tempfile::tempdir().unwrap(), model, loader, &options)
}

fn server() -> Server {
    serve_model(
        &sd(),
        "loader-safetensors",
        &["arch-clip", "arch-diffusion", "runner-image"],
    )
}

#[test]
fn the_openai_client_generates_images_over_http() {
    let server = server();
    let dir = tempfile::tempdir().unwrap();
    let cli = dir.path().join("cli.png");
    let made = image(&sd(), &cli, &["--steps", "4", "--seed", "11"]);
    assert!(made.status.success(), "{}", text(&made));
    let want = std::fs::read(&cli).unwrap();

    let script = r#"
import base64, json
c = openai_client()
r = c.images.generate(model="sd", prompt="a photo of a red cat", size="32x32",
                      response_format="b64_json", extra_body={"steps": 4, "seed": 11})
two = c.images.generate(model="sd", prompt="a photo of a red cat", n=2,
                        extra_body={"steps": 2, "seed": 3})
print(json.dumps({
    "png": r.data[0].b64_json,
    "seed": r.data[0].model_dump().get("seed"),
    "seeds": [d.model_dump().get("seed") for d in two.data],
    "distinct": two.data[0].b64_json != two.data[1].b64_json,
}))
"#;
    for answer in python_client_both(script, &[], &server) {
        let png = base64::engine::general_purpose::STANDARD
            .decode(answer["png"].as_str().unwrap())
            .unwrap();
        assert_eq!(png, want, "served = command line for the same seed");
        assert_eq!(answer["seed"], 11);
        assert_eq!(answer["seeds"], serde_json::json!([3, 4]));
        assert_eq!(answer["distinct"], true);
    }

    // An edited prompt taking over that trajectory at step 2: approximate, and said to be.
    let (status, reply) = post(
        server.port,
        "/v1/images/generations",
        br#"{"model":"sd","prompt":"two dogs!","size":"32x32","steps":4,"seed":11,
             "handoff_prompt":"a photo of a red cat","handoff_step":2}"#,
    );
    assert_eq!(status, 200, "{reply}");
    let image = &reply["data"][0];
    assert_eq!(
        (&image["approximate"], &image["cached_steps"]),
        (&Value::Bool(true), &2.into())
    );

    // Streamed: a progress event per step, then the image.
    let body = br#"{"model":"sd","prompt":"two dogs!","steps":3,"seed":5,"stream":true}"#;
    let raw = format!(
        "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let (status, reply) = http(server.port, &[raw.as_bytes(), body].concat()).unwrap();
    assert_eq!(status, 200, "{reply}");
    let events: Vec<Value> = reply
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "image_generation.progress",
            "image_generation.progress",
            "image_generation.progress",
            "image_generation.completed"
        ],
        "{reply}"
    );
    assert_eq!(
        (events[2]["step"].as_u64(), events[2]["steps"].as_u64()),
        (Some(3), Some(3))
    );
    assert!(events[3]["b64_json"].as_str().unwrap().len() > 100);

    for (body, status) in [
        (&br#"{"model":"sd","prompt":"x","steps":0}"#[..], 400),
        (
            br#"{"model":"sd","prompt":"x","size":"30x30","steps":1}"#,
            400,
        ),
        (
            br#"{"model":"sd","prompt":"x","size":"4096x4096","steps":1}"#,
            400,
        ),
        (
            br#"{"model":"sd","prompt":"x","response_format":"url"}"#,
            400,
        ),
        (br#"{"model":"nope","prompt":"x"}"#, 404),
        (
            br#"{"model":"sd","prompt":"x","image":"aGVsbG8=","steps":1}"#,
            400,
        ),
        (br#"{"model":"sd""#, 400),
    ] {
        let (got, reply) = post(server.port, "/v1/images/generations", body);
        assert_eq!(got, status, "{}: {reply}", String::from_utf8_lossy(body));
        assert!(reply["error"]["message"].is_string(), "{reply}");
    }
    // The server serves on.
    let (got, _) = post(
        server.port,
        "/v1/images/generations",
        br#"{"model":"sd","prompt":"x","steps":1,"seed":1}"#,
    );
    assert_eq!(got, 200);
}

/// `u-runner image` on the terrain model: no prompt, one step, its difficulty; one thread, as
/// the test deployments serve (the backend's attention splits its keys over the threads when
/// a map's rows are few, so the last bits follow the thread count).
fn terrain_image(out: &Path, extra: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(bin("u-runner"));
    cmd.arg("image")
        .args(["--threads", "1", "--steps", "1", "--model"])
        .arg(terrain_onnx())
        .arg("--out")
        .arg(out)
        .arg("--deployment")
        .arg(root().join("manifests/dev.toml"))
        .args(extra);
    run(&mut cmd)
}

/// Real weights without a pipeline: the terrain UNet of PyPI's `adaptive-terrain-diffusion`
/// (an ONNX file) is read by loader-onnx, run by arch-onnx and sampled in one step by
/// runner-image: a 16-bit grey heightfield from the command line, the same PNG from the openai
/// client for the same seed and difficulty, clear errors for a prompt or many steps.
#[test]
fn the_terrain_model_makes_heightfields() {
    let dir = tempfile::tempdir().unwrap();
    let out = |name: &str| dir.path().join(name);
    let made = terrain_image(&out("t.png"), &["--conditioning", "0.5", "--seed", "3"]);
    assert!(made.status.success(), "{}", text(&made));
    let png = std::fs::read(out("t.png")).unwrap();
    assert_eq!(png_size(&png), (128, 128));
    assert_eq!((png[24], png[25]), (16, 0), "16-bit grey");
    let again = terrain_image(&out("u.png"), &["--conditioning", "0.5", "--seed", "3"]);
    assert!(again.status.success(), "{}", text(&again));
    assert_eq!(
        png,
        std::fs::read(out("u.png")).unwrap(),
        "same seed, same bytes"
    );
    let harder = terrain_image(&out("v.png"), &["--conditioning", "0.9", "--seed", "3"]);
    assert!(harder.status.success(), "{}", text(&harder));
    assert_ne!(png, std::fs::read(out("v.png")).unwrap());

    let variation = terrain_image(
        &out("w.png"),
        &[
            "--conditioning",
            "0.5",
            "--init-image",
            out("t.png").to_str().unwrap(),
            "--strength",
            "0.4",
        ],
    );
    assert!(variation.status.success(), "{}", text(&variation));
    assert_eq!(png_size(&std::fs::read(out("w.png")).unwrap()), (128, 128));

    let prompt = terrain_image(
        &out("x.png"),
        &["--conditioning", "0.5", "--prompt", "alps"],
    );
    assert!(!prompt.status.success());
    assert!(text(&prompt).contains("reads no text"), "{}", text(&prompt));
    let missing = terrain_image(&out("x.png"), &[]);
    assert!(!missing.status.success());
    assert!(
        text(&missing).contains("sigma, difficulty"),
        "{}",
        text(&missing)
    );
    assert!(!out("x.png").exists());

    let server = serve_model(
        &terrain_onnx(),
        "loader-onnx",
        &["arch-onnx", "runner-image"],
    );
    let script = r#"
import json
c = openai_client()
r = c.images.generate(model="terrain_consistency_unet", prompt="",
                      extra_body={"steps": 1, "seed": 3, "conditioning": [0.5]})
print(json.dumps({"png": r.data[0].b64_json}))
"#;
    for answer in python_client_both(script, &[], &server) {
        let served = base64::engine::general_purpose::STANDARD
            .decode(answer["png"].as_str().unwrap())
            .unwrap();
        assert_eq!(served, png, "served = command line for the same seed");
    }
    for (body, status) in [
        (
            &br#"{"model":"terrain_consistency_unet","prompt":"","steps":4,"conditioning":[0.5]}"#[..],
            400,
        ),
        (
            br#"{"model":"terrain_consistency_unet","prompt":"","steps":1,"conditioning":"hard"}"#,
            400,
        ),
        (
            br#"{"model":"terrain_consistency_unet","prompt":"","steps":1,"size":"64x64","conditioning":[0.5]}"#,
            400,
        ),
    ] {
        let (got, reply) = post(server.port, "/v1/images/generations", body);
        assert_eq!(got, status, "{}: {reply}", String::from_utf8_lossy(body));
        assert!(reply["error"]["message"].is_string(), "{reply}");
    }
}
