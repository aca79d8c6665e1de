"""The run's loop state (runs/engine/loops.py) as pure values: its size on the run row, and states
stored before the short call keys."""

from __future__ import annotations

import json

from agents.spec import LOOP_DEFAULTS, LoopLimits
from runs.engine import loops
from runs.models import Step


def call(seq: int, tool_id: int = 7, name: str = "kb__search", digest: str | None = None) -> Step:
    return Step(seq=seq, tool_id=tool_id, tool_name=name, args_digest=digest or f"{seq:064x}")


def test_a_hundred_different_calls_keep_the_run_row_small():
    """Every step reads and writes the state with the run row: 100 calls were 9 KB of long keys."""
    state = loops.LoopState()
    for seq in range(1, 101):
        state = loops.observed(state, loops.key_of(call(seq)), seq=seq, succeeded=True, empty=False)
    size = len(json.dumps(state.stored()))
    assert len(state.calls) == 100
    assert size < 3_000, size


def test_a_state_stored_with_long_keys_counts_the_same_calls():
    """A run in flight when the keys got short keeps its counts and its replays."""
    step = call(4, digest="ab" * 32)
    long_key = f"{step.tool_id}:{step.tool_name}:{step.args_digest}"
    stored = {"calls": {long_key: [2, 4]}, "tail": [long_key], "alternating": 0, "empties": 0}
    state = loops.LoopState.of(stored)
    key = loops.key_of(step)
    assert state.calls == {key: [2, 4]} and state.tail == (key,)
    again = loops.observed(state, key, seq=9, succeeded=True, empty=False)
    assert again.calls[key] == [3, 4]  # the third time; the first success stays step 4
    limits = LoopLimits(**{**LOOP_DEFAULTS, "max_repeats": 3})
    assert loops.verdict(again, key, limits, tool_name="kb__search") == (
        "stop",
        "the same call kb__search was made 3 times",
    )


def test_different_tools_or_arguments_are_different_calls():
    keys = {
        loops.key_of(call(1, digest="aa" * 32)),
        loops.key_of(call(1, digest="ab" * 32)),
        loops.key_of(call(1, tool_id=8, digest="aa" * 32)),
        loops.key_of(call(1, name="kb__other", digest="aa" * 32)),
    }
    assert len(keys) == 4
    assert all(len(key) == 12 and ":" not in key for key in keys)
