"""Canaries: an alias splits new runs, each run keeps its arm; a canary doing worse is rolled back
by the platform, a healthy one promoted by hand."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from agents.models import Alias, AliasChange
from evals import canary
from evals.canary import ArmStats, verdict
from observability import metrics
from runs.models import Run
from runs.services import start_run
from tenants.models import Tenant
from tests import factories
from tests.conftest import drive
from tests.fakes.model_servers import FakeOpenAI

RULES = {"min_runs": 10}
pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize(
    ("stable", "canary_arm", "why"),
    [
        (ArmStats(runs=50, failed=1), ArmStats(runs=9, failed=9), None),  # too few canary runs yet
        (ArmStats(runs=50, failed=1), ArmStats(runs=10, failed=1), None),
        (
            ArmStats(runs=50, failed=1),
            ArmStats(runs=10, failed=5),
            "failure rate 50% on the canary against 2%",
        ),
        (ArmStats(runs=0), ArmStats(runs=10, failed=3), "failure rate 30% on the canary against 0%"),
        (ArmStats(runs=50, attention=5), ArmStats(runs=10, attention=4), "needs_attention rate 40%"),
        (ArmStats(runs=50, denied=0), ArmStats(runs=10, denied=3), "policy denial rate 30%"),
        (ArmStats(runs=50, cost_micros=50_000), ArmStats(runs=10, cost_micros=19_000), None),
        (ArmStats(runs=50, cost_micros=50_000), ArmStats(runs=10, cost_micros=21_000), "cost per run 2.1x"),
    ],
)
def test_a_canary_is_rolled_back_only_past_a_threshold(stable, canary_arm, why):
    found = verdict(stable, canary_arm, RULES)
    assert (found is None) if why is None else (why in (found or "")), found


@pytest.fixture
def agent(tenant, asha, builtins):
    Tenant.objects.filter(pk=tenant.pk).update(max_active_runs=1000, max_starts_per_minute=1000)
    asha.tenant.refresh_from_db()
    factories.grant(builtins["echo"], use=[asha])
    stable_endpoint = factories.make_endpoint(tenant, name="stable", config={"turns": [{"text": "done"}]})
    canary_endpoint = factories.make_endpoint(
        tenant,
        name="canary",
        config={"turns": [{"tool_calls": [{"name": builtins["echo"].name, "arguments": {"text": "hi"}}]}]},
    )
    v1 = factories.make_agent(tenant, name="helper", endpoint=stable_endpoint, tools=[builtins["echo"]])
    # v2 stops at once: one step allowed, and its model asks for a tool first (a canary that fails).
    v2 = factories.make_agent(
        tenant,
        name="helper",
        endpoint=canary_endpoint,
        tools=[builtins["echo"]],
        alias="candidate",
        limits={"max_steps": 1},
    )
    return v1, v2


@pytest.mark.django_db(transaction=True)
def test_200_runs_at_10_percent_split_within_binomial_bounds_and_keep_their_arm(tenant, asha, ravi, agent):
    from agents import services as agents

    v1, v2 = agent
    agents.start_canary(tenant=tenant, agent="helper", alias="prod", version=v2.number, percent=10, user=ravi)
    runs = [start_run(user=asha, agent="helper", input={"i": i})[0] for i in range(200)]
    canaries = [r for r in runs if r.arm == "canary"]
    # Binomial(200, 0.1): mean 20, sd 4.2; [7, 35] holds with probability above 0.999.
    assert 7 <= len(canaries) <= 35, len(canaries)
    assert {r.version_id for r in canaries} == {v2.pk}
    assert {(r.arm, r.version_id) for r in runs if r not in canaries} == {("stable", v1.pk)}
    stored = Run.objects.get(pk=canaries[0].pk)
    assert stored.arm == "canary" and stored.events.get(kind="created").data["arm"] == "canary"
    # A version asked for by number takes no arm.
    assert start_run(user=asha, agent="helper", version=v1.number, input={})[0].arm == ""


@pytest.mark.django_db(transaction=True)
def test_a_failing_canary_is_rolled_back_by_the_watcher_and_later_runs_take_prod(tenant, asha, ravi, agent):
    from agents import services as agents

    v1, v2 = agent
    agents.start_canary(
        tenant=tenant,
        agent="helper",
        alias="prod",
        version=v2.number,
        percent=50,
        user=ravi,
        rules={"min_runs": 5},
    )
    before = metrics.CANARY_ROLLBACKS.labels(tenant.slug, "helper", "prod")._value.get()
    served = []
    for i in range(40):
        run = drive(start_run(user=asha, agent="helper", input={"i": i})[0].pk)
        served.append((run.arm, run.status))
        if canary.watch():
            break
    canary_runs = [s for a, s in served if a == "canary"]
    assert len(canary_runs) >= 5 and set(canary_runs) == {"stopped"}
    assert {s for a, s in served if a == "stable"} <= {"succeeded"}
    alias = Alias.objects.get(agent__name="helper", name="prod")
    assert alias.canary_version_id is None and alias.version_id == v1.pk
    change = AliasChange.objects.get(kind="rolled_back")
    assert change.automatic and change.actor is None and "failure rate 100% on the canary" in change.reason
    assert change.data["canary"]["failed"] == len(canary_runs)
    assert metrics.CANARY_ROLLBACKS.labels(tenant.slug, "helper", "prod")._value.get() == before + 1
    later = [start_run(user=asha, agent="helper", input={"later": i})[0] for i in range(20)]
    assert {(r.version_id, r.arm) for r in later} == {(v1.pk, "")}
    assert canary.watch() == []  # nothing left to watch


@pytest.fixture
def half_failing_server():
    """A model server that refuses every other call it gets (a 400, which no retry mends)."""
    fake = FakeOpenAI(min_cacheable_tokens=0)
    fake.start()
    fake.queue(*[{"fault": "bad_request"}, {"text": "done"}] * 100)
    yield fake
    fake.stop()


@pytest.mark.django_db(transaction=True)
def test_a_canary_whose_endpoint_fails_half_its_calls_is_rolled_back_within_the_window(
    tenant, asha, ravi, agent, half_failing_server
):
    from agents import services as agents

    v1, _ = agent
    endpoint = factories.make_endpoint(
        tenant, name="flaky", kind="openai", base_url=half_failing_server.base_url
    )
    v3 = factories.make_agent(tenant, name="helper", endpoint=endpoint, tools=[], alias="flaky-candidate")
    window = 600
    agents.start_canary(
        tenant=tenant,
        agent="helper",
        alias="prod",
        version=v3.number,
        percent=50,
        user=ravi,
        rules={"min_runs": 6, "window_seconds": window},
    )
    since = Alias.objects.get(agent__name="helper", name="prod").canary_since
    served = []
    for i in range(60):
        run = drive(start_run(user=asha, agent="helper", input={"i": i})[0].pk)
        served.append((run.arm, run.status))
        if canary.watch():
            break
    canary_runs = [s for a, s in served if a == "canary"]
    # Half the endpoint's calls refused: about half the canary's runs failed, none of prod's.
    assert len(canary_runs) >= 6 and set(canary_runs) == {"failed", "succeeded"}
    assert (
        canary_runs.count("failed")
        == len(half_failing_server.requests) // 2 + len(half_failing_server.requests) % 2
    )
    # None of prod's failed. The arms are drawn at random: six canary draws in a row (1 in 64)
    # roll the canary back before prod served a run, and then there is none to look at here (the
    # twenty runs below are prod's).
    assert {s for a, s in served if a == "stable"} <= {"succeeded"}
    change = AliasChange.objects.get(kind="rolled_back")
    assert change.automatic and "failure rate" in change.reason
    assert (change.at - since).total_seconds() < window
    alias = Alias.objects.get(agent__name="helper", name="prod")
    assert alias.canary_version_id is None and alias.version_id == v1.pk

    calls = len(half_failing_server.requests)
    later = [drive(start_run(user=asha, agent="helper", input={"later": i})[0].pk) for i in range(20)]
    assert {(r.version_id, r.arm, r.status) for r in later} == {(v1.pk, "", "succeeded")}
    assert len(half_failing_server.requests) == calls  # the canary's endpoint hears no more


@pytest.mark.django_db(transaction=True)
def test_a_healthy_canary_is_promoted_by_hand_and_only_staff_may(tenant, asha, ravi, agent):
    v1, v2 = agent
    staff, member = APIClient(), APIClient()
    staff.force_authenticate(ravi)
    member.force_authenticate(asha)
    url = "/v1/agents/helper/aliases/prod/canary"
    bad = staff.put(
        url, {"version": v2.number, "percent": 0, "rules": {"min_runs": -1, "sideways": 1}}, format="json"
    )
    assert bad.status_code == 400 and set(bad.json()["error"]["fields"]) == {"percent"}
    bad = staff.put(
        url, {"version": v2.number, "percent": 5, "rules": {"min_runs": -1, "sideways": 1}}, format="json"
    )
    assert bad.status_code == 400 and set(bad.json()["error"]["fields"]) == {
        "rules.min_runs",
        "rules.sideways",
    }
    assert member.put(url, {"version": v2.number, "percent": 5}, format="json").status_code == 403
    started = staff.put(url, {"version": v2.number, "percent": 5}, format="json")
    assert started.status_code == 200 and started.json()["canary"]["version"] == v2.number
    promoted = staff.post(f"{url}/promote", {"reason": "a week without trouble"}, format="json")
    assert promoted.status_code == 200 and promoted.json()["version"] == v2.number
    assert promoted.json()["canary"] is None
    assert start_run(user=asha, agent="helper", input={})[0].version_id == v2.pk
    assert staff.post(f"{url}/rollback", format="json").json()["error"]["code"] == "no_canary"
    kinds = list(AliasChange.objects.order_by("at").values_list("kind", "actor__username"))
    assert kinds[-2:] == [("canary_started", "ravi"), ("promoted", "ravi")]


@pytest.mark.django_db(transaction=True)
def test_a_gated_alias_moves_only_to_a_version_whose_evaluation_passed(tenant, asha, ravi, agent):
    from evals import services as evals

    v1, v2 = agent
    v3 = factories.make_agent(
        tenant,
        name="helper",
        endpoint=v1.model_endpoint,
        tools=["platform__echo"],
        alias="next",
        instructions="You help bank support agents, briefly.",
    )
    evals.save_dataset(
        tenant=tenant,
        dataset="smoke",
        cases=[{"name": "answers", "input": {}, "user": "asha", "checks": [{"status": "succeeded"}]}],
    )
    staff = APIClient()
    staff.force_authenticate(ravi)
    gate = staff.put(
        "/v1/agents/helper/aliases/prod/gate",
        {"gate": {"dataset": "smoke", "min_pass_rate": 1.0, "min_tag_pass_rate": {"safety": 2}}},
        format="json",
    )
    assert gate.status_code == 400 and set(gate.json()["error"]["fields"]) == {"min_tag_pass_rate"}
    gate = staff.put(
        "/v1/agents/helper/aliases/prod/gate",
        {"gate": {"dataset": "smoke", "min_pass_rate": 1.0}},
        format="json",
    )
    assert gate.status_code == 200 and gate.json()["gate"]["dataset"] == "smoke"

    move = staff.put("/v1/agents/helper/aliases/prod", {"version": v2.number}, format="json")
    assert move.status_code == 409 and "none yet" in move.json()["error"]["message"]
    evals.execute(evals.start_evaluation(user=ravi, agent="helper", version=v2.number, dataset="smoke").pk)
    move = staff.put("/v1/agents/helper/aliases/prod", {"version": v2.number}, format="json")
    assert move.status_code == 409 and "pass rate 0% below 100%" in move.json()["error"]["message"]
    canary_refused = staff.put(
        "/v1/agents/helper/aliases/prod/canary", {"version": v2.number, "percent": 10}, format="json"
    )
    assert canary_refused.status_code == 409
    assert Alias.objects.get(agent__name="helper", name="prod").version_id == v1.pk

    evals.execute(evals.start_evaluation(user=ravi, agent="helper", version=v3.number, dataset="smoke").pk)
    move = staff.put("/v1/agents/helper/aliases/prod", {"version": v3.number}, format="json")
    assert move.status_code == 200, move.content
    assert Alias.objects.get(agent__name="helper", name="prod").version_id == v3.pk
