"""Compaction (llm/compaction.py): old turns folded into records written once, a flat last request."""

from __future__ import annotations

import re

import pytest

from llm import context
from llm.context import ContextPolicy, Result
from llm.providers import anthropic, openai
from llm.tokens import estimate_input_tokens
from llm.types import Message, ModelRequest, ToolCall

# Each turn below shows about 450 tokens (a 1,200-character head and its pointer).
POLICY = ContextPolicy(compact_after_tokens=1_000, compact_record_tokens=600)


def conversation(
    turns: int,
    *,
    chars: int = 3_000,
    tools=("lookup",),
    refused: dict[int, str] | None = None,
    decided: dict[int, str] | None = None,
) -> tuple[list[Message], dict[int, Result]]:
    """A run's conversation: `turns` model turns, each calling one tool (in turn from `tools`),
    the result of turn i at step 2i + 2."""
    messages = [Message("user", '{"case": "DSP-1"}')]
    shown: dict[int, Result] = {}
    for i in range(turns):
        name = tools[i % len(tools)]
        messages.append(Message("assistant", "", [ToolCall(id=f"c{i}", name=name, arguments={"i": i})]))
        refusal = (refused or {}).get(i, "")
        shown[len(messages)] = Result(
            seq=2 * i + 2,
            tool_name=name,
            total_chars=chars,
            refusal=refusal,
            decision=(decided or {}).get(i, ""),
        )
        body = f"policy forbids {name}" if refusal else f"{i:04d}" + "x" * (chars - 4)
        messages.append(Message("tool", body, tool_call_id=f"c{i}", is_error=bool(refusal)))
    return messages, shown


def request(messages: list[Message]) -> ModelRequest:
    return ModelRequest(model="m", instructions="", messages=messages, tools=[], max_output_tokens=1)


def records(shaped: list[Message]) -> list[str]:
    return [m.content for m in shaped[1:] if m.role == "user"]


def call_points(messages: list[Message]) -> list[int]:
    """Where the model was called: before each assistant message, and at the end."""
    return [i for i, m in enumerate(messages) if m.role == "assistant"] + [len(messages)]


def upto(point: int, messages: list[Message], results: dict[int, Result]):
    return messages[:point], {k: v for k, v in results.items() if k < point}


def test_it_folds_the_oldest_turns_into_one_record_once_the_live_history_passes_its_budget():
    messages, results = conversation(4)
    assert context.shaped(*upto(5, messages, results), POLICY).folds == []  # 2 turns: 900 tokens
    at_fold = context.shaped(*upto(7, messages, results), POLICY)  # 3 turns: 1,350 tokens
    assert at_fold.new_fold is at_fold.folds[0]
    shaped = context.shaped(messages, results, POLICY)
    assert shaped.new_fold is None  # made at the previous call, and the same bytes again here
    [record] = records(shaped.messages)
    assert shaped.messages[0] == messages[0]  # the run's input stays first, unchanged
    assert record.splitlines() == [
        "[platform: steps 2-4 folded (2 model turns, 2 tool results); each result is stored: call "
        "read_result with its step to see it again]",
        'step 2 lookup {"i": 0} -> 3000 characters: 0000' + "x" * 96 + "…",
        'step 4 lookup {"i": 1} -> 3000 characters: 0001' + "x" * 96 + "…",
    ]
    # The newer turns stay live, as before: their calls, then each result's head and pointer.
    assert [m.role for m in shaped.messages] == ["user", "user", "assistant", "tool", "assistant", "tool"]
    assert shaped.messages[2] is messages[5]
    assert shaped.messages[5].content.endswith("call read_result with step=8 and offset=1200 to read on]")
    assert shaped.paged


def test_a_record_once_written_is_the_same_bytes_on_every_later_call():
    """Between folds every request starts with the previous one; a fold rewrites the history once
    from its new record on, never the records before it (unless the digest takes them)."""
    messages, results = conversation(120)
    previous: list[Message] | None = None
    folds = digests = digested = 0
    for point in call_points(messages):
        shaped = context.shaped(*upto(point, messages, results), POLICY)
        if previous is not None:
            if shaped.new_fold is None:
                assert shaped.messages[: len(previous)] == previous, point
            elif shaped.digested == digested:
                folds += 1
                kept = records(previous)
                assert records(shaped.messages)[: len(kept)] == kept  # the earlier records stay
            else:
                digests += 1
        previous, digested = shaped.messages, shaped.digested
    assert folds > 30 and 0 < digests < folds  # merges are rarer than folds


def test_the_last_request_stops_growing():
    """The history swings between folds (and between merges into the digest), never upward: the
    requests of turns 400 to 500 are no larger than those of turns 100 to 200 (but for the digits
    of their step numbers)."""
    messages, results = conversation(500, tools=("lookup", "ledger", "notes"))
    sizes = [
        estimate_input_tokens(request(context.shape(*upto(point, messages, results), POLICY)))
        for point in call_points(messages)
    ]
    early, late = sizes[100:200], sizes[400:]
    assert max(late) <= max(early) * 1.01 and min(late) >= min(early) * 0.95, (
        min(early),
        max(early),
        min(late),
        max(late),
    )
    unshaped = estimate_input_tokens(request(messages[: call_points(messages)[100]]))
    assert max(early) < unshaped / 10


def test_every_folded_result_can_be_found_again_by_its_step():
    """In a record line, or through the digest: its tool's results and their first and last step
    (a tool called once names its one step, which is how a model finds an early result)."""
    tools = ("vault", *["lookup"] * 9)
    messages, results = conversation(300, tools=tools)
    shaped = context.shaped(messages, results, POLICY)
    text = "\n".join(records(shaped.messages))
    assert shaped.digested > 0
    [digest] = [r for r in records(shaped.messages) if "folded earlier" in r]
    folded = {r.seq for i, r in results.items() if i < shaped.folds[-1].end}
    in_digest = {r.seq for f in shaped.folds[: shaped.digested] for r in f.lines}
    in_records = {int(s) for s in re.findall(r"^step (\d+) ", text, re.M)}
    assert in_digest | in_records == folded and not in_digest & in_records
    vaults = sorted(s for s in in_digest if s % 20 == 2)  # vault: turns 0, 10, 20, ...: step 2, 22, ...
    assert f"vault: {len(vaults)} results, steps 2 to {vaults[-1]}" in digest.splitlines()
    assert len(digest) < 1_000  # bounded by the tools, not the 300 turns


def test_refusals_are_named_in_the_record_and_kept_by_the_digest():
    messages, results = conversation(120, refused={1: "denied", 5: "rejected", 40: "approval expired"})
    shaped = context.shaped(messages, results, POLICY)
    [digest] = [r for r in records(shaped.messages) if "folded earlier" in r]
    assert 'step 4 lookup {"i": 1} -> denied: policy forbids lookup' in digest
    assert "refused (latest 3 of 3):" in digest
    assert 'step 82 lookup {"i": 40} -> approval expired: policy forbids lookup' in digest


def test_a_persons_decisions_are_named_in_the_record_and_kept_by_the_digest():
    """The issue's record holds the approvals and denials: a call made once a person approved it
    says who did, in its record and, once merged, in the digest; a person's refusal too."""
    messages, results = conversation(
        120,
        refused={5: "rejected"},
        decided={3: "approved by ravi", 5: "rejected by ravi", 60: "approved by meera"},
    )
    # At the fold that takes turn 3, its record says who approved the call.
    point = next(
        p for p in call_points(messages) if context.shaped(*upto(p, messages, results), POLICY).folds
    )
    for p in call_points(messages):
        found = context.shaped(*upto(p, messages, results), POLICY)
        if any(line.seq == 8 for fold in found.folds[found.digested :] for line in fold.lines):
            record = next(r for r in records(found.messages) if "step 8 " in r)
            assert 'step 8 lookup {"i": 3} -> approved by ravi; 3000 characters: 0003xxx' in record
            break
    else:
        raise AssertionError(f"turn 3 was never in a record (first fold at {point})")
    shaped = context.shaped(messages, results, POLICY)
    [digest] = [r for r in records(shaped.messages) if "folded earlier" in r]
    assert "approved by a person (latest 2 of 2):" in digest
    assert 'step 8 lookup {"i": 3} -> approved by ravi; 3000 characters' in digest
    assert 'step 122 lookup {"i": 60} -> approved by meera; ' in digest
    assert 'step 12 lookup {"i": 5} -> rejected by ravi: policy forbids lookup' in digest
    assert "refused (latest 1 of 1):" in digest


def test_it_never_parts_a_result_from_its_call():
    messages = [Message("user", "start")]
    results: dict[int, Result] = {}
    seq = 1
    for i in range(30):  # parallel calls: three results per turn
        calls = [ToolCall(id=f"c{i}_{k}", name="lookup", arguments={"i": i, "k": k}) for k in range(3)]
        messages.append(Message("assistant", f"turn {i}", calls))
        for call in calls:
            seq += 1
            results[len(messages)] = Result(seq=seq, tool_name="lookup", total_chars=900)
            messages.append(Message("tool", "y" * 900, tool_call_id=call.id))
        seq += 1
    shaped = context.shape(messages, results, POLICY)
    live = [m for m in shaped if m.role != "user"]
    assert live[0].role == "assistant"
    answered = {c.id for m in live if m.role == "assistant" for c in m.tool_calls}
    assert {m.tool_call_id for m in live if m.role == "tool"} == answered
    # The model's own words in a folded turn, in its record.
    assert re.search(r"^model: turn \d+$", "\n".join(records(shaped)), re.M)


@pytest.mark.parametrize("policy", [ContextPolicy(compaction="off"), ContextPolicy(enabled=False)])
def test_switched_off_every_turn_stays(policy):
    messages, results = conversation(60)
    shaped = context.shape(messages, results, policy)
    assert len(shaped) == len(messages) and records(shaped) == []


def test_read_result_is_offered_from_the_first_call_when_compacting():
    tools = [compaction_spec("lookup")]
    assert [t.name for t in context.offered(tools, ContextPolicy(), paged=False)] == ["lookup", "read_result"]
    off = ContextPolicy(compaction="off")
    assert [t.name for t in context.offered(tools, off, paged=False)] == ["lookup"]
    assert context.offered([], ContextPolicy(), paged=False) == []  # nothing to read back


def compaction_spec(name: str):
    from llm.types import ToolSpec

    return ToolSpec(name=name, description=name, input_schema={"type": "object"})


def test_the_openai_wire_sends_input_and_records_as_one_user_turn():
    messages, results = conversation(12)
    shaped = context.shape(messages, results, POLICY)
    wire = openai.build_messages("be brief", shaped)
    assert [m["role"] for m in wire] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert wire[1]["content"] == "\n\n".join([messages[0].content, *records(shaped)])
    # One more fold appends to that turn: the bytes before it are the same (the cache holds).
    more, more_results = conversation(14)
    longer = openai.build_messages("be brief", context.shape(more, more_results, POLICY))
    assert longer[1]["content"].startswith(wire[1]["content"] + "\n\n[platform: steps")


def test_the_anthropic_wire_sends_each_record_as_a_block_of_the_first_user_turn():
    messages, results = conversation(12)
    point = next(
        p for p in call_points(messages)[8:] if context.shaped(*upto(p, messages, results), POLICY).new_fold
    )
    shaped = context.shape(*upto(point, messages, results), POLICY)
    wire = anthropic.mark_conversation(anthropic.build_messages(shaped))
    first = wire[0]["content"]
    assert [b["text"] for b in first] == [messages[0].content, *records(shaped)]
    assert len(first) >= 3
    # A fold keeps one turn live, so the previous-end breakpoint falls on the newest record: the
    # next fold reads every earlier record back from the cache and writes only its own.
    assert [m["role"] for m in wire] == ["user", "assistant", "user"]
    assert first[-1]["cache_control"] == {"type": "ephemeral"}
    assert all("cache_control" not in block for block in first[:-1])


@pytest.mark.parametrize("turns,parallel", [(80, 1), (60, 3)])
def test_going_on_from_the_previous_call_gives_the_folds_of_a_whole_replay(turns, parallel):
    """The engine keeps each call's plan and resumes from it (runs/engine/conversation.py): at
    every call point, and after a call retried at the same point, the bytes are those of a
    replay from the start, which is what a process reading the run whole makes."""
    messages = [Message("user", "start")]
    results: dict[int, Result] = {}
    seq = 1
    for i in range(turns):
        calls = [ToolCall(id=f"c{i}_{k}", name=f"t{k}", arguments={"i": i}) for k in range(parallel)]
        messages.append(Message("assistant", "", calls))
        for k, call in enumerate(calls):
            seq += 1
            results[len(messages)] = Result(seq=seq, tool_name=call.name, total_chars=700 * (1 + (i + k) % 5))
            messages.append(Message("tool", "z" * 700 * (1 + (i + k) % 5), tool_call_id=call.id))
        seq += 1
    kept = None
    resumed_folds = 0
    for point in call_points(messages):
        for _retry in range(2):  # the same call point planned twice, resumed both times
            shaped = context.shaped(*upto(point, messages, results), POLICY, resume=kept)
            whole = context.shaped(*upto(point, messages, results), POLICY)
            assert shaped.messages == whole.messages, point
            assert [f.record for f in shaped.folds] == [f.record for f in whole.folds]
            assert shaped.digested == whole.digested
            kept = shaped.plan
        resumed_folds = len(shaped.folds)
    assert resumed_folds > 10
    # Under another policy the kept plan is not used: a whole replay under the new one.
    other = ContextPolicy(compact_after_tokens=3_000)
    assert (
        context.shape(messages, results, other)
        == context.shaped(messages, results, other, resume=kept).messages
    )
