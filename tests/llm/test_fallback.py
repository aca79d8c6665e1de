"""Fallback routing (llm/fallback.py): the chain rules from a table of cases, the error classes,
and the spec's validation with its field paths."""

from __future__ import annotations

import pytest

from agents.spec import Fallback, validate_spec
from llm import fallback
from llm.breaker import Admission
from llm.fallback import Attempt, Chain, Choice
from llm.models import ModelEndpoint
from llm.types import ProviderError
from tests import factories


def _chain(*fallbacks: Fallback) -> Chain:
    endpoints = tuple(ModelEndpoint(pk=i + 1, name=f"e{i + 1}") for i in range(len(fallbacks) + 1))
    return Chain(endpoints, fallbacks)


EVERY = frozenset({"rate_limited", "server_error", "timeout", "context_too_long"})
BACK = Fallback("e2", EVERY, rate_limit_retries=2, move_back=True)
STAY = Fallback("e2", EVERY, rate_limit_retries=2, move_back=False)
ONLY_5XX = Fallback("e2", frozenset({"server_error"}), rate_limit_retries=0, move_back=True)
THIRD = Fallback("e3", frozenset({"server_error", "timeout"}), rate_limit_retries=0, move_back=False)

R, S, T, C = "rate_limited", "server_error", "timeout", "context_too_long"

CASES = [
    # (chain fallbacks, history as (endpoint, class), expected index, expected reason)
    ((BACK,), [], 0, ""),
    ((BACK,), [(1, "")], 0, ""),
    ((BACK,), [(1, S)], 1, S),
    ((BACK,), [(1, T)], 1, T),
    ((BACK,), [(1, C)], 1, C),
    ((BACK,), [(1, "refused")], 0, ""),  # no endpoint takes the request's own fault
    # 429: retried rate_limit_retries times on the endpoint before it moves
    ((BACK,), [(1, R)], 0, ""),
    ((BACK,), [(1, R), (1, R)], 0, ""),
    ((BACK,), [(1, R), (1, R), (1, R)], 1, R),
    ((BACK,), [(1, S), (1, R), (1, R)], 0, ""),  # the streak is of 429s only
    # after an answer on the fallback: back to the primary, or stay
    ((BACK,), [(1, S), (2, "")], 0, "moved_back"),
    ((STAY,), [(1, S), (2, "")], 1, ""),
    # a class the fallback does not take stays where it is
    ((ONLY_5XX,), [(1, T)], 0, ""),
    ((ONLY_5XX,), [(1, S)], 1, S),
    # down the chain, skipping an endpoint that does not take the class
    ((ONLY_5XX, THIRD), [(1, T)], 2, T),
    ((BACK, THIRD), [(1, S), (2, S)], 2, S),
    ((BACK, THIRD), [(1, S), (2, C)], 1, ""),  # the last in the chain that takes it: stay
    ((BACK, THIRD), [(1, S), (2, S), (3, S)], 2, ""),  # never back up the chain after a failure
    ((BACK,), [(None, S)], 1, S),  # a step from before fallbacks were recorded: the primary
]


@pytest.mark.parametrize("fallbacks,history,index,reason", CASES)
def test_choose_follows_the_chain_rules(fallbacks, history, index, reason):
    chain = _chain(*fallbacks)
    got = fallback.choose(chain, [Attempt(e, k) for e, k in history])
    assert got == Choice(index, reason)


def test_moves_on_says_whether_the_next_call_goes_elsewhere():
    chain = _chain(BACK)
    assert fallback.moves_on(chain, (), Attempt(1, S))
    assert not fallback.moves_on(chain, (), Attempt(1, R))  # a first 429 is retried in place
    assert fallback.moves_on(chain, (Attempt(1, R), Attempt(1, R)), Attempt(1, R))
    assert not fallback.moves_on(_chain(), (), Attempt(1, S))  # no fallbacks at all


def test_route_passes_over_open_circuits_and_waits_when_none_is_left():
    chain = _chain(BACK, THIRD)
    e1, e2, e3 = chain.endpoints
    open_ = {1: 12.0}

    def admit(endpoint):
        return Admission("open", open_[endpoint.pk]) if endpoint.pk in open_ else Admission("closed")

    got = fallback.route(chain, Choice(0), previous=None, admit=admit)
    assert isinstance(got, fallback.Route) and got.endpoint is e2
    assert got.moved == ("e1", "e2", "circuit_open") and got.refused == ("e1",)
    # already on e2: no switch to report
    got = fallback.route(chain, Choice(0, "moved_back"), previous=2, admit=admit)
    assert isinstance(got, fallback.Route) and got.endpoint is e2 and got.moved is None
    open_.update({2: 5.0, 3: 30.0})
    waited = fallback.route(chain, Choice(0), previous=None, admit=admit)
    assert waited == fallback.Wait(5.0, ("e1", "e2", "e3"))
    # a probe is a call like any other, marked so
    got = fallback.route(chain, Choice(1, S), previous=1, admit=lambda e: Admission("probe"))
    assert isinstance(got, fallback.Route) and got.probe and got.moved == ("e1", "e2", S)


@pytest.mark.parametrize(
    "error,kind",
    [
        (ProviderError("openai: HTTP 429", retryable=True, sent=True, status=429), R),
        (ProviderError("openai: HTTP 503", retryable=True, sent=True, status=503), S),
        (ProviderError("anthropic: HTTP 529 overloaded", retryable=True, sent=True, status=529), S),
        (ProviderError("openai: ConnectError: refused", retryable=True, sent=False), S),
        (ProviderError("openai: RemoteProtocolError", retryable=True, sent=True), S),
        (ProviderError("openai: ReadTimeout", retryable=True, sent=True, timed_out=True), T),
        (ProviderError("openai: HTTP 408", retryable=True, sent=True, status=408), T),
        (
            ProviderError(
                "openai: HTTP 400: This model's maximum context length is 8192 tokens",
                retryable=False,
                sent=True,
                status=400,
            ),
            C,
        ),
        (
            ProviderError(
                "anthropic: HTTP 400: prompt is too long: 210000 tokens > 200000 maximum",
                retryable=False,
                sent=True,
                status=400,
            ),
            C,
        ),
        (
            ProviderError("openai: HTTP 400: bad tool schema", retryable=False, sent=True, status=400),
            "refused",
        ),
        (ProviderError("openai: HTTP 401", retryable=False, sent=True, status=401), "refused"),
    ],
)
def test_error_class(error, kind):
    assert fallback.error_class(error) == kind


def test_a_real_timeout_and_a_refused_connection_are_told_apart():
    import httpx

    from llm.providers.http import transport_error

    timeout = transport_error(httpx.ReadTimeout("slow"), provider="openai", secret=None)
    refused = transport_error(httpx.ConnectError("refused"), provider="openai", secret=None)
    unreachable = transport_error(httpx.ConnectTimeout("no route"), provider="openai", secret=None)
    assert [fallback.error_class(e) for e in (timeout, refused, unreachable)] == [T, S, S]


@pytest.mark.django_db
def test_the_spec_names_its_fallbacks_and_each_bad_part_has_its_path(tenant):
    factories.make_endpoint(tenant, name="primary")
    factories.make_endpoint(tenant, name="backup")
    base = {"model": "primary", "instructions": "help"}
    assert validate_spec({**base, "fallbacks": [{"model": "backup"}]}, tenant) == {}
    errors = validate_spec(
        {
            **base,
            "fallbacks": [
                {"model": "nowhere"},
                {"model": "primary"},
                {"model": "backup", "on": ["lunch"], "rate_limit_retries": 9, "move_back": "yes", "x": 1},
                "backup",
            ],
        },
        tenant,
    )
    assert errors == {
        "fallbacks[0].model": ["no model endpoint named 'nowhere' in this tenant"],
        "fallbacks[1].model": ["'primary' is already in the chain (the primary or an earlier fallback)"],
        "fallbacks[2].x": ["unknown field; one of model, move_back, on, rate_limit_retries"],
        "fallbacks[2].on[0]": ["must be one of rate_limited, server_error, timeout, context_too_long"],
        "fallbacks[2].rate_limit_retries": ["must be an integer from 0 to 4"],
        "fallbacks[2].move_back": ["must be true or false"],
        "fallbacks[3]": ["must be an object with model, on, rate_limit_retries, move_back"],
    }
    assert validate_spec({**base, "fallbacks": {"model": "backup"}}, tenant) == {
        "fallbacks": ["must be a list of {model, on, rate_limit_retries, move_back}"]
    }


@pytest.mark.django_db(transaction=True)
def test_the_configuration_file_sets_the_breaker_and_the_fallbacks_and_refuses_bad_breaker_values_at_their_path():
    from configuration.apply import ConfigError, apply_config
    from tests.configuration.test_apply import config

    data = config()
    data["model_endpoints"].append(
        {
            "name": "backup",
            "kind": "scripted",
            "circuit_breaker": {"failures": 3, "window_seconds": 30, "open_seconds": 10},
        }
    )
    data["agents"][0]["versions"][1]["fallbacks"] = [{"model": "backup", "on": ["server_error", "timeout"]}]
    apply_config(data)
    backup = ModelEndpoint.objects.get(name="backup")
    assert (backup.breaker_failures, backup.breaker_window_seconds, backup.breaker_open_seconds) == (
        3,
        30,
        10,
    )
    assert ModelEndpoint.objects.get(name="scripted").breaker_failures == 5  # the default
    from agents.models import AgentVersion
    from agents.spec import spec_for

    version = AgentVersion.objects.get(agent__name="helper", number=2)
    assert spec_for(version).fallbacks == (
        Fallback("backup", frozenset({"server_error", "timeout"}), rate_limit_retries=2, move_back=True),
    )

    data["model_endpoints"][-1]["circuit_breaker"] = {"failures": -1, "open_seconds": 0}
    with pytest.raises(ConfigError) as caught:
        apply_config(data)
    paths = [path for path, _ in caught.value.errors]
    assert "model_endpoints[1].circuit_breaker.failures" in paths
    assert "model_endpoints[1].circuit_breaker.open_seconds" in paths
