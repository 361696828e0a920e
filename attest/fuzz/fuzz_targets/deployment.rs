//! Fuzzes the deployment manifest parser and what is derived from a parsed one (listeners,
//! warnings, model grants): any text must give `Ok` or a `DeploymentError`, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;
use u_attest::Deployment;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(d) = Deployment::parse(text, Path::new("/fuzz/deployment.toml")) else {
        return;
    };
    let _ = d.listeners();
    let _ = d.warnings();
    if let Some(model) = &d.model {
        let _ = u_attest::deployment::model_grants(model);
    }
    for p in &d.plugins {
        let _ = p.grants.describe();
    }
});
