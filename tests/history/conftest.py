"""A finished run with a model call, a tool call and a reply: the history's tests tamper with it."""

from __future__ import annotations

import pytest

from runs.models import RunStatus
from runs.services import start_run
from tests import factories
from tests.conftest import drive


def finished_run(user, *, word: str = "hello", agent: str = "agent"):
    run, _ = start_run(user=user, agent=agent, input={"word": word})
    run = drive(run.pk)
    assert run.status == RunStatus.SUCCEEDED, run.error
    return run


@pytest.fixture
def echo_agent(tenant, asha, builtins):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(
        tenant,
        tools=[echo],
        turns=[
            {"tool_calls": [{"name": echo.name, "arguments": {"say": "$input.word"}}]},
            {"text": "all done"},
        ],
    )
    return echo
