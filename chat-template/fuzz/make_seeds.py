#!/usr/bin/env python3
"""Writes the render fuzz target's seeds (chat-template/fuzz/seeds) from the conformance
fixtures: each distinct template on one line (newlines as spaces), then its case's messages and
tools as JSON, the input layout fuzz_targets/render.rs reads."""

import hashlib
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = HERE.parent / "tests" / "fixtures" / "chat_templates.json"


def main() -> None:
    seeds = HERE / "seeds"
    seeds.mkdir(exist_ok=True)
    seen = set()
    for case in json.loads(CASES.read_text())["cases"]:
        template = case.get("template")
        if not template or template in seen:
            continue
        seen.add(template)
        messages = [
            {"role": m.get("role", "user"),
             "content": m["content"] if isinstance(m.get("content"), str) else ""}
            for m in case.get("messages", [])
        ]
        rest = json.dumps({"messages": messages, "tools": case.get("tools") or []})
        data = (template.replace("\n", " ") + "\n" + rest).encode()
        (seeds / hashlib.sha1(data).hexdigest()[:16]).write_bytes(data)


if __name__ == "__main__":
    main()
