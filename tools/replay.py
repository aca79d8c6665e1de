"""Answering an evaluation's tool calls from recordings (docs/evaluations.md): nothing is sent.

    answer(recordings, tool, arguments, earlier=n, uncovered=...)   the recorded result of the call

A recording is {"tool": "bank__lookup_transaction", "arguments": {...}, "result": {"text": ...,
"structured": ..., "is_error": false}} (or "error": "..." for a call that failed). A call is
covered when a recording of the same tool has the same arguments; the n-th such call of a run
takes the n-th such recording (a retried lookup may be recorded twice with different answers) and
repeats the last one after that. A call no recording covers (another tool, other arguments) is
answered as the evaluation says: an error the model is shown, or the recording of the same tool
whose arguments are nearest (most equal top-level values). Either way the answer says so, and the
engine reports it on the run's timeline.

Pure: no database, no network; the engine passes the run's recordings in (runs.models.RunReplay).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tools.types import ToolResult


@dataclass(frozen=True)
class Replayed:
    result: ToolResult | None  # None: the recording is of a failed call (`error`)
    error: str = ""
    covered: bool = True
    note: str = ""  # why an uncovered call got this answer


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _result(recording: dict) -> ToolResult | None:
    if "error" in recording and "result" not in recording:
        return None
    result = recording.get("result") or {}
    if isinstance(result, str):
        return ToolResult(text=result)
    structured = result.get("structured")
    text = result.get("text")
    if text is None:
        text = json.dumps(structured) if structured is not None else ""
    return ToolResult(text=text, structured=structured, is_error=bool(result.get("is_error")))


def _answer(recording: dict, *, covered: bool, note: str = "") -> Replayed:
    result = _result(recording)
    error = "" if result is not None else str(recording.get("error") or "the recorded call failed")
    return Replayed(result=result, error=error, covered=covered, note=note)


def nearness(recorded: dict, arguments: dict) -> int:
    """How many top-level arguments are equal, less how many are on one side only."""
    recorded, arguments = recorded or {}, arguments or {}
    equal = sum(1 for k, v in arguments.items() if k in recorded and _same(recorded[k], v))
    one_side = len(set(recorded) ^ set(arguments))
    return equal * 2 - one_side


def answer(
    recordings: list[dict], tool: str, arguments: dict, *, earlier: int = 0, uncovered: str = "error"
) -> Replayed:
    """The recorded answer to `tool(arguments)`; `earlier`: calls of the run with the same tool and
    arguments answered before this one."""
    same_tool = [r for r in recordings if r.get("tool") == tool]
    exact = [r for r in same_tool if _same(r.get("arguments") or {}, arguments or {})]
    if exact:
        return _answer(exact[min(earlier, len(exact) - 1)], covered=True)
    if uncovered == "nearest" and same_tool:
        nearest = max(same_tool, key=lambda r: nearness(r.get("arguments") or {}, arguments))
        return _answer(
            nearest,
            covered=False,
            note=f"no recording of {tool} with these arguments: answered from the nearest, "
            f"{json.dumps(nearest.get('arguments') or {}, sort_keys=True)}",
        )
    why = (
        f"no recording of {tool} with these arguments"
        if same_tool
        else f"no recording of {tool} in this evaluation case"
    )
    return Replayed(result=None, error=f"not replayed: {why}", covered=False, note=why)
