"""Self-hosted servers' quirks on both wires, and answers bounded by the platform (llm/compat.py,
llm/providers/http.py).

Each quirk is played by the fake servers the way the server family behaves (a template that drops
tool messages, a proxy that refuses list content); each test shows the default failing the way a
user met it and the setting making it work, read from the request bodies the fake received.
Streaming: a server that ignores the output limit is cut at it, on both wires, and the usage is
the platform's own count, marked; a server that holds back its first token is given up on at the
first-token timeout, well before the call's total.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from llm.compat import Compat
from llm.providers.anthropic import AnthropicProvider
from llm.providers.openai import OpenAIProvider
from llm.types import Message, ModelRequest, ProviderError, ToolCall, ToolSpec
from tests.fakes.model_servers import FakeAnthropic, FakeOpenAI

pytestmark = pytest.mark.timeout(60)

TOOLS = [ToolSpec("lookup", "Look a record up.", {"type": "object", "properties": {"q": {"type": "string"}}})]
NONCE = "nonce-5f3a9c1e"


def conversation(result: str) -> list[Message]:
    return [
        Message("user", "find TXN-1"),
        Message("assistant", "", tool_calls=[ToolCall(id="call_1", name="lookup", arguments={"q": "TXN-1"})]),
        Message("tool", result, tool_call_id="call_1"),
    ]


def request(messages: list[Message], *, limit: int = 100, **fields: Any) -> ModelRequest:
    return ModelRequest(
        model="m",
        instructions="You help bank support agents.",
        messages=messages,
        tools=TOOLS,
        max_output_tokens=limit,
        timeout_seconds=fields.pop("timeout_seconds", 10),
        **fields,
    )


@pytest.fixture
def fakes() -> Iterator[Any]:
    started: list[Any] = []

    def start(kind: str, *quirks: str) -> Any:
        fake = (FakeOpenAI if kind == "openai" else FakeAnthropic)(quirks=quirks, min_cacheable_tokens=0)
        fake.start()
        started.append(fake)
        return fake

    yield start
    for fake in started:
        fake.stop()


def provider(kind: str, fake: Any, **kwargs: Any) -> Any:
    if kind == "openai":
        return OpenAIProvider(fake.base_url, None, "m", **kwargs)
    return AnthropicProvider(fake.base_url, "key", "m", **kwargs)


QUIRK = {"openai": "drops_tool_messages", "anthropic": "drops_tool_results"}


# --- tool results as user messages ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_server_that_drops_tool_results_never_sees_them_and_tool_results_user_shows_them(fakes, kind):
    fake = fakes(kind, QUIRK[kind])
    small, large = (
        f'{{"id": "TXN-1", "check": "{NONCE}"}}',
        f'{{"id": "TXN-1", "check": "{NONCE}"}}' + " " * 1_600,
    )

    def prompt_tokens(compat: Compat, result: str) -> tuple[int, str]:
        reply = provider(kind, fake, compat=compat).complete(request(conversation(result)))
        return reply.usage.total_input, reply.text

    # As the issue measured it: the prompt does not grow with the result, and the model cannot
    # repeat what only the result holds.
    (dropped_small, text), (dropped_large, _) = prompt_tokens(Compat(), small), prompt_tokens(Compat(), large)
    assert dropped_small == dropped_large
    assert NONCE not in text

    user = Compat(tool_results="user")
    (seen_small, text), (seen_large, _) = prompt_tokens(user, small), prompt_tokens(user, large)
    assert seen_large > seen_small + 300  # the 1,600 characters of the larger result reach the model
    assert NONCE in text

    body = fake.requests[-1]
    if kind == "openai":
        assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
        assert body["messages"][2]["content"] == '[called tool lookup (call call_1) with {"q": "TXN-1"}]'
        assert body["messages"][3]["content"].startswith("[result of tool lookup (call call_1)]\n")
    else:
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
        kinds = {block["type"] for m in body["messages"] for block in m["content"]}
        assert kinds == {"text"}  # no tool_use or tool_result blocks for the proxy to turn into tool messages


def test_an_error_result_keeps_its_marker_as_a_user_message(fakes):
    fake = fakes("openai")
    messages = conversation("no such transaction")
    messages[-1].is_error = True
    provider("openai", fake, compat=Compat(tool_results="user")).complete(request(messages))
    assert fake.requests[-1]["messages"][-1]["content"].endswith("\nERROR: no such transaction")


# --- Anthropic-compatible proxies -------------------------------------------------------------------


def test_a_proxy_that_refuses_cache_blocks_is_told_the_setting_and_works_with_it(fakes):
    fake = fakes("anthropic", "no_cache_control")
    with pytest.raises(ProviderError) as caught:
        provider("anthropic", fake).complete(request(conversation("{}")))
    assert not caught.value.retryable
    assert "set compat.prompt_cache: none" in str(caught.value), str(caught.value)
    assert len(fake.requests) == 1

    reply = provider("anthropic", fake, compat=Compat(prompt_cache="none")).complete(
        request(conversation("{}"))
    )
    assert reply.text == "done"
    assert "cache_control" not in str(fake.requests[-1])


def test_a_proxy_that_wants_system_as_a_string_gets_one(fakes):
    fake = fakes("anthropic", "string_system")
    with pytest.raises(ProviderError) as caught:
        provider("anthropic", fake).complete(request(conversation("{}")))
    assert "set compat.system: string" in str(caught.value), str(caught.value)

    both = Compat(system="string", prompt_cache="none")
    provider("anthropic", fake, compat=both).complete(request(conversation("{}")))
    body = fake.requests[-1]
    assert body["system"] == "You help bank support agents."
    assert "cache_control" not in str(body)


def test_litellm_in_front_of_a_template_server_works_with_the_three_settings(fakes):
    """What the issue's 6 of 6 runs failed on: list content refused, results dropped."""
    fake = fakes("anthropic", "string_system", "no_cache_control", "drops_tool_results")
    settings = Compat(system="string", prompt_cache="none", tool_results="user")
    reply = provider("anthropic", fake, compat=settings).complete(
        request(conversation(f'{{"c": "{NONCE}"}}'))
    )
    assert NONCE in reply.text


# --- sampling defaults ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_sampling_defaults_go_with_every_request(fakes, kind):
    fake = fakes(kind)
    client = provider(kind, fake, sampling={"temperature": 0.2, "top_p": 0.9})
    client.complete(request([Message("user", "hi")]))
    client.complete(request(conversation("{}")))
    assert [(b["temperature"], b["top_p"]) for b in fake.requests] == [(0.2, 0.9), (0.2, 0.9)]
    provider(kind, fake).complete(request([Message("user", "hi")]))
    assert "temperature" not in fake.requests[-1] and "top_p" not in fake.requests[-1]


# --- bounded output: streaming ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_streamed_answer_is_read_whole_with_the_servers_usage(fakes, kind):
    fake = fakes(kind)
    fake.queue(
        {
            "text": "the transaction TXN-1 was found",
            "tool_calls": [{"name": "lookup", "arguments": {"q": "x"}}],
        }
    )
    reply = provider(kind, fake, stream=True).complete(request([Message("user", "hi")]))
    assert reply.text == "the transaction TXN-1 was found"
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("lookup", {"q": "x"})]
    assert reply.usage.counted_by == "server"
    billed = fake.replies[-1]["usage"]
    assert reply.usage.output_tokens == billed["completion_tokens" if kind == "openai" else "output_tokens"]
    assert fake.requests[-1]["stream"] is True
    # The fake marks its stream ended once the server asks it for more after the last event, which
    # can be a moment after the client has read that event and returned (seen once on a loaded CI).
    deadline = time.monotonic() + 5
    while (
        not fake.streams[0]["ended"] and not fake.streams[0]["closed_early"] and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    assert fake.streams == [{"tokens": fake.streams[0]["tokens"], "ended": True, "closed_early": False}]


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_server_that_ignores_stream_is_read_as_one_answer(fakes, kind):
    fake = fakes(kind)
    fake.queue({"text": "found TXN-1", "ignores_stream": True})
    reply = provider(kind, fake, stream=True).complete(request([Message("user", "hi")]))
    assert fake.requests[-1]["stream"] is True and fake.streams == []
    assert (reply.text, reply.usage.counted_by) == ("found TXN-1", "server")
    assert reply.usage.output_tokens > 0


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_malformed_answer_is_the_servers_fault_not_a_setting_to_change(fakes, kind, stream):
    """A 200 whose body is no answer of the wire: not retried (it would come back the same), and
    the message names no setting, since no setting of the platform's would change it."""
    fake = fakes(kind)
    for raw in ({"unexpected": "shape"}, ["not", "an", "object"]):
        fake.queue({"raw": raw})
        with pytest.raises(ProviderError) as caught:
            provider(kind, fake, stream=stream).complete(request([Message("user", "hi")]))
        assert not caught.value.retryable and caught.value.status == 200
        assert "malformed reply" in str(caught.value) or "not a JSON object" in str(caught.value)
        assert "set " not in str(caught.value) and "compat" not in str(caught.value)


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_runaway_answer_is_cut_at_the_output_limit_and_the_connection_closed(fakes, kind):
    """llama-cpp-python ignores max_tokens when tools are offered: 3,000+ tokens against 256."""
    fake = fakes(kind)
    fake.queue({"runaway": 4_000, "token_ms": 1})
    started = time.monotonic()
    reply = provider(kind, fake, stream=True).complete(request([Message("user", "hi")], limit=64))
    elapsed = time.monotonic() - started

    assert reply.stop_reason == "cut_at_output_limit"
    assert reply.usage.counted_by == "platform"
    assert reply.usage.output_tokens == 64
    assert reply.usage.input_tokens > 0
    assert elapsed < 3, elapsed  # 4,000 tokens at 1 ms each would take 4 s and more
    # The server saw the connection close and stopped generating: at most a few tokens past it.
    deadline = time.monotonic() + 5
    while not fake.streams[-1]["closed_early"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.streams[-1]["closed_early"]
    assert fake.streams[-1]["tokens"] <= 64 + 8, fake.streams[-1]


def test_without_stream_usage_the_platform_counts_and_says_so(fakes):
    fake = fakes("openai")
    fake.queue({"text": "one two three four"})
    reply = provider("openai", fake, stream=True, compat=Compat(stream_usage="omit")).complete(
        request([Message("user", "hi")])
    )
    assert "stream_options" not in fake.requests[-1]
    assert (reply.text, reply.usage.counted_by, reply.usage.output_tokens) == (
        "one two three four",
        "platform",
        4,
    )


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_first_token_that_does_not_come_times_out_before_the_total(fakes, kind):
    fake = fakes(kind)
    fake.queue({"text": "late", "first_token_delay": 4})
    started = time.monotonic()
    with pytest.raises(ProviderError) as caught:
        provider(kind, fake, stream=True).complete(
            request([Message("user", "hi")], timeout_seconds=20, first_token_timeout_seconds=0.5)
        )
    elapsed = time.monotonic() - started
    assert caught.value.timed_out and caught.value.retryable and caught.value.sent
    assert "no first token within 0.5s" in str(caught.value)
    assert 0.4 < elapsed < 2.5, elapsed


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_server_that_goes_silent_mid_answer_is_given_up(fakes, kind):
    fake = fakes(kind)
    fake.queue({"text": "one two three four five six", "stall_after": 2, "stall_seconds": 4})
    started = time.monotonic()
    with pytest.raises(ProviderError) as caught:
        provider(kind, fake, stream=True).complete(
            request([Message("user", "hi")], timeout_seconds=20, first_token_timeout_seconds=0.5)
        )
    assert caught.value.timed_out
    assert "went silent" in str(caught.value)
    assert time.monotonic() - started < 2.5


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_the_total_timeout_still_bounds_a_slow_steady_stream(fakes, kind):
    fake = fakes(kind)
    fake.queue({"runaway": 400, "token_ms": 20})  # 8 s of tokens, each within the silence allowed
    started = time.monotonic()
    with pytest.raises(ProviderError) as caught:
        provider(kind, fake, stream=True).complete(
            request(
                [Message("user", "hi")], limit=1_000, timeout_seconds=1.0, first_token_timeout_seconds=0.5
            )
        )
    assert caught.value.timed_out
    assert "no complete answer within 1s" in str(caught.value)
    assert time.monotonic() - started < 2.5


def test_a_refused_stream_names_stream_false_and_upstream_is_not_mistaken_for_it():
    from llm.compat import anthropic_refusal_hint, refusal_hint

    body = {"stream": True, "messages": [], "model": "m"}
    assert refusal_hint("'stream' is not supported", body, Compat()).endswith("set stream: false")
    assert "set stream: false" not in refusal_hint("upstream rejected the request", body, Compat())
    assert anthropic_refusal_hint("stream: Input should be a valid boolean", body).endswith(
        "set stream: false"
    )
    assert anthropic_refusal_hint("cache_control: Extra inputs are not permitted", body).endswith(
        "set compat.prompt_cache: none"
    )
