//! What `deploy/` ships, checked offline (issue 21 in part):
//!
//! - the systemd units pass `systemd-analyze verify` (with their binaries pointed at this build)
//!   and `systemd-analyze security --offline=true` rates their exposure at most
//!   [`MAX_EXPOSURE`] (printed);
//! - the Kubernetes manifests validate against Kubernetes 1.37's schemas
//!   (`kubernetes-validate --strict`, PyPI), the deployment manifest their ConfigMap carries is
//!   admitted by `u-attest inspect --strict` once its paths point at this build, and the Inference
//!   Extension's pool selects the Deployment's pods on its port;
//! - the ZFS helper prints the snapshot and clone it would run, and refuses bad names.

use serde_json::Value;
use std::{path::Path, process::Command};
use u_conformance::{bin, root, run, text};

/// The most exposure `systemd-analyze security` may rate a shipped unit (0 safe … 10 unsafe).
const MAX_EXPOSURE: f64 = 2.0;

/// `unit` with its `/opt/u/bin/` binaries pointed at this build, as `name` in `dir`.
fn unit_here(unit: &str, name: &str, dir: &Path) -> std::path::PathBuf {
    let text = std::fs::read_to_string(root().join(unit)).unwrap();
    let here = format!("{}/", bin("u-runner").parent().unwrap().display());
    let path = dir.join(name);
    std::fs::write(&path, text.replace("/opt/u/bin/", &here)).unwrap();
    path
}

#[test]
fn the_systemd_units_verify_and_expose_little() {
    let dir = tempfile::tempdir().unwrap();
    for (unit, name) in [
        ("deploy/u-runner.service", "u-runner.service"),
        ("deploy/safebox/u-llm@.service", "u-llm@0123abcd.service"),
    ] {
        let path = unit_here(unit, name, dir.path());
        let o = run(Command::new("systemd-analyze").arg("verify").arg(&path));
        assert!(
            o.status.success() && o.stderr.is_empty(),
            "{unit}: {}",
            text(&o)
        );
        let o = run(Command::new("systemd-analyze")
            .args(["security", "--offline=true", "--no-pager"])
            .arg(&path));
        let out = text(&o);
        let score: f64 = out
            .lines()
            .find_map(|l| l.split("Overall exposure level for ").nth(1))
            .and_then(|l| l.split(": ").nth(1))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{unit}: no exposure level in {out}"));
        println!("{unit}: systemd-analyze security exposure {score}");
        assert!(score <= MAX_EXPOSURE, "{unit}: exposure {score}:\n{out}");
    }
}

/// The YAML documents of a manifest file, as JSON (through PyYAML).
fn documents(file: &Path) -> Vec<Value> {
    let script =
        "import json, sys, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))";
    let o = run(Command::new("python3").args(["-c", script]).arg(file));
    assert!(o.status.success(), "{}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn the_kubernetes_manifests_validate_and_their_deployment_is_admitted() {
    let manifests = root().join("deploy/kubernetes/u-runner.yaml");
    let o = run(Command::new("python3")
        .args(["-m", "kubernetes_validate", "--strict", "--no-warn"])
        .arg(&manifests));
    assert!(o.status.success(), "{}", text(&o));
    let docs = documents(&manifests);
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "ConfigMap",
            "Secret",
            "PersistentVolumeClaim",
            "PersistentVolumeClaim",
            "Deployment",
            "Service"
        ]
    );

    // The ConfigMap's deployment, its paths moved to this build, is one u-attest admits.
    let config = docs[0]["data"]["deployment.toml"].as_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (models, kv) = (dir.path().join("models"), dir.path().join("kv"));
    let secrets = dir.path().join("secrets");
    std::fs::create_dir_all(models.join("adapters")).unwrap();
    std::fs::create_dir_all(&kv).unwrap();
    std::fs::create_dir_all(&secrets).unwrap();
    let keys = docs[1]["stringData"]["api-keys"].as_str().unwrap();
    std::fs::write(secrets.join("api-keys"), keys).unwrap();
    let local = config
        .replace(
            "/opt/u/plugins/",
            &format!("{}/", root().join("target/plugins").display()),
        )
        .replace(
            "/opt/u/keys/publisher.pub",
            &root().join("target/dev-keys/dev.pub").display().to_string(),
        )
        .replace("/models", &models.display().to_string())
        .replace("/var/lib/u/kv", &kv.display().to_string())
        .replace("/etc/u/secrets", &secrets.display().to_string());
    let toml = dir.path().join("deployment.toml");
    std::fs::write(&toml, local).unwrap();
    let o = run(Command::new(bin("u-attest"))
        .args(["inspect", "--strict"])
        .arg(&toml));
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("[REFUSED]"), "{}", text(&o));

    // The pod's port and probes, and the Inference Extension's pool over those pods.
    let pod = &docs[4]["spec"]["template"];
    let container = &pod["spec"]["containers"][0];
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/health");
    assert_eq!(
        pod["metadata"]["annotations"]["prometheus.io/path"],
        "/metrics"
    );
    let port = container["ports"][0]["containerPort"].as_u64().unwrap();
    assert!(config.contains(&format!("tcp:0.0.0.0:{port}")));
    let pool = documents(&root().join("deploy/kubernetes/inference-pool.yaml"));
    assert_eq!(pool[0]["kind"], "InferencePool");
    assert_eq!(
        pool[0]["spec"]["selector"]["matchLabels"],
        pod["metadata"]["labels"]
    );
    assert_eq!(
        pool[0]["spec"]["targetPorts"][0]["number"].as_u64(),
        Some(port)
    );
}

#[test]
fn the_zfs_helper_prints_what_it_would_run() {
    let helper = root().join("deploy/zfs-kv-snapshot");
    let o = run(Command::new(&helper).args(["--dry-run", "tank/u/kv", "tank/u/kv-b"]));
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    let snapshot = lines[0]
        .strip_prefix("zfs snapshot tank/u/kv@u-")
        .unwrap_or_else(|| panic!("{out}"));
    assert!(snapshot.ends_with('Z') && snapshot.len() == 16, "{out}");
    assert_eq!(
        lines[1],
        format!("zfs clone tank/u/kv@u-{snapshot} tank/u/kv-b")
    );
    for bad in [
        &["--dry-run", "tank/u/kv@x"][..],
        &["--dry-run"],
        &["--dry-run", "-x"],
    ] {
        let o = run(Command::new(&helper).args(bad));
        assert_eq!(o.status.code(), Some(2), "{bad:?}: {}", text(&o));
    }
}
