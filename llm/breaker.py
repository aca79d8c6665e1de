"""Circuit breakers per model endpoint, shared by every worker process through PostgreSQL.

    closed     calls go. A failure that says the endpoint is not serving (5xx or overloaded, a
               refused connection, no answer within the timeout: COUNTED) is counted in a window
               of `breaker_window_seconds`; `breaker_failures` of them in one window open it.
    open       calls are not sent: the engine moves them to the next fallback at once, or lets the
               run wait (a countdown, no worker held) when there is none, instead of each call
               burning its timeout on a dead endpoint. After `breaker_open_seconds`:
    half_open  the first caller gets the probe (`admit` answers PROBE): its call goes out alone,
               for at most the endpoint's timeout plus a margin (past that another caller probes);
               the probe's answer closes the circuit, its failure opens it again.

Why PostgreSQL and not Redis: the state is a handful of rows that change only on failures, and
`admit` runs inside the claim's transaction, which must not wait on another network service; the
demo (SQLite, no Redis) gets the same breaker. A call that answered writes nothing (only a probe's
answer does), and a closed circuit is read at most once a second per process (CLOSED_FOR_SECONDS),
so the hot path costs next to nothing.

Every move is one conditional UPDATE (0 rows: another process moved it first) and is counted in
`agentplatform_circuit_transitions` (docs/operations.md has the alert rule).
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import Final, Literal

from django.db.models import Case, F, Q, Value, When
from django.utils import timezone

from llm.models import EndpointCircuit, ModelEndpoint
from observability import logs, metrics

State = EndpointCircuit.State
# The failure classes (llm/fallback.error_class) that say the endpoint itself is not serving.
COUNTED: Final = frozenset({"server_error", "timeout"})
PROBE_MARGIN_SECONDS: Final = 15


@dataclass(frozen=True, slots=True)
class Admission:
    """What `admit` answers: "closed" (send), "probe" (send: this call decides), or "open" (do not
    send; `retry_in` seconds until a probe may go)."""

    verdict: Literal["closed", "probe", "open"]
    retry_in: float = 0.0

    @property
    def sends(self) -> bool:
        return self.verdict != "open"


CLOSED = Admission("closed")


# A circuit read closed is taken as closed by this process for this long without reading it
# again: one read per endpoint per second, not one per model call, at the price of seeing
# another process open it up to a second late. This process's own failures forget it at once.
CLOSED_FOR_SECONDS: Final = 1.0
_closed_at: dict[int, float] = {}


def admit(endpoint: ModelEndpoint, *, now: dt.datetime | None = None) -> Admission:
    """May a call go to `endpoint` now? Grants the probe to the first caller once the circuit has
    been open for its time (or a probe's lease ran out). `now`: a given time (tests) always reads."""
    if not endpoint.breaker_failures:
        return CLOSED
    if now is None:
        seen = _closed_at.get(endpoint.pk)
        if seen is not None and time.monotonic() - seen < CLOSED_FOR_SECONDS:
            return CLOSED
        now = timezone.now()
    row = EndpointCircuit.objects.filter(pk=endpoint.pk).values_list("state", "until").first()
    if row is None or row[0] == State.CLOSED:
        _closed_at[endpoint.pk] = time.monotonic()
        return CLOSED
    _closed_at.pop(endpoint.pk, None)
    state, until = row
    if until is not None and until > now:
        _refused(endpoint)
        left = (until - now).total_seconds()
        if state == State.HALF_OPEN:
            # A probe is out; it usually answers well before its lease ends, so ask again soon.
            left = min(left, float(endpoint.breaker_open_seconds))
        return Admission("open", left)
    lease = now + dt.timedelta(seconds=endpoint.timeout_seconds + PROBE_MARGIN_SECONDS)
    # Open past its time, or half open with a probe whose lease ran out: one caller takes the probe.
    took = EndpointCircuit.objects.filter(pk=endpoint.pk, state=state, until=until).update(
        state=State.HALF_OPEN, until=lease, changed_at=now
    )
    if not took:
        _refused(endpoint)
        return Admission("open", float(endpoint.breaker_open_seconds))
    _moved(endpoint, State.HALF_OPEN)
    return Admission("probe")


def record(
    endpoint: ModelEndpoint,
    *,
    error_class: str,
    probe: bool,
    error: str = "",
    now: dt.datetime | None = None,
) -> str:
    """Count a call's outcome (`error_class` "" : it answered). Outside any transaction: each
    statement commits alone. Returns the state it moved the circuit to, or "" for no move."""
    if not endpoint.breaker_failures:
        return ""
    now = now or timezone.now()
    if error_class in COUNTED:
        _closed_at.pop(endpoint.pk, None)
    if error_class not in COUNTED:
        if probe:
            # An answer (a refusal or a 429 is an answer too) to the probe closes the circuit.
            if _move(endpoint, State.HALF_OPEN, State.CLOSED, now, failures=0, window_started_at=None):
                return State.CLOSED
        return ""
    if probe and _move(
        endpoint, State.HALF_OPEN, State.OPEN, now, until=now + _open_for(endpoint), last_error=error[:2000]
    ):
        return State.OPEN
    EndpointCircuit.objects.get_or_create(endpoint_id=endpoint.pk)
    window_start = now - dt.timedelta(seconds=endpoint.breaker_window_seconds)
    new_window = Q(window_started_at__isnull=True) | Q(window_started_at__lt=window_start)
    EndpointCircuit.objects.filter(pk=endpoint.pk, state=State.CLOSED).update(
        failures=Case(When(new_window, then=Value(1)), default=F("failures") + 1),
        window_started_at=Case(When(new_window, then=Value(now)), default=F("window_started_at")),
        last_error=error[:2000],
    )
    opened = EndpointCircuit.objects.filter(
        pk=endpoint.pk, state=State.CLOSED, failures__gte=endpoint.breaker_failures
    ).update(state=State.OPEN, opened_at=now, until=now + _open_for(endpoint), changed_at=now)
    if opened:
        _moved(endpoint, State.OPEN)
        return State.OPEN
    return ""


def close(endpoint: ModelEndpoint, *, now: dt.datetime | None = None) -> bool:
    """An operator closes the circuit by hand (the endpoint is known to be back)."""
    now = now or timezone.now()
    return any(
        _move(endpoint, state, State.CLOSED, now, failures=0, window_started_at=None)
        for state in (State.OPEN, State.HALF_OPEN)
    )


def _open_for(endpoint: ModelEndpoint) -> dt.timedelta:
    return dt.timedelta(seconds=endpoint.breaker_open_seconds)


def _move(endpoint: ModelEndpoint, old: str, new: str, now: dt.datetime, **fields) -> bool:
    if new == State.OPEN:
        fields.setdefault("opened_at", now)
    if new == State.CLOSED:
        fields.setdefault("until", None)
    moved = EndpointCircuit.objects.filter(pk=endpoint.pk, state=old).update(
        state=new, changed_at=now, **fields
    )
    if moved:
        _moved(endpoint, new)
    return bool(moved)


def _moved(endpoint: ModelEndpoint, state: str) -> None:
    metrics.CIRCUIT_TRANSITIONS.labels(logs.current().get("tenant") or "", endpoint.name, state).inc()


def _refused(endpoint: ModelEndpoint) -> None:
    metrics.CIRCUIT_REFUSED.labels(logs.current().get("tenant") or "", endpoint.name).inc()
