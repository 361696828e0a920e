//! Issue 15, tool calling: OpenAI `tools` / `tool_choice` and Anthropic `tools` /
//! `tool_choice` on SmolLM2-135M-Instruct with the official `openai` and `anthropic` clients.
//! `required` and a named tool are held to a grammar of `<tool_call>` blocks whose arguments
//! match the tool's schema: every call parses, names a declared tool and validates against its
//! schema (`jsonschema`), non-streamed and streamed (the `tool_calls` deltas assembled); a
//! follow-up with the assistant's call and a `tool` message renders and is answered; Anthropic
//! answers with a `tool_use` block (and streamed `input_json_delta`); tools with malformed
//! parameter schemas are a 400 and the server serves on. All of it over TCP and over the Unix
//! socket.

use u_conformance::serving::{Options, python_client_both, start_smollm2};

const NAME: &str = "SmolLM2-135M-Instruct.Q4_1";

const CLIENT: &str = r##"
import json, os
import anthropic, jsonschema, openai

MODEL = os.environ["U_MODEL"]
c = openai_client()
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
           "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
out = {}

def check(name, arguments, want=None):
    assert name in SCHEMAS, name
    assert want is None or name == want, (name, want)
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])
    return [name, args]

r = c.chat.completions.create(model=MODEL, messages=ask, tools=tools, tool_choice="required", max_tokens=80, temperature=0)
ch = r.choices[0]
assert ch.finish_reason == "tool_calls", ch
out["required"] = [check(t.function.name, t.function.arguments) for t in ch.message.tool_calls]
first = ch.message.tool_calls[0]

r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2 plus 3?"}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=60, temperature=0)
ch = r.choices[0]
assert ch.finish_reason == "tool_calls", ch
out["named"] = [check(t.function.name, t.function.arguments, "add") for t in ch.message.tool_calls]

calls, finish = {}, None
for chunk in c.chat.completions.create(model=MODEL, messages=ask, tools=tools, tool_choice="required",
        max_tokens=80, temperature=0, stream=True):
    for d in chunk.choices:
        finish = d.finish_reason or finish
        for t in d.delta.tool_calls or []:
            e = calls.setdefault(t.index, {"name": "", "arguments": ""})
            e["name"] += (t.function.name or "") if t.function else ""
            e["arguments"] += (t.function.arguments or "") if t.function else ""
assert finish == "tool_calls", finish
out["streamed"] = [check(e["name"], e["arguments"]) for _, e in sorted(calls.items())]
assert out["streamed"] == out["required"], (out["streamed"], out["required"])

follow = ask + [{"role": "assistant", "content": None, "tool_calls": [
    {"id": first.id, "type": "function", "function": {"name": first.function.name, "arguments": first.function.arguments}}]},
    {"role": "tool", "tool_call_id": first.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
r = c.chat.completions.create(model=MODEL, messages=follow, tools=tools, tool_choice="none", max_tokens=40, temperature=0)
assert r.choices[0].message.content, r
out["follow_up"] = [r.choices[0].message.content, r.usage.prompt_tokens]

r = c.chat.completions.create(model=MODEL, messages=ask, tools=tools, max_tokens=60, temperature=0)
ch = r.choices[0]
for t in ch.message.tool_calls or []:
    check(t.function.name, t.function.arguments)
out["auto"] = [ch.finish_reason, ch.message.content, len(ch.message.tool_calls or [])]

# A plain answer with tools declared streams as it is made: text that cannot start a call is
# sent at once, in several chunks, and adds up to the whole answer's content.
hello = [{"role": "user", "content": "Say hello to Marie in three friendly sentences."}]
r = c.chat.completions.create(model=MODEL, messages=hello, tools=tools, max_tokens=48, temperature=0)
whole = r.choices[0].message
parts = []
for chunk in c.chat.completions.create(model=MODEL, messages=hello, tools=tools, max_tokens=48,
        temperature=0, stream=True):
    for d in chunk.choices:
        if d.delta.content:
            parts.append(d.delta.content)
out["plain_stream"] = [len(parts), bool(whole.tool_calls)]
if not whole.tool_calls:
    assert len(parts) >= 3, parts
    assert "".join(parts).strip() == whole.content.strip(), (parts, whole.content)

a = anthropic_client()
atools = [{"name": t["function"]["name"], "description": t["function"]["description"], "input_schema": t["function"]["parameters"]} for t in tools]
m = a.messages.create(model=MODEL, max_tokens=80, messages=ask, tools=atools, tool_choice={"type": "tool", "name": "get_weather"},
                      extra_body={"temperature": 0})
uses = [b for b in m.content if b.type == "tool_use"]
assert m.stop_reason == "tool_use" and uses, m
out["anthropic"] = [check(b.name, b.input, "get_weather") for b in uses]
with a.messages.stream(model=MODEL, max_tokens=80, messages=ask, tools=atools, tool_choice={"type": "any"}, extra_body={"temperature": 0}) as s:
    final = s.get_final_message()
uses = [b for b in final.content if b.type == "tool_use"]
assert final.stop_reason == "tool_use" and uses, final
out["anthropic_stream"] = [check(b.name, b.input) for b in uses]
whole = a.messages.create(model=MODEL, max_tokens=48, messages=hello, tools=atools, extra_body={"temperature": 0})
deltas = []
with a.messages.stream(model=MODEL, max_tokens=48, messages=hello, tools=atools, extra_body={"temperature": 0}) as s:
    for event in s:
        if event.type == "content_block_delta" and event.delta.type == "text_delta" and event.delta.text:
            deltas.append(event.delta.text)
out["anthropic_plain_stream"] = [len(deltas), whole.stop_reason]
if whole.stop_reason != "tool_use":
    assert len(deltas) >= 3, deltas
    assert "".join(deltas).strip() == whole.content[0].text.strip(), (deltas, whole.content)
m = a.messages.create(model=MODEL, max_tokens=30, extra_body={"temperature": 0}, tools=atools, messages=ask + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": uses[0].name, "input": uses[0].input}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "21 degrees, sunny"}]}],
    tool_choice={"type": "none"})
assert m.content[0].text, m
out["anthropic_follow_up"] = m.content[0].text

def refused(bad):
    try:
        c.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, tools=[bad], tool_choice="required")
        return None
    except openai.APIStatusError as e:
        return [e.status_code, e.body.get("message")]
f = lambda p: {"type": "function", "function": {"name": "f", "parameters": p}}
out["bad"] = [refused(f("object")), refused(f({"type": "array"})), refused(f({"properties": {"x": 3}})),
              refused(f({"type": "object", "properties": {"x": {"type": "no-such-type"}}})),
              refused({"type": "function", "function": {"name": "bad name!"}})]
try:
    a.messages.create(model=MODEL, max_tokens=8, messages=ask, tools=[{"name": "f", "input_schema": {"type": "string"}}])
    out["anthropic_bad"] = None
except anthropic.APIStatusError as e:
    out["anthropic_bad"] = e.status_code
out["after_bad"] = c.chat.completions.create(model=MODEL, messages=ask, max_tokens=4, temperature=0).usage.completion_tokens
print(json.dumps(out))
"##;

#[test]
fn tool_calls_parse_name_a_declared_tool_and_match_its_schema() {
    let server = start_smollm2(&Options::default());
    // Over TCP, then over the Unix socket.
    for out in python_client_both(CLIENT, &[("U_MODEL", NAME)], &server) {
        eprintln!("{}", serde_json::to_string_pretty(&out).unwrap());
        for key in [
            "required",
            "named",
            "streamed",
            "anthropic",
            "anthropic_stream",
        ] {
            assert!(
                out[key].as_array().is_some_and(|a| !a.is_empty()),
                "{key}: {out}"
            );
        }
        for bad in out["bad"].as_array().unwrap() {
            assert_eq!(bad[0], 400, "{bad}");
        }
        assert_eq!(out["anthropic_bad"], 400);
        assert_eq!(out["after_bad"], 4);
        assert_eq!(
            out["plain_stream"][1], false,
            "the plain question was answered with a call, so its streaming went unchecked: {out}"
        );
        assert_ne!(
            out["anthropic_plain_stream"][1], "tool_use",
            "the plain question was answered with a call, so its streaming went unchecked: {out}"
        );
    }
}
