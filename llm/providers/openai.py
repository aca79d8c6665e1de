"""OpenAI-compatible Chat Completions client (OpenAI, vLLM, llama.cpp, Ollama, LiteLLM...).

The request shape follows the endpoint's compatibility settings (llm/compat.py): the output
limit's name (`max_completion_tokens` by default: OpenAI rejects `max_tokens` for reasoning models
and deprecated it elsewhere, and sending both is rejected too), the content of a tool-call turn,
tool_choice, and where the instructions go. A refused request raises a non-retried ProviderError
whose message names the setting to change (compat.refusal_hint).

Prompt caching is automatic on a byte-stable prefix (the gateway keeps it so). The request's
cache key, the run, goes out as `prompt_cache_key` so requests of one run reach the same cache
shard; servers that reject unknown fields are configured with send_cache_key=False
(ModelEndpoint.send_cache_key).
"""

from __future__ import annotations

import json
from typing import Any

from llm.compat import Compat, refusal_hint
from llm.providers.http import make_client, post_json
from llm.types import Message, ModelReply, ModelRequest, ProviderError, ToolCall, ToolSpec, Usage

PROVIDER = "openai"


class OpenAIProvider:
    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        model: str,
        *,
        max_tokens_param: str | None = None,
        send_cache_key: bool = True,
        compat: Compat | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.send_cache_key = send_cache_key
        self.model = model
        compat = compat or Compat()
        if max_tokens_param is not None:
            compat = Compat(**{**compat.__dict__, "max_tokens_field": max_tokens_param})
        self.compat = compat
        self.max_tokens_param = compat.max_tokens_field
        self._api_key = api_key
        self._client = make_client()

    def __repr__(self) -> str:  # keep the key out of logs and tracebacks
        return f"OpenAIProvider(base_url={self.base_url!r}, model={self.model!r})"

    def close(self) -> None:
        self._client.close()

    def complete(self, request: ModelRequest) -> ModelReply:
        body = self.build_body(request)
        try:
            data = post_json(
                self._client,
                f"{self.base_url}/chat/completions",
                headers=self._headers(),
                body=body,
                timeout_seconds=request.timeout_seconds,
                provider=PROVIDER,
                secret=self._api_key,
            )
        except ProviderError as exc:
            if exc.retryable or exc.status in (None, 401, 403, 404):
                raise
            # Refused as shaped: the same request would be refused again, so say what to change.
            raise ProviderError(
                f"{exc}; {refusal_hint(str(exc), body, self.compat)}",
                retryable=False,
                sent=exc.sent,
                status=exc.status,
            ) from None
        return parse_reply(data)

    def build_body(self, request: ModelRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            # The request may pin a model; otherwise the provider's configured one is used.
            "model": request.model or self.model,
            "messages": build_messages(request.instructions, request.messages, self.compat),
            self.max_tokens_param: request.max_output_tokens,
        }
        if request.tools:
            body["tools"] = [tool_to_wire(tool) for tool in request.tools]
            if self.compat.tool_choice != "omit":
                body["tool_choice"] = self.compat.tool_choice
        if request.cache_key and self.send_cache_key:
            body["prompt_cache_key"] = request.cache_key
        return body

    def _headers(self) -> dict[str, str]:
        # Local servers often run without a key; an empty Bearer header confuses some of them.
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}


def tool_to_wire(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.input_schema},
    }


def build_messages(
    instructions: str, messages: list[Message], compat: Compat | None = None
) -> list[dict[str, Any]]:
    compat = compat or Compat()
    wire: list[dict[str, Any]] = []
    if compat.system_message == "always" or (instructions and compat.system_message == "system"):
        wire.append({"role": "system", "content": instructions})
    for message in messages:
        turn = message_to_wire(message, compat)
        if turn["role"] == "user" and wire and wire[-1]["role"] == "user":
            # The compact records of folded turns follow the run's input (llm/compaction.py): one
            # user turn, as chat templates that want roles to alternate need, and the same bytes
            # up to the previous record on every call (the cached prefix holds).
            wire[-1]["content"] = f"{wire[-1]['content']}\n\n{turn['content']}"
        else:
            wire.append(turn)
    if instructions and compat.system_message == "in_user":
        # Templates without a system role: the instructions lead the first user message, the same
        # bytes on every call of the run (the cached prefix stays stable).
        first = next((m for m in wire if m["role"] == "user"), None)
        if first is None:
            wire.insert(0, {"role": "user", "content": instructions})
        else:
            first["content"] = f"{instructions}\n\n{first['content']}"
    return wire


def message_to_wire(message: Message, compat: Compat | None = None) -> dict[str, Any]:
    compat = compat or Compat()
    if message.role == "tool":
        # Observations of failed calls already begin with "ERROR:" (the platform writes them so);
        # only a tool's own error result needs the marker here, where is_error has no field.
        marked = not message.is_error or message.content.startswith("ERROR:")
        content = message.content if marked else f"ERROR: {message.content}"
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": content}
    if message.role == "assistant" and message.tool_calls:
        turn: dict[str, Any] = {"role": "assistant"}
        # null (not "") is the canonical "no text" for a tool-calling turn; some servers' templates
        # want a string, some no key at all (compat.tool_call_content).
        if message.content or compat.tool_call_content == "null":
            turn["content"] = message.content or None
        elif compat.tool_call_content == "empty_string":
            turn["content"] = ""
        turn["tool_calls"] = [call_to_wire(call) for call in message.tool_calls]
        return turn
    if message.role in ("user", "assistant"):
        return {"role": message.role, "content": message.content}
    raise ValueError(f"unknown message role {message.role!r}")


def call_to_wire(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
    }


def parse_reply(data: dict[str, Any]) -> ModelReply:
    try:
        choice = data["choices"][0]
        message = choice["message"]
        calls = [parse_call(raw, i) for i, raw in enumerate(message.get("tool_calls") or [])]
    except (KeyError, IndexError, TypeError) as exc:
        raise ProviderError(
            f"{PROVIDER}: malformed reply ({type(exc).__name__}: {exc})",
            retryable=False,
            sent=True,
            status=200,
        ) from None
    return ModelReply(
        text=message.get("content") or "",
        tool_calls=calls,
        usage=parse_usage(data.get("usage")),
        stop_reason=choice.get("finish_reason") or "",
    )


def parse_call(raw: dict[str, Any], index: int = 0) -> ToolCall:
    function = raw["function"]
    # Some local servers leave the id out; the tool message must still answer the call by one.
    call_id = raw.get("id") or f"call_{index}"
    return ToolCall(id=call_id, name=function["name"], arguments=parse_arguments(function.get("arguments")))


def parse_arguments(raw: Any) -> dict:
    """Arguments are a JSON string written by the model, so they can be broken.

    Broken arguments are kept as {"_raw": text} rather than raising: the platform then denies
    the call with a schema error the model can read and fix on its next turn.
    """
    if isinstance(raw, dict):  # some compatible servers already decode it
        return raw
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}  # some servers send "" for a call with no arguments
    try:
        parsed = json.loads(raw)
    except (TypeError, ValueError):
        return {"_raw": str(raw)}
    return parsed if isinstance(parsed, dict) else {"_raw": raw}


def parse_usage(raw: Any) -> Usage:
    if not isinstance(raw, dict):
        return Usage()
    prompt = raw.get("prompt_tokens") or 0
    details = raw.get("prompt_tokens_details") or {}
    cached = min(details.get("cached_tokens") or 0, prompt)
    return Usage(
        input_tokens=prompt - cached,
        cached_input_tokens=cached,
        output_tokens=raw.get("completion_tokens") or 0,
    )
