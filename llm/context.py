"""The context policy: what of a run's history the model is shown on each call (DESIGN.md 8).

Every call re-sends the history, so a long run's cost grows with the square of its steps unless
the history is kept short and its prefix byte-stable (so provider prompt caches read it back):
- a tool result longer than its tool's limit is shown as its head plus a pointer; the full
  result stays stored on its step and the model pages through it with `read_result`;
- once more than `keep_recent_results + mask_batch - 1` results are shown whole, the oldest
  `mask_batch` of them are masked at once (a one-line stub with the same pointer). The boundary
  moves in whole batches, so between two moves every request starts with the previous request
  byte for byte and a cache reads all of it; a move rewrites the history once from the first
  newly masked result, in the same request that adds the new turn: one cache write per batch.

- once the history past the records passes `compact_after_tokens`, its oldest turns are folded
  into a compact record, written once and stable from then on (llm/compaction.py): the calls
  and their arguments, one line per result with its step, the refusals; the last request then
  stays flat however long the run.

The policy is part of the agent version's spec (`context`), so it is as immutable as the version.
Defaults were chosen by measurement on the reference run of `bench/context.py` (25 tool turns,
6,000-token prefix, 6,000-character results), where they meet the targets on both wires.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from llm import compaction
from llm.types import Message, ToolSpec

READ_RESULT = "read_result"
READ_RESULT_SPEC = ToolSpec(
    name=READ_RESULT,
    description="Read a stored tool result that was shortened or masked in this conversation (give the step "
    "number from its [platform: ...] note), or the text of an artifact of this run (give its artifact_id as "
    "artifact); and the offset to read from.",
    input_schema={
        "type": "object",
        "properties": {
            "step": {"type": "integer", "minimum": 1},
            "artifact": {"type": "string", "maxLength": 64},
            "offset": {"type": "integer", "minimum": 0},
        },
        "additionalProperties": False,
    },
)

# Measured with bench/context.py (docs/context.md has the table).
DEFAULT_RESULT_LIMIT_CHARS = 1_200
DEFAULT_KEEP_RECENT_RESULTS = 2
DEFAULT_MASK_BATCH = 8
DEFAULT_COMPACT_AFTER_TOKENS = 1_200
DEFAULT_COMPACT_KEEP_TURNS = 1
DEFAULT_COMPACT_RECORD_TOKENS = 1_200
# `compaction: provider` on an endpoint that clears old tool results itself (Anthropic's context
# editing, llm/compat.py `context_editing: clear_tool_uses`); measured with bench/context.py.
DEFAULT_CLEAR_TRIGGER_TOKENS = 12_000
DEFAULT_CLEAR_KEEP_TOOL_USES = 3
DEFAULT_CLEAR_AT_LEAST_TOKENS = 4_000

INT_KEYS = (
    "result_limit_chars",
    "keep_recent_results",
    "mask_batch",
    "compact_after_tokens",
    "compact_keep_turns",
    "compact_record_tokens",
    "clear_trigger_tokens",
    "clear_keep_tool_uses",
    "clear_at_least_tokens",
)
# "provider": the endpoint's own context management where it declares support (llm/compat.py),
# deterministic compaction elsewhere.
COMPACTION = ("deterministic", "off", "provider")


@dataclass(frozen=True)
class ContextPolicy:
    result_limit_chars: int = DEFAULT_RESULT_LIMIT_CHARS
    # Per tool name: a different limit (a tool whose results the model needs whole, say).
    result_limits: dict[str, int] = field(default_factory=dict)
    keep_recent_results: int = DEFAULT_KEEP_RECENT_RESULTS
    mask_batch: int = DEFAULT_MASK_BATCH
    enabled: bool = True
    # llm/compaction.py: "deterministic" folds old turns into records; "off" keeps every turn.
    compaction: str = "deterministic"
    compact_after_tokens: int = DEFAULT_COMPACT_AFTER_TOKENS  # the live history's budget
    compact_keep_turns: int = DEFAULT_COMPACT_KEEP_TURNS  # the newest turns a fold leaves live
    compact_record_tokens: int = DEFAULT_COMPACT_RECORD_TOKENS  # records, before the digest takes the oldest
    # `compaction: provider`, on an endpoint that clears old tool results itself: past this many
    # input tokens it clears every result but the newest few, if that clears at least so many.
    clear_trigger_tokens: int = DEFAULT_CLEAR_TRIGGER_TOKENS
    clear_keep_tool_uses: int = DEFAULT_CLEAR_KEEP_TOOL_USES
    clear_at_least_tokens: int = DEFAULT_CLEAR_AT_LEAST_TOKENS
    # The name of a model endpoint of the tenant that summarises each fold (runs/engine/summaries.py);
    # empty: the deterministic record alone (the default).
    summariser: str = ""

    @classmethod
    def from_spec(cls, section: dict | None) -> ContextPolicy:
        """The version's `context` section (validated by agents.spec) over the defaults."""
        section = section or {}
        keys = (*INT_KEYS, "result_limits", "enabled", "compaction", "summariser")
        return cls(**{key: section[key] for key in keys if key in section})

    def limit_for(self, tool_name: str) -> int:
        return self.result_limits.get(tool_name, self.result_limit_chars)

    @property
    def compacts(self) -> bool:
        return self.enabled and self.compaction == "deterministic"

    def at(self, *, clears: bool) -> ContextPolicy:
        """The policy as applied at an endpoint: `compaction: provider` is the provider's own
        clearing (the platform keeps every turn, masking as set) where the endpoint `clears`,
        and deterministic compaction where it does not (a fallback endpoint without it, say)."""
        if self.compaction != "provider":
            return self
        return replace(self, compaction="off" if clears else "deterministic")

    def clearing(self) -> dict[str, int]:
        """What the provider is asked to clear (llm.types.ModelRequest.clear_tool_uses)."""
        return {
            "trigger": self.clear_trigger_tokens,
            "keep": self.clear_keep_tool_uses,
            "clear_at_least": self.clear_at_least_tokens,
        }


@dataclass(frozen=True)
class Result:
    """What the shaping needs to know about one tool message: its step and its tool."""

    seq: int
    tool_name: str
    total_chars: int  # of the full stored result (the observation may already be capped)
    artifacts: bool = False  # it describes an artifact (a file the model can page with read_result)
    refusal: str = ""  # the call was not made: "denied", "rejected" or "approval expired"
    # A person's decision on the call's approval, as its record names it: "approved by ravi",
    # "rejected by ravi" ("" for a call that needed none).
    decision: str = ""


def offered(
    tools: list[ToolSpec], policy: ContextPolicy, *, paged: bool = True, artifacts: bool = False
) -> list[ToolSpec]:
    """The tools of a request: sorted by name, then read_result once the policy has shortened or
    masked a result (`paged`) it could page back, or the model has been shown an artifact
    (`artifacts`: even an agent with no tools may read the files it was given). It is added at
    the end, once: shortened and masked results stay so, so the prefix changes a single time in a
    run (one cache write) and a run with nothing to page through is never offered it.

    A compacting policy offers it from the first call to an agent with tools: every result of a
    long run is folded sooner or later, and adding it at the second call would rewrite the whole
    cached prefix (instructions and tools) once more, a tenth of the reference run's bill."""
    tools = sorted(tools, key=lambda t: t.name)
    # A result the provider clears is read back the same way: offered from the first call too.
    paged = paged or policy.compacts or policy.compaction == "provider"
    return tools + [READ_RESULT_SPEC] if policy.enabled and ((tools and paged) or artifacts) else tools


def pointer(seq: int, shown: int, total: int) -> str:
    return (
        f"[platform: result of step {seq}, {total} characters, showing {shown}; "
        f"call {READ_RESULT} with step={seq} and offset={shown} to read on]"
    )


def masked(result: Result, message: Message) -> str:
    head = message.content[:120].replace("\n", " ")
    total = max(result.total_chars, len(message.content))
    return (
        f"{head}… [platform: older result of step {result.seq} masked ({total} characters); "
        f"call {READ_RESULT} with step={result.seq} to see it again]"
    )


@dataclass(frozen=True)
class Shaped:
    """What the model is shown, and what the shaping did to get there."""

    messages: list[Message]
    paged: bool  # a result was shortened, masked or folded: read_result has something to read
    folds: list[compaction.Fold]  # every fold so far, oldest first
    digested: int  # how many of them the digest holds
    at: int  # the call point: the length of the conversation shaped
    plan: compaction.Plan | None = None  # to resume from on the run's next call

    @property
    def new_fold(self) -> compaction.Fold | None:
        """The fold this call makes (at the end of the conversation), if it makes one."""
        return self.folds[-1] if self.folds and self.folds[-1].at == self.at else None


def shape(messages: list[Message], results: dict[int, Result], policy: ContextPolicy) -> list[Message]:
    """The messages the model is shown. `results`: message index -> its step, for tool messages."""
    return shaped(messages, results, policy).messages


def shaped(
    messages: list[Message],
    results: dict[int, Result],
    policy: ContextPolicy,
    *,
    resume: compaction.Plan | None = None,
    summaries: dict[int, str] | None = None,
) -> Shaped:
    """The messages the model is shown and how they were made. `results`: message index -> its
    step, for tool messages. `resume`: the previous call's Shaped.plan (compaction.plan).
    `summaries`: per fold's call point, a model's summary of it (compaction.records).

    Pure and deterministic: the same steps give the same bytes on every call, which is what lets
    a provider's cache read the previous request back.
    """
    if not policy.enabled:
        return Shaped(messages=messages, paged=False, folds=[], digested=0, at=len(messages))
    folds = compaction.plan(messages, results, policy, resume=resume)
    live = folds.live_start
    # Only the live turns are shown as messages: the work here does not grow with the run.
    positions = [i for i in range(live, len(messages)) if messages[i].role == "tool" and i in results]
    hidden = max(len(positions) - policy.keep_recent_results, 0)
    hidden -= hidden % policy.mask_batch  # the boundary moves in whole batches only
    mask = set(positions[:hidden])
    shaped = list(messages)
    for i in positions:
        message, result = messages[i], results[i]
        if i in mask:
            if len(message.content) > 200:
                shaped[i] = _with(message, masked(result, message))
            continue
        limit = policy.limit_for(result.tool_name)
        # A read_result answer is already one page with its own pointer.
        if len(message.content) > limit and result.tool_name != READ_RESULT:
            total = max(result.total_chars, len(message.content))
            shaped[i] = _with(message, message.content[:limit] + "\n" + pointer(result.seq, limit, total))
    paged = any(shaped[i] is not messages[i] for i in positions)
    if folds.folds:
        shaped = [messages[0], *compaction.records(folds, summaries), *shaped[live:]]
    return Shaped(
        messages=shaped,
        paged=paged or bool(folds.folds),
        folds=folds.folds,
        digested=folds.digested,
        at=len(messages),
        plan=folds,
    )


def _with(message: Message, content: str) -> Message:
    return Message(
        role=message.role, content=content, tool_call_id=message.tool_call_id, is_error=message.is_error
    )


def page(text: str, *, offset: int, limit: int, seq: int | None = None, artifact: str | None = None) -> str:
    """One page of a stored result (of step `seq`) or of an artifact's text, for read_result, with
    a pointer to the next one."""
    offset = max(offset, 0)
    chunk = text[offset : offset + limit]
    end = offset + len(chunk)
    what, argument = (
        (f"artifact {artifact}", f"artifact={artifact}") if artifact else (f"step {seq}", f"step={seq}")
    )
    if end < len(text):
        return (
            chunk
            + "\n"
            + (
                f"[platform: {'text of ' if artifact else 'result of '}{what}, characters {offset}-{end} of "
                f"{len(text)}; call {READ_RESULT} with {argument} and offset={end} to read on]"
            )
        )
    return (
        chunk
        + f"\n[platform: end of the {'text of ' if artifact else 'result of '}{what} ({len(text)} characters)]"
    )
