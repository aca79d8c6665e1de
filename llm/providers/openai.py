"""OpenAI-compatible Chat Completions client (OpenAI, vLLM, llama.cpp, Ollama, LiteLLM...).

The request shape follows the endpoint's compatibility settings (llm/compat.py): the output
limit's name (`max_completion_tokens` by default: OpenAI rejects `max_tokens` for reasoning models
and deprecated it elsewhere, and sending both is rejected too), the content of a tool-call turn,
tool_choice, where the instructions go, and how tool results go back (`tool_results: user` sends
the calls and results as plain text, for templates that drop `role: tool`). The endpoint's
sampling defaults (temperature, top_p) go with every request. A refused request raises a
non-retried ProviderError whose message names the setting to change (compat.refusal_hint).

Streamed (the endpoint's default): the answer is read as server-sent events, its output counted
as it comes (http.OutputMeter), and the connection closed once the call's output limit is
reached, whatever the server does with `max_tokens` (llama-cpp-python ignores it when tools are
offered with `tool_choice: auto`). The usage is the server's own (`stream_options.include_usage`,
the last event) when the stream ends, else the platform's count, marked `counted_by: platform`.

Prompt caching is automatic on a byte-stable prefix (the gateway keeps it so). The request's
cache key, the run, goes out as `prompt_cache_key` so requests of one run reach the same cache
shard; servers that reject unknown fields are configured with send_cache_key=False
(ModelEndpoint.send_cache_key).
"""

from __future__ import annotations

import json
from typing import Any

from llm.compat import Compat, refusal_hint, tool_calls_text, tool_result_text
from llm.providers.http import OutputMeter, complete_call, make_client
from llm.tokens import estimate_input_tokens
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
        sampling: dict[str, float] | None = None,
        stream: bool = False,
    ):
        self.base_url = base_url.rstrip("/")
        self.send_cache_key = send_cache_key
        self.sampling = dict(sampling or {})
        self.stream = stream
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
        return complete_call(
            self._client,
            f"{self.base_url}/chat/completions",
            request,
            headers=self._headers(),
            body=body,
            stream=self.stream,
            provider=PROVIDER,
            secret=self._api_key,
            parse_reply=parse_reply,
            streamed=StreamedAnswer,
            is_token=lambda _name, data: bool(_delta_pieces(data)),
            refusal_hint=lambda detail: refusal_hint(detail, body, self.compat),
        )

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
        body.update(self.sampling)
        if self.stream:
            body["stream"] = True
            if self.compat.stream_usage == "include":
                body["stream_options"] = {"include_usage": True}
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
    as_text = compat.tool_results == "user"
    names = {call.id: call.name for message in messages for call in message.tool_calls} if as_text else {}
    for message in messages:
        turn = message_as_text(message, names) if as_text else message_to_wire(message, compat)
        if (
            turn["role"] == "user"
            and wire
            and wire[-1]["role"] == "user"
            and isinstance(turn["content"], str)
            and isinstance(wire[-1]["content"], str)
        ):
            # The compact records of folded turns follow the run's input (llm/compaction.py), and
            # with `tool_results: user` results follow each other: one user turn, as chat templates
            # that want roles to alternate need, and the same bytes up to the previous record on
            # every call (the cached prefix holds).
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


def message_as_text(message: Message, names: dict[str, str]) -> dict[str, Any]:
    """A turn for servers that drop tool messages (`tool_results: user`): calls and results as
    the conversation's own text, so the model reads the result whatever its template keeps."""
    if message.role == "tool":
        return {"role": "user", "content": tool_result_text(message, names.get(message.tool_call_id, ""))}
    if message.role == "assistant" and message.tool_calls:
        return {"role": "assistant", "content": tool_calls_text(message)}
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


def _delta_pieces(data: Any) -> list[str]:
    """The generated text and tool-call arguments one streamed chunk carries."""
    pieces: list[str] = []
    for choice in (data.get("choices") or []) if isinstance(data, dict) else []:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            pieces.append(delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if function.get("name"):
                pieces.append(function["name"])
            if function.get("arguments"):
                pieces.append(function["arguments"])
    return pieces


class StreamedAnswer:
    """A Chat Completions answer put together from its chunks: text, tool calls by index (id and
    name in the first chunk of each, arguments in pieces), finish reason, and usage if the server
    sends it (the last chunk, with no choices)."""

    def __init__(self, limit: int) -> None:
        self.meter = OutputMeter(limit)
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish = ""
        self.usage: dict[str, Any] | None = None

    def add(self, data: Any) -> None:
        if not isinstance(data, dict):
            return
        if isinstance(data.get("error"), dict):  # some servers report a failure mid-stream so
            raise ProviderError(
                f"{PROVIDER}: the stream ended with an error: {data['error'].get('message', data['error'])}",
                retryable=True,
                sent=True,
                status=200,
            )
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]
        # One pass over the chunk (one per token): what it adds is metered as it is kept.
        meter = self.meter.add
        for choice in data.get("choices") or ():
            delta = choice.get("delta")
            if delta:
                content = delta.get("content")
                if content:
                    self.text.append(content)
                    meter(content)
                for raw in delta.get("tool_calls") or ():
                    call = self.calls.setdefault(raw.get("index", len(self.calls)), {"arguments": []})
                    function = raw.get("function") or {}
                    if raw.get("id"):
                        call["id"] = raw["id"]
                    if function.get("name"):
                        call["name"] = function["name"]
                        meter(function["name"])
                    if function.get("arguments"):
                        call["arguments"].append(function["arguments"])
                        meter(function["arguments"])
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]

    def reply(self, request: ModelRequest, *, cut: bool) -> ModelReply:
        calls = [
            ToolCall(
                id=call.get("id") or f"call_{index}",
                name=call.get("name", ""),
                arguments=parse_arguments("".join(call["arguments"])),
            )
            for index, call in sorted(self.calls.items())
            if call.get("name")
        ]
        if self.usage is not None and not cut:
            usage = parse_usage(self.usage)
        else:
            usage = Usage(
                input_tokens=estimate_input_tokens(request),
                output_tokens=self.meter.tokens,
                counted_by="platform",
            )
        return ModelReply(
            text="".join(self.text),
            tool_calls=calls,
            usage=usage,
            stop_reason="cut_at_output_limit" if cut else self.finish,
        )
