"""The engine's shared types: the `Plan` a claim hands on and the `ToolOutcome` of a tool call."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from runs.models import Run
from tools.types import ToolResult


@dataclass
class Plan:
    run_id: uuid.UUID
    token: uuid.UUID
    kind: str  # "model" | "tool" | "recover_model"
    lease_seconds: int
    step_id: int | None = None
    reservation_id: uuid.UUID | None = None
    reconcile_first: bool = False
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ToolOutcome:
    kind: str  # "succeeded" | "failed" | "unknown"
    result: ToolResult | None = None
    error: str = ""
    retry_after: float | None = None
    reconciled: bool = False
    sent: bool = False  # "in_progress": the call itself was answered so (not a lookup)


def fenced(run: Run, plan: Plan) -> bool:
    return run.lease_token == plan.token
