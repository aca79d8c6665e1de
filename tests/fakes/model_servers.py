"""Fake OpenAI-compatible and Anthropic model servers for tests and benchmarks.

They validate request shapes strictly (400 with the provider's error body, like the real APIs)
so client bugs surface here instead of in production, and they report usage the way the real
APIs do, including prompt-cache hits, so budget accounting can be tested end to end.

Token counts are approximate on purpose: len(json)/4. Prompt caches bill the way the providers
document them (per model; a prefix is what every later request that starts with it can read):
- OpenAI: automatic prefix caching. The longest prefix (tools, then messages in order) shared
  with an earlier request is read from cache, counted in 128-token steps from 1,024 tokens
  (`min_cacheable_tokens`); shorter prefixes are not cached. `prompt_cache_key` is accepted.
- Anthropic: only prefixes ending at a `cache_control` breakpoint are written (tools render
  before system, then the messages' blocks). A breakpoint reads the longest cached prefix that
  ends at it or at one of the 20 blocks before it (the documented lookback); what lies between
  that and the last breakpoint is written; what follows it is plain input. Prefixes shorter
  than `min_cacheable_tokens` are neither written nor read.
`min_cacheable_tokens` is 1024 as documented; tests with tiny prompts pass 0.

    fake = FakeOpenAI(tool_turns=2)
    base_url = fake.start()
    fake.queue({"text": "hi"}, {"fault": "429", "retry_after": 2})
    ...
    fake.stop()

Replies: {"text": "...", "tool_calls": [{"name": ..., "arguments": {...}}]}. Faults:
{"fault": "429", "retry_after": 2} (any status code works, e.g. "500", "529"),
{"fault": "timeout", "seconds": 5} (answers after sleeping: received and charged),
{"fault": "bad_request"}, {"fault": "context_too_long"} (a 400 as OpenAI words it). `fake.outage = {"fault": "503"}` answers every request so until it is set
back to None. With an empty queue the server plays an agent: it calls the first
offered tool with {"i": n} until the request holds `tool_turns` tool results, then says "done"
(turns the platform folded into a compact record count too: n goes on from the newest call's i).

Streaming (`"stream": true`): the same answer as server-sent events in each provider's shape, one
word of text or a few characters of tool arguments per event, usage as the provider sends it
(OpenAI: a last chunk when `stream_options.include_usage`; Anthropic: message_start and
message_delta). Reply options for streams: {"runaway": 5000, "token_ms": 2} generates that many
tokens whatever `max_tokens` says (llama-cpp-python with tools offered); {"first_token_delay": 3}
opens the stream and waits before the first token; {"stall_after": 5, "stall_seconds": 3} goes
silent mid-answer; {"ignores_stream": True} answers one JSON body (servers that ignore `stream`);
{"raw": <JSON>} answers that JSON as it is. `fake.streams` records each stream: tokens sent, whether it ended or the
client closed the connection first.

With an empty queue, the auto agent's last answer repeats any `nonce-<hex>` it can see in a tool
result (what `manage.py probe_endpoint` asks of a model), so a server that drops tool messages
(quirk "drops_tool_messages", like llama-cpp-python's chatml-function-calling template) answers
without it, and bills their tokens as not seen.

    python -m tests.fakes.model_servers --kind openai --port 8001 --latency-ms 200 --tool-turns 12
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import itertools
import json
import re
import socket
import threading
import time
from collections import deque
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

HOST = "127.0.0.1"
NONCE = re.compile(r"nonce-[0-9a-f]{6,}")
TEXT_RESULT = "[result of tool"  # how llm.compat.tool_result_text begins a result sent as text
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_STATUS_TYPES = {429: "rate_limit_error", 529: "overloaded_error", 401: "authentication_error"}


class BadRequest(Exception):
    """A malformed request: becomes a 400 (or `status`) with the provider's error body."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def require(condition: bool, message: str) -> None:
    if not condition:
        raise BadRequest(message)


def is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def approx_tokens(value: Any) -> int:
    return max(1, len(json.dumps(value)) // 4)


CACHE_STEP = 128  # OpenAI: cached prefixes grow in 128-token increments
CACHED_PROMPTS = 512  # the latest prompts a prefix may be found in
CACHE_LOOKBACK = 20  # Anthropic: blocks searched before a breakpoint for a cached prefix


class FakeModelServer:
    """Shared machinery; subclasses speak one wire protocol."""

    path = ""
    url_suffix = ""

    def __init__(
        self,
        *,
        tool_turns: int = 0,
        latency_ms: int = 0,
        api_key: str | None = None,
        min_cacheable_tokens: int = 1024,
    ):
        self.tool_turns = tool_turns
        self.min_cacheable_tokens = min_cacheable_tokens
        self.latency_ms = latency_ms
        self.api_key = api_key  # when set, other keys get a 401 (which echoes the bad key, like OpenAI)
        self.requests: list[dict[str, Any]] = []
        self.arrived_at: list[float] = []  # per request, when it came (time.monotonic)
        self.request_headers: list[dict[str, str]] = []
        self.client_ports: list[int] = []  # per request: one port per TCP connection of the client
        self.set_cookie = ""  # when set, every answer carries it (as a CDN in front of a provider does)
        self.replies: list[dict[str, Any]] = []  # charged replies, even if the client gave up
        # Per streamed answer: {"tokens": sent, "ended": True once its last event went out,
        # "closed_early": True when the client closed the connection before that}.
        self.streams: list[dict[str, Any]] = []
        self.in_flight = 0  # requests being answered now
        self.most_in_flight = 0  # the most ever answered at once
        self.base_url = ""
        self._queue: deque[dict[str, Any]] = deque()
        # While set, every request gets this fault (a server that is down: {"fault": "503"}),
        # before the queue is read.
        self.outage: dict[str, Any] | None = None
        self._seen_prefixes: set[str] = set()
        # OpenAI: (model, pieces) of the latest prompts. Bounded, as a provider's cache is: a scan
        # of every prompt ever seen made each request slower than the last, and a long benchmark
        # then measured this server (bench/peers.py runs thousands of calls through one).
        self._cached_prompts: collections.deque[tuple[str, list[str]]] = collections.deque(
            maxlen=CACHED_PROMPTS
        )
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = Starlette(routes=[Route(self.path, self._handle, methods=["POST"])])

    # --- Python API -------------------------------------------------------------------------

    def queue(self, *replies: dict[str, Any]) -> None:
        with self._lock:
            self._queue.extend(replies)

    def start(self, port: int = 0) -> str:
        """Serve on a free 127.0.0.1 port (or `port`: a server coming back where it was) from a
        daemon thread; returns the base URL."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))  # binding here (not in uvicorn) avoids a free-port race
        self._server = uvicorn.Server(self._config())
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            daemon=True,
            name=f"{type(self).__name__}-server",
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{type(self).__name__} failed to start")
            time.sleep(0.01)
        self.base_url = f"http://{HOST}:{sock.getsockname()[1]}{self.url_suffix}"
        return self.base_url

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        self._server = self._thread = None

    def serve_forever(self, port: int) -> None:
        config = self._config()
        config.port = port
        self._server = uvicorn.Server(config)
        self._server.run()

    def _config(self) -> uvicorn.Config:
        return uvicorn.Config(
            self.app,
            host=HOST,
            log_level="warning",
            access_log=False,
            lifespan="off",
            backlog=2048,
            timeout_graceful_shutdown=1,
        )

    # --- request handling -------------------------------------------------------------------

    async def _handle(self, request: Request) -> Response:
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        streaming = False
        try:
            response = await self._answer(request)
            streaming = isinstance(response, StreamingResponse)
            return response
        finally:
            if not streaming:  # a stream counts itself out when its last event is sent
                with self._lock:
                    self.in_flight -= 1

    async def _answer(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return self.error(400, "invalid_request_error", "request body is not valid JSON")
        latency_ms = self.latency_ms  # read before the request shows: a test may change it once it does
        with self._lock:
            self.requests.append(body)
            self.arrived_at.append(time.monotonic())
            self.request_headers.append(dict(request.headers))
            self.client_ports.append(request.client.port if request.client else 0)
        if latency_ms:
            await asyncio.sleep(latency_ms / 1000)
        auth_problem = self.check_auth(request.headers)
        if auth_problem:
            return self.error(401, "authentication_error", auth_problem)
        try:
            self.validate(body, request.headers)
        except BadRequest as exc:
            return self.error(exc.status, "invalid_request_error", str(exc))
        reply = self._next_reply(body)
        fault = str(reply.get("fault", ""))
        if fault == "timeout":
            await asyncio.sleep(float(reply.get("seconds", 5)))
            reply = self.auto_reply(body)
        elif fault == "bad_request":
            return self.error(400, "invalid_request_error", "fake: queued bad_request fault")
        elif fault == "context_too_long":
            return self.error(
                400,
                "invalid_request_error",
                "This model's maximum context length is 8192 tokens. However, your messages "
                "resulted in 9000 tokens. Please reduce the length of the messages.",
            )
        elif fault:
            return self._status_fault(int(fault), reply.get("retry_after"))
        if "raw" in reply:  # answered as given, streamed or not: a server's broken answer
            return JSONResponse(reply["raw"])
        if body.get("stream") and reply.get("runaway"):
            reply = {**reply, "text": "tok " * int(reply["runaway"])}
        payload = self.render(body, reply, self._next_id())
        with self._lock:
            self.replies.append(payload)
        headers = {"set-cookie": self.set_cookie} if self.set_cookie else None
        if body.get("stream") and not reply.get("ignores_stream"):
            record: dict[str, Any] = {"tokens": 0, "ended": False, "closed_early": False}
            with self._lock:
                self.streams.append(record)
            return StreamingResponse(
                self._sse(request, body, payload, reply, record),
                media_type="text/event-stream",
                headers=headers,
            )
        if reply.get("first_token_delay"):
            await asyncio.sleep(float(reply["first_token_delay"]))
        return JSONResponse(payload, headers=headers)

    async def _sse(
        self,
        request: Request,
        body: dict[str, Any],
        payload: dict[str, Any],
        reply: dict[str, Any],
        record: dict,
    ):
        """The answer as server-sent events, paced as the reply asks; records how far it got."""
        token_seconds = float(reply.get("token_ms", 0)) / 1000
        try:
            for name, data, is_token in self.events(body, payload):
                if is_token:
                    if record["tokens"] == 0 and reply.get("first_token_delay"):
                        await asyncio.sleep(float(reply["first_token_delay"]))
                    if record["tokens"] == reply.get("stall_after"):
                        await asyncio.sleep(float(reply.get("stall_seconds", 5)))
                    if token_seconds:
                        await asyncio.sleep(token_seconds)
                    # A closed connection is not an error for the sender (uvicorn only logs it): a
                    # server notices that nobody reads by asking, as llama.cpp's server does.
                    if await request.is_disconnected():
                        return
                    record["tokens"] += 1
                prefix = f"event: {name}\n" if name else ""
                yield f"{prefix}data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"
            record["ended"] = True
        finally:
            record["closed_early"] = not record["ended"]
            with self._lock:
                self.in_flight -= 1

    def _next_reply(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self.outage is not None:
                return self.outage
            if self._queue:
                return self._queue.popleft()
        return self.auto_reply(body)

    def auto_reply(self, body: dict[str, Any]) -> dict[str, Any]:
        # The newest call's i counts the results before it, folded into a record or not.
        results = max([self.count_tool_results(body), *(i + 1 for i in self.call_numbers(body))])
        tools = self.tool_names(body)
        quirks = getattr(self, "quirks", set())
        asked = json.dumps(body.get("messages") or [])
        if "numbers from 1 to 400" in asked:
            # A long answer on request (probe_endpoint's output_limit check): cut at the request's
            # output limit, as servers do, unless the server ignores it.
            numbers = [str(n) for n in range(1, 401)]
            limit = body.get("max_tokens") or body.get("max_completion_tokens") or len(numbers)
            return {
                "text": " ".join(numbers if "ignores_max_tokens" in quirks else numbers[: max(1, limit // 2)])
            }
        if "tools_need_choice" in quirks and body.get("tool_choice") != "auto":
            tools = []  # vLLM without auto tool choice: tools are not offered to the model
        if results < self.tool_turns and tools:
            return {"text": "", "tool_calls": [{"name": tools[0], "arguments": {"i": results}}]}
        # A nonce the model read in a result (what a model's own turns say does not count).
        read = [m for m in self.visible(body) or [] if isinstance(m, dict) and m.get("role") != "assistant"]
        seen = NONCE.findall(json.dumps(read))
        return {"text": f"done {seen[-1]}" if seen else "done"}

    def visible(self, body: dict[str, Any]) -> Any:
        """What the model reads of a request: all of it, unless a quirk drops a part."""
        return body.get("messages")

    def events(self, body: dict[str, Any], payload: dict[str, Any]) -> list[tuple[str, Any, bool]]:
        """(event name, data, whether it carries a token) for a streamed answer."""
        raise NotImplementedError

    def _status_fault(self, status: int, retry_after: Any) -> JSONResponse:
        kind = _STATUS_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        response = self.error(status, kind, f"fake: queued {status} fault")
        if retry_after is not None:
            response.headers["retry-after"] = str(retry_after)
        return response

    def _next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    # --- protocol hooks ---------------------------------------------------------------------

    def check_auth(self, headers: Any) -> str | None:
        raise NotImplementedError

    def validate(self, body: Any, headers: Any) -> None:
        raise NotImplementedError

    def render(self, body: dict[str, Any], reply: dict[str, Any], reply_id: int) -> dict[str, Any]:
        raise NotImplementedError

    def error(self, status: int, kind: str, message: str) -> JSONResponse:
        raise NotImplementedError

    def count_tool_results(self, body: dict[str, Any]) -> int:
        raise NotImplementedError

    def tool_names(self, body: dict[str, Any]) -> list[str]:
        raise NotImplementedError

    def call_numbers(self, body: dict[str, Any]) -> list[int]:
        """The `i` of each tool call this agent made that the request still shows."""
        return [
            arguments["i"]
            for arguments in self.call_arguments(body)
            if isinstance(arguments, dict) and isinstance(arguments.get("i"), int)
        ]

    def call_arguments(self, body: dict[str, Any]) -> list[Any]:
        raise NotImplementedError


# --- OpenAI Chat Completions ------------------------------------------------------------------

_OPENAI_KEYS = {
    "model",
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_completion_tokens",
    "max_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "user",
    "n",
    "response_format",
    "metadata",
    "store",
    "prompt_cache_key",
}


# The differences of the servers banks host themselves, as FakeOpenAI(quirks=...) plays them (each
# answers the way that server family does; llm/compat.py has the setting that adapts to it).
QUIRKS = {
    # older vLLM and Azure API versions: only the legacy output limit's name
    "legacy_max_tokens": "Unrecognized request argument supplied: max_completion_tokens",
    # llama-cpp-python's request model: an assistant turn's content must be a string (422, FastAPI)
    "string_content": "messages.{index}.content: Input should be a valid string",
    # llama-cpp-python 0.3.36 as measured (docs/self-hosted.md): the same refusal of content: null,
    # as an HTTP 500 listing one validation error per message type it tried
    "string_content_500": "7 validation errors: {{'type': 'string_type', 'loc': ('body', 'messages', "
    "{index}, 'ChatCompletionRequestAssistantMessage', 'content'), 'msg': 'Input should be a valid "
    "string', 'input': None}} ...",
    # Gemma's chat template under llama.cpp: no system role (a 500 from the template engine)
    "no_system_role": "Value error: System role not supported",
    # servers that know only some tool_choice values
    "no_tool_choice": "tool_choice is not supported by this server",
    # servers whose tool-call template needs a system message
    "system_required": "a system message is required when tools are given",
    # error bodies as plain text, like a proxy's or a template engine's
    "text_errors": "",
    # llama-cpp-python's chatml-function-calling template: `role: tool` messages are accepted and
    # never reach the model (the prompt's tokens do not grow with the result)
    "drops_tool_messages": "",
    # llama-cpp-python with tools offered and tool_choice auto: max_tokens is not honoured
    "ignores_max_tokens": "",
    # a server that lets the model call tools only with "tool_choice": "auto"
    "tools_need_choice": "",
    # a server that reports no usage
    "no_usage": "",
}


class FakeOpenAI(FakeModelServer):
    path = "/v1/chat/completions"
    url_suffix = "/v1"

    def __init__(self, *, quirks: tuple[str, ...] = (), **kwargs: Any):
        unknown = set(quirks) - set(QUIRKS)
        if unknown:
            raise ValueError(f"unknown quirks {sorted(unknown)}")
        self.quirks = set(quirks)
        super().__init__(**kwargs)

    def check_quirks(self, body: dict[str, Any]) -> None:
        messages = body.get("messages") or []
        if "legacy_max_tokens" in self.quirks and "max_completion_tokens" in body:
            raise BadRequest(QUIRKS["legacy_max_tokens"])
        for quirk, status in (("string_content", 422), ("string_content_500", 500)):
            if quirk in self.quirks:
                for index, message in enumerate(messages):
                    if message.get("role") == "assistant" and not isinstance(message.get("content", ""), str):
                        raise BadRequest(QUIRKS[quirk].format(index=index), status=status)
        if "no_system_role" in self.quirks and any(m.get("role") == "system" for m in messages):
            raise BadRequest(QUIRKS["no_system_role"], status=500)
        if "no_tool_choice" in self.quirks and "tool_choice" in body:
            raise BadRequest(QUIRKS["no_tool_choice"])
        if "system_required" in self.quirks and body.get("tools"):
            if not any(m.get("role") == "system" for m in messages):
                raise BadRequest(QUIRKS["system_required"])

    def check_auth(self, headers: Any) -> str | None:
        if self.api_key is None:
            return None
        given = headers.get("authorization", "").removeprefix("Bearer ")
        return None if given == self.api_key else f"Incorrect API key provided: {given}."

    def error(self, status: int, kind: str, message: str) -> Response:
        if "text_errors" in self.quirks:
            return PlainTextResponse(
                f"{'Internal Server Error' if status >= 500 else 'Bad Request'}: {message}", status
            )
        return JSONResponse(
            {"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status
        )

    def validate(self, body: Any, headers: Any) -> None:
        require(isinstance(body, dict), "request body must be a JSON object")
        self.check_quirks(body)
        unknown = sorted(set(body) - _OPENAI_KEYS)
        require(not unknown, f"Unrecognized request argument supplied: {', '.join(unknown)}")
        require(isinstance(body.get("model"), str) and body["model"] != "", "model is required")
        require(
            not ("max_tokens" in body and "max_completion_tokens" in body),
            "max_tokens and max_completion_tokens cannot both be set",
        )
        for key in ("max_tokens", "max_completion_tokens"):
            require(key not in body or is_positive_int(body[key]), f"{key} must be a positive integer")
        require(isinstance(body.get("stream", False), bool), "stream must be a boolean")
        options = body.get("stream_options")
        require(
            options is None or (body.get("stream") is True and isinstance(options, dict)),
            "stream_options is only allowed when stream is true",
        )
        if "tools" in body:
            validate_openai_tools(body["tools"])
        validate_openai_messages(body.get("messages"))

    def count_tool_results(self, body: dict[str, Any]) -> int:
        # A result sent as a user message (`tool_results: user`) is read as one too.
        return sum(
            1
            for message in body["messages"]
            if message["role"] == "tool"
            or (message["role"] == "user" and str(message.get("content", "")).startswith(TEXT_RESULT))
        )

    def visible(self, body: dict[str, Any]) -> Any:
        messages = body.get("messages") or []
        if "drops_tool_messages" in self.quirks:
            return [m for m in messages if m.get("role") != "tool"]
        return messages

    def events(self, body: dict[str, Any], payload: dict[str, Any]) -> list[tuple[str, Any, bool]]:
        choice = payload["choices"][0]
        message = choice["message"]

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {
                "id": payload["id"],
                "object": "chat.completion.chunk",
                "created": payload["created"],
                "model": payload["model"],
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }

        out: list[tuple[str, Any, bool]] = [("", chunk({"role": "assistant", "content": ""}), False)]
        out += [("", chunk({"content": word}), True) for word in words(message.get("content") or "")]
        for index, call in enumerate(message.get("tool_calls") or []):
            head = {"index": index, "id": call["id"], "type": "function"}
            head["function"] = {"name": call["function"]["name"], "arguments": ""}
            out.append(("", chunk({"tool_calls": [head]}), True))
            arguments = call["function"]["arguments"]
            out += [
                (
                    "",
                    chunk(
                        {"tool_calls": [{"index": index, "function": {"arguments": arguments[i : i + 4]}}]}
                    ),
                    True,
                )
                for i in range(0, len(arguments), 4)
            ]
        out.append(("", chunk({}, choice["finish_reason"]), False))
        if (body.get("stream_options") or {}).get("include_usage") and "usage" in payload:
            usage = {**chunk({}), "choices": [], "usage": payload["usage"]}
            out.append(("", usage, False))
        out.append(("", "[DONE]", False))
        return out

    def tool_names(self, body: dict[str, Any]) -> list[str]:
        return [tool["function"]["name"] for tool in body.get("tools", [])]

    def call_arguments(self, body: dict[str, Any]) -> list[Any]:
        found = []
        for message in body["messages"]:
            for call in message.get("tool_calls") or []:
                try:
                    found.append(json.loads(call["function"]["arguments"]))
                except (KeyError, TypeError, ValueError):
                    continue
        return found

    def openai_cached_tokens(self, body: dict[str, Any]) -> int:
        """Automatic prefix caching: the longest prefix shared with an earlier prompt, in steps."""
        system = list(itertools.takewhile(lambda m: m["role"] == "system", body["messages"]))
        pieces = [json.dumps(message, sort_keys=True) for message in system]
        pieces.append(json.dumps(body.get("tools") or [], sort_keys=True))
        pieces += [json.dumps(message, sort_keys=True) for message in body["messages"][len(system) :]]
        best = 0
        with self._lock:
            for model, earlier in self._cached_prompts:
                if model == body["model"]:
                    best = max(best, common_prefix_chars(pieces, earlier))
            self._cached_prompts.append((body["model"], pieces))
        tokens = best // 4
        floor = self.min_cacheable_tokens
        if floor == 0:  # tiny test prompts: any shared prefix counts, to the token
            return tokens
        if tokens < floor:
            return 0
        return floor + (tokens - floor) // CACHE_STEP * CACHE_STEP

    def render(self, body: dict[str, Any], reply: dict[str, Any], reply_id: int) -> dict[str, Any]:
        calls = [
            {
                "id": f"call_{reply_id}_{index}",
                "type": "function",
                "function": {"name": call["name"], "arguments": openai_arguments(call.get("arguments", {}))},
            }
            for index, call in enumerate(reply.get("tool_calls", []))
        ]
        message: dict[str, Any] = {"role": "assistant", "content": reply.get("text") or None}
        if calls:
            message["tool_calls"] = calls
        prompt = approx_tokens({**body, "messages": self.visible(body)})
        cached = min(self.openai_cached_tokens(body), prompt)
        completion = approx_tokens([message["content"], calls])
        payload = {
            "id": f"chatcmpl-fake-{reply_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
        if "no_usage" in self.quirks:
            del payload["usage"]
        return payload


def words(text: str) -> list[str]:
    """A text in the pieces a server streams it in: one word with its leading space each."""
    return re.findall(r"\s*\S+\s*?", text) or ([text] if text else [])


def common_prefix_chars(pieces: list[str], earlier: list[str]) -> int:
    """Characters two prompts share from the start (whole pieces first, then within one)."""
    shared = 0
    for mine, theirs in zip(pieces, earlier):
        if mine == theirs:
            shared += len(mine)
            continue
        n = 0
        for a, b in zip(mine, theirs):
            if a != b:
                break
            n += 1
        return shared + n
    return shared


def openai_arguments(arguments: Any) -> str:
    # A queued string is sent verbatim so tests can simulate a model writing broken JSON.
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def validate_openai_tools(tools: Any) -> None:
    require(isinstance(tools, list) and len(tools) > 0, "tools: expected a non-empty array")
    names = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        require(isinstance(tool, dict) and tool.get("type") == "function", f"{where}.type must be 'function'")
        function = tool.get("function")
        require(isinstance(function, dict), f"{where}.function is required")
        require(
            set(function) <= {"name", "description", "parameters", "strict"},
            f"{where}.function has unknown fields",
        )
        name = function.get("name")
        require(isinstance(name, str) and bool(TOOL_NAME.match(name)), f"{where}.function.name is invalid")
        require(name not in names, f"{where}: duplicate tool name {name!r}")
        names.add(name)
        require(
            isinstance(function.get("description", ""), str), f"{where}.function.description must be a string"
        )
        parameters = function.get("parameters", {"type": "object"})
        require(
            isinstance(parameters, dict) and parameters.get("type") == "object",
            f"{where}.function.parameters must be a JSON schema of type 'object'",
        )


def validate_openai_messages(messages: Any) -> None:
    require(isinstance(messages, list) and len(messages) > 0, "messages: expected a non-empty array")
    pending: list[str] = []  # calls of the last assistant turn still awaiting a tool message
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        require(isinstance(message, dict), f"{where} must be an object")
        role = message.get("role")
        if role == "tool":
            call_id = message.get("tool_call_id")
            require(
                call_id in pending,
                f"{where}: messages with role 'tool' must be a response to a "
                f"preceding message with 'tool_calls' (tool_call_id {call_id!r})",
            )
            require(isinstance(message.get("content"), str), f"{where}.content must be a string")
            pending.remove(call_id)
            continue
        require(
            not pending,
            f"{where}: an assistant message with 'tool_calls' must be followed by tool "
            f"messages responding to each 'tool_call_id'; missing {pending}",
        )
        if role in ("system", "user"):
            require(set(message) <= {"role", "content", "name"}, f"{where} has unknown fields")
            require(isinstance(message.get("content"), str), f"{where}.content must be a string")
        elif role == "assistant":
            pending = validate_openai_assistant(message, where)
        else:
            raise BadRequest(f"{where}.role {role!r} is invalid")
    require(not pending, f"the last assistant message has unanswered tool_calls {pending}")


def validate_openai_assistant(message: dict[str, Any], where: str) -> list[str]:
    require(set(message) <= {"role", "content", "tool_calls", "name"}, f"{where} has unknown fields")
    content = message.get("content")
    calls = message.get("tool_calls", [])
    require(content is None or isinstance(content, str), f"{where}.content must be a string or null")
    require(isinstance(calls, list), f"{where}.tool_calls must be an array")
    require(content is not None or len(calls) > 0, f"{where}: content is required without tool_calls")
    ids = []
    for index, call in enumerate(calls):
        at = f"{where}.tool_calls[{index}]"
        require(isinstance(call, dict) and call.get("type") == "function", f"{at}.type must be 'function'")
        require(isinstance(call.get("id"), str) and call["id"] != "", f"{at}.id is required")
        function = call.get("function")
        require(
            isinstance(function, dict) and isinstance(function.get("name"), str),
            f"{at}.function.name is required",
        )
        require(isinstance(function.get("arguments"), str), f"{at}.function.arguments must be a JSON string")
        ids.append(call["id"])
    require(len(set(ids)) == len(ids), f"{where}: duplicate tool call ids")
    return ids


# --- Anthropic Messages -----------------------------------------------------------------------

_ANTHROPIC_KEYS = {
    "model",
    "max_tokens",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "metadata",
    "context_management",  # only with the context-management beta header
}
ANTHROPIC_VERSION = "2023-06-01"
# Context editing (Anthropic's beta): the header that enables it, the edit the fake applies, and
# the documented defaults of that edit.
CONTEXT_MANAGEMENT_BETA = "context-management-2025-06-27"
CLEAR_TOOL_USES = "clear_tool_uses_20250919"
CLEAR_DEFAULTS = {"trigger": 100_000, "keep": 3, "clear_at_least": 0}
CLEARED_PLACEHOLDER = "[tool result cleared]"
MAX_CACHE_BREAKPOINTS = 4
# LiteLLM's proxy in front of an OpenAI-compatible server, as FakeAnthropic(quirks=...) plays it:
# list content (system blocks, cache_control) passed on to a server that takes only strings.
ANTHROPIC_QUIRKS = {
    "string_system": "system: Input should be a valid string",
    "no_cache_control": "cache_control: Extra inputs are not permitted",
    # tool_result blocks become `role: tool` messages the server's template drops
    "drops_tool_results": "",
    "ignores_max_tokens": "",
}


class FakeAnthropic(FakeModelServer):
    path = "/v1/messages"

    def __init__(self, *, quirks: tuple[str, ...] = (), **kwargs: Any):
        unknown = set(quirks) - set(ANTHROPIC_QUIRKS)
        if unknown:
            raise ValueError(f"unknown quirks {sorted(unknown)}")
        self.quirks = set(quirks)
        super().__init__(**kwargs)
        self.edited: list[dict[str, Any]] = []  # each request as the model saw it (context editing applied)

    def visible(self, body: dict[str, Any]) -> Any:
        messages = cleared(body)[0].get("messages") or []
        if "drops_tool_results" not in self.quirks:
            return messages
        return [
            {**m, "content": [b for b in m["content"] if b.get("type") != "tool_result"]}
            if isinstance(m.get("content"), list)
            else m
            for m in messages
        ]

    def events(self, body: dict[str, Any], payload: dict[str, Any]) -> list[tuple[str, Any, bool]]:
        usage = payload["usage"]
        start = {**payload, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
        out: list[tuple[str, Any, bool]] = [
            ("message_start", {"type": "message_start", "message": start}, False)
        ]
        for index, block in enumerate(payload["content"]):
            if block["type"] == "text":
                opening: dict[str, Any] = {"type": "text", "text": ""}
                pieces = [{"type": "text_delta", "text": word} for word in words(block["text"])]
            else:
                opening = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
                raw = json.dumps(block["input"])
                pieces = [
                    {"type": "input_json_delta", "partial_json": raw[i : i + 4]}
                    for i in range(0, len(raw), 4)
                ]
            out.append(
                (
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": opening},
                    False,
                )
            )
            out += [
                ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": piece}, True)
                for piece in pieces
            ]
            out.append(("content_block_stop", {"type": "content_block_stop", "index": index}, False))
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": payload["stop_reason"], "stop_sequence": None},
        }
        ending = {**delta, "usage": {"output_tokens": usage["output_tokens"]}}
        if "context_management" in payload:
            ending["context_management"] = payload["context_management"]
        out.append(("message_delta", ending, False))
        out.append(("message_stop", {"type": "message_stop"}, False))
        return out

    def check_auth(self, headers: Any) -> str | None:
        given = headers.get("x-api-key")
        if not given:
            return "x-api-key header is required"
        return None if self.api_key is None or given == self.api_key else "invalid x-api-key"

    def error(self, status: int, kind: str, message: str) -> JSONResponse:
        return JSONResponse(
            {"type": "error", "error": {"type": kind, "message": message}}, status_code=status
        )

    def validate(self, body: Any, headers: Any) -> None:
        require(
            headers.get("anthropic-version") == ANTHROPIC_VERSION,
            f"anthropic-version header must be {ANTHROPIC_VERSION}",
        )
        require(isinstance(body, dict), "request body must be a JSON object")
        unknown = sorted(set(body) - _ANTHROPIC_KEYS)
        require(not unknown, f"{', '.join(unknown)}: Extra inputs are not permitted")
        require(isinstance(body.get("model"), str) and body["model"] != "", "model: Field required")
        require(is_positive_int(body.get("max_tokens")), "max_tokens: Field required (positive integer)")
        require(isinstance(body.get("stream", False), bool), "stream: Input should be a valid boolean")
        if "context_management" in body:
            betas = {b.strip() for b in str(headers.get("anthropic-beta", "")).split(",")}
            require(
                CONTEXT_MANAGEMENT_BETA in betas,
                f"context_management: requires the anthropic-beta header {CONTEXT_MANAGEMENT_BETA}",
            )
            validate_context_management(body["context_management"])
        if "string_system" in self.quirks:
            require(isinstance(body.get("system", ""), str), ANTHROPIC_QUIRKS["string_system"])
        if "no_cache_control" in self.quirks:
            require("cache_control" not in json.dumps(body), ANTHROPIC_QUIRKS["no_cache_control"])
        breakpoints = validate_anthropic_system(body.get("system", ""))
        if "tools" in body:
            breakpoints += validate_anthropic_tools(body["tools"])
        breakpoints += validate_anthropic_messages(body.get("messages"))
        require(
            breakpoints <= MAX_CACHE_BREAKPOINTS,
            f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. Found {breakpoints}.",
        )

    def count_tool_results(self, body: dict[str, Any]) -> int:
        return sum(
            1
            for message in body["messages"]
            if isinstance(message["content"], list)
            for block in message["content"]
            if block["type"] == "tool_result"
            or (
                block["type"] == "text"
                and message["role"] == "user"
                and block["text"].startswith(TEXT_RESULT)
            )
        )

    def tool_names(self, body: dict[str, Any]) -> list[str]:
        return [tool["name"] for tool in body.get("tools", [])]

    def call_arguments(self, body: dict[str, Any]) -> list[Any]:
        return [
            block.get("input")
            for message in body["messages"]
            if isinstance(message["content"], list)
            for block in message["content"]
            if block["type"] == "tool_use"
        ]

    def render(self, body: dict[str, Any], reply: dict[str, Any], reply_id: int) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if reply.get("text"):
            content.append({"type": "text", "text": reply["text"]})
        content.extend(
            {
                "type": "tool_use",
                "id": f"toolu_{reply_id}_{index}",
                "name": call["name"],
                "input": anthropic_input(call.get("arguments", {})),
            }
            for index, call in enumerate(reply.get("tool_calls", []))
        )
        edited, applied = cleared(body)
        usage = self._usage(edited)
        usage["output_tokens"] = approx_tokens(content)
        payload = {
            "id": f"msg_fake_{reply_id}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": "tool_use" if reply.get("tool_calls") else "end_turn",
            "stop_sequence": None,
            "usage": usage,
        }
        if "context_management" in body:
            payload["context_management"] = {"applied_edits": applied}
        with self._lock:
            self.edited.append(edited)
        return payload

    def _usage(self, body: dict[str, Any]) -> dict[str, int]:
        seen = {**body, "messages": self.visible(body)}
        prompt = approx_tokens(without_cache_control(seen))  # markers are not billed as tokens
        blocks = anthropic_blocks(body)
        breakpoints = [i for i, (_, _, marked) in enumerate(blocks) if marked]
        if not breakpoints:
            return {"input_tokens": prompt, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        model, floor = body["model"], max(self.min_cacheable_tokens, 1)
        read = 0
        with self._lock:
            for point in breakpoints:
                for i in range(point, max(point - CACHE_LOOKBACK, 0) - 1, -1):
                    _, tokens, _ = blocks[i]
                    if tokens >= floor and f"{model}:{blocks[i][0]}" in self._seen_prefixes:
                        read = max(read, tokens)
                        break
            last = blocks[breakpoints[-1]][1]
            write = last - read if last >= floor else 0
            for point in breakpoints:
                if blocks[point][1] >= floor:
                    self._seen_prefixes.add(f"{model}:{blocks[point][0]}")
        read, write = min(read, prompt), min(write, prompt - read)
        return {
            "input_tokens": prompt - read - write,
            "cache_creation_input_tokens": write,
            "cache_read_input_tokens": read,
        }


def validate_context_management(value: Any) -> None:
    require(isinstance(value, dict), "context_management: Input should be an object")
    require(set(value) <= {"edits"}, "context_management: Extra inputs are not permitted")
    edits = value.get("edits")
    require(isinstance(edits, list), "context_management.edits: Input should be a valid list")
    for index, edit in enumerate(edits):
        at = f"context_management.edits.{index}"
        require(
            isinstance(edit, dict) and edit.get("type") == CLEAR_TOOL_USES, f"{at}.type: unknown edit type"
        )
        known = {"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"}
        require(set(edit) <= known, f"{at}: Extra inputs are not permitted")
        for key, unit in (
            ("trigger", "input_tokens"),
            ("keep", "tool_uses"),
            ("clear_at_least", "input_tokens"),
        ):
            if key in edit:
                threshold = edit[key]
                require(
                    isinstance(threshold, dict)
                    and threshold.get("type") == unit
                    and isinstance(threshold.get("value"), int)
                    and threshold["value"] >= 0,
                    f"{at}.{key}: must be {{'type': '{unit}', 'value': <non-negative integer>}}",
                )


def cleared(body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The prompt the model sees once the request's clear_tool_uses edit is applied, and the
    edits applied, as the API documents them: the edit is applied on the server to the whole
    history the client sent, per request (the client keeps its history unchanged); once the
    prompt passes `trigger` input tokens, every tool result but the newest `keep` is replaced by
    a placeholder, oldest first, unless that clears fewer than `clear_at_least` tokens. A prompt
    cache sees the edited prompt, so a clear invalidates it from the first cleared result."""
    edits = (body.get("context_management") or {}).get("edits") or []
    if not edits:
        return body, []
    edit = edits[0]
    value = {key: (edit.get(key) or {}).get("value", default) for key, default in CLEAR_DEFAULTS.items()}
    excluded = set(edit.get("exclude_tools") or [])
    applied = {"type": CLEAR_TOOL_USES, "cleared_tool_uses": 0, "cleared_input_tokens": 0}
    prompt = approx_tokens(without_cache_control(body))
    if prompt <= value["trigger"]:
        return body, [applied]
    names = {
        block["id"]: block["name"]
        for message in body["messages"]
        if isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_use"
    }
    places = [
        (m, b)
        for m, message in enumerate(body["messages"])
        if isinstance(message["content"], list)
        for b, block in enumerate(message["content"])
        if block.get("type") == "tool_result" and names.get(block.get("tool_use_id")) not in excluded
    ]
    clear = places[: max(len(places) - value["keep"], 0)]
    if not clear:
        return body, [applied]
    messages = [dict(message) for message in body["messages"]]
    for m, b in clear:
        content = list(messages[m]["content"])
        content[b] = {**content[b], "content": CLEARED_PLACEHOLDER}
        messages[m]["content"] = content
    edited = {**body, "messages": messages}
    saved = prompt - approx_tokens(without_cache_control(edited))
    if saved < value["clear_at_least"]:
        return body, [applied]
    return edited, [{**applied, "cleared_tool_uses": len(clear), "cleared_input_tokens": saved}]


def anthropic_input(arguments: Any) -> dict[str, Any]:
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def without_cache_control(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [without_cache_control(v) for v in value]
    return value


def anthropic_blocks(body: dict[str, Any]) -> list[tuple[str, int, bool]]:
    """The prompt as the cache sees it: for each block in render order (tools, system, then each
    message's blocks), the hash of the prefix ending there, its size in tokens, and whether it
    carries a breakpoint. cache_control itself is not part of the prefix (a breakpoint may move)."""
    system = body.get("system") or []
    if isinstance(system, str):
        system = [{"type": "text", "text": system}]
    parts: list[tuple[Any, dict[str, Any]]] = [("tool", tool) for tool in body.get("tools", [])]
    parts += [("system", block) for block in system]
    for index, message in enumerate(body["messages"]):
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        parts += [([index, message["role"]], block) for block in content]
    blocks, digest, chars = [], hashlib.sha256(), 0
    for where, block in parts:
        plain = json.dumps([where, {k: v for k, v in block.items() if k != "cache_control"}], sort_keys=True)
        digest.update(plain.encode())
        chars += len(plain)
        blocks.append((digest.copy().hexdigest(), chars // 4, "cache_control" in block))
    return blocks


def validate_cache_control(block: dict[str, Any], where: str) -> int:
    if "cache_control" not in block:
        return 0
    require(
        block["cache_control"]
        in ({"type": "ephemeral"}, {"type": "ephemeral", "ttl": "5m"}, {"type": "ephemeral", "ttl": "1h"}),
        f"{where}.cache_control: invalid value",
    )
    return 1


def validate_text_block(block: Any, where: str) -> int:
    require(isinstance(block, dict) and block.get("type") == "text", f"{where}.type must be 'text'")
    require(set(block) <= {"type", "text", "cache_control"}, f"{where}: Extra inputs are not permitted")
    require(
        isinstance(block.get("text"), str) and block["text"] != "",
        f"{where}: text content blocks must be non-empty",
    )
    return validate_cache_control(block, where)


def validate_anthropic_system(system: Any) -> int:
    if isinstance(system, str):
        return 0
    require(isinstance(system, list), "system: Input should be a valid string or list")
    return sum(validate_text_block(block, f"system.{index}") for index, block in enumerate(system))


def validate_anthropic_tools(tools: Any) -> int:
    require(isinstance(tools, list), "tools: Input should be a valid list")
    names, breakpoints = set(), 0
    for index, tool in enumerate(tools):
        where = f"tools.{index}"
        require(isinstance(tool, dict), f"{where}: Input should be an object")
        require(
            set(tool) <= {"name", "description", "input_schema", "cache_control"},
            f"{where}: Extra inputs are not permitted",
        )
        name = tool.get("name")
        require(isinstance(name, str) and bool(TOOL_NAME.match(name)), f"{where}.name: invalid tool name")
        require(name not in names, f"tools: Tool names must be unique ({name})")
        names.add(name)
        require(isinstance(tool.get("description", ""), str), f"{where}.description must be a string")
        schema = tool.get("input_schema")
        require(
            isinstance(schema, dict) and schema.get("type") == "object",
            f"{where}.input_schema: type must be 'object'",
        )
        breakpoints += validate_cache_control(tool, where)
    return breakpoints


def validate_anthropic_messages(messages: Any) -> int:
    require(isinstance(messages, list) and len(messages) > 0, "messages: at least one message is required")
    breakpoints = 0
    open_calls: list[str] = []  # tool_use ids of the previous assistant turn
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        require(
            isinstance(message, dict) and set(message) == {"role", "content"},
            f"{where}: a message needs exactly 'role' and 'content'",
        )
        expected = "user" if index % 2 == 0 else "assistant"
        require(message["role"] == expected, f"{where}.role: roles must alternate, starting with 'user'")
        blocks = message["content"]
        if isinstance(blocks, str):
            require(blocks != "", f"{where}: content must be non-empty")
            blocks = [{"type": "text", "text": blocks}]
        require(isinstance(blocks, list) and len(blocks) > 0, f"{where}.content must be a non-empty list")
        breakpoints += sum(
            validate_content_block(block, message["role"], f"{where}.content.{i}")
            for i, block in enumerate(blocks)
        )
        if message["role"] == "user":
            check_tool_results(blocks, open_calls, where)
            open_calls = []
        else:
            open_calls = [block["id"] for block in blocks if block["type"] == "tool_use"]
    return breakpoints


def validate_content_block(block: Any, role: str, where: str) -> int:
    require(isinstance(block, dict), f"{where}: Input should be an object")
    kind = block.get("type")
    if kind == "text":
        return validate_text_block(block, where)
    if kind == "tool_use":
        require(role == "assistant", f"{where}: tool_use blocks are only allowed in assistant messages")
        require(
            set(block) <= {"type", "id", "name", "input", "cache_control"},
            f"{where}: Extra inputs are not permitted",
        )
        require(isinstance(block.get("id"), str) and block["id"] != "", f"{where}.id: Field required")
        require(isinstance(block.get("name"), str) and block["name"] != "", f"{where}.name: Field required")
        require(isinstance(block.get("input"), dict), f"{where}.input: Input should be an object")
        return validate_cache_control(block, where)
    if kind == "tool_result":
        require(role == "user", f"{where}: tool_result blocks are only allowed in user messages")
        require(
            set(block) <= {"type", "tool_use_id", "content", "is_error", "cache_control"},
            f"{where}: Extra inputs are not permitted",
        )
        require(isinstance(block.get("tool_use_id"), str), f"{where}.tool_use_id: Field required")
        content = block.get("content", "")
        if isinstance(content, list):
            for i, inner in enumerate(content):
                validate_text_block(inner, f"{where}.content.{i}")
        else:
            require(isinstance(content, str), f"{where}.content: Input should be a string or list")
        require(
            isinstance(block.get("is_error", False), bool), f"{where}.is_error: Input should be a boolean"
        )
        return validate_cache_control(block, where)
    raise BadRequest(f"{where}.type: unsupported block type {kind!r}")


def check_tool_results(blocks: list[dict[str, Any]], open_calls: list[str], where: str) -> None:
    """Mirror the API: every tool_use is answered in the very next user message, results first."""
    answered = [block["tool_use_id"] for block in blocks if block["type"] == "tool_result"]
    unexpected = [call_id for call_id in answered if call_id not in open_calls]
    require(
        not unexpected,
        f"{where}: unexpected `tool_use_id` found in `tool_result` blocks: {unexpected}. "
        "Each `tool_result` block must have a corresponding `tool_use` block in the previous message.",
    )
    missing = [call_id for call_id in open_calls if call_id not in answered]
    require(
        not missing,
        f"{where}: `tool_use` ids were found without `tool_result` blocks immediately after: "
        f"{missing}. Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
    )
    require(len(set(answered)) == len(answered), f"{where}: duplicate tool_result for one tool_use")
    kinds = [block["type"] for block in blocks]
    require(
        kinds[: len(answered)] == ["tool_result"] * len(answered),
        f"{where}: tool_result blocks must come first in the message content",
    )


# --- command line -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run a fake model server in the foreground (127.0.0.1).")
    parser.add_argument("--kind", choices=["openai", "anthropic"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--latency-ms", type=int, default=0)
    parser.add_argument("--tool-turns", type=int, default=0)
    args = parser.parse_args(argv)
    fake_class = FakeOpenAI if args.kind == "openai" else FakeAnthropic
    fake = fake_class(tool_turns=args.tool_turns, latency_ms=args.latency_ms)
    print(f"fake {args.kind} server on http://{HOST}:{args.port}{fake.url_suffix}", flush=True)
    fake.serve_forever(args.port)


if __name__ == "__main__":
    main()
