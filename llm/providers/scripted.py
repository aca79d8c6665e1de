"""A deterministic offline model for the demo and tests.

config = {"turns": [...], "latency_ms": 0, "auto_tool": "", "auto_tool_turns": 0}
Turn i answers the request that already holds i assistant messages. A turn is
{"text": "..."} and/or {"tool_calls": [{"name": ..., "arguments": {...}}]}. A string argument of
the form "$input.field" is replaced by that field of the run's input (the first user message,
when it is JSON); "$artifact.N" by the id of the N-th artifact the run's files and the tool results so far named
(what a model copies from a tool's file description into run_python's `artifacts`). After the turns: `auto_tool` is called until `auto_tool_turns` tool results
exist, then the model answers "done".
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from llm.tokens import estimate_input_tokens, estimate_text
from llm.types import ModelReply, ModelRequest, ToolCall, Usage


class ScriptedProvider:
    def __init__(self, config: dict):
        self.config = config or {}

    def complete(self, request: ModelRequest) -> ModelReply:
        latency = self.config.get("latency_ms", 0)
        if latency:
            time.sleep(latency / 1000)
        turn_index = sum(1 for m in request.messages if m.role == "assistant")
        turns = self.config.get("turns", [])
        if turn_index < len(turns):
            turn = turns[turn_index]
        else:
            turn = self._auto_turn(request)
        values = _input_values(request)
        values["$artifacts"] = [
            next(g for g in found if g)
            for i, m in enumerate(request.messages)
            if m.role == "tool" or i == 0
            for found in _ARTIFACT_ID.findall(m.content or "")
        ]
        calls = [
            ToolCall(
                id=f"call_{turn_index}_{i}", name=c["name"], arguments=_fill(c.get("arguments", {}), values)
            )
            for i, c in enumerate(turn.get("tool_calls", []))
        ]
        text = turn.get("text", "")
        output = estimate_text(text + json.dumps([c.arguments for c in calls]))
        return ModelReply(
            text=text,
            tool_calls=calls,
            stop_reason="tool_use" if calls else "end_turn",
            usage=Usage(input_tokens=estimate_input_tokens(request), output_tokens=output),
        )

    def _auto_turn(self, request: ModelRequest) -> dict:
        results = sum(1 for m in request.messages if m.role == "tool")
        tool = self.config.get("auto_tool", "")
        if tool and results < self.config.get("auto_tool_turns", 0):
            return {"tool_calls": [{"name": tool, "arguments": {"i": results}}]}
        return {"text": self.config.get("final_text", "done")}


def _input_values(request: ModelRequest) -> dict:
    first = next((m for m in request.messages if m.role == "user"), None)
    try:
        # The files a run was started with are described after its input (llm.gateway.first_message).
        value = json.loads(first.content.split("\n\n[platform: files", 1)[0]) if first else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


_ARTIFACT_ID = re.compile(r'"artifact_id": "([0-9a-f-]{36})"|^artifact ([0-9a-f-]{36}):', re.M)


def _fill(value, values: dict):
    if isinstance(value, str) and value.startswith("$artifact."):
        index = int(value[len("$artifact.") :])
        found = values.get("$artifacts", [])
        return found[index] if index < len(found) else value
    if isinstance(value, str) and value.startswith("$input."):
        current: Any = values
        for part in value[len("$input.") :].split("."):
            current = current.get(part) if isinstance(current, dict) else None
        return current
    if isinstance(value, dict):
        return {k: _fill(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, values) for v in value]
    return value
