"""Regions' rules from tables of cases, without a database (runs/engine/decisions.py), and the
signatures between regions (regions/signing.py)."""

from __future__ import annotations

import pytest

from regions import signing
from runs.engine import decisions as d

SIZE = 1000


@pytest.mark.parametrize(
    "here, allowed, refused",
    [
        ("", ("mumbai",), False),  # a deployment without regions starts every run
        ("mumbai", ("mumbai", "frankfurt"), False),
        ("frankfurt", ("mumbai", "frankfurt"), False),
        ("paris", ("mumbai", "frankfurt"), True),
    ],
)
def test_it_starts_runs_only_in_the_allowed_regions(here, allowed, refused):
    answer = d.start_here(here=here, home="mumbai", allowed=allowed)
    assert (answer is not None) == refused
    if refused:
        assert "'mumbai', 'frankfurt'" in answer and "paris" in answer


@pytest.mark.parametrize(
    "scope, home_here, link_up, home_free, expected",
    [
        ("run", False, False, None, "tenant_rule"),  # a run's own budget: never the region's business
        ("user_day", True, False, None, "tenant_rule"),  # at home the user's day is the user's day
        ("user_day", False, False, None, ("park", d.REGION_UNREACHABLE)),  # a user's day: its slice
        ("user_day", False, True, 5, ("park", d.WAITING_FOR_SLICE)),
        ("user_day", False, True, 0, "tenant_rule"),  # the user's day is spent everywhere
        ("tenant_day", True, False, None, "tenant_rule"),  # at home the day is the day
        ("tenant_day", False, False, None, ("park", d.REGION_UNREACHABLE)),
        ("tenant_day", False, False, 0, ("park", d.REGION_UNREACHABLE)),  # cut off: never assume spent
        ("tenant_day", False, True, None, ("park", d.WAITING_FOR_SLICE)),
        ("tenant_day", False, True, 1, ("park", d.WAITING_FOR_SLICE)),
        ("tenant_day", False, True, 0, "tenant_rule"),  # nothing left to lend anywhere
    ],
)
def test_a_refused_reservation_away_from_home_parks_or_follows_the_tenant_rule(
    scope, home_here, link_up, home_free, expected
):
    assert (
        d.budget_refusal(scope=scope, home_here=home_here, link_up=link_up, home_free_micros=home_free)
        == expected
    )


@pytest.mark.parametrize(
    "free, waiting, pending, ask",
    [
        (0, False, False, SIZE),
        (499, False, False, SIZE - 499),  # below half a slice: top up before it runs out
        (500, False, False, 0),
        (5 * SIZE, True, False, SIZE),  # runs waiting: their next call did not fit what is free
        (0, True, True, 0),  # one request at a time: the pending one is sent again first
    ],
)
def test_it_asks_for_a_slice_before_it_runs_low(free, waiting, pending, ask):
    assert d.slice_ask(free_micros=free, size_micros=SIZE, runs_waiting=waiting, pending=pending) == ask


@pytest.mark.parametrize(
    "free, committed, waiting, queued, ask",
    [
        (5 * SIZE, 5 * SIZE, False, 0, SIZE),  # free room all promised to admitted runs: top up
        (5 * SIZE, 4 * SIZE + 400, False, 0, 0),  # more than half a slice to admit new runs on
        (SIZE, 3 * SIZE, False, 0, 3 * SIZE),  # promised beyond the room (a run admitted alone)
        (SIZE, 0, True, 70 * SIZE, 69 * SIZE),  # a burst queued: its whole need in one request
        (SIZE, 0, True, 70 * SIZE + 1, 70 * SIZE),  # in whole slices
        (SIZE, 0, True, SIZE // 2, SIZE),  # at least a slice: the queue's head did not fit
        (100, 2900, True, 0, 3 * SIZE),  # runs parked mid-run: what they were promised
    ],
)
def test_it_asks_for_what_the_runs_here_are_expected_to_need(free, committed, waiting, queued, ask):
    assert (
        d.slice_ask(
            free_micros=free,
            size_micros=SIZE,
            runs_waiting=waiting,
            pending=False,
            committed_micros=committed,
            waiting_micros=queued,
        )
        == ask
    )


@pytest.mark.parametrize(
    "free, day_over, waiting, give",
    [
        (0, True, False, 0),
        (-5, True, False, 0),  # over its limit (a late overage): nothing to give
        (700, True, True, 700),  # a day that is over gives everything back
        (3 * SIZE, False, False, 0),  # keeps up to three slices at hand today
        (3 * SIZE + 1, False, False, SIZE + 1),  # beyond that, all but two
        (10 * SIZE, False, True, 0),  # runs waiting here: none of it is spare
    ],
)
def test_it_gives_back_what_it_does_not_need(free, day_over, waiting, give):
    assert (
        d.slice_give_back(free_micros=free, size_micros=SIZE, day_over=day_over, runs_waiting=waiting) == give
    )


@pytest.mark.parametrize(
    "free, committed, day_over, give",
    [
        (10 * SIZE, 10 * SIZE, False, 0),  # all promised to the runs admitted here
        (10 * SIZE, 7 * SIZE, False, 0),  # three slices beyond the promises: kept
        (10 * SIZE, 6 * SIZE, False, 2 * SIZE),  # beyond that, all but two slices
        (10 * SIZE, 10 * SIZE, True, 10 * SIZE),  # a closed day: its runs reserve on the new one
    ],
)
def test_it_never_gives_back_what_admitted_runs_are_expected_to_spend(free, committed, day_over, give):
    assert (
        d.slice_give_back(free_micros=free, size_micros=SIZE, day_over=day_over, committed_micros=committed)
        == give
    )


def test_it_verifies_a_signed_request_and_refuses_every_change():
    body = b'{"amount_micros": 5}'
    headers = signing.sign_request(
        key="k", region="frankfurt", method="POST", path="/p", body=body, now=100.0
    )
    keys = {"frankfurt": "k"}
    ok = {"keys": keys, "method": "POST", "path": "/p", "body": body, "now": 101.0}
    assert signing.verify_request(headers=headers, **ok) == "frankfurt"
    for changed in (
        {"body": body + b" "},
        {"path": "/q"},
        {"method": "PUT"},
        {"keys": {"frankfurt": "other"}},
        {"keys": {}},
        {"now": 100.0 + signing.MAX_SKEW_SECONDS + 1},
    ):
        with pytest.raises(signing.BadSignature):
            signing.verify_request(headers=headers, **{**ok, **changed})
    with pytest.raises(signing.BadSignature):
        signing.verify_request(headers={**headers, signing.REGION: "paris"}, **ok)


def test_it_refuses_an_answer_the_home_did_not_sign():
    answer = signing.sign_answer(key="k", request_signature="abc", status=200, body=b"{}")
    signing.verify_answer(key="k", request_signature="abc", status=200, body=b"{}", signature=answer)
    for changed in (
        {"body": b'{"moved_micros": 9}'},
        {"status": 500},
        {"request_signature": "abd"},  # the answer to another request, replayed
        {"signature": ""},
    ):
        with pytest.raises(signing.BadSignature):
            signing.verify_answer(
                **{
                    "key": "k",
                    "request_signature": "abc",
                    "status": 200,
                    "body": b"{}",
                    "signature": answer,
                    **changed,
                }
            )
