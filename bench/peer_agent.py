"""The agent loop every peer of bench/peers.py runs: the same HTTP calls the engine makes.

A run is a conversation with the fake OpenAI-compatible server (tests/fakes/model_servers.py,
"auto agent" mode): each model call answers with one call of the first offered tool until the
conversation holds `tool_turns` tool results, then says "done". Each tool call is an HTTP POST
to bench/tool_server.py with an Idempotency-Key header. With 12 tool turns a run is 25 steps:
13 model calls and 12 tool calls, in the same order as the engine's.

The model is offered the same tool the engine's agent has (`bench__echo`, as the engine names
a tool of server `bench`) and gets the same instructions. Each peer process shares one
httpx.Client (keep-alive, thread-safe) for both servers, as the engine's model client does.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

INSTRUCTIONS = "You help bank support agents."
TOOL_NAME = "bench__echo"
TOOL_REMOTE_NAME = "echo"
TOOL_SCHEMA = {"type": "object", "properties": {"i": {"type": "integer"}}}
TOOLS = [
    {
        "type": "function",
        "function": {"name": TOOL_NAME, "description": "Echo the arguments back.", "parameters": TOOL_SCHEMA},
    }
]
MODEL = "test-model"
TIMEOUT = httpx.Timeout(60.0, connect=5.0)


class StepFailed(RuntimeError):
    """A model or tool call did not answer 200: the benchmark stops, it does not retry."""


def make_client() -> httpx.Client:
    return httpx.Client(
        timeout=TIMEOUT, limits=httpx.Limits(max_connections=256, max_keepalive_connections=128)
    )


def first_messages(run: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": json.dumps({"task": f"bench {run}"})},
    ]


def model_turn(client: httpx.Client, model_url: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One model call: the assistant message to append (with `tool_calls` when it wants a tool)."""
    response = client.post(
        f"{model_url}/chat/completions",
        json={"model": MODEL, "messages": messages, "tools": TOOLS, "max_completion_tokens": 1024},
    )
    if response.status_code != 200:
        raise StepFailed(f"model answered {response.status_code}: {response.text[:300]}")
    message = response.json()["choices"][0]["message"]
    reply: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        reply["tool_calls"] = message["tool_calls"]
    return reply


def tool_turn(client: httpx.Client, tool_url: str, call: dict[str, Any], key: str) -> dict[str, Any]:
    """One tool call over HTTP: the tool message that answers `call`."""
    name = call["function"]["name"]
    if name != TOOL_NAME:
        raise StepFailed(f"the model called an unknown tool {name!r}")
    response = client.post(
        f"{tool_url}/tools/{TOOL_REMOTE_NAME}",
        content=call["function"]["arguments"],
        headers={"Idempotency-Key": key, "Content-Type": "application/json"},
    )
    if response.status_code != 200:
        raise StepFailed(f"tool answered {response.status_code}: {response.text[:300]}")
    return {"role": "tool", "tool_call_id": call["id"], "content": response.text}


def pending_call(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The tool call the last assistant message asked for, if the next step is a tool call."""
    last = messages[-1]
    calls = last.get("tool_calls") if last["role"] == "assistant" else None
    if not calls:
        return None
    if len(calls) != 1:
        raise StepFailed(f"expected one tool call per model turn, got {len(calls)}")
    return calls[0]


def is_done(messages: list[dict[str, Any]]) -> bool:
    last = messages[-1]
    return last["role"] == "assistant" and not last.get("tool_calls")


def check_run(messages: list[dict[str, Any]], steps: int) -> None:
    """A finished run made exactly `steps` calls and ended with the model's final answer."""
    made = sum(1 for m in messages if m["role"] in ("assistant", "tool"))
    if made != steps or not is_done(messages) or messages[-1].get("content") != "done":
        raise StepFailed(f"run ended after {made} steps (expected {steps}): {messages[-1]}")
