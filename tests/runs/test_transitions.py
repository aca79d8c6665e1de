"""Every move the run and step maps refuse raises IllegalTransition and writes nothing.

Each refused (from, to) pair of RUN_TRANSITIONS and STEP_TRANSITIONS, on real rows: the row keeps
its status and the run gains no event.
"""

from __future__ import annotations

import pytest

from core.errors import IllegalTransition
from runs.models import (
    RUN_TRANSITIONS,
    STEP_TRANSITIONS,
    Run,
    RunEvent,
    RunStatus,
    Step,
    StepKind,
    StepStatus,
)
from runs.services import start_run
from runs.transitions import transition_run, transition_step
from tests import factories

pytestmark = pytest.mark.django_db

REFUSED_RUN = [(old, to) for old in RunStatus for to in RunStatus if to not in RUN_TRANSITIONS[old]]
REFUSED_STEP = [
    (old, to) for old in StepStatus for to in StepStatus if to not in STEP_TRANSITIONS.get(old, set())
]


@pytest.fixture
def run(tenant, asha, builtins):
    factories.make_agent(tenant, tools=[builtins["echo"]], turns=[{"text": "hi"}])
    started, _ = start_run(user=asha, agent="agent", input={})
    return started


def written(run_id) -> tuple:
    return (
        list(Run.objects.filter(pk=run_id).values_list("status", flat=True)),
        list(Step.objects.filter(run_id=run_id).values_list("seq", "status")),
        RunEvent.objects.filter(run_id=run_id).count(),
    )


def test_every_status_pair_is_either_allowed_or_refused():
    assert set(RUN_TRANSITIONS) == set(RunStatus)
    assert len(REFUSED_RUN) + sum(len(v) for v in RUN_TRANSITIONS.values()) == len(RunStatus) ** 2
    assert set(STEP_TRANSITIONS) <= set(StepStatus)


@pytest.mark.parametrize(("old", "to"), REFUSED_RUN, ids=[f"{a}->{b}" for a, b in REFUSED_RUN])
def test_a_refused_run_move_raises_and_writes_nothing(run, old, to):
    Run.objects.filter(pk=run.pk).update(status=old)
    run = Run.objects.get(pk=run.pk)
    before = written(run.pk)
    with pytest.raises(IllegalTransition):
        transition_run(run, to)
    assert written(run.pk) == before
    assert run.status == old


@pytest.mark.parametrize(("old", "to"), REFUSED_STEP, ids=[f"{a}->{b}" for a, b in REFUSED_STEP])
def test_a_refused_step_move_raises_and_writes_nothing(run, old, to):
    step = Step.objects.create(run=run, seq=1, kind=StepKind.TOOL, status=old, tool_name="platform__echo")
    before = written(run.pk)
    with pytest.raises(IllegalTransition):
        transition_step(step, to)
    assert written(run.pk) == before
    assert step.status == old


def test_a_move_another_writer_made_first_is_refused_and_writes_nothing(run):
    stale = Run.objects.get(pk=run.pk)  # read as queued
    transition_run(Run.objects.get(pk=run.pk), RunStatus.RUNNING)
    before = written(run.pk)
    with pytest.raises(IllegalTransition):
        transition_run(stale, RunStatus.RUNNING)  # allowed from queued, but the row moved on
    assert written(run.pk) == before
