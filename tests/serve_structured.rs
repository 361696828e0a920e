//! Issue 15, structured outputs: `response_format` `json_schema` (OpenAI's nested form and
//! llama.cpp's top-level `schema`), `json_object`, and the `regex` and `grammar` (Lark)
//! extensions, compiled by llguidance in runner-text. On SmolLM2-135M-Instruct with the
//! official `openai` client: 20 schemas (nested objects, arrays, enums, anyOf, required
//! fields, …) asked for all at once beside free requests — every answer validates against its
//! schema with the `jsonschema` package, and the free requests equal their solo runs (the mask
//! stays on its own rows); streamed constrained answers; Anthropic's `output_format` with the
//! official `anthropic` client; a schema llguidance cannot compile is
//! a 400 naming it and the server serves on. Also prints decode tokens/s with a JSON-schema
//! constraint against the same prompt unconstrained, for one client and for sixteen at once
//! (half of them constrained, and all).
//! Schema, regex, grammar and Anthropic answers are checked over the Unix socket too.

use serde_json::{Value, json};
use u_conformance::serving::{Options, post, python_client, python_client_both, start_smollm2};

const NAME: &str = "SmolLM2-135M-Instruct.Q4_1";

const CLIENT: &str = r##"
import json, os, time
from concurrent.futures import ThreadPoolExecutor
import jsonschema, openai, re

MODEL = os.environ["U_MODEL"]
c = openai.OpenAI(base_url=os.environ["U_BASE"], api_key="unused", timeout=300, max_retries=0)
S = lambda n=12: {"type": "string", "maxLength": n}
I = lambda lo=0, hi=999: {"type": "integer", "minimum": lo, "maximum": hi}
def obj(props, required=None, **kw):
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}
SCHEMAS = [
    ("person", obj({"name": S(), "age": I(0, 120)})),
    ("city", obj({"city": S(), "country": S(), "population": I(0, 99999999)})),
    ("color", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("flag", obj({"ok": {"type": "boolean"}})),
    ("book", obj({"title": S(20), "author": obj({"first": S(), "last": S()})})),
    ("tags", obj({"tags": {"type": "array", "items": S(8), "minItems": 1, "maxItems": 3}})),
    ("matrix", obj({"rows": {"type": "array", "items": {"type": "array", "items": I(0, 9), "maxItems": 3}, "maxItems": 2}})),
    ("pet", obj({"kind": {"enum": ["cat", "dog", "fish"]}, "name": S(10), "legs": I(0, 8)})),
    ("id_or_name", obj({"key": {"anyOf": [I(0, 9999), S(10)]}})),
    ("maybe_age", obj({"name": S(), "age": {"anyOf": [I(0, 120), {"type": "null"}]}})),
    ("optional", obj({"name": S(), "nick": S(8)}, required=["name"])),
    ("const", obj({"version": {"const": 2}, "label": S(8)})),
    ("order", obj({"items": {"type": "array", "items": obj({"sku": S(6), "qty": I(1, 9)}), "minItems": 1, "maxItems": 2}, "paid": {"type": "boolean"}})),
    ("point", obj({"x": {"type": "number", "minimum": -100, "maximum": 100}, "y": {"type": "number", "minimum": -100, "maximum": 100}})),
    ("deep", obj({"a": obj({"b": obj({"c": S(6)})})})),
    ("pattern", obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("status", obj({"status": {"enum": ["open", "closed"]}, "count": I(0, 99)})),
    ("ref", {"$defs": {"name": S(10)}, **obj({"first": {"$ref": "#/$defs/name"}, "last": {"$ref": "#/$defs/name"}})}),
    ("list_of_people", obj({"people": {"type": "array", "items": obj({"name": S(8), "age": I(0, 99)}), "maxItems": 2}})),
    ("scalar_array", {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 4}),
]
def ask_schema(item):
    name, schema = item
    r = c.chat.completions.create(model=MODEL, max_tokens=120, temperature=0,
        messages=[{"role": "user", "content": f"Give me a {name.replace('_', ' ')} as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
    text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    try:
        jsonschema.validate(json.loads(text), schema)
        return [name, True, finish, text]
    except Exception as e:
        return [name, False, finish, f"{text!r}: {e}"]
FREE = ["What is a KV cache?", "Name three colors.", "Count to five."]
def ask_free(q):
    return c.chat.completions.create(model=MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "user", "content": q}]).choices[0].message.content
out = {"free_solo": [ask_free(q) for q in FREE]}
with ThreadPoolExecutor(8) as pool:
    free = [pool.submit(ask_free, q) for q in FREE]
    out["schemas"] = list(pool.map(ask_schema, SCHEMAS))
    out["free_batched"] = [f.result() for f in free]

chat = [{"role": "user", "content": "Describe a cat as JSON."}]
r = c.chat.completions.create(model=MODEL, messages=chat, max_tokens=60, temperature=0, response_format={"type": "json_object"})
out["json_object"] = [r.choices[0].message.content, r.choices[0].finish_reason]
rx = "[A-Z]{3}-[0-9]{4}"
r = c.completions.create(model=MODEL, prompt="Flight number:", max_tokens=20, temperature=0,
                         extra_body={"response_format": {"type": "regex", "regex": rx}})
out["regex"] = [r.choices[0].text, bool(re.fullmatch(rx, r.choices[0].text)), r.choices[0].finish_reason]
lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=20,
                              temperature=0, extra_body={"response_format": {"type": "grammar", "grammar": lark}})
out["grammar"] = r.choices[0].message.content
stream_schema = SCHEMAS[7][1]
text = ""
for chunk in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A pet as JSON."}], max_tokens=80,
        temperature=0.8, seed=3, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": stream_schema}}):
    for ch in chunk.choices:
        text += ch.delta.content or ""
jsonschema.validate(json.loads(text), stream_schema)
out["streamed"] = text
import anthropic
a = anthropic.Anthropic(base_url=os.environ["U_BASE"].removesuffix("/v1"), api_key="unused", timeout=300, max_retries=0)
m = a.messages.create(model=MODEL, max_tokens=80, messages=[{"role": "user", "content": "A pet as JSON."}],
                      extra_body={"temperature": 0, "output_format": {"type": "json_schema", "schema": stream_schema}})
jsonschema.validate(json.loads(m.content[0].text), stream_schema)
out["anthropic"] = [m.content[0].text, m.stop_reason]

def refused(rf):
    try:
        c.chat.completions.create(model=MODEL, messages=chat, max_tokens=8, response_format=rf)
        return None
    except openai.APIStatusError as e:
        return [e.status_code, e.body.get("message")]
out["bad"] = [
    refused({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}),
    refused({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}),
    refused({"type": "regex", "regex": "[a-"}),
    refused({"type": "grammar", "grammar": "start: nowhere"}),
]
out["after_bad"] = c.chat.completions.create(model=MODEL, messages=chat, max_tokens=4, temperature=0).usage.completion_tokens

# Decode speed: the same prompt, 96 tokens, free and held to a schema whose answer is long.
long_schema = {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 40, "maxItems": 40}
prompt = [{"role": "user", "content": "List forty animals as a JSON array of strings."}]
def rate(**kw):
    best = 0
    for _ in range(2):
        t = time.perf_counter()
        r = c.chat.completions.create(model=MODEL, messages=prompt, max_tokens=96, temperature=0, **kw)
        best = max(best, r.usage.completion_tokens / (time.perf_counter() - t))
    return [best, r.usage.completion_tokens]
def batch_rate(constrain):
    # Sixteen clients at once (one forward pass per step carries all of them); `constrain(i)`
    # says whether client i is held to the schema.
    def one(i):
        kw = constrained if constrain(i) else {}
        return c.chat.completions.create(model=MODEL, max_tokens=96, temperature=0,
            messages=[{"role": "user", "content": f"List forty animals as a JSON array of strings, client {i}."}], **kw)
    t = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        done = list(pool.map(one, range(16)))
    return [sum(r.usage.completion_tokens for r in done) / (time.perf_counter() - t), sum(r.usage.completion_tokens for r in done)]
constrained = dict(response_format={"type": "json_schema", "json_schema": {"name": "animals", "schema": long_schema}})
out["rate_free"] = rate()
out["rate_schema"] = rate(**constrained)
out["batch_free"] = batch_rate(lambda i: False)
out["batch_half"] = batch_rate(lambda i: i % 2 == 1)
out["batch_schema"] = batch_rate(lambda i: True)
print(json.dumps(out))
"##;

#[test]
fn structured_outputs_follow_their_schema_regex_and_grammar() {
    let server = start_smollm2(&Options::default());
    let v = python_client(
        CLIENT,
        &[("U_MODEL", NAME), ("U_BASE", &server.url())],
        &server,
    );
    eprintln!("client saw {v:#}");
    let schemas = v["schemas"].as_array().unwrap();
    assert_eq!(schemas.len(), 20);
    let failed: Vec<&Value> = schemas.iter().filter(|s| s[1] != true).collect();
    assert!(
        failed.is_empty(),
        "answers not valid against their schema: {failed:#?}"
    );
    for s in schemas {
        assert_eq!(s[2], "stop", "{s}: the grammar ends the answer");
    }
    assert_eq!(
        v["free_batched"], v["free_solo"],
        "free requests beside constrained ones answer as alone"
    );

    let (obj, finish) = (v["json_object"][0].as_str().unwrap(), &v["json_object"][1]);
    assert_eq!(finish, "stop", "{obj}");
    assert!(
        serde_json::from_str::<Value>(obj).unwrap().is_object(),
        "{obj}"
    );
    assert_eq!(v["regex"][1], true, "{}", v["regex"]);
    assert_eq!(v["regex"][2], "stop");
    assert!(
        ["The answer is yes.", "The answer is no."].contains(&v["grammar"].as_str().unwrap()),
        "{}",
        v["grammar"]
    );

    for (bad, what) in
        v["bad"]
            .as_array()
            .unwrap()
            .iter()
            .zip(["JSON schema", "JSON schema", "regex", "grammar"])
    {
        assert_eq!(bad[0], 400, "{bad}");
        assert!(bad[1].as_str().unwrap().contains(what), "{bad}");
    }
    assert_eq!(v["after_bad"], 4, "the server serves on");

    // llama.cpp's form: the schema at the top level of `response_format`.
    let (s, r) = post(
        server.port,
        "/v1/chat/completions",
        json!({"model": NAME, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "A color as JSON."}],
            "response_format": {"type": "json_schema", "schema":
                {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
                 "required": ["color"], "additionalProperties": false}}})
        .to_string()
        .as_bytes(),
    );
    assert_eq!(s, 200, "{r}");
    let answer: Value =
        serde_json::from_str(r["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
    assert!(
        ["red", "blue"].contains(&answer["color"].as_str().unwrap()),
        "{r}"
    );

    for (what, free, schema) in [
        ("one client", "rate_free", "rate_schema"),
        (
            "16 clients, half held to the schema",
            "batch_free",
            "batch_half",
        ),
        (
            "16 clients, all held to the schema",
            "batch_free",
            "batch_schema",
        ),
    ] {
        let (f, s) = (v[free][0].as_f64().unwrap(), v[schema][0].as_f64().unwrap());
        eprintln!(
            "decode, {what}: {f:.1} tokens/s free, {s:.1} tokens/s constrained \
             ({} tokens): ratio {:.2}",
            v[schema][1],
            s / f
        );
    }
}

/// The same constraints over TCP and over the Unix socket: a nested schema, a regex, a grammar
/// and Anthropic's `output_format`, each validated.
const BOTH: &str = r##"
import json, re
import jsonschema
MODEL = os.environ["U_MODEL"]
c, a = openai_client(), anthropic_client()
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
          "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}
ask = [{"role": "user", "content": "Describe a cat."}]
r = c.chat.completions.create(model=MODEL, messages=ask, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema, "strict": True}})
jsonschema.validate(json.loads(r.choices[0].message.content), schema)
r = c.chat.completions.create(model=MODEL, messages=ask, max_tokens=20, temperature=0,
        extra_body={"response_format": {"type": "regex", "regex": "[0-9]{3}-[0-9]{4}"}})
assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].message.content), r
r = c.chat.completions.create(model=MODEL, messages=ask, max_tokens=20, temperature=0,
        extra_body={"response_format": {"type": "grammar", "grammar": 'start: "yes" | "no"'}})
assert r.choices[0].message.content in ("yes", "no"), r
m = a.messages.create(model=MODEL, max_tokens=80, messages=ask,
        extra_body={"temperature": 0, "output_format": {"type": "json_schema", "schema": schema}})
jsonschema.validate(json.loads(m.content[0].text), schema)
print(json.dumps({"ok": True, "kind": "unix" if UNIX else "tcp"}))
"##;

#[test]
fn constraints_hold_over_tcp_and_the_unix_socket() {
    let server = start_smollm2(&Options::default());
    let [tcp, unix] = python_client_both(BOTH, &[("U_MODEL", NAME)], &server);
    assert_eq!(tcp, json!({"ok": true, "kind": "tcp"}));
    assert_eq!(unix, json!({"ok": true, "kind": "unix"}));
}
