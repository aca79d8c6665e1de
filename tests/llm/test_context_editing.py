"""Provider-native context management behind the version's `context` policy (issue 42, part 2):
`compaction: provider` asks an endpoint that declares Anthropic's context editing
(`compat: {context_editing: clear_tool_uses}`) to clear old tool results itself, and falls back
to the platform's deterministic compaction at an endpoint that does not."""

from __future__ import annotations

import pytest

from llm.compat import Compat, problems
from llm.context import ContextPolicy
from llm.providers.anthropic import CONTEXT_MANAGEMENT_BETA, AnthropicProvider
from llm.types import Message, ModelRequest, ToolCall, ToolSpec
from runs.engine import compacted
from runs.models import RunEvent, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tests.fakes.model_servers import CLEARED_PLACEHOLDER, FakeAnthropic

LOOKUP = ToolSpec(name="lookup", description="look up", input_schema={"type": "object"})
CLEARING = {"trigger": 2_000, "keep": 3, "clear_at_least": 500}


def history(turns: int, chars: int = 4_000) -> list[Message]:
    messages = [Message("user", "case DSP-1")]
    for i in range(turns):
        messages.append(Message("assistant", "", [ToolCall(id=f"c{i}", name="lookup", arguments={"i": i})]))
        messages.append(Message("tool", f"result {i} " + "x" * chars, tool_call_id=f"c{i}"))
    return messages


def request(messages: list[Message], clearing: dict | None) -> ModelRequest:
    return ModelRequest(
        model="m",
        instructions="be brief",
        messages=messages,
        tools=[LOOKUP],
        max_output_tokens=64,
        clear_tool_uses=clearing,
    )


@pytest.fixture
def fake():
    server = FakeAnthropic()
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_clears_all_but_the_newest_results_and_says_how_much(fake, stream):
    provider = AnthropicProvider(
        fake.base_url, "sk", "m", compat=Compat(context_editing="clear_tool_uses"), stream=stream
    )
    fake.queue({"text": "done"})
    reply = provider.complete(request(history(8), CLEARING))
    provider.close()

    [body] = fake.requests
    assert body["context_management"] == {
        "edits": [
            {
                "type": "clear_tool_uses_20250919",
                "trigger": {"type": "input_tokens", "value": 2_000},
                "keep": {"type": "tool_uses", "value": 3},
                "clear_at_least": {"type": "input_tokens", "value": 500},
            }
        ]
    }
    assert CONTEXT_MANAGEMENT_BETA in fake.request_headers[-1]["anthropic-beta"]
    # The client sent every result; the model read the newest 3 and placeholders for the rest.
    seen = [
        block["content"]
        for message in fake.edited[-1]["messages"]
        if isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    ]
    assert seen[:5] == [CLEARED_PLACEHOLDER] * 5
    assert [text.split(" ")[:2] for text in seen[5:]] == [["result", "5"], ["result", "6"], ["result", "7"]]
    assert reply.cleared_tool_uses == 5
    assert reply.cleared_input_tokens > 5 * 900  # about a thousand tokens each
    # Billed: what the model read; with what was cleared, what the client sent.
    assert reply.usage.total_input < 5_000 < reply.usage.total_input + reply.cleared_input_tokens


def test_under_the_trigger_or_clear_at_least_nothing_is_cleared(fake):
    provider = AnthropicProvider(fake.base_url, "sk", "m", compat=Compat(context_editing="clear_tool_uses"))
    fake.queue({"text": "done"}, {"text": "done"})
    short = provider.complete(request(history(2), CLEARING))  # under the trigger
    # Over the trigger, but the results it may clear hold less than clear_at_least.
    small = provider.complete(
        request(history(8, chars=10), {**CLEARING, "trigger": 100, "clear_at_least": 5_000})
    )
    provider.close()
    assert (short.cleared_tool_uses, small.cleared_tool_uses) == (0, 0)
    assert fake.edited[-1] == fake.requests[-1]


def test_an_endpoint_that_does_not_declare_it_is_never_sent_it(fake):
    provider = AnthropicProvider(fake.base_url, "sk", "m")  # context_editing: none (the default)
    fake.queue({"text": "done"})
    provider.complete(request(history(8), CLEARING))
    provider.close()
    assert "context_management" not in fake.requests[-1]
    assert "anthropic-beta" not in fake.request_headers[-1]


def test_the_fake_refuses_context_management_without_the_beta_header(fake):
    import httpx

    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    body["context_management"] = {"edits": [{"type": "clear_tool_uses_20250919"}]}
    answer = httpx.post(
        f"{fake.base_url}/v1/messages",
        json=body,
        headers={"x-api-key": "sk", "anthropic-version": "2023-06-01"},
    )
    assert answer.status_code == 400 and CONTEXT_MANAGEMENT_BETA in answer.text


def test_the_policy_and_the_setting_are_checked():
    assert problems({"context_editing": "clear_tool_uses"}, "anthropic") == []
    assert problems({"context_editing": "always"}, "anthropic") == [
        (".context_editing", "must be one of none, clear_tool_uses")
    ]
    assert problems({"context_editing": "clear_tool_uses"}, "openai")[0][1].startswith("only for anthropic")
    policy = ContextPolicy.from_spec({"compaction": "provider", "clear_trigger_tokens": 30_000})
    assert policy.at(clears=True).compaction == "off"  # the provider clears; the platform keeps every turn
    assert policy.at(clears=False).compaction == "deterministic"  # elsewhere the platform compacts
    assert policy.clearing() == {"trigger": 30_000, "keep": 3, "clear_at_least": 4_000}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("declared", [True, False])
def test_a_run_with_the_provider_policy_clears_where_the_endpoint_declares_it(
    tenant, asha, builtins, fake, declared
):
    """The engine: at an endpoint that declares context editing the request asks for it, the
    platform folds nothing and the step records what the provider cleared; at one that does not,
    the same version is compacted by the platform, with its folds on the timeline."""
    from tenants.models import Secret

    echo = builtins["echo"]  # its result repeats its arguments: a few hundred characters each
    factories.grant(echo, use=[asha])
    secret = Secret(tenant=tenant, name="anthropic-key")
    secret.set_value("sk-test")
    secret.save()
    endpoint = factories.make_endpoint(
        tenant,
        name="claude",
        kind="anthropic",
        base_url=fake.base_url,
        secret=secret,
        compat={"context_editing": "clear_tool_uses"} if declared else {},
    )
    context = {
        "compaction": "provider",
        "clear_trigger_tokens": 1_200,
        "clear_at_least_tokens": 100,
        "compact_after_tokens": 300,
    }
    factories.make_agent(
        tenant,
        endpoint=endpoint,
        tools=[echo],
        context=context,
        limits={"max_steps": 60, "max_tool_calls": 30},
    )
    fake.queue(
        *({"tool_calls": [{"name": echo.name, "arguments": {"i": i, "pad": "p" * 400}}]} for i in range(12)),
        {"text": "done"},
    )
    run, _ = start_run(user=asha, agent="agent", input={"case": "clearing"})
    run = drive(run.pk)
    assert run.status == "succeeded", run.error

    asked = ["context_management" in body for body in fake.requests]
    folds = RunEvent.objects.filter(run=run, kind=compacted.KIND).count()
    last = Step.objects.filter(run=run, kind="model").order_by("-seq").first()
    if declared:
        assert all(asked) and folds == 0
        assert last.usage["cleared_tool_uses"] == 12 - 3
        assert "the provider cleared 9 old tool result(s)" in " ".join(
            RunEvent.objects.filter(run=run, step_seq=last.seq).values_list("message", flat=True)
        )
    else:
        assert not any(asked) and folds > 0
        assert "cleared_tool_uses" not in last.usage
