//! Every scheduler against diffusers on diffusers' own test pattern
//! (`fixtures/schedulers_expected.json`, made by `fixtures/gen_schedulers.py`): the whole loop
//! of `dummy_sample_deter` (4×3×8×8) through the dummy model `sample·t/(t + 1)`, for DDPM
//! (its three fixed variances, with noise), DDIM (linear, scaled-linear and cosine betas; ε, v
//! and sample prediction; leading, trailing and linspace spacing; clipping; η = 0.5 with
//! noise), Euler (linear and Karras σ), ancestral
//! Euler, LCM (with noise) and flow-matching Euler (a fixed shift, and dynamic shifting with μ). The timesteps,
//! σ and `init_noise_sigma` equal diffusers', the final sample is within [`TOL`] of it element
//! by element (relative to the largest value), and its sum and mean, which diffusers' own tests
//! assert, within 1e-4 relative. Noise, where a scheduler adds it, is the fixture's formula.
//! `add_noise` (a flow-matching scheduler's `scale_noise`) at the middle step, where a run from
//! an image begins, equals diffusers' within 1e-5.

use anyhow::{Context, Result};
use serde_json::Value;
use u_diffusion::scheduler::{
    Config, Schedule, Scheduler, ddim::Ddim, flow_match, from_config, from_config_with,
};

/// Final sample against diffusers', per element, relative to the largest value (measured:
/// at most 2.5e-6, DDPM over 20 steps; flow matching 1e-16).
const TOL: f64 = 5e-6;

fn fixture() -> Result<Value> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/schedulers_expected.json");
    Ok(serde_json::from_slice(&std::fs::read(path)?)?)
}

/// diffusers' `dummy_sample_deter`: `arange(768)` as channels × height × width × batch,
/// divided by 768, in batch-first order.
fn dummy_sample() -> Vec<f32> {
    let (b, c, h, w) = (4, 3, 8, 8);
    let n = b * c * h * w;
    let mut out = vec![0f32; n];
    for bi in 0..b {
        for ci in 0..c {
            for hi in 0..h {
                for wi in 0..w {
                    let source = ((ci * h + hi) * w + wi) * b + bi;
                    out[((bi * c + ci) * h + hi) * w + wi] = source as f32 / n as f32;
                }
            }
        }
    }
    out
}

/// The fixture's noise, draw `k`.
fn noise(k: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (0.7 * i as f64 + 1.3 * k as f64 + 1.0).sin() as f32)
        .collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs().max(1e-6)
}

#[test]
fn every_scheduler_equals_diffusers_on_its_test_pattern() -> Result<()> {
    let fixture = fixture()?;
    for case in fixture["cases"].as_array().context("cases")? {
        let name = case["scheduler"].as_str().context("scheduler")?;
        let steps = case["steps"].as_u64().context("steps")? as usize;
        let mut config = case["config"].as_object().context("config")?.clone();
        config.insert("_class_name".into(), Value::from(name));
        let text = Value::Object(config.clone()).to_string();
        let extra = &case["extra"];
        let s: Box<dyn Scheduler> = match extra["eta"].as_f64() {
            Some(eta) => Box::new(Ddim::new(&Config(&config), steps)?.with_eta(eta as f32)?),
            None => from_config(&text, steps, extra["mu"].as_f64())?,
        };
        let what = format!("{name} {text} ({steps} steps)");
        let want_t = floats(&case["timesteps"]);
        assert_eq!(s.timesteps().len(), want_t.len(), "{what}");
        for (i, (&got, &want)) in s.timesteps().iter().zip(&want_t).enumerate() {
            assert!(
                close(got.into(), want, 1e-6),
                "{what}: timestep {i}: {got} vs {want}"
            );
        }
        assert!(
            close(
                s.init_noise_sigma().into(),
                case["init_noise_sigma"].as_f64().unwrap(),
                1e-6
            ),
            "{what}: init_noise_sigma {}",
            s.init_noise_sigma()
        );

        let mut sample: Vec<f32> = dummy_sample()
            .into_iter()
            .map(|x| x * s.init_noise_sigma())
            .collect();
        let mut draws = 0;
        for (i, &t) in s.timesteps().iter().enumerate() {
            let mut x = sample.clone();
            s.scale_model_input(&mut x, i)?;
            let output: Vec<f32> = x.iter().map(|&v| v * t / (t + 1.0)).collect();
            let fresh = match s.needs_noise(i) {
                true => {
                    draws += 1;
                    Some(noise(draws - 1, sample.len()))
                }
                false => None,
            };
            sample = s.step(&output, i, &sample, fresh.as_deref())?;
        }
        assert_eq!(
            draws,
            case["noise_draws"].as_u64().unwrap() as usize,
            "{what}"
        );
        let want = floats(&case["sample"]);
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        let worst = sample
            .iter()
            .zip(&want)
            .map(|(&g, &w)| (f64::from(g) - w).abs() / scale)
            .fold(0f64, f64::max);
        let sum: f64 = sample.iter().map(|v| f64::from(v.abs())).sum();
        eprintln!("{name:32} {steps:3} steps: max |Δ|/max {worst:.1e}, sum {sum:.6}");
        assert!(
            worst <= TOL,
            "{what}: the sample differs by {worst} of its largest value"
        );
        assert!(
            close(sum, case["sum"].as_f64().unwrap(), 1e-4),
            "{what}: sum {sum}"
        );
        let mean = sum / sample.len() as f64;
        assert!(
            close(mean, case["mean"].as_f64().unwrap(), 1e-4),
            "{what}: mean {mean}"
        );

        // Noised to the middle step, where a run from an image would begin.
        let clean = dummy_sample();
        let added = s.add_noise(&clean, &noise(99, clean.len()), steps / 2)?;
        let want = floats(&case["added"]);
        let worst = added
            .iter()
            .zip(&want)
            .map(|(&g, &w)| (f64::from(g) - w).abs())
            .fold(0f64, f64::max);
        assert!(worst <= 1e-5, "{what}: add_noise differs by {worst}");
    }
    Ok(())
}

#[test]
fn what_a_scheduler_cannot_do_is_refused_by_name() -> Result<()> {
    let refused = |config: &str, steps: usize, mu: Option<f64>| -> String {
        match from_config(config, steps, mu) {
            Ok(_) => panic!("{config} ({steps} steps) was accepted"),
            Err(e) => e.to_string(),
        }
    };
    for (config, steps, mu, says) in [
        (
            r#"{"_class_name": "PNDMScheduler"}"#,
            10,
            None,
            "`PNDMScheduler` is not implemented",
        ),
        (r#"{}"#, 10, None, "no `_class_name`"),
        ("[1]", 10, None, "not a JSON object"),
        (
            r#"{"_class_name": "DDIMScheduler"}"#,
            0,
            None,
            "0 inference steps",
        ),
        (
            r#"{"_class_name": "DDIMScheduler"}"#,
            1001,
            None,
            "more than the 1000",
        ),
        (
            r#"{"_class_name": "DDIMScheduler", "thresholding": true}"#,
            10,
            None,
            "`thresholding`",
        ),
        (
            r#"{"_class_name": "LCMScheduler"}"#,
            51,
            None,
            "more than original_inference_steps 50",
        ),
        (
            r#"{"_class_name": "DDPMScheduler", "variance_type": "learned"}"#,
            10,
            None,
            "`learned`",
        ),
        (
            r#"{"_class_name": "DDIMScheduler", "beta_schedule": "sigmoid"}"#,
            10,
            None,
            "sigmoid",
        ),
        (
            r#"{"_class_name": "DDIMScheduler", "steps_offset": 1000}"#,
            1,
            None,
            "outside the 1000 training timesteps",
        ),
        (
            r#"{"_class_name": "EulerDiscreteScheduler", "prediction_type": "x"}"#,
            10,
            None,
            "`x`",
        ),
        (
            r#"{"_class_name": "EulerDiscreteScheduler", "use_beta_sigmas": true}"#,
            10,
            None,
            "`use_beta_sigmas`",
        ),
        (
            r#"{"_class_name": "EulerAncestralDiscreteScheduler", "prediction_type": "sample"}"#,
            10,
            None,
            "prediction_type `sample`",
        ),
        (
            r#"{"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": true}"#,
            10,
            None,
            "needs a finite",
        ),
        (
            r#"{"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": -1}"#,
            10,
            None,
            "not positive",
        ),
        (
            r#"{"_class_name": "DDIMScheduler", "num_train_timesteps": "many"}"#,
            10,
            None,
            "not a whole number",
        ),
    ] {
        let e = refused(config, steps, mu);
        assert!(e.contains(says), "{config}: {e}");
    }

    // Calls that do not fit the schedule.
    let s = from_config(
        r#"{"_class_name": "EulerAncestralDiscreteScheduler"}"#,
        4,
        None,
    )?;
    let x = vec![0.5f32; 8];
    assert!(
        s.step(&x, 4, &x, Some(&x))
            .unwrap_err()
            .to_string()
            .contains("step 4 of a 4-step")
    );
    assert!(
        s.step(&x[..7], 0, &x, Some(&x))
            .unwrap_err()
            .to_string()
            .contains("7 values")
    );
    assert!(
        s.step(&x, 0, &x, None)
            .unwrap_err()
            .to_string()
            .contains("needs noise")
    );
    let mut y = x.clone();
    assert!(s.scale_model_input(&mut y, 9).is_err());
    let c = serde_json::json!({});
    let c = Config(c.as_object().unwrap());
    assert!(Ddim::new(&c, 10)?.with_eta(1.5).is_err());
    let ddim = Ddim::new(&c, 10)?.with_eta(0.3)?;
    assert!(
        ddim.step(&x, 0, &x, None)
            .unwrap_err()
            .to_string()
            .contains("needs noise")
    );
    Ok(())
}

#[test]
fn dynamic_shifting_grows_with_the_image_as_flux_pipelines_compute_it() -> Result<()> {
    let c = serde_json::json!({"base_shift": 0.5, "max_shift": 1.15});
    let c = Config(c.as_object().unwrap());
    assert!((flow_match::mu(&c, 256)? - 0.5).abs() < 1e-12);
    assert!((flow_match::mu(&c, 4096)? - 1.15).abs() < 1e-12);
    // A 1024×1024 FLUX image: (1024 / 16)² tokens.
    assert!((flow_match::mu(&c, 4096)? - flow_match::mu(&c, 64 * 64)?).abs() < 1e-12);
    let bad = serde_json::json!({"base_image_seq_len": 4096, "max_image_seq_len": 256});
    assert!(flow_match::mu(&Config(bad.as_object().unwrap()), 100).is_err());
    Ok(())
}

/// FLUX's pipelines give the σs of a run; diffusers shifts them (in f32) by the dynamic μ of
/// the image's tokens, or by the static `shift`. Only a flow-matching scheduler takes σs.
#[test]
fn given_sigmas_are_shifted_as_flux_pipelines_shift_them() {
    let dynamic = r#"{"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0,
        "use_dynamic_shifting": true, "base_shift": 0.5, "max_shift": 1.15,
        "base_image_seq_len": 256, "max_image_seq_len": 4096}"#;
    // 1024 tokens: 0.5 + (1024 − 256) · 0.65 / 3840.
    let mu = u_diffusion::dynamic_mu(dynamic, 1024)
        .unwrap()
        .expect("dynamic");
    assert!((mu - (0.5 + 768.0 * 0.65 / 3840.0)).abs() < 1e-12, "{mu}");
    let given = vec![1.0, 0.75, 0.5, 0.25];
    let s = from_config_with(dynamic, Schedule::Sigmas(given.clone()), Some(mu)).unwrap();
    let e = mu.exp() as f32;
    for (t, g) in s.timesteps().iter().zip(&given) {
        let sigma = e / (e + (1.0 / *g as f32 - 1.0));
        assert_eq!(*t, sigma * 1000.0);
    }
    let fixed = r#"{"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}"#;
    assert_eq!(u_diffusion::dynamic_mu(fixed, 1024).unwrap(), None);
    let s = from_config_with(fixed, Schedule::Sigmas(given.clone()), None).unwrap();
    assert_eq!(s.timesteps()[1], 3.0 * 0.75 / (1.0 + 2.0 * 0.75) * 1000.0);
    for (config, given, says) in [
        (
            r#"{"_class_name": "DDIMScheduler"}"#,
            given.clone(),
            "not σs",
        ),
        (fixed, vec![1.0, 0.0], "each in (0, 1]"),
        (fixed, Vec::new(), "0 inference steps"),
    ] {
        let e = from_config_with(config, Schedule::Sigmas(given), None)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains(says), "{config}: {e}");
    }
}
