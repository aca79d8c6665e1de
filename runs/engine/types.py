"""The engine's shared types: the `Plan` a claim hands on and the `ToolOutcome` of a tool call.

The decisions themselves are frozen types of runs/engine/decisions.py; a Plan is what a decision
to call becomes once the claim has read what the call needs (the request, the tool's row) and
committed it: it carries the lease and the reservation from the claim to the record.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from llm.fallback import Attempt, Chain
from llm.models import ModelEndpoint
from llm.types import ModelRequest
from runs.models import Run, Step
from tools.models import Tool
from tools.types import ToolResult


@dataclass(frozen=True)
class ModelPlan:
    """A model call, as the claim built it: the request, its worst-case cost, where it goes."""

    request: ModelRequest
    estimate: int  # micros reserved for it
    endpoint: ModelEndpoint  # with its secret read: the call needs no database
    seq: int
    summary: dict  # the redacted request as stored on the step
    # The tools the user was allowed at the claim, by name: the record proposes the model's calls
    # to them without reading them again (runs/engine/proposals.propose).
    tools: dict[str, Tool] = field(default_factory=dict)
    # Where the call sits in the version's chain of endpoints, the run's model calls before it,
    # and whether it is its endpoint's circuit probe (llm/fallback.py, llm/breaker.py).
    chain: Chain | None = None
    history: tuple[Attempt, ...] = ()
    probe: bool = False


@dataclass
class ToolPlan:
    """A tool call: its step (with tool and server) and the step log the claim read."""

    step: Step
    steps: list[Step]
    # False for a call the model proposed and nobody approved: no approver can have corrected
    # it, so its result needs no correction note (tools/results.correction_note reads approvals)
    # and its assertion names no approval (authority.for_call).
    may_be_corrected: bool = True


@dataclass
class Plan:
    """What a claim hands on: the lease it took and the call it committed as `dispatching`.

    kind "model" and "tool": the step is committed as dispatching and its budget reserved
    (`reservation_id`), unless `reconcile_first` (a lookup comes first; dispatch.reserve_and_mark
    then commits the call). kind "recover_model": a model call lost with its worker.
    """

    run_id: uuid.UUID
    token: uuid.UUID
    kind: str  # "model" | "tool" | "recover_model"
    lease_seconds: int
    run: Run | None = None  # the row the claim locked (tenant, version, user, endpoint attached)
    step_id: int | None = None
    reservation_id: uuid.UUID | None = None
    reconcile_first: bool = False
    model: ModelPlan | None = None
    tool: ToolPlan | None = None
    step: Step | None = None  # the step as committed `dispatching`
    record_began: dt.datetime | None = None  # when recording the outcome was first tried
    # This process's clock when the claim made the plan, just after reading the time its lease
    # starts from: past `send_by` another worker may own the run, so nothing may be sent.
    leased_at: float = field(default_factory=time.monotonic)

    @property
    def send_by(self) -> float:
        return self.leased_at + self.lease_seconds

    # The parts each kind of plan has for sure, once the claim has committed it.
    @property
    def model_call(self) -> ModelPlan:
        if self.model is None:
            raise TypeError("not a model call")
        return self.model

    @property
    def tool_call(self) -> ToolPlan:
        if self.tool is None:
            raise TypeError("not a tool call")
        return self.tool

    @property
    def dispatched(self) -> Step:
        if self.step is None:
            raise TypeError("nothing committed as dispatching yet")
        return self.step

    @property
    def step_pk(self) -> int:
        if self.step_id is None:
            raise TypeError("no step yet")
        return self.step_id

    @property
    def locked_run(self) -> Run:
        if self.run is None:
            raise TypeError("the claim has not attached its run")
        return self.run


def tool_of(step: Step) -> Tool:
    """A tool step's tool (checked at dispatch: a step without one is denied before it is sent)."""
    if step.tool is None:
        raise TypeError(f"step {step.seq} has no tool")
    return step.tool


@dataclass(frozen=True)
class ToolOutcome:
    """What a tool call (or a status lookup) came to. "in_progress": the provider has the request
    and is still on it (a 409 for a key in use), so it is asked again later, never re-sent.
    "unauthorized": the server answered 401 before the call ran (connections/)."""

    kind: Literal["succeeded", "failed", "unknown", "in_progress", "denied", "not_sent", "unauthorized"]
    result: ToolResult | None = None
    error: str = ""
    retry_after: float | None = None
    reconciled: bool = False
    sent: bool = False  # "in_progress": the call itself was answered so (not a lookup)
    # Which identity this attempt presented (authority.credentials: jti, subject, audience, never a
    # token); "denied": the identity provider refused the user, "not_sent": it did not answer.
    presented: dict | None = None
    challenge: str = ""  # "unauthorized": the server's WWW-Authenticate
    token_presented: bool = False  # "unauthorized": the user's own token was sent, and refused

    @property
    def answer(self) -> ToolResult:
        """The provider's result of a succeeded call."""
        if self.result is None:
            raise TypeError(f"a {self.kind} outcome has no result")
        return self.result


def fenced(run: Run, plan: Plan) -> bool:
    return run.lease_token == plan.token
