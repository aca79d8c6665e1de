"""A deterministic offline model for the demo and tests.

config = {"turns": [...], "latency_ms": 0, "auto_tool": "", "auto_tool_turns": 0}
Turn i answers the request that already holds i assistant messages. A turn is
{"text": "..."} and/or {"tool_calls": [{"name": ..., "arguments": {...}}]}. A string argument of
the form "$input.field" is replaced by that field of the run's input (the first user message,
when it is JSON); "$artifact.N" by the id of the N-th artifact the run's files and the tool results so far named
(what a model copies from a tool's file description into run_python's `artifacts`). After the turns: `auto_tool` is called until `auto_tool_turns` tool results
exist, then the model answers "done" (or `final_text`), or, with `recall`, answers from an early
result the way a model would: {"recall": {"tool": "vault", "pattern": "code=(\\w+)", "text": "the
code is {0}"}} answers `text` with the pattern's groups once some message shows it, and until
then calls read_result on that tool's step, found in its masked result's note or in the compact
record of folded turns (llm/compaction.py).

Turns folded into a record count as turns made (and their results as results): the record says
how many it holds, which is how the model knows where it is in its script.
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
        folded_turns, folded_results = _folded(request)
        turn_index = folded_turns + sum(1 for m in request.messages if m.role == "assistant")
        turns = self.config.get("turns", [])
        if turn_index < len(turns):
            turn = turns[turn_index]
        else:
            turn = self._auto_turn(request, folded_results)
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

    def _auto_turn(self, request: ModelRequest, folded_results: int) -> dict:
        results = folded_results + sum(1 for m in request.messages if m.role == "tool")
        tool = self.config.get("auto_tool", "")
        if tool and results < self.config.get("auto_tool_turns", 0):
            return {"tool_calls": [{"name": tool, "arguments": {"i": results}}]}
        if "recall" in self.config:
            return _recall(request, self.config["recall"])
        return {"text": self.config.get("final_text", "done")}


_FOLDED = re.compile(
    r"^\[platform: (?:steps \d+-\d+|earlier turns) folded(?: earlier)? \((\d+) model turns, (\d+) tool results\)",
    re.M,
)


_STEP_NOTE = re.compile(r"\[platform: (?:older )?result of step (\d+)")


def _records(request: ModelRequest) -> str:
    """The compact records of folded turns: the user messages after the run's input."""
    return "\n".join(m.content for m in request.messages[1:] if m.role == "user")


def _folded(request: ModelRequest) -> tuple[int, int]:
    """Model turns and tool results the compact records hold."""
    found = _FOLDED.findall(_records(request))
    return sum(int(turns) for turns, _ in found), sum(int(results) for _, results in found)


def _recall(request: ModelRequest, recall: dict) -> dict:
    """Answer from an early result once it is shown; until then read it back with read_result."""
    pattern = re.compile(recall["pattern"])
    for message in reversed(request.messages):
        match = pattern.search(message.content or "")
        if match:
            return {"text": recall["text"].format(*match.groups())}
    # Its call still in the conversation, its result masked: the stub names the step.
    calls = {
        c.id
        for m in request.messages
        if m.role == "assistant"
        for c in m.tool_calls
        if c.name == recall["tool"]
    }
    for message in request.messages:
        stub = (
            _STEP_NOTE.search(message.content)
            if message.role == "tool" and message.tool_call_id in calls
            else None
        )
        if stub:
            return {"tool_calls": [{"name": "read_result", "arguments": {"step": int(stub.group(1))}}]}
    tool = re.escape(recall["tool"])
    folded = _records(request)
    # A record line ("step 4 vault {...} -> ...") or the digest's line ("vault: 1 result, step 4").
    where = re.search(rf"^step (\d+) {tool} ", folded, re.M) or re.search(
        rf"^{tool}: \d+ results?, steps? (\d+)", folded, re.M
    )
    if where is None:
        return {"text": f"I cannot find the result of {recall['tool']}"}
    return {"tool_calls": [{"name": "read_result", "arguments": {"step": int(where.group(1))}}]}


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
