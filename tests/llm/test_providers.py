"""Real provider clients against the fake model servers (no network beyond 127.0.0.1)."""

from __future__ import annotations

import email.utils
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from llm.providers.anthropic import AnthropicProvider
from llm.providers.http import parse_retry_after, transport_error
from llm.providers.openai import OpenAIProvider, parse_arguments
from llm.types import Message, ModelReply, ModelRequest, ProviderError, ToolSpec
from tests.fakes.model_servers import FakeAnthropic, FakeModelServer, FakeOpenAI

pytestmark = pytest.mark.timeout(60)

API_KEY = "sk-test-SECRET-0123456789"
INSTRUCTIONS = "You are a careful assistant for the test tenant."
TOOLS = [
    ToolSpec("lookup", "Look a record up.", {"type": "object", "properties": {"q": {"type": "string"}}}),
    ToolSpec(
        "search",
        "Search records.",
        {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}},
    ),
]


@dataclass
class Kit:
    kind: str
    fake: FakeModelServer
    provider: OpenAIProvider | AnthropicProvider

    def request(
        self,
        messages: list[Message],
        *,
        instructions: str = INSTRUCTIONS,
        timeout: float = 10.0,
        max_tokens: int = 123,
    ) -> ModelRequest:
        return ModelRequest(
            model="fake-model",
            instructions=instructions,
            messages=messages,
            tools=TOOLS,
            max_output_tokens=max_tokens,
            timeout_seconds=timeout,
        )

    def ask(self, text: str = "hello", **kwargs: Any) -> ModelReply:
        return self.provider.complete(self.request([Message("user", text)], **kwargs))

    def fail(self, messages: list[Message] | None = None, **kwargs: Any) -> ProviderError:
        with pytest.raises(ProviderError) as caught:
            self.provider.complete(self.request(messages or [Message("user", "hello")], **kwargs))
        assert API_KEY not in str(caught.value)  # every error path must keep the key out
        return caught.value


def make_kit(kind: str, **fake_kwargs: Any) -> Kit:
    fake_kwargs.setdefault("min_cacheable_tokens", 0)  # these prompts are tiny; caching tests below are not
    fake: FakeModelServer = FakeOpenAI(**fake_kwargs) if kind == "openai" else FakeAnthropic(**fake_kwargs)
    base_url = fake.start()
    provider_class = OpenAIProvider if kind == "openai" else AnthropicProvider
    return Kit(kind, fake, provider_class(base_url, API_KEY, "configured-model"))


@pytest.fixture(params=["openai", "anthropic"])
def kit(request: pytest.FixtureRequest) -> Iterator[Kit]:
    made = make_kit(request.param)
    yield made
    made.provider.close()
    made.fake.stop()


@pytest.fixture
def kit_factory() -> Iterator[Any]:
    made: list[Kit] = []

    def factory(kind: str, **fake_kwargs: Any) -> Kit:
        made.append(make_kit(kind, **fake_kwargs))
        return made[-1]

    yield factory
    for one in made:
        one.provider.close()
        one.fake.stop()


def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


# --- happy paths -----------------------------------------------------------------------------


def test_text_reply(kit: Kit) -> None:
    kit.fake.queue({"text": "hi there"})
    reply = kit.ask()
    assert reply.text == "hi there"
    assert reply.tool_calls == []
    assert reply.stop_reason == ("stop" if kit.kind == "openai" else "end_turn")
    raw_usage = kit.fake.replies[-1]["usage"]
    expected_out = raw_usage["completion_tokens" if kit.kind == "openai" else "output_tokens"]
    assert reply.usage.output_tokens == expected_out > 0
    assert reply.usage.input_tokens > 0


def test_a_cookie_the_provider_sets_is_never_sent_back(kit: Kit) -> None:
    # One client serves every run calling the endpoint: a session cookie from one call must not
    # travel with the next, whoever's run makes it.
    kit.fake.set_cookie = "__cf_bm=first-callers-session; Path=/"
    kit.fake.queue({"text": "one"}, {"text": "two"})
    kit.ask()
    kit.ask()
    assert [h.get("cookie") for h in kit.fake.request_headers[-2:]] == [None, None]


def test_a_connection_idle_for_a_second_is_not_sent_on_again(kit: Kit) -> None:
    # Servers close idle connections after 5 s (uvicorn, Node); a call sent as one closes is lost
    # after it was sent. Calls in quick succession share a connection; after an idle second the
    # client opens a new one rather than race the server's close.
    kit.fake.queue({"text": "one"}, {"text": "two"}, {"text": "three"})
    kit.ask()
    kit.ask()
    time.sleep(1.3)  # idle: the time itself is what is tested
    kit.ask()
    first, second, third = kit.fake.client_ports[-3:]
    assert first == second and third != second


def test_openai_request_shape(kit_factory: Any) -> None:
    kit = kit_factory("openai")
    kit.ask("hello")
    body, headers = kit.fake.requests[-1], kit.fake.request_headers[-1]
    assert body["model"] == "fake-model"
    assert body["messages"] == [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "hello"},
    ]
    assert body["max_completion_tokens"] == 123 and "max_tokens" not in body
    assert body["tools"][1] == {
        "type": "function",
        "function": {"name": "search", "description": "Search records.", "parameters": TOOLS[1].input_schema},
    }
    assert headers["authorization"] == f"Bearer {API_KEY}"


def test_openai_legacy_max_tokens_param(kit_factory: Any) -> None:
    kit = kit_factory("openai")
    legacy = OpenAIProvider(kit.fake.base_url, None, "configured-model", max_tokens_param="max_tokens")
    legacy.complete(kit.request([Message("user", "hello")]))
    body, headers = kit.fake.requests[-1], kit.fake.request_headers[-1]
    assert body["max_tokens"] == 123 and "max_completion_tokens" not in body
    assert "authorization" not in headers  # no key -> no empty Bearer header
    legacy.close()


def test_anthropic_request_shape(kit_factory: Any) -> None:
    kit = kit_factory("anthropic")
    kit.ask("hello")
    body, headers = kit.fake.requests[-1], kit.fake.request_headers[-1]
    assert body["system"] == [{"type": "text", "text": INSTRUCTIONS, "cache_control": {"type": "ephemeral"}}]
    assert body["tools"][-1]["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in body["tools"][0]
    assert body["tools"][0]["input_schema"] == TOOLS[0].input_schema
    assert body["max_tokens"] == 123
    assert body["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}],
        }
    ]
    assert headers["x-api-key"] == API_KEY
    assert headers["anthropic-version"] == "2023-06-01"


def test_tool_call_round_trip(kit: Kit) -> None:
    kit.fake.queue(
        {
            "text": "checking",
            "tool_calls": [
                {"name": "lookup", "arguments": {"q": "a"}},
                {"name": "search", "arguments": {"q": "b", "n": 2}},
            ],
        },
        {"text": "final answer"},
    )
    messages = [Message("user", "find a and b")]
    first = kit.provider.complete(kit.request(messages))
    assert [(call.name, call.arguments) for call in first.tool_calls] == [
        ("lookup", {"q": "a"}),
        ("search", {"q": "b", "n": 2}),
    ]
    assert first.text == "checking"
    assert first.stop_reason == ("tool_calls" if kit.kind == "openai" else "tool_use")
    assert len({call.id for call in first.tool_calls}) == 2

    lookup, search = first.tool_calls
    messages += [
        Message("assistant", first.text, first.tool_calls),
        Message("tool", "result a", tool_call_id=lookup.id),
        Message("tool", "boom", tool_call_id=search.id, is_error=True),
    ]
    second = kit.provider.complete(kit.request(messages))
    assert second.text == "final answer" and second.tool_calls == []

    sent = kit.fake.requests[-1]["messages"]
    if kit.kind == "openai":
        assert sent[-3]["tool_calls"][1]["function"] == {
            "name": "search",
            "arguments": json.dumps({"q": "b", "n": 2}),
        }
        assert sent[-2] == {"role": "tool", "tool_call_id": lookup.id, "content": "result a"}
        assert sent[-1] == {"role": "tool", "tool_call_id": search.id, "content": "ERROR: boom"}
    else:
        assert len(sent) == 3  # both results merged into one user turn
        assert sent[1]["content"][1] == {
            "type": "tool_use",
            "id": lookup.id,
            "name": "lookup",
            "input": {"q": "a"},
        }
        assert sent[2] == {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": lookup.id, "content": "result a"},
                {
                    "type": "tool_result",
                    "tool_use_id": search.id,
                    "content": "boom",
                    "is_error": True,
                    "cache_control": {"type": "ephemeral"},
                },
            ],
        }


def test_auto_agent_loop(kit_factory: Any) -> None:
    for kind in ("openai", "anthropic"):
        kit = kit_factory(kind, tool_turns=3)
        messages = [Message("user", "go")]
        seen = []
        for _ in range(10):
            reply = kit.provider.complete(kit.request(messages))
            if not reply.tool_calls:
                break
            seen += [(call.name, call.arguments) for call in reply.tool_calls]
            messages.append(Message("assistant", reply.text, reply.tool_calls))
            messages += [Message("tool", "ok", tool_call_id=call.id) for call in reply.tool_calls]
        assert reply.text == "done"
        assert seen == [("lookup", {"i": 0}), ("lookup", {"i": 1}), ("lookup", {"i": 2})]


def test_openai_broken_arguments_kept_raw(kit_factory: Any) -> None:
    kit = kit_factory("openai")
    kit.fake.queue(
        {
            "tool_calls": [
                {"name": "lookup", "arguments": '{"q": "a"'},
                {"name": "lookup", "arguments": "[1, 2]"},
            ]
        }
    )
    reply = kit.ask()
    assert [call.arguments for call in reply.tool_calls] == [{"_raw": '{"q": "a"'}, {"_raw": "[1, 2]"}]
    # the raw form must still round-trip so the platform can answer with a schema error
    messages = [Message("user", "hello"), Message("assistant", "", reply.tool_calls)]
    messages += [
        Message("tool", "bad arguments", tool_call_id=call.id, is_error=True) for call in reply.tool_calls
    ]
    assert kit.provider.complete(kit.request(messages)).text == "done"


def test_parse_arguments_edge_cases() -> None:
    assert parse_arguments("") == {}
    assert parse_arguments(None) == {}
    assert parse_arguments({"a": 1}) == {"a": 1}
    assert parse_arguments('{"a": 1}') == {"a": 1}
    assert parse_arguments("null") == {"_raw": "null"}


def test_cached_prefix_on_second_call(kit: Kit) -> None:
    first = kit.ask("first question")
    second = kit.ask("a different second question")
    raw = kit.fake.replies[-1]["usage"]
    if kit.kind == "openai":
        assert first.usage.cached_input_tokens == 0
        cached = raw["prompt_tokens_details"]["cached_tokens"]
        assert second.usage.cached_input_tokens == cached > 0
        assert second.usage.input_tokens == raw["prompt_tokens"] - cached
        assert second.usage.total_input == raw["prompt_tokens"]
    else:
        assert first.usage.cached_input_tokens == 0
        assert first.usage.cache_write_tokens > 0
        # the newest message carries a breakpoint too: the tools and system are read back, the
        # different question is written
        assert second.usage.cache_write_tokens > 0
        assert (
            0
            < second.usage.cached_input_tokens
            == raw["cache_read_input_tokens"]
            < first.usage.cache_write_tokens
        )
        assert second.usage.input_tokens == raw["input_tokens"]
    other = kit.ask("third", instructions="Different instructions, different prefix.")
    if kit.kind == "openai":  # only the JSON framing before the instructions is shared
        assert other.usage.cached_input_tokens < 8
    else:  # tools render before system and carry their own breakpoint: only they are read back
        assert 0 < other.usage.cached_input_tokens < second.usage.cached_input_tokens


# --- errors ----------------------------------------------------------------------------------


def test_429_retry_after_seconds(kit: Kit) -> None:
    kit.fake.queue({"fault": "429", "retry_after": 2})
    error = kit.fail()
    assert (error.status, error.retryable, error.sent, error.retry_after) == (429, True, True, 2.0)


def test_429_retry_after_http_date(kit: Kit) -> None:
    kit.fake.queue({"fault": "429", "retry_after": email.utils.formatdate(time.time() + 30, usegmt=True)})
    error = kit.fail()
    assert error.status == 429 and error.retryable
    assert error.retry_after is not None and 25 <= error.retry_after <= 30


@pytest.mark.parametrize("status", ["500", "503", "529"])
def test_server_errors_are_retryable(kit: Kit, status: str) -> None:
    kit.fake.queue({"fault": status})
    error = kit.fail()
    assert (error.status, error.retryable, error.sent, error.retry_after) == (int(status), True, True, None)


def test_timeout_is_retryable_and_maybe_charged(kit: Kit) -> None:
    kit.fake.queue({"fault": "timeout", "seconds": 3})
    started = time.monotonic()
    error = kit.fail(timeout=0.5)
    assert time.monotonic() - started < 2.5
    assert (error.retryable, error.sent, error.status) == (True, True, None)
    assert len(kit.fake.requests) == 1  # it reached the server, so it may be billed


@pytest.mark.parametrize("provider_class", [OpenAIProvider, AnthropicProvider])
def test_connection_refused_was_not_sent(provider_class: type) -> None:
    provider = provider_class(f"http://127.0.0.1:{closed_port()}", API_KEY, "m")
    with pytest.raises(ProviderError) as caught:
        provider.complete(ModelRequest("m", "x", [Message("user", "hi")], [], 10, timeout_seconds=5))
    assert (caught.value.retryable, caught.value.sent, caught.value.status) == (True, False, None)
    assert API_KEY not in str(caught.value)


def test_bad_request_is_permanent(kit: Kit) -> None:
    kit.fake.queue({"fault": "bad_request"})
    error = kit.fail()
    assert (error.status, error.retryable, error.sent) == (400, False, True)
    assert "bad_request" in str(error)  # the provider's message is surfaced


def test_malformed_conversation_rejected(kit: Kit) -> None:
    # A tool result that answers no tool call: both real APIs reject this with a 400.
    messages = [
        Message("user", "hi"),
        Message("assistant", "ok"),
        Message("tool", "orphan", tool_call_id="call_missing"),
    ]
    error = kit.fail(messages)
    assert (error.status, error.retryable) == (400, False)
    assert "tool" in str(error)
    assert kit.fake.replies == []


def test_wrong_key_error_never_leaks_key(kit_factory: Any) -> None:
    for kind in ("openai", "anthropic"):
        kit = kit_factory(kind, api_key="the-right-key")
        error = kit.fail()  # fail() asserts the key is absent from the message
        assert (error.status, error.retryable) == (401, False)
        assert API_KEY not in repr(error.args) and API_KEY not in repr(kit.provider)
        if kind == "openai":  # its 401 body echoes the bad key, like the real API: redaction did work
            raw = httpx.post(
                f"{kit.fake.base_url}/chat/completions",
                json={},
                headers={"authorization": f"Bearer {API_KEY}"},
            )
            assert API_KEY in raw.text


# --- helpers and fake strictness -------------------------------------------------------------


def test_parse_retry_after_forms() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after(httpx.Headers({"retry-after": "7"})) == 7.0
    assert parse_retry_after(httpx.Headers({"retry-after": "1.5"})) == 1.5
    assert parse_retry_after(httpx.Headers({"retry-after-ms": "250", "retry-after": "9"})) == 0.25
    date = email.utils.formatdate(now + 12, usegmt=True)
    assert parse_retry_after(httpx.Headers({"retry-after": date}), now=now) == 12.0
    assert (
        parse_retry_after(
            httpx.Headers({"retry-after": email.utils.formatdate(now - 60, usegmt=True)}), now=now
        )
        == 0.0
    )
    assert parse_retry_after(httpx.Headers({"retry-after": "soon"})) is None
    assert parse_retry_after(httpx.Headers({})) is None


@pytest.mark.parametrize(
    ("exc", "sent"),
    [
        (httpx.ConnectTimeout("t"), False),
        (httpx.ConnectError("c"), False),
        (httpx.ReadTimeout("r"), True),
        (httpx.WriteTimeout("w"), True),
        (httpx.PoolTimeout("p"), True),
        (httpx.RemoteProtocolError("peer closed"), True),
        (httpx.ReadError("reset"), True),
    ],
)
def test_transport_error_classification(exc: httpx.TransportError, sent: bool) -> None:
    error = transport_error(exc, provider="p", secret=API_KEY)
    assert (error.retryable, error.sent) == (True, sent)


def test_fake_anthropic_rejects_unmerged_tool_results(kit_factory: Any) -> None:
    kit = kit_factory("anthropic")
    use = [
        {"type": "tool_use", "id": "t1", "name": "lookup", "input": {}},
        {"type": "tool_use", "id": "t2", "name": "lookup", "input": {}},
    ]
    unmerged = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": use},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "b"}]},
    ]
    headers = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
    body = {"model": "m", "max_tokens": 5, "messages": unmerged}
    response = httpx.post(f"{kit.fake.base_url}/v1/messages", json=body, headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    merged = unmerged[:2] + [{"role": "user", "content": unmerged[2]["content"] + unmerged[3]["content"]}]
    response = httpx.post(
        f"{kit.fake.base_url}/v1/messages", json={**body, "messages": merged}, headers=headers
    )
    assert response.status_code == 200, response.text


def test_fake_openai_rejects_unanswered_tool_call(kit_factory: Any) -> None:
    kit = kit_factory("openai")
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "user", "content": "and?"},
        ],
    }
    response = httpx.post(f"{kit.fake.base_url}/chat/completions", json=body)
    assert response.status_code == 400
    assert "tool_call_id" in response.json()["error"]["message"]


def test_one_fake_serves_many_concurrent_requests(kit_factory: Any) -> None:
    kit = kit_factory("openai", latency_ms=300)
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=100) as pool:
        replies = list(pool.map(lambda i: kit.ask(f"q{i}"), range(100)))
    assert all(reply.text == "done" for reply in replies)
    assert len(kit.fake.requests) == 100
    assert time.monotonic() - started < 5  # serial would take 30s


def test_a_platform_error_observation_carries_one_error_prefix_on_both_wires(kit: Kit) -> None:
    """Denied, rejected, expired and resolved-failed calls are observed as "ERROR: ..." already."""
    kit.fake.queue({"tool_calls": [{"name": "refund", "arguments": {"amount": 1}}]}, {"text": "ok"})
    messages = [Message("user", "refund it")]
    first = kit.provider.complete(kit.request(messages))
    denied = "ERROR: call denied by the platform: user asha may not use refund"
    messages += [
        Message("assistant", first.text, first.tool_calls),
        Message("tool", denied, tool_call_id=first.tool_calls[0].id, is_error=True),
    ]
    kit.provider.complete(kit.request(messages))
    sent = kit.fake.requests[-1]["messages"][-1]
    if kit.kind == "openai":
        assert sent == {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": denied}
    else:
        assert sent["content"] == [
            {
                "type": "tool_result",
                "tool_use_id": first.tool_calls[0].id,
                "content": denied,
                "is_error": True,
                "cache_control": {"type": "ephemeral"},
            }
        ]


# --- prompt caching as the providers bill it ---------------------------------------------------

LONG_INSTRUCTIONS = "Follow the bank's dispute procedure exactly. " * 200  # about 2,300 tokens


def _conversation(turns: int, result_chars: int = 2_000) -> list[Message]:
    from llm.types import ToolCall

    messages = [Message("user", "start")]
    for i in range(turns):
        messages.append(
            Message("assistant", "", [ToolCall(id=f"c{i}", name="lookup", arguments={"q": str(i)})])
        )
        messages.append(Message("tool", f"result {i} " + "x" * result_chars, tool_call_id=f"c{i}"))
    return messages


def test_anthropic_reads_the_previous_request_and_writes_only_the_new_turn(kit_factory: Any) -> None:
    kit = kit_factory("anthropic", min_cacheable_tokens=1024)
    usages = []
    for turns in range(0, 6):
        request = kit.request(_conversation(turns), instructions=LONG_INSTRUCTIONS)
        usages.append(kit.provider.complete(request).usage)
        body = kit.fake.requests[-1]
        marks = (
            sum("cache_control" in block for block in body["system"])
            + sum("cache_control" in tool for tool in body["tools"])
            + sum("cache_control" in block for message in body["messages"] for block in message["content"])
        )
        assert marks <= 4
    for before, after in zip(usages, usages[1:]):
        # all of the previous request is read back; what is written is the one new turn (~2,000
        # characters of result, ~520 tokens), never the history again
        assert after.cached_input_tokens == before.cached_input_tokens + before.cache_write_tokens
        assert 0 < after.cache_write_tokens < 600
    assert usages[-1].cached_input_tokens / usages[-1].total_input > 0.85


def test_anthropic_without_a_message_breakpoint_reads_only_tools_and_system(kit_factory: Any) -> None:
    """The old placement (system and tools only): the history is never read from cache."""
    kit = kit_factory("anthropic", min_cacheable_tokens=1024)
    from llm.providers import anthropic as wire

    for turns in (3, 4):
        body = kit.provider.build_body(kit.request(_conversation(turns), instructions=LONG_INSTRUCTIONS))
        for message in body["messages"]:
            for block in message["content"]:
                block.pop("cache_control", None)
        response = httpx.post(
            f"{kit.fake.base_url}/v1/messages",
            json=body,
            headers={"x-api-key": API_KEY, "anthropic-version": wire.API_VERSION},
        )
    usage = response.json()["usage"]
    assert usage["cache_read_input_tokens"] < 2_600 and usage["input_tokens"] > 2_000


def test_anthropic_nothing_below_the_minimum_cacheable_length_is_cached(kit_factory: Any) -> None:
    kit = kit_factory("anthropic", min_cacheable_tokens=1024)
    kit.ask("short")
    second = kit.ask("short")
    assert second.usage.cached_input_tokens == 0 and second.usage.cache_write_tokens == 0


def test_openai_caches_the_shared_prefix_in_128_token_steps_from_1024(kit_factory: Any) -> None:
    kit = kit_factory("openai", min_cacheable_tokens=1024)
    kit.ask("short")
    assert kit.ask("short").usage.cached_input_tokens == 0  # under 1,024 tokens: never cached
    usages = [
        kit.provider.complete(kit.request(_conversation(turns), instructions=LONG_INSTRUCTIONS)).usage
        for turns in range(0, 4)
    ]
    assert usages[0].cached_input_tokens == 0
    for before, after in zip(usages, usages[1:]):
        assert after.cached_input_tokens >= 1024 and (after.cached_input_tokens - 1024) % 128 == 0
        # the previous prompt is a prefix of this one: all of it but the last partial step is read
        assert before.total_input - 128 - 8 <= after.cached_input_tokens <= before.total_input


def test_openai_sends_the_runs_cache_key_unless_the_endpoint_is_configured_not_to(kit_factory: Any) -> None:
    kit = kit_factory("openai")
    request = ModelRequest(
        model="m",
        instructions=INSTRUCTIONS,
        messages=[Message("user", "hi")],
        tools=TOOLS,
        max_output_tokens=10,
        cache_key="run-42",
    )
    kit.provider.complete(request)
    assert kit.fake.requests[-1]["prompt_cache_key"] == "run-42"
    quiet = OpenAIProvider(kit.fake.base_url, API_KEY, "m", send_cache_key=False)
    quiet.complete(request)
    assert "prompt_cache_key" not in kit.fake.requests[-1]
    quiet.close()
