"""The circuit breaker (llm/breaker.py) on PostgreSQL: opens after the configured failures in its
window, refuses while open, grants one probe, and the probe's answer closes or reopens it."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from django.db import connection
from django.utils import timezone

from llm import breaker
from llm.models import EndpointCircuit
from tests import factories

pytestmark = pytest.mark.django_db


@pytest.fixture
def endpoint(tenant):
    return factories.make_endpoint(
        tenant, name="primary", breaker_failures=3, breaker_window_seconds=60, breaker_open_seconds=30
    )


def _state(endpoint) -> str:
    return EndpointCircuit.objects.get(pk=endpoint.pk).state


def test_it_opens_after_the_configured_failures_in_a_window_and_refuses_until_a_probe(endpoint):
    t0 = timezone.now()
    assert breaker.admit(endpoint, now=t0).verdict == "closed"
    assert breaker.record(endpoint, error_class="server_error", probe=False, now=t0) == ""
    assert breaker.record(endpoint, error_class="timeout", probe=False, now=t0) == ""
    # 429s and refusals say nothing about whether the endpoint is up
    assert breaker.record(endpoint, error_class="rate_limited", probe=False, now=t0) == ""
    assert breaker.record(endpoint, error_class="refused", probe=False, now=t0) == ""
    assert breaker.admit(endpoint, now=t0).verdict == "closed"
    assert (
        breaker.record(endpoint, error_class="server_error", probe=False, error="HTTP 503", now=t0) == "open"
    )
    refused = breaker.admit(endpoint, now=t0 + dt.timedelta(seconds=10))
    assert refused.verdict == "open" and refused.retry_in == pytest.approx(20, abs=0.01)
    # after open_seconds: one probe, and only one
    later = t0 + dt.timedelta(seconds=31)
    assert breaker.admit(endpoint, now=later).verdict == "probe"
    assert breaker.admit(endpoint, now=later).verdict == "open"
    assert _state(endpoint) == "half_open"
    # the probe answered: closed, and the failures are forgotten
    assert breaker.record(endpoint, error_class="", probe=True, now=later) == "closed"
    assert breaker.admit(endpoint, now=later).verdict == "closed"
    assert breaker.record(endpoint, error_class="server_error", probe=False, now=later) == ""


def test_failures_spread_wider_than_the_window_never_open_it(endpoint):
    t0 = timezone.now()
    for i in range(6):
        assert (
            breaker.record(
                endpoint, error_class="server_error", probe=False, now=t0 + dt.timedelta(seconds=40 * i)
            )
            == ""
        )
    assert _state(endpoint) == "closed"


def test_a_failed_probe_opens_it_again_and_a_lost_probe_is_given_to_the_next_caller(endpoint):
    t0 = timezone.now()
    for _ in range(3):
        breaker.record(endpoint, error_class="server_error", probe=False, now=t0)
    probe_at = t0 + dt.timedelta(seconds=30)
    assert breaker.admit(endpoint, now=probe_at).verdict == "probe"
    assert breaker.record(endpoint, error_class="timeout", probe=True, now=probe_at) == "open"
    assert breaker.admit(endpoint, now=probe_at + dt.timedelta(seconds=29)).verdict == "open"
    second = probe_at + dt.timedelta(seconds=30)
    assert breaker.admit(endpoint, now=second).verdict == "probe"
    # that probe's worker died: past its lease (timeout + margin) the next caller probes
    lease = endpoint.timeout_seconds + breaker.PROBE_MARGIN_SECONDS
    assert breaker.admit(endpoint, now=second + dt.timedelta(seconds=lease - 1)).verdict == "open"
    assert breaker.admit(endpoint, now=second + dt.timedelta(seconds=lease + 1)).verdict == "probe"


def test_an_answer_that_is_not_the_probe_writes_nothing(endpoint, django_assert_num_queries):
    with django_assert_num_queries(0):
        breaker.record(endpoint, error_class="", probe=False)
    with django_assert_num_queries(1):  # the claim's read of a closed circuit
        assert breaker.admit(endpoint).verdict == "closed"


def test_off_when_failures_is_zero(tenant, django_assert_num_queries):
    endpoint = factories.make_endpoint(tenant, name="nobreaker", breaker_failures=0)
    with django_assert_num_queries(0):
        for _ in range(10):
            breaker.record(endpoint, error_class="server_error", probe=False)
        assert breaker.admit(endpoint).verdict == "closed"


@pytest.mark.django_db(transaction=True)
def test_concurrent_callers_get_one_probe(tenant):
    endpoint = factories.make_endpoint(tenant, name="racy", breaker_failures=1, breaker_open_seconds=1)
    t0 = timezone.now()
    breaker.record(endpoint, error_class="server_error", probe=False, now=t0)
    at = t0 + dt.timedelta(seconds=2)
    verdicts: list[str] = []
    barrier = threading.Barrier(8)

    def caller():
        try:
            barrier.wait()
            verdicts.append(breaker.admit(endpoint, now=at).verdict)
        finally:
            connection.close()

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(verdicts) == ["open"] * 7 + ["probe"]
