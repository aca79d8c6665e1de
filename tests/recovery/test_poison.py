"""A step that kills every worker that runs it fails its run after MAX_STEP_CRASHES, with a reason."""

from __future__ import annotations

import pytest

from runs.models import Step
from runs.services import start_run
from tests import factories
from tests.recovery.conftest import FAST_LEASES, events, single_call_agent, sweep_until, until_status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_sweeps")]


def test_it_fails_the_run_when_one_step_keeps_killing_its_worker(tenant, asha, workers):
    sleep = factories.make_builtin_tools(tenant, effect="read_only", timeout_seconds=2, max_attempts=10)[
        "sleep"
    ]
    single_call_agent(tenant, asha, sleep, {"seconds": 120})
    env = {**FAST_LEASES, "MAX_STEP_CRASHES": "3"}
    run, _ = start_run(user=asha, agent="agent", input={})
    for attempt in (1, 2, 3):
        worker = workers(f"w{attempt}", env=env)
        sweep_until(
            lambda: Step.objects.filter(run=run, seq=2, status="dispatching", attempts=attempt).exists(),
            timeout=40,
            what=f"attempt {attempt} in flight",
        )
        worker.kill()
    workers("w4", env=env)

    run = until_status(run.pk, "failed", "succeeded", timeout=40)
    assert run.status == "failed"
    assert run.error == "step 2 crashed its worker 3 times"
    step = Step.objects.get(run=run, seq=2)
    assert (step.status, step.attempts, step.crashes) == ("failed", 3, 3)  # read-only: nothing to resolve
    assert [e.data["action"] for e in events(run.pk, "recovery") if e.step_seq == 2][-1] == "fail_run"
    assert Step.objects.filter(run=run).count() == 2  # no further model call was made
