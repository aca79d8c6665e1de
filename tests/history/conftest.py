"""A finished run with a model call, a tool call and a reply: the history's tests tamper with it."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission

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


@pytest.fixture
def compliance(tenant):
    """A tenant's compliance officer: staff, with the history's permissions."""
    user = factories.make_user(tenant, "clara", staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="history",
            codename__in=[
                "add_erasurecertificate",
                "view_erasurecertificate",
                "add_legalhold",
                "change_legalhold",
                "view_legalhold",
            ],
        )
    )
    return type(user).objects.get(pk=user.pk)
