"""No-progress detection: one platform warning to the model, then `loop_detected`.

Patterns, each with a limit from the version's spec (`loop`, defaults in agents.spec.LOOP_DEFAULTS):
- the same call (tool and canonical arguments) made `max_repeats` times in the run, whatever
  came of it: succeeded, failed at the provider, or denied by the platform;
- `max_empty_results` empty results in a row (an empty text, or a result whose collections are
  all empty, like {"tickets": []});
- two different calls alternating (A B A B ...) for `alternation_cycles` cycles.

Checked after every tool step has its outcome (also a denial, a replay, a platform tool's answer).
The counts are kept with the run (`Run.loop_state`) and moved by one pure function per outcome
(`observed`), so a check never rescans the log: its cost is the same at step 200 as at step 2.
A call is kept under a 12-character key (`key_of`), not its tool and argument digest: the state
holds every distinct call of the run and travels with the run row, read by both of a step's
transactions and written by its record, so its size is on every step's bill (with the long keys
it was 9 KB at step 200, and a step there cost 1.2x one at step 25).
The same state answers the replay check (`prior_success`: an identical call that already
succeeded in this run is answered from its record, not sent again).

The call that reaches a limit stops the run. The call just before it gets one platform warning
appended to its observation, so the model reads it on its next turn and can change course. A
run is warned once. So a model that keeps repeating an empty search costs at most `limit`
tool calls (identical ones are replayed from the record by the engine, not sent again) and
`limit` model calls. Runs started before the state existed begin counting at their next call.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field

from agents.spec import LoopLimits, spec_for
from core import chain
from runs.models import Run, RunStatus, Step, StepStatus, StopReason
from runs.transitions import end_run, record_event, write_run_at_end, write_step

EMPTY = {"", "[]", "{}", "null", "none", "no results", "0 results"}
WARNING = (
    "[platform] You are not making progress ({pattern}). Do not repeat this call; change your "
    "approach or give your final answer."
)
FINISHED = (StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.DENIED)


@dataclass(frozen=True)
class LoopState:
    """The run's finished tool calls, as counts: per call key [times made, seq of its first success
    or 0], the last two keys, how long the calls have alternated, empty results in a row."""

    calls: dict[str, list[int]] = field(default_factory=dict)
    tail: tuple[str, ...] = ()
    alternating: int = 0
    empties: int = 0

    @classmethod
    def of(cls, stored: dict | None) -> LoopState:
        stored = stored or {}
        return cls(
            calls={_short(k): list(v) for k, v in (stored.get("calls") or {}).items()},
            tail=tuple(_short(k) for k in stored.get("tail") or ()),
            alternating=int(stored.get("alternating") or 0),
            empties=int(stored.get("empties") or 0),
        )

    def stored(self) -> dict:
        return {
            "calls": self.calls,
            "tail": list(self.tail),
            "alternating": self.alternating,
            "empties": self.empties,
        }


def key_of(step: Step) -> str:
    """The call's key: its tool and canonical arguments, in 72 bits (a collision within one run's
    calls is about as likely as n^2 / 2^73)."""
    return _short(f"{step.tool_id}:{step.tool_name}:{step.args_digest}")


def _short(key: str) -> str:
    if ":" not in key:
        return key  # already short
    # States stored before the short keys held the long form: read, it counts as the same call.
    return base64.urlsafe_b64encode(hashlib.blake2b(key.encode(), digest_size=9).digest()).decode()


def observed(state: LoopState, key: str, *, seq: int, succeeded: bool, empty: bool) -> LoopState:
    """The state after one more finished call (pure)."""
    count, first_success = state.calls.get(key, [0, 0])
    calls = {**state.calls, key: [count + 1, first_success or (seq if succeeded else 0)]}
    if state.tail and key == state.tail[-1]:
        alternating = 0
    elif len(state.tail) == 2 and key == state.tail[0] and state.alternating >= 2:
        alternating = state.alternating + 1
    else:
        alternating = 2 if state.tail else 0
    return LoopState(
        calls=calls,
        tail=(*state.tail[-1:], key),
        alternating=alternating,
        empties=state.empties + 1 if succeeded and empty else 0,
    )


def patterns(state: LoopState, key: str, limits: LoopLimits, *, tool_name: str) -> list[tuple[str, int, int]]:
    """(description, count so far, limit) of each no-progress pattern, after the call `key`."""
    found = []
    if state.alternating >= 3:
        found.append(
            ("alternating between the same two calls", state.alternating, 2 * limits.alternation_cycles)
        )
    repeats = state.calls.get(key, [0, 0])[0]
    found.append((f"the same call {tool_name} was made {repeats} times", repeats, limits.max_repeats))
    found.append((f"{state.empties} empty results in a row", state.empties, limits.max_empty_results))
    return found


def verdict(state: LoopState, key: str, limits: LoopLimits, *, tool_name: str) -> tuple[str, str] | None:
    """("stop" | "warn", pattern) when a limit is reached or is one call away, else None (pure)."""
    found = patterns(state, key, limits, tool_name=tool_name)
    for description, count, limit in found:
        if count >= limit:
            return "stop", description
    for description, count, limit in found:
        if limit > 1 and count == limit - 1:
            return "warn", description
    return None


def prior_success(run: Run, step: Step) -> int | None:
    """The seq of an identical call that already succeeded earlier in this run, if any."""
    seq = LoopState.of(run.loop_state).calls.get(key_of(step), [0, 0])[1]
    return seq if seq and seq < step.seq else None


def _is_empty_value(value) -> bool:
    if isinstance(value, list):
        return not value
    if isinstance(value, dict):
        collections = [v for v in value.values() if isinstance(v, (list, dict))]
        return not value or (bool(collections) and all(_is_empty_value(v) for v in collections))
    return False


def is_empty(step: Step) -> bool:
    result = step.result if isinstance(step.result, dict) else {}
    text = str(result.get("text") or "")
    if text.strip().lower() in EMPTY:
        return True
    structured = result.get("structured")
    if structured is None:
        try:
            structured = json.loads(text)
        except ValueError:
            return False
    return _is_empty_value(structured)


def check(run: Run, step: Step) -> bool:
    """After a tool step's outcome: count it, warn once when a limit is one call away, stop at it.
    True when the run stopped. In the caller's transaction, with the run locked."""
    key = key_of(step)
    succeeded = step.status == StepStatus.SUCCEEDED
    state = observed(
        LoopState.of(run.loop_state),
        key,
        seq=step.seq,
        succeeded=succeeded,
        empty=succeeded and is_empty(step),
    )
    write_run_at_end(run, loop_state=state.stored())
    found = verdict(state, key, spec_for(run.version).loop, tool_name=step.tool_name)
    if found is None:
        return False
    level, pattern = found
    if level == "stop":
        end_run(
            run,
            RunStatus.STOPPED,
            reason=StopReason.LOOP_DETECTED,
            error=pattern,
            message=f"stopped: loop detected ({pattern})",
        )
        return True
    if run.loop_warnings == 0:
        warning = WARNING.format(pattern=pattern)
        write_step(step, observation=f"{step.observation}\n{warning}")
        write_run_at_end(run, adds={"loop_warnings": 1})
        record_event(
            run.pk,
            "loop_warning",
            f"no progress: {pattern}; the model was told to change approach",
            step_seq=step.seq,
            pattern=pattern,
            content=chain.content_of({"observation": step.observation}),  # the observation as now
        )
    return False
