"""The engine's shared types: the plan a claim hands on and the `ToolOutcome` of a tool call.

The decisions themselves are frozen types of runs/engine/decisions.py. A decision to call becomes
an `Intent` once the claim has read what the call needs (the request, the tool's row), and a
plan once the claim has reserved its budget and committed it: a `ModelCall`, a `ToolCall` or a
`LostModelCall`, each frozen, each carrying the lease and the reservation from the claim to the
record. A later phase that learns something makes a new plan; none is changed in place.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import ClassVar, Literal

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
    # A summary of a compaction's fold (runs/engine/summaries.py), not an agent's turn: what it
    # folded (its call point `at`, steps, turns, results, record_tokens). None: a model call.
    fold: dict | None = None


@dataclass(frozen=True)
class ToolPlan:
    """A tool call: its step, with tool and server, as the claim read it."""

    step: Step
    # False for a call the model proposed and nobody approved: no approver can have corrected
    # it, so its result needs no correction note (tools/results.correction_note reads approvals)
    # and its assertion names no approval (authority.for_call).
    may_be_corrected: bool = True


@dataclass(frozen=True, slots=True)
class Lease:
    """The lease a claim takes: its token, its length, and this process's clock when the claim
    took it, just after reading the time the lease starts from. Past `send_by` another worker
    may own the run, so nothing may be sent."""

    run_id: uuid.UUID
    token: uuid.UUID
    seconds: int
    taken_at: float = field(default_factory=time.monotonic)

    @property
    def send_by(self) -> float:
        return self.taken_at + self.seconds


@dataclass(frozen=True)
class Intent:
    """A call the claim decided to make, before its budget is reserved and its step committed:
    runs/engine/dispatch.reserve_and_mark turns it into a ModelCall or a ToolCall (or refuses)."""

    lease: Lease
    model: ModelPlan | None = None
    tool: ToolPlan | None = None


class _Leased:
    """What every plan answers about its lease (the fencing token the record compares)."""

    lease: Lease

    @property
    def run_id(self) -> uuid.UUID:
        return self.lease.run_id

    @property
    def token(self) -> uuid.UUID:
        return self.lease.token

    @property
    def lease_seconds(self) -> int:
        return self.lease.seconds

    @property
    def send_by(self) -> float:
        return self.lease.send_by


@dataclass(frozen=True)
class ModelCall(_Leased):
    """A model call committed as `dispatching`, its worst case reserved: what the call and its
    record need, none of it read again."""

    kind: ClassVar[str] = "model"
    lease: Lease
    run: Run  # the row the claim locked (tenant, version, user, endpoint attached)
    step: Step  # as committed `dispatching`
    reservation_id: uuid.UUID
    model: ModelPlan

    @property
    def step_id(self) -> int:
        return self.step.pk


@dataclass(frozen=True)
class ToolCall(_Leased):
    """A tool call. Committed as `dispatching` with its budget reserved (`step`,
    `reservation_id`); or, `reconcile_first`, not yet: the provider is asked first whether the
    lost attempt happened, and dispatch.mark_after_lookup commits the resend as a new ToolCall."""

    kind: ClassVar[str] = "tool"
    lease: Lease
    run: Run
    call: ToolPlan
    step: Step | None = None
    reservation_id: uuid.UUID | None = None
    reconcile_first: bool = False

    @property
    def step_id(self) -> int:
        return self.call.step.pk

    @property
    def dispatched(self) -> Step:
        if self.step is None:
            raise TypeError("nothing committed as dispatching yet")
        return self.step


@dataclass(frozen=True)
class LostModelCall(_Leased):
    """A model call lost with its worker: the claim took the lease and nothing else;
    model_step.recover_model settles what the call may have cost."""

    kind: ClassVar[str] = "recover_model"
    lease: Lease
    run: Run
    step_id: int
    reservation_id: None = None  # nothing is reserved for it: every plan answers the same fields


# What a claim hands on (runs.engine.advance dispatches on the type).
Plan = ModelCall | ToolCall | LostModelCall


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
    # An evaluation's call answered from its recordings (tools/replay.py): nothing was sent, so
    # nothing is charged; `replay_note` says why a call the recordings did not cover got its answer.
    replayed: bool = False
    replay_note: str = ""

    @property
    def answer(self) -> ToolResult:
        """The provider's result of a succeeded call."""
        if self.result is None:
            raise TypeError(f"a {self.kind} outcome has no result")
        return self.result


def fenced(run: Run, plan: _Leased) -> bool:
    return run.lease_token == plan.token
