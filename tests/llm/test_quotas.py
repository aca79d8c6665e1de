"""The shared endpoint quota (llm/quotas.py) against the real Redis of the test session.

Each test's endpoints point at a base URL of their own, so their accounts (and Redis keys) are
theirs. Callers here follow the limiter's waits the way the engine's countdowns do: a caller told
to wait comes back then.
"""

from __future__ import annotations

import heapq
import time
import uuid
from collections import Counter

import pytest

from llm import quotas
from llm.models import ModelEndpoint
from tenants.models import Secret
from tests import factories

WINDOW = 1.0
_callers = iter(range(1, 10**9))


def next_caller() -> str:
    """A new run asking: each call of these tests stands for another run."""
    return f"run-{next(_callers)}"


@pytest.fixture(autouse=True)
def _short_window(settings):
    assert settings.QUOTA_REDIS_URL, "the tests run with a Redis broker, which the quotas use"
    settings.QUOTA_WINDOW_SECONDS = WINDOW


def endpoint(base_url: str | None = None, **fields) -> ModelEndpoint:
    return ModelEndpoint(
        name="shared",
        kind="openai",
        base_url=base_url or f"http://127.0.0.1:9/{uuid.uuid4().hex}/v1",
        model="gpt-test",
        **fields,
    )


def admit_until_go(ep: ModelEndpoint, *, tenant: str = "acme", tokens: int = 1) -> float:
    """Follow the limiter's waits until the call may go; when it went (monotonic clock)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answer = quotas.admit(ep, tenant=tenant, weight=1, tokens=tokens, caller="run-1")
        if answer.wait_seconds == 0:
            return time.monotonic()
        time.sleep(answer.wait_seconds)
    raise AssertionError("never admitted")


def most_in_any_window(times: list[float], window: float) -> int:
    times = sorted(times)
    return max(sum(1 for t in times[i:] if t < start + window) for i, start in enumerate(times))


def test_it_spaces_calls_so_no_window_holds_more_than_the_limit():
    ep = endpoint(requests_per_minute=5)  # per WINDOW here
    started = [admit_until_go(ep) for _ in range(12)]
    assert most_in_any_window(started, WINDOW) <= 5
    # ...and it is the limit, not a slower pace: slots a quarter of a second apart.
    assert started[-1] - started[0] < 11 * (WINDOW / 4) + 0.3


def test_it_tells_a_call_over_the_limit_how_long_to_wait_and_does_not_count_it():
    ep = endpoint(requests_per_minute=4)
    assert quotas.admit(ep, tenant="acme", weight=1, tokens=1, caller=next_caller()) == quotas.GO
    waits = [quotas.admit(ep, tenant="acme", weight=1, tokens=1, caller=next_caller()) for _ in range(3)]
    assert all(w.limit == "requests" for w in waits)
    # A waiting call holds nothing; the tenant's waiting calls are told to come back one spacing apart.
    # Slots are a third of a second apart (4 a second, with a slot to spare).
    assert 1 / 3 - 0.02 <= waits[0].wait_seconds <= 1 / 3
    assert waits[1].wait_seconds == pytest.approx(waits[0].wait_seconds + 1 / 3, abs=0.02)


def test_a_call_of_many_tokens_holds_the_token_quota_for_its_share_of_the_window():
    ep = endpoint(tokens_per_minute=1000)
    assert quotas.admit(ep, tenant="acme", weight=1, tokens=500, caller=next_caller()) == quotas.GO
    answer = quotas.admit(ep, tenant="acme", weight=1, tokens=100, caller=next_caller())
    assert answer.limit == "tokens"
    assert 0.45 <= answer.wait_seconds <= 0.5


def test_an_endpoint_without_limits_is_not_held_back():
    ep = endpoint()
    assert all(
        quotas.admit(ep, tenant="acme", weight=1, tokens=10_000, caller=next_caller()) == quotas.GO
        for _ in range(50)
    )


def test_retry_after_slows_every_tenant_calling_the_account_not_only_the_one_told():
    base_url = f"http://127.0.0.1:9/{uuid.uuid4().hex}/v1"
    told, other = endpoint(base_url), endpoint(base_url)  # two tenants' endpoints, one account
    quotas.slow_down(told, 0.6)
    answer = quotas.admit(other, tenant="globex", weight=1, tokens=1, caller=next_caller())
    assert answer.limit == "retry_after"
    assert 0.5 <= answer.wait_seconds <= 0.6
    # An endpoint on another account is not slowed.
    assert quotas.admit(endpoint(), tenant="globex", weight=1, tokens=1, caller=next_caller()) == quotas.GO


@pytest.mark.django_db
def test_endpoints_share_an_account_when_kind_url_model_and_key_match():
    acme, globex = factories.make_tenant("acme"), factories.make_tenant("globex")

    def with_key(tenant, key: str, model: str = "m") -> ModelEndpoint:
        secret = Secret(tenant=tenant, name=f"key-{uuid.uuid4().hex[:6]}")
        secret.set_value(key)
        secret.save()
        url = "https://api.example.test/v1"
        ep = factories.make_endpoint(
            tenant, name=f"e-{uuid.uuid4().hex[:6]}", kind="openai", base_url=url, secret=secret
        )
        ep.model = model
        ep.save(update_fields=["model"])
        return ModelEndpoint.objects.select_related("secret").get(pk=ep.pk)

    shared = quotas.account_of(with_key(acme, "sk-bank-1"))
    assert quotas.account_of(with_key(globex, "sk-bank-1")) == shared
    assert quotas.account_of(with_key(globex, "sk-other")) != shared
    assert quotas.account_of(with_key(globex, "sk-bank-1", model="m2")) != shared
    assert "sk-bank-1" not in shared


def follow(
    ep: ModelEndpoint, runs_per_tenant: dict[str, int], weights: dict[str, int], seconds: float
) -> Counter:
    """Each tenant's runs ask, follow the waits (their countdowns) and ask again after each call."""
    runs = [(0.0, f"{tenant}-{i}", tenant) for tenant, n in runs_per_tenant.items() for i in range(n)]
    heapq.heapify(runs)
    calls: Counter[str] = Counter()
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        due, run, tenant = heapq.heappop(runs)
        delay = start + due - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # the run's countdown
        answer = quotas.admit(ep, tenant=tenant, weight=weights[tenant], tokens=1, caller=run)
        now = time.monotonic() - start
        if answer.wait_seconds == 0:
            calls[tenant] += 1
            heapq.heappush(runs, (now + 0.005, run, tenant))  # the call and its tool step
        else:
            heapq.heappush(runs, (now + answer.wait_seconds, run, tenant))
    return calls


def test_tenants_waiting_together_share_the_quota_by_weight():
    weights = {"small": 1, "middle": 2, "large": 3}
    calls = follow(endpoint(requests_per_minute=30), dict.fromkeys(weights, 4), weights, 4.0)
    total = sum(calls.values())
    assert total <= 4.0 * 30 + 1
    for tenant, weight in weights.items():
        expected = total * weight / sum(weights.values())
        assert abs(calls[tenant] - expected) <= 0.2 * expected, (calls, total)


def test_a_tenant_with_many_runs_does_not_starve_one_with_few():
    weights = {"busy": 1, "quiet": 1}
    calls = follow(endpoint(requests_per_minute=20), {"busy": 50, "quiet": 2}, weights, 3.0)
    # Their equal share is half; by runs it would be 2 in 52.
    assert calls["quiet"] >= sum(calls.values()) / 3, calls


def test_a_tenant_alone_gets_the_whole_quota():
    ep = endpoint(requests_per_minute=20)
    started = [admit_until_go(ep, tenant="alone") for _ in range(10)]
    # Its weight is its share of the tenants waiting, and it is the only one: all 20 per second.
    assert started[-1] - started[0] < 9 * (WINDOW / 19) + 0.3


def test_with_redis_unreachable_the_call_goes_ahead_unlimited(settings):
    from tests.services import free_port

    settings.QUOTA_REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    begun = time.monotonic()
    answer = quotas.admit(endpoint(requests_per_minute=1), tenant="acme", weight=1, tokens=1, caller="run-1")
    assert answer == quotas.Admission(0.0, "unavailable")
    assert time.monotonic() - begun < 1.0
    quotas.slow_down(endpoint(), 5)  # logged and counted, never raised


def test_max_in_flight_holds_a_call_until_a_slot_frees_and_a_lost_slot_lapses(monkeypatch):
    ep = endpoint(max_in_flight=1, timeout_seconds=0.3)
    first = quotas.admit(ep, tenant="acme", weight=1, tokens=1, caller="run-a")
    held = quotas.admit(ep, tenant="acme", weight=1, tokens=1, caller="run-b")
    assert first.wait_seconds == 0
    assert held.limit == "in_flight" and 0 < held.wait_seconds <= quotas.IN_FLIGHT_POLL_SECONDS
    quotas.release(ep, "run-a")
    assert quotas.admit(ep, tenant="acme", weight=1, tokens=1, caller="run-b").wait_seconds == 0
    # run-b's worker dies with its call: its slot lapses after the call's timeout and the margin.
    monkeypatch.setattr(quotas, "IN_FLIGHT_MARGIN_SECONDS", 0.0)
    ep2 = endpoint(max_in_flight=1, timeout_seconds=0.3)
    assert quotas.admit(ep2, tenant="acme", weight=1, tokens=1, caller="run-c").wait_seconds == 0
    assert quotas.admit(ep2, tenant="acme", weight=1, tokens=1, caller="run-d").limit == "in_flight"
    time.sleep(0.35)
    assert quotas.admit(ep2, tenant="acme", weight=1, tokens=1, caller="run-d").wait_seconds == 0


def test_without_max_in_flight_calls_are_not_held(monkeypatch):
    ep = endpoint()
    answers = [quotas.admit(ep, tenant="acme", weight=1, tokens=1, caller=next_caller()) for _ in range(5)]
    assert all(answer.wait_seconds == 0 for answer in answers)
