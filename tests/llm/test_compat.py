"""The OpenAI-compatible wire against the servers banks host themselves (llm/compat.py).

The fake OpenAI server validates requests strictly and plays each server family's difference as a
quirk (tests/fakes/model_servers.py QUIRKS). For each: the default request is refused once, with an
error that names the setting to change, and the setting makes the same request go through. Then
through the engine: a refused request fails the run at once (one request at the server, no retry)
with that sentence in the run's error, and the setting, applied from the configuration file, makes
the next run succeed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from llm.compat import Compat
from llm.providers.http import error_detail
from llm.providers.openai import OpenAIProvider
from llm.types import Message, ModelRequest, ProviderError, ToolCall, ToolSpec
from tests.fakes.model_servers import FakeOpenAI

pytestmark = pytest.mark.timeout(60)

TOOLS = [ToolSpec("lookup", "Look a record up.", {"type": "object", "properties": {"q": {"type": "string"}}})]
# A conversation with a tool-call turn that has no text, the shape servers disagree about most.
CONVERSATION = [
    Message("user", "find TXN-1"),
    Message("assistant", "", tool_calls=[ToolCall(id="call_1", name="lookup", arguments={"q": "TXN-1"})]),
    Message("tool", '{"found": true}', tool_call_id="call_1"),
]


@pytest.fixture
def server() -> Iterator[Any]:
    started: list[FakeOpenAI] = []

    def start(*quirks: str) -> FakeOpenAI:
        fake = FakeOpenAI(quirks=quirks, min_cacheable_tokens=0)
        fake.start()
        started.append(fake)
        return fake

    yield start
    for fake in started:
        fake.stop()


def request(instructions: str = "You help bank support agents.") -> ModelRequest:
    return ModelRequest(
        model="m",
        instructions=instructions,
        messages=list(CONVERSATION),
        tools=TOOLS,
        max_output_tokens=100,
        timeout_seconds=10,
    )


def refusal(fake: FakeOpenAI, compat: Compat = Compat(), **kwargs: Any) -> ProviderError:
    provider = OpenAIProvider(fake.base_url, None, "m", compat=compat)
    with pytest.raises(ProviderError) as caught:
        provider.complete(request(**kwargs))
    provider.close()
    return caught.value


def answered(fake: FakeOpenAI, compat: Compat, **kwargs: Any) -> dict:
    provider = OpenAIProvider(fake.base_url, None, "m", compat=compat)
    assert provider.complete(request(**kwargs)).text == "done"
    provider.close()
    return fake.requests[-1]


@pytest.mark.parametrize(
    ("quirk", "setting", "value"),
    [
        ("legacy_max_tokens", "max_tokens_field", "max_tokens"),
        ("string_content", "tool_call_content", "empty_string"),
        ("no_system_role", "system_message", "in_user"),
    ],
)
def test_a_refused_shape_names_the_setting_and_the_setting_makes_it_pass(server, quirk, setting, value):
    fake = server(quirk)
    error = refusal(fake)
    assert not error.retryable
    assert f"set compat.{setting}: {value}" in str(error), str(error)
    assert len(fake.requests) == 1

    body = answered(fake, Compat(**{setting: value}))
    if setting == "max_tokens_field":
        assert body["max_tokens"] == 100 and "max_completion_tokens" not in body
    elif setting == "tool_call_content":
        assert body["messages"][2] == {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"q": "TXN-1"}'},
                }
            ],
        }
    else:
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool"]
        assert body["messages"][0]["content"] == "You help bank support agents.\n\nfind TXN-1"


def test_content_can_be_left_out_of_a_tool_call_turn(server):
    body = answered(server("string_content"), Compat(tool_call_content="omit"))
    assert "content" not in body["messages"][2]


def test_tool_choice_is_omitted_unless_set_and_a_refusal_of_it_says_omit(server):
    fake = server("no_tool_choice")
    assert "tool_choice" not in answered(fake, Compat())
    error = refusal(fake, Compat(tool_choice="auto"))
    assert "set compat.tool_choice: omit" in str(error)
    assert answered(server(), Compat(tool_choice="auto"))["tool_choice"] == "auto"


def test_a_server_that_wants_a_system_message_gets_one_when_always(server):
    fake = server("system_required")
    error = refusal(fake, instructions="")
    assert "set compat.system_message: always" in str(error), str(error)
    body = answered(fake, Compat(system_message="always"), instructions="")
    assert body["messages"][0] == {"role": "system", "content": ""}


def test_a_plain_text_error_body_is_read_as_text_and_still_not_retried(server):
    fake = server("no_system_role", "text_errors")
    error = refusal(fake)
    assert (error.status, error.retryable) == (500, False)
    assert "Internal Server Error: Value error: System role not supported" in str(error)
    assert "set compat.system_message: in_user" in str(error)


@pytest.mark.parametrize(
    ("body", "content_type", "detail"),
    [
        ('{"error": "model \\"x\\" not found"}', "application/json", 'model "x" not found'),  # Ollama
        ('{"object": "error", "message": "bad field", "code": 400}', "application/json", "bad field"),  # vLLM
        ('{"detail": "Not Found"}', "application/json", "Not Found"),  # FastAPI
        ("<html><head><title>502</title></head><body><h1>Bad Gateway</h1></body></html>", "text/html", None),
    ],
)
def test_error_bodies_in_every_shape_read_as_the_servers_words(body, content_type, detail):
    response = httpx.Response(400, content=body.encode(), headers={"content-type": content_type})
    assert error_detail(response) == (detail or "502 Bad Gateway")


def test_a_size_refusal_is_not_mistaken_for_a_field_name(server):
    from llm.compat import refusal_hint

    hint = refusal_hint(
        "'max_tokens' or 'max_completion_tokens' is too large: 4096. This model's maximum context length is 2048",
        {"max_completion_tokens": 4096, "messages": []},
        Compat(),
    )
    assert "lower limits.max_output_tokens" in hint


def test_an_unknown_refusal_points_at_every_setting(server):
    fake = server()
    fake.queue({"fault": "bad_request"})
    error = refusal(fake)
    assert "compat settings" in str(error) and "max_tokens_field: max_completion_tokens|max_tokens" in str(
        error
    )
