//! Request counters and latency histograms, rendered with the engine's counters as
//! Prometheus text (`GET /metrics`).

use std::{collections::BTreeMap, fmt::Write, sync::Mutex, time::Duration};
use u_sdk::EngineStats;

/// Upper bounds (seconds) of the latency histogram buckets.
const BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

#[derive(Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        for (c, le) in self.counts.iter_mut().zip(BUCKETS) {
            if seconds <= le {
                *c += 1;
            }
        }
        self.sum += seconds;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        for (c, le) in self.counts.iter().zip(BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

#[derive(Default)]
struct Inner {
    requests: BTreeMap<(String, u16), u64>,
    duration: BTreeMap<String, Histogram>,
    first_token: BTreeMap<String, Histogram>,
}

/// What the transport measures itself: answers by route and status, time to the whole answer,
/// time to the first streamed token.
#[derive(Default)]
pub struct Metrics(Mutex<Inner>);

impl Metrics {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records an answered request: its route (a fixed label, never the raw path), status and
    /// time from arrival to the end of the answer.
    pub fn request(&self, route: &str, status: u16, took: Duration) {
        let mut m = self.inner();
        *m.requests.entry((route.to_string(), status)).or_default() += 1;
        m.duration
            .entry(route.to_string())
            .or_default()
            .observe(took.as_secs_f64());
    }

    /// Records the time from a generation request's arrival to its first token.
    pub fn first_token(&self, route: &str, took: Duration) {
        self.inner()
            .first_token
            .entry(route.to_string())
            .or_default()
            .observe(took.as_secs_f64());
    }

    /// Prometheus text exposition of these metrics and the engine's `stats`.
    pub fn render(&self, stats: &EngineStats) -> String {
        let mut out = String::new();
        let m = self.inner();
        out.push_str("# HELP u_http_requests_total HTTP requests answered, by route and status.\n");
        out.push_str("# TYPE u_http_requests_total counter\n");
        for ((route, status), n) in &m.requests {
            let _ = writeln!(
                out,
                "u_http_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        out.push_str(
            "# HELP u_request_duration_seconds Time from request to the end of the answer.\n",
        );
        out.push_str("# TYPE u_request_duration_seconds histogram\n");
        for (route, h) in &m.duration {
            h.render(
                &mut out,
                "u_request_duration_seconds",
                &format!("route=\"{route}\""),
            );
        }
        out.push_str("# HELP u_time_to_first_token_seconds Time from request to the first generated token.\n");
        out.push_str("# TYPE u_time_to_first_token_seconds histogram\n");
        for (route, h) in &m.first_token {
            h.render(
                &mut out,
                "u_time_to_first_token_seconds",
                &format!("route=\"{route}\""),
            );
        }
        let engine: [(&str, &str, &str, u64); 13] = [
            (
                "u_engine_requests_total",
                "counter",
                "Generation requests accepted.",
                stats.requests,
            ),
            (
                "u_engine_rejected_total",
                "counter",
                "Requests refused because the queue was full.",
                stats.rejected,
            ),
            (
                "u_engine_running",
                "gauge",
                "Requests prefilling or decoding.",
                stats.running.into(),
            ),
            (
                "u_engine_queue_depth",
                "gauge",
                "Requests waiting for a slot.",
                stats.queued.into(),
            ),
            (
                "u_engine_queue_capacity",
                "gauge",
                "Most requests that may wait.",
                stats.queue_capacity.into(),
            ),
            (
                "u_prompt_tokens_total",
                "counter",
                "Prompt tokens seen.",
                stats.prompt_tokens,
            ),
            (
                "u_cache_hit_tokens_total",
                "counter",
                "Prompt tokens whose KV came from the cache.",
                stats.cached_tokens,
            ),
            (
                "u_generated_tokens_total",
                "counter",
                "Tokens generated.",
                stats.generated_tokens,
            ),
            (
                "u_forward_passes_total",
                "counter",
                "Batched forward passes run.",
                stats.forward_passes,
            ),
            (
                "u_draft_tokens_total",
                "counter",
                "Tokens drafted by speculative decoding (prompt lookup).",
                stats.draft_tokens,
            ),
            (
                "u_draft_accepted_tokens_total",
                "counter",
                "Drafted tokens the sampler kept.",
                stats.accepted_tokens,
            ),
            (
                "u_image_cache_hits_total",
                "counter",
                "Images whose encoder output came from the cache (no encoding).",
                stats.image_cache_hits,
            ),
            (
                "u_kv_cache_bytes",
                "gauge",
                "Bytes of KV held in memory.",
                stats.kv_bytes,
            ),
        ];
        for (name, kind, help, value) in engine {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        }
        model_counters(stats, &mut out);
        inference_extension(stats, &mut out);
        out
    }
}

/// The model's own counters as `u_model_<name>`; a name that is not Prometheus-safe is left
/// out rather than breaking the page.
fn model_counters(stats: &EngineStats, out: &mut String) {
    for c in &stats.model_counters {
        let safe =
            !c.name.is_empty() && c.name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
        if !safe {
            continue;
        }
        let (name, kind) = (
            format!("u_model_{}", c.name),
            if c.gauge { "gauge" } else { "counter" },
        );
        let help = c.help.replace(['\\', '\n'], " ");
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
            c.value
        );
    }
}

/// The model-server metrics the Kubernetes Gateway API Inference Extension's endpoint picker
/// reads, under vLLM's names: requests running and waiting, the KV cache's fill (a fraction of
/// its byte budget), and which adapters are in use (`max_lora`: the adapters resident, all of
/// which one pass may mix; the value is the time of the reading, as vLLM reports it).
fn inference_extension(stats: &EngineStats, out: &mut String) {
    let usage = match stats.kv_capacity_bytes {
        0 => 0.0,
        cap => (stats.kv_bytes as f64 / cap as f64).min(1.0),
    };
    let gauges = [
        (
            "vllm:num_requests_running",
            "Requests prefilling or decoding.",
            f64::from(stats.running),
        ),
        (
            "vllm:num_requests_waiting",
            "Requests waiting for a slot.",
            f64::from(stats.queued),
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV cache usage (1 means its byte budget is full).",
            usage,
        ),
    ];
    for (name, help, value) in gauges {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
        );
    }
    let list = |names: &[abi_stable::std_types::RString]| {
        names
            .iter()
            .map(|n| label_value(n))
            .collect::<Vec<_>>()
            .join(",")
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let _ = writeln!(
        out,
        "# HELP vllm:lora_requests_info Adapters resident, in use and asked for.\n\
         # TYPE vllm:lora_requests_info gauge\n\
         vllm:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {now}",
        stats.resident_adapters,
        list(&stats.running_adapters),
        list(&stats.waiting_adapters),
    );
    if !stats.device.is_empty() {
        let _ = writeln!(
            out,
            "# HELP u_device_info The compute device the model runs on.\n\
             # TYPE u_device_info gauge\n\
             u_device_info{{device=\"{}\"}} 1",
            label_value(&stats.device)
        );
    }
}

/// `v` escaped for a Prometheus label value (backslash, double quote, newline).
fn label_value(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_cumulative_buckets() {
        let m = Metrics::default();
        m.request("/v1/messages", 200, Duration::from_millis(30));
        m.request("/v1/messages", 200, Duration::from_millis(300));
        m.request("/v1/messages", 429, Duration::from_millis(1));
        m.first_token("/v1/messages", Duration::from_millis(20));
        let text = m.render(&EngineStats {
            queued: 3,
            running: 2,
            cached_tokens: 42,
            kv_bytes: 250,
            kv_capacity_bytes: 1000,
            resident_adapters: 3,
            running_adapters: vec!["sql".into(), "a\"b".into()].into(),
            waiting_adapters: vec!["chat".into()].into(),
            model_counters: vec![
                u_sdk::ModelCounter {
                    name: "expert_misses_total".into(),
                    help: "Experts read in.\nagain".into(),
                    value: 7.0,
                    gauge: false,
                },
                u_sdk::ModelCounter {
                    name: "expert_resident_bytes".into(),
                    help: "Bytes of experts in memory.".into(),
                    value: 1024.0,
                    gauge: true,
                },
                u_sdk::ModelCounter {
                    name: "bad name{x=\"1\"}".into(),
                    help: String::new().into(),
                    value: 1.0,
                    gauge: true,
                },
            ]
            .into(),
            device: "llvmpipe (\"wgpu\")".into(),
            ..Default::default()
        });
        assert!(
            text.contains("\nu_device_info{device=\"llvmpipe (\\\"wgpu\\\")\"} 1\n"),
            "{text}"
        );
        assert!(text.contains(
            "# HELP u_model_expert_misses_total Experts read in. again\n\
             # TYPE u_model_expert_misses_total counter\nu_model_expert_misses_total 7\n"
        ));
        assert!(text.contains(
            "# TYPE u_model_expert_resident_bytes gauge\nu_model_expert_resident_bytes 1024\n"
        ));
        assert!(!text.contains("bad name"), "{text}");
        assert!(text.contains("\nvllm:num_requests_running 2\n"), "{text}");
        assert!(text.contains("\nvllm:num_requests_waiting 3\n"), "{text}");
        assert!(text.contains("\nvllm:kv_cache_usage_perc 0.25\n"), "{text}");
        assert!(
            text.contains(
                "vllm:lora_requests_info{max_lora=\"3\",running_lora_adapters=\"sql,a\\\"b\",waiting_lora_adapters=\"chat\"} "
            ),
            "{text}"
        );
        assert!(text.contains("u_http_requests_total{route=\"/v1/messages\",status=\"200\"} 2"));
        assert!(text.contains("u_http_requests_total{route=\"/v1/messages\",status=\"429\"} 1"));
        assert!(
            text.contains(
                "u_request_duration_seconds_bucket{route=\"/v1/messages\",le=\"0.05\"} 2"
            )
        );
        assert!(
            text.contains(
                "u_request_duration_seconds_bucket{route=\"/v1/messages\",le=\"+Inf\"} 3"
            )
        );
        assert!(text.contains("u_time_to_first_token_seconds_count{route=\"/v1/messages\"} 1"));
        assert!(text.contains("u_engine_queue_depth 3"));
        assert!(text.contains("u_cache_hit_tokens_total 42"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "bad sample line {line}");
        }
    }
}
