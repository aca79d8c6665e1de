"""Tools implemented inside the platform (server kind `builtin`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from tools import run_python
from tools.types import ToolResult


@dataclass(frozen=True)
class Builtin:
    description: str
    input_schema: dict
    run: Callable[[dict], ToolResult]


def _echo(arguments: dict) -> ToolResult:
    return ToolResult(text=json.dumps(arguments, sort_keys=True), structured=arguments)


def _noop(arguments: dict) -> ToolResult:
    return ToolResult(text="ok")


def _sleep(arguments: dict) -> ToolResult:
    time.sleep(min(float(arguments.get("seconds", 1)), 300))
    return ToolResult(text=f"slept {arguments.get('seconds', 1)}s")


def _clock(arguments: dict) -> ToolResult:
    from django.utils import timezone

    return ToolResult(text=timezone.now().isoformat())


_OBJECT = {"type": "object", "additionalProperties": True}
BUILTINS: dict[str, Builtin] = {
    "echo": Builtin("Return the arguments unchanged.", _OBJECT, _echo),
    "noop": Builtin("Do nothing and answer ok.", _OBJECT, _noop),
    "sleep": Builtin(
        "Wait for the given number of seconds.",
        {
            "type": "object",
            "properties": {"seconds": {"type": "number", "minimum": 0}},
            "required": ["seconds"],
        },
        _sleep,
    ),
    "clock": Builtin("Current time (UTC, ISO 8601).", {"type": "object", "properties": {}}, _clock),
}


def _run_python_by_dispatch(arguments: dict) -> ToolResult:
    raise RuntimeError("run_python needs its step: tools.transports.dispatch sends it to the sandbox runner")


# Listed with the builtins (discovery, the catalogue); called through tools/run_python.py.
BUILTINS["run_python"] = Builtin(run_python.DESCRIPTION, run_python.INPUT_SCHEMA, _run_python_by_dispatch)
