"""Compaction: a long run's old turns folded into a compact record, written once (DESIGN.md 8).

Masking (llm/context.py) keeps old results short, but every model turn and every masked stub
stays in the history, so the last request grows with the run and passes any context window at a
few hundred steps. Compaction bounds it, without a model and without changing what was written:

| operation | what it does |
|---|---|
| `plan(messages, results, policy, resume=)` | the run's folds: where each one cut, replayed from its call points (or from the previous call's plan) |
| `records(found)` | the digest and the records of the folds, the messages that follow the input |

The protocol, stated once:
- **Call points.** A model call was made before each assistant message and is being planned at
  the end of the conversation: the request at call point `p` held `messages[:p]`. Steps are final
  once a model call is planned (runs/engine/conversation.py), so these never change.
- **Folds.** At each call point, in order, the live history (the turns after the last fold, each
  result counted at the size it is shown: its head and pointer) is measured. Over
  `compact_after_tokens`, every live turn but the newest `compact_keep_turns` is folded: its
  assistant message and its tool messages leave the conversation, and one record takes their
  place. A fold cuts only before an assistant message, so no tool result is parted from its call.
- **Written once.** Replaying from the first call point gives the same folds on every call, so a
  record, once written, is the same bytes on every later request and a prompt cache reads it back.
  A fold rewrites the history once, from the new record on, in the request that makes it.
- **Where records go.** After the run's input, one user message each: [input][digest][records],
  then the live turns. A fold appends a record, so everything up to the previous record stays the
  same bytes. The providers send them as one user turn: Anthropic as one block each (so a cache
  breakpoint on the newest record lets the next fold read every earlier one back), the OpenAI
  wire joined by blank lines (chat templates of self-hosted servers want roles to alternate).
- **Bounded.** Records over `compact_record_tokens` in total are merged, oldest first, into the
  digest until they hold three quarters of it: per tool, how many results and the first and last
  step, and the latest approved calls and refusals. The digest grows with the number of tools, not of steps, so a
  1,000-step run's last request is the size of a 200-step run's. A merge rewrites from the digest
  on, once every few folds.
- **Nothing is lost.** Every folded result is stored on its step; the record names its step and
  `read_result` reads it back, in pages. Loop detection and approvals read the step log, never
  the prompt, so a fold changes nothing they decide.

Pure and deterministic: the same steps and policy give the same bytes on every call and in every
process.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from llm.tokens import CHARS_PER_TOKEN, MESSAGE_OVERHEAD, estimate_text, message_tokens
from llm.types import Message, ToolCall


# What this module reads of llm.context's Result and ContextPolicy (context imports this module).
class Result(Protocol):
    @property
    def seq(self) -> int: ...
    @property
    def tool_name(self) -> str: ...
    @property
    def total_chars(self) -> int: ...
    @property
    def refusal(self) -> str: ...
    @property
    def decision(self) -> str: ...


class ContextPolicy(Protocol):
    @property
    def compacts(self) -> bool: ...
    @property
    def compact_after_tokens(self) -> int: ...
    @property
    def compact_keep_turns(self) -> int: ...
    @property
    def compact_record_tokens(self) -> int: ...
    def limit_for(self, tool_name: str) -> int: ...


POINTER_CHARS = 170  # a head's pointer note (llm.context.pointer), as counted for the budget
ARGUMENT_CHARS = 120  # of a folded call's arguments, in its record line
HEAD_CHARS = 100  # of a folded result, in its record line
TEXT_CHARS = 200  # of the model's own words in a folded turn
REFUSALS_KEPT = 10  # the digest's latest refusals (denied, rejected, approval expired), and approvals
# A merge leaves the records three quarters of their budget: the request's swing between merges
# stays small (a 1,000-step run's requests within 9% of each other), at a merge every few folds.
MERGE_TO = 0.75


@dataclass(frozen=True)
class Line:
    """One folded tool result, as its record shows it (and the digest counts it)."""

    seq: int
    tool_name: str
    text: str
    refusal: str = ""
    decision: str = ""  # a person's decision on its approval ("approved by ravi")


@dataclass(frozen=True)
class Fold:
    """One fold: the messages [start, end) it took out of the conversation, and what it wrote."""

    start: int
    end: int
    at: int  # the call point that made it
    record: str
    lines: tuple[Line, ...]
    turns: int  # assistant messages folded
    live_before: int  # estimated tokens of the live history at `at`, before the fold
    live_after: int  # and after it (the turns it kept)


@dataclass
class Plan:
    """The folds of a conversation and what the digest took from the oldest of them; and where
    the replay stopped, so that the run's next call goes on from there (`plan(resume=...)`)."""

    folds: list[Fold] = field(default_factory=list)
    digested: int = 0  # the first `digested` folds are merged into the digest
    point: int = 0  # the last call point replayed: the conversation's length then
    cost: list[int] = field(default_factory=lambda: [0])  # prefix sums of shown tokens, to `point`
    live_turns: list[int] = field(default_factory=list)  # starts of the live turns, to `point`
    policy: object = None  # the policy it was replayed under
    digest_text: tuple[int, str] = (0, "")  # the digest of the first n folds, made once per merge

    @property
    def live_start(self) -> int:
        return self.folds[-1].end if self.folds else 1

    def resumed(self) -> Plan:
        """A copy to go on from (the lists are copied: the kept plan stays as it was)."""
        return Plan(
            folds=list(self.folds),
            digested=self.digested,
            point=self.point,
            cost=list(self.cost),
            live_turns=list(self.live_turns),
            policy=self.policy,
            digest_text=self.digest_text,
        )


def shown_tokens(message: Message, result: Result | None, policy: ContextPolicy) -> int:
    """A message's estimated tokens as the live history shows it: a tool result at its head and
    pointer (masking only shortens it further: the budget is an upper bound)."""
    if result is None:
        return message_tokens(message)
    chars = len(message.content)
    limit = policy.limit_for(result.tool_name)
    if chars > limit and result.tool_name != "read_result":  # a page already: shown whole
        chars = limit + POINTER_CHARS
    return MESSAGE_OVERHEAD + math.ceil((chars + 2) / CHARS_PER_TOKEN)


def plan(
    messages: list[Message],
    results: Mapping[int, Result],
    policy: ContextPolicy,
    *,
    resume: Plan | None = None,
) -> Plan:
    """The folds of the conversation, replayed from its first call point to its end.

    `resume`: the plan of the same conversation at an earlier call (its messages a prefix of
    these), to replay only the call points since: the same folds as a whole replay (tested),
    without a cost that grows with the run. A plan made under another policy, or one that does
    not end where a model turn starts, is not resumed from.
    """
    if not policy.compacts or len(messages) < 3:
        return Plan(policy=policy)
    found = Plan(policy=policy)
    first = 1  # the first call point to replay
    if (
        resume is not None
        and resume.policy == policy
        and 0 < resume.point <= len(messages)
        and len(resume.cost) == resume.point + 1
        and (resume.point == len(messages) or messages[resume.point].role == "assistant")
    ):
        found = resume.resumed()
        if found.point < len(messages):
            # The previous call's end is where its reply starts: that call point was replayed
            # then; its turn joins the live ones now.
            found.live_turns.append(found.point)
        first = found.point + 1
    cost = found.cost
    for i in range(len(cost) - 1, len(messages)):
        cost.append(cost[i] + shown_tokens(messages[i], results.get(i), policy))
    points = [i for i in range(first, len(messages)) if messages[i].role == "assistant"]
    if first <= len(messages):
        points.append(len(messages))
    for point in points:
        live = found.live_start
        before = cost[point] - cost[live]
        if before > policy.compact_after_tokens and len(found.live_turns) > policy.compact_keep_turns:
            cut = found.live_turns[-policy.compact_keep_turns]
            folded = [i for i in found.live_turns if i < cut]
            found.folds.append(
                _fold(messages, results, live, cut, point, folded, before, cost[point] - cost[cut])
            )
            found.live_turns = found.live_turns[-policy.compact_keep_turns :]
            _digest(found, policy)
        if point < len(messages):
            found.live_turns.append(point)
    found.point = len(messages)
    return found


def _fold(
    messages: list[Message],
    results: Mapping[int, Result],
    start: int,
    end: int,
    at: int,
    turns: list[int],
    live_before: int,
    live_after: int,
) -> Fold:
    calls: dict[str, ToolCall] = {}
    lines, said = [], []
    for i in range(start, end):
        message = messages[i]
        if message.role == "assistant":
            calls.update((call.id, call) for call in message.tool_calls)
            if message.content.strip():
                said.append(f"model: {_flat(message.content, TEXT_CHARS)}")
        result = results.get(i)
        if message.role != "tool" or result is None:
            continue
        if not isinstance(message.record_line, Line):
            message.record_line = _line(message, result, calls.get(message.tool_call_id))
        lines.append(message.record_line)
    seqs = [line.seq for line in lines]
    span = f"steps {min(seqs)}-{max(seqs)}" if seqs else "earlier turns"
    record = "\n".join(
        [
            f"[platform: {span} folded ({len(turns)} model turns, {len(lines)} tool results); each "
            "result is stored: call read_result with its step to see it again]",
            *said,
            *(line.text for line in lines),
        ]
    )
    return Fold(
        start=start,
        end=end,
        at=at,
        record=record,
        lines=tuple(lines),
        turns=len(turns),
        live_before=live_before,
        live_after=live_after,
    )


def _line(message: Message, result: Result, call: ToolCall | None) -> Line:
    """A folded result's line: its step, tool, arguments, and size and start (or why it failed)."""
    arguments = json.dumps(call.arguments, sort_keys=True, ensure_ascii=False) if call else ""
    total = max(result.total_chars, len(message.content))
    if result.refusal:
        # "rejected by ravi": the refusal with who decided it, where a person did.
        refusal = result.decision if result.decision.startswith(result.refusal) else result.refusal
        outcome = f"{refusal}: {_flat(message.content, HEAD_CHARS)}"
    elif message.is_error:
        outcome = f"error: {_flat(message.content, HEAD_CHARS)}"
    else:
        outcome = f"{total} characters: {_flat(message.content, HEAD_CHARS)}"
    if result.decision and not result.refusal:
        outcome = f"{result.decision}; {outcome}"  # the call was made once a person approved it
    text = f"step {result.seq} {result.tool_name} {_flat(arguments, ARGUMENT_CHARS)} -> {outcome}"
    return Line(
        seq=result.seq,
        tool_name=result.tool_name,
        text=text,
        refusal=result.refusal,
        decision=result.decision,
    )


def _digest(found: Plan, policy: ContextPolicy) -> None:
    """Merge the oldest records into the digest once the records pass their budget, down to
    MERGE_TO of it, so a merge (a rewrite of the records) happens once every few folds."""
    kept = found.folds[found.digested :]
    total = sum(estimate_text(f.record) for f in kept)
    if total <= policy.compact_record_tokens:
        return
    while len(kept) > 1 and total > policy.compact_record_tokens * MERGE_TO:
        total -= estimate_text(kept[0].record)
        kept = kept[1:]
        found.digested += 1


def digest(folds: list[Fold]) -> str:
    """The merged records: per tool, its results and their first and last step; the latest
    refusals; how to read any of them back. Bounded by the number of tools."""
    if not folds:
        return ""
    tools: dict[str, list[int]] = {}
    refusals: list[str] = []
    decided: list[str] = []
    turns = 0
    for fold in folds:
        turns += fold.turns
        for line in fold.lines:
            tools.setdefault(line.tool_name, []).append(line.seq)
            if line.refusal:
                refusals.append(line.text)
            elif line.decision:
                decided.append(line.text)
    seqs = [s for found in tools.values() for s in found]
    span = f"steps {min(seqs)}-{max(seqs)}" if seqs else "earlier turns"
    parts = [
        f"[platform: {span} folded earlier ({turns} model turns, {len(seqs)} tool results); each result "
        "is stored: call read_result with its step to see it again]"
    ]
    for name in sorted(tools):
        found = tools[name]
        where = f"step {found[0]}" if len(found) == 1 else f"steps {found[0]} to {found[-1]}"
        parts.append(f"{name}: {len(found)} result{'s' if len(found) > 1 else ''}, {where}")
    if decided:
        parts.append(f"approved by a person (latest {min(len(decided), REFUSALS_KEPT)} of {len(decided)}):")
        parts.extend(decided[-REFUSALS_KEPT:])
    if refusals:
        parts.append(f"refused (latest {min(len(refusals), REFUSALS_KEPT)} of {len(refusals)}):")
        parts.extend(refusals[-REFUSALS_KEPT:])
    return "\n".join(parts)


def records(found: Plan, summaries: Mapping[int, str] | None = None) -> list[Message]:
    """The digest and the records, one user message each, to follow the run's input.

    `summaries`: per fold's call point, a model's summary of it (runs/engine/summaries.py): the
    fold's record shows it in place of the model's own words. Stored once on its step, so the
    record is the same bytes on every call after it; the digest stays deterministic."""
    if found.digest_text[0] != found.digested:
        found.digest_text = (found.digested, digest(found.folds[: found.digested]))
    summaries = summaries or {}
    texts = [found.digest_text[1]] + [
        summarised(fold, summaries[fold.at]) if fold.at in summaries else fold.record
        for fold in found.folds[found.digested :]
    ]
    return [Message(role="user", content=text) for text in texts if text]


SUMMARY_INPUT_CHARS = 24_000  # of the folded turns, sent to the summariser
SUMMARY_PART_CHARS = 2_000  # of each folded message


def summarised(fold: Fold, summary: str) -> str:
    """A fold's record with a model's summary in place of the model's own words: its header, the
    summary, and one line per result (each still names its step for read_result)."""
    header, *rest = fold.record.split("\n")
    return "\n".join(
        [header, f"summary: {summary.strip()}", *(line for line in rest if not line.startswith("model: "))]
    )


def folded_text(messages: list[Message], fold: Fold) -> str:
    """The folded turns as the summariser reads them: each message's start, with its step where
    it is a tool result, bounded in total."""
    parts, total = [], 0
    lines = {line.seq: line for line in fold.lines}
    seqs = iter(sorted(lines))
    for message in messages[fold.start : fold.end]:
        if message.role == "assistant":
            calls = "; ".join(
                f"{c.name} {json.dumps(c.arguments, sort_keys=True, ensure_ascii=False)[:ARGUMENT_CHARS]}"
                for c in message.tool_calls
            )
            text = f"model: {message.content[:SUMMARY_PART_CHARS]}" + (f" [calls: {calls}]" if calls else "")
        elif message.role == "tool":
            seq = next(seqs, None)
            text = f"result of step {seq}: {message.content[:SUMMARY_PART_CHARS]}"
        else:
            text = f"{message.role}: {message.content[:SUMMARY_PART_CHARS]}"
        if total + len(text) > SUMMARY_INPUT_CHARS:
            parts.append("[the rest of the folded turns is left out]")
            break
        parts.append(text)
        total += len(text)
    return "\n\n".join(parts)


def _flat(text: str, limit: int) -> str:
    # Only the start is shown: splitting a whole 6,000-character result on every call cost
    # milliseconds at a few hundred steps.
    flat = " ".join(text[: limit * 4].split())
    return flat if len(flat) <= limit else flat[:limit] + "…"
