"""The context policy (llm/context.py): heads and pointers, masking in batches, read_result."""

from __future__ import annotations

import json

import pytest

from agents.spec import validate_spec
from llm import context
from llm.context import ContextPolicy, Result
from llm.types import Message, ToolCall
from runs.models import Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tests.fakes.model_servers import FakeOpenAI


def conversation(results: int, chars: int = 3_000) -> tuple[list[Message], dict[int, Result]]:
    messages = [Message("user", "start")]
    shown: dict[int, Result] = {}
    for i in range(results):
        messages.append(Message("assistant", "", [ToolCall(id=f"c{i}", name="lookup", arguments={"i": i})]))
        shown[len(messages)] = Result(seq=2 * i + 2, tool_name="lookup", total_chars=chars)
        messages.append(Message("tool", f"{i:04d}" + "x" * (chars - 4), tool_call_id=f"c{i}"))
    return messages, shown


def tool_texts(messages: list[Message]) -> list[str]:
    return [m.content for m in messages if m.role == "tool"]


def test_it_shows_a_large_result_as_its_head_and_a_pointer():
    messages, results = conversation(1)
    [shown] = tool_texts(context.shape(messages, results, ContextPolicy(result_limit_chars=1_000)))
    assert shown.startswith(messages[2].content[:1_000])
    assert (
        shown[1_000:] == "\n[platform: result of step 2, 3000 characters, showing 1000; call read_result "
        "with step=2 and offset=1000 to read on]"
    )


def test_a_per_tool_limit_overrides_the_default():
    messages, results = conversation(1)
    policy = ContextPolicy(result_limit_chars=1_000, result_limits={"lookup": 5_000})
    assert tool_texts(context.shape(messages, results, policy)) == [messages[2].content]


def test_it_masks_old_results_in_whole_batches_so_the_prefix_changes_once_per_batch():
    # Masking alone: compaction (tests/llm/test_compaction.py) would fold these turns away first.
    policy = ContextPolicy(result_limit_chars=10_000, keep_recent_results=2, mask_batch=4, compaction="off")
    masked_counts = []
    previous: list[str] | None = None
    rewrites = 0
    for n in range(1, 16):
        messages, results = conversation(n)
        texts = tool_texts(context.shape(messages, results, policy))
        masked_counts.append(sum("masked" in t for t in texts))
        if previous is not None and texts[: len(previous)] != previous:
            rewrites += 1
        previous = texts
    # 2 to 5 results shown whole; the boundary moves 4 at a time
    assert masked_counts == [0, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12]
    assert rewrites == 3  # everything else only grows at the end: a cache reads it back


def test_a_masked_result_keeps_its_start_and_says_how_to_read_it_again():
    messages, results = conversation(6)
    policy = ContextPolicy(keep_recent_results=1, mask_batch=5, compaction="off")
    texts = tool_texts(context.shape(messages, results, policy))
    assert texts[0].startswith("0000xxx") and len(texts[0]) < 300
    assert "older result of step 2 masked (3000 characters); call read_result with step=2" in texts[0]


def test_switched_off_it_sends_the_history_unchanged():
    messages, results = conversation(12)
    assert context.shape(messages, results, ContextPolicy(enabled=False)) == messages


def test_pages_end_with_a_pointer_to_the_next_one():
    text = "a" * 2_500
    assert context.page(text, seq=4, offset=0, limit=1_000).endswith("offset=1000 to read on]")
    last = context.page(text, seq=4, offset=2_000, limit=1_000)
    assert last == "a" * 500 + "\n[platform: end of the result of step 4 (2500 characters)]"


@pytest.mark.django_db
def test_the_spec_validates_the_context_policy(tenant):
    factories.make_endpoint(tenant)
    base = {"model": "scripted", "instructions": "x"}
    assert (
        validate_spec(
            {
                **base,
                "context": {
                    "result_limit_chars": 500,
                    "keep_recent_results": 2,
                    "mask_batch": 6,
                    "result_limits": {"kb__search": 4000},
                    "enabled": True,
                    "compaction": "deterministic",
                    "compact_after_tokens": 4_000,
                    "compact_keep_turns": 2,
                    "compact_record_tokens": 1_500,
                },
            },
            tenant,
        )
        == {}
    )
    errors = validate_spec(
        {
            **base,
            "context": {
                "mask_batch": 0,
                "enabled": "yes",
                "result_limits": {"a": -1},
                "compaction": "summary",
                "compact_after_tokens": 0,
                "summariser": "cheap",
            },
        },
        tenant,
    )
    assert set(errors) == {
        "context.mask_batch",
        "context.enabled",
        "context.result_limits.a",
        "context.compaction",
        "context.compact_after_tokens",
        "context.summariser",
    }
    assert errors["context.compaction"] == ["must be one of deterministic, off, provider"]
    assert validate_spec({**base, "expected_cost_micros": 0}, tenant) == {
        "expected_cost_micros": [
            "must be a positive integer (micros a run is expected to cost; learned from "
            "finished runs when absent)"
        ]
    }


@pytest.mark.django_db(transaction=True)
def test_the_model_sees_a_head_and_pages_through_the_stored_result_with_read_result(tenant, asha, builtins):
    fake = FakeOpenAI(min_cacheable_tokens=0)
    fake.start()
    try:
        echo = builtins["echo"]
        factories.grant(echo, use=[asha])
        blob = "".join(f"line {i:04d} of the ledger\n" for i in range(300))  # ~7,500 characters
        endpoint = factories.make_endpoint(tenant, name="gpt", kind="openai", base_url=fake.base_url)
        # The call carries ~1,900 tokens of arguments: an output limit that lets the model write them
        # (the platform cuts a streamed answer at the limit).
        factories.make_agent(
            tenant,
            endpoint=endpoint,
            tools=[echo],
            context={"result_limit_chars": 1_000},
            limits={"max_output_tokens": 4_000},
        )
        fake.queue(
            {"tool_calls": [{"name": echo.name, "arguments": {"blob": blob}}]},
            {"tool_calls": [{"name": "read_result", "arguments": {"step": 2, "offset": 1_000}}]},
            {"text": "done"},
        )
        run, _ = start_run(user=asha, agent="agent", input={"case": 1})
        run = drive(run.pk)
        assert run.status == "succeeded", run.error
    finally:
        fake.stop()

    # read_result is offered from the first call: with compaction (the default) every result of
    # a long run is folded sooner or later, and adding it later would rewrite the cached prefix.
    offered = [[tool["function"]["name"] for tool in body["tools"]] for body in fake.requests]
    assert offered == [[echo.name, "read_result"]] * 3
    stored = Step.objects.get(run=run, seq=2).result["text"]
    assert stored == json.dumps({"blob": blob}, sort_keys=True)  # kept in full
    shown = fake.requests[1]["messages"][-1]["content"]
    assert (
        shown == stored[:1_000] + f"\n[platform: result of step 2, {len(stored)} characters, showing 1000; "
        "call read_result with step=2 and offset=1000 to read on]"
    )
    page = fake.requests[2]["messages"][-1]["content"]
    assert page.startswith(stored[1_000:2_000]) and "offset=2000 to read on]" in page
    read = Step.objects.get(run=run, seq=4)
    assert (read.tool_name, read.status, read.tool_id) == ("read_result", "succeeded", None)
    # the request's cache key is the run, so one run's calls share a cache shard
    assert {body["prompt_cache_key"] for body in fake.requests} == {f"run-{run.pk}"}
