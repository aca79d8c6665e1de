"""Fallback endpoints: where a run's next model call goes, from its recent model calls.

A version names its primary endpoint (`model`) and, in order, its `fallbacks` (agents/spec.py):
each with the error classes that move a call to it and whether the run goes back to the primary
once it has answered. Each attempt is its own step, reserved at its own endpoint's prices, so a
fallback that costs more is paid for only if the budget carries it (else the run stops with that
reason, before anything is sent), and a lost attempt's charge stays held: moving on releases
nothing the provider may have billed.

    error_class(exc)              rate_limited | server_error | timeout | context_too_long, or
                                  refused (no fallback takes it: the same request would fail there too)
    choose(chain, history)        pure: the chain position of the next call, and why it moved
    route(chain, choice, admit)   the endpoint the call goes to once circuit breakers have had
                                  their say (llm/breaker.py): an open circuit moves the call further
                                  down the chain at once; with none left the run waits (`Wait`)

The rules, in `choose`: the first call goes to the primary. After an answer, the next call stays
on the endpoint that answered, or goes back to the primary if that fallback says `move_back`.
After a failure of class C on position i, the call moves to the first later endpoint that takes C;
a 429 moves only once it has been retried that endpoint's `rate_limit_retries` times on position
i (a short burst of 429s is the provider pacing us, not an outage). With no later endpoint taking
C it stays on i (the engine's "failed 5 times in a row" then ends the run). The chain is walked
downwards only, so a run never ping-pongs between two failing endpoints.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agents.spec import Fallback, spec_for
from llm.breaker import Admission
from llm.models import ModelEndpoint
from llm.types import ProviderError

RATE_LIMITED, SERVER_ERROR, TIMEOUT, CONTEXT_TOO_LONG = (
    "rate_limited",
    "server_error",
    "timeout",
    "context_too_long",
)
REFUSED = "refused"  # a 4xx of the request's own making: no endpoint would take it either
CIRCUIT_OPEN, MOVED_BACK = "circuit_open", "moved_back"  # why a call moved, besides a failure class

# What OpenAI, Anthropic, vLLM, llama.cpp, Ollama and LiteLLM answer to a prompt over the window.
_CONTEXT = re.compile(
    r"context[ _.-]?(length|window)|maximum context|prompt is too long|too many (input )?tokens"
    r"|reduce the length|exceeds? the (model'?s? )?(context|maximum)|input is too long",
    re.I,
)


def error_class(exc: ProviderError) -> str:
    """The class of a failed call, as a version's `fallbacks[].on` names them."""
    if exc.status == 429:
        return RATE_LIMITED
    if exc.status == 408 or exc.timed_out:
        return TIMEOUT
    if exc.status is None or (exc.retryable and exc.status >= 500):
        # No HTTP answer: refused or reset connections (the server is down or going down).
        return SERVER_ERROR
    if exc.status in (400, 413, 422) and _CONTEXT.search(str(exc)):
        return CONTEXT_TOO_LONG
    if exc.retryable:
        return SERVER_ERROR  # a 2xx that could not be read: the server is misbehaving
    return REFUSED


@dataclass(frozen=True, slots=True)
class Attempt:
    """A finished model call of the run: the endpoint it went to and its failure class ("" for
    an answer). endpoint_id None: a step from before fallbacks were recorded (the primary)."""

    endpoint_id: int | None
    error_class: str = ""


@dataclass(frozen=True)
class Chain:
    """The version's endpoints in order: the primary, then its fallbacks (None: an endpoint the
    version names that no longer exists, skipped)."""

    endpoints: tuple[ModelEndpoint | None, ...]
    fallbacks: tuple[Fallback, ...]

    def index_of(self, endpoint_id: int | None) -> int:
        for i, endpoint in enumerate(self.endpoints):
            if endpoint is not None and endpoint.pk == endpoint_id:
                return i
        return 0

    def name_of(self, endpoint_id: int | None) -> str:
        found = next((e for e in self.endpoints if e is not None and e.pk == endpoint_id), None)
        return found.name if found is not None else f"endpoint #{endpoint_id}"

    def takes(self, index: int, kind: str) -> bool:
        return index > 0 and self.endpoints[index] is not None and kind in self.fallbacks[index - 1].on


@dataclass(frozen=True, slots=True)
class Choice:
    index: int
    reason: str = ""  # why it is not where the previous call went: a failure class or moved_back


@dataclass(frozen=True)
class Route:
    """Where the call goes: `endpoint`, at `index` of the chain; `probe`: it is its circuit's probe.
    `moved`: (from, to, reason) when it is not the endpoint of the run's previous call."""

    endpoint: ModelEndpoint
    index: int
    probe: bool = False
    moved: tuple[str, str, str] | None = None
    refused: tuple[str, ...] = ()  # endpoints passed over because their circuit is open


@dataclass(frozen=True)
class Wait:
    """Every endpoint the call may go to has an open circuit: try again in `seconds`."""

    seconds: float
    endpoints: tuple[str, ...]


def chain_of(version) -> Chain:
    """The version's chain, with fresh rows (prices, secrets) for its fallbacks: one statement,
    and none for a version without fallbacks."""
    spec = spec_for(version)
    primary = version.model_endpoint
    if not spec.fallbacks:
        return Chain((primary,), ())
    names = [f.model for f in spec.fallbacks]
    rows = {
        e.name: e
        for e in ModelEndpoint.objects.select_related("secret").filter(
            tenant_id=primary.tenant_id, name__in=names
        )
    }
    return Chain((primary, *(rows.get(name) for name in names)), spec.fallbacks)


def choose(chain: Chain, history: Sequence[Attempt]) -> Choice:
    """Where the next call goes, before circuit breakers: the rules in the module's docstring."""
    if not history:
        return Choice(0)
    last = history[-1]
    i = chain.index_of(last.endpoint_id)
    if not last.error_class:
        if i > 0 and chain.fallbacks[i - 1].move_back:
            return Choice(0, MOVED_BACK)
        return Choice(i)
    j = next((k for k in range(i + 1, len(chain.endpoints)) if chain.takes(k, last.error_class)), None)
    if j is None:
        return Choice(i)
    if last.error_class == RATE_LIMITED:
        streak = 0
        for attempt in reversed(history):
            if chain.index_of(attempt.endpoint_id) != i or attempt.error_class != RATE_LIMITED:
                break
            streak += 1
        if streak <= chain.fallbacks[j - 1].rate_limit_retries:
            return Choice(i)
    return Choice(j, last.error_class)


def moves_on(chain: Chain, history: Sequence[Attempt], failed: Attempt) -> bool:
    """Whether the call after this failure goes to another endpoint (then it goes at once, not
    after the failed endpoint's Retry-After, and a refusal the next endpoint takes ends nothing)."""
    return choose(chain, (*history, failed)).index != chain.index_of(failed.endpoint_id)


def route(
    chain: Chain,
    choice: Choice,
    *,
    previous: int | None,
    admit: Callable[[ModelEndpoint], Admission],
) -> Route | Wait:
    """The endpoint the call goes to: the chosen one, or the next ones down the chain whose
    circuit lets it through (`admit`: llm/breaker.admit). `previous`: the endpoint of the run's
    previous model call (None: this is its first, which would go to the primary), to say when and
    why the call moved."""
    primary_id = chain.endpoints[0].pk if chain.endpoints[0] is not None else None
    reason, refused, waits = choice.reason, [], []
    for i in range(choice.index, len(chain.endpoints)):
        endpoint = chain.endpoints[i]
        if endpoint is None:
            continue
        admission = admit(endpoint)
        if not admission.sends:
            refused.append(endpoint.name)
            waits.append(admission.retry_in)
            reason = CIRCUIT_OPEN
            continue
        moved = None
        before = previous if previous is not None else primary_id
        if endpoint.pk != before:
            moved = (chain.name_of(before), endpoint.name, reason or CIRCUIT_OPEN)
        return Route(endpoint, i, probe=admission.verdict == "probe", moved=moved, refused=tuple(refused))
    return Wait(max(min(waits), 1.0) if waits else 1.0, tuple(refused))
