from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.contrib.auth import get_user_model

from tests import factories
from tests.admin.helpers import echo_call_agent, make_supervisor, park_on_approval

REFUND = {"amount": 12499, "currency": "INR", "transaction_id": "TXN-1001"}


@pytest.fixture
def acme(transactional_db):
    """Tenant acme: asha runs agents, ravi supervises echo (not noop); both tools need approval."""
    tenant = factories.make_tenant("acme")
    tools = factories.make_builtin_tools(tenant, approval_policy="always")
    asha = factories.make_user(tenant, "asha")
    ravi = make_supervisor(tenant, "ravi")
    factories.grant(tools["echo"], use=[asha, ravi], approve=[ravi])
    factories.grant(tools["noop"], use=[asha])
    echo_call_agent(tenant, tools["echo"], name="refunder", arguments=REFUND)
    echo_call_agent(tenant, tools["noop"], name="nooper", arguments={"x": 1})
    return SimpleNamespace(tenant=tenant, tools=tools, asha=asha, ravi=ravi)


@pytest.fixture
def globex(transactional_db):
    """Another tenant with its own pending approval on its own echo tool."""
    tenant = factories.make_tenant("globex")
    tools = factories.make_builtin_tools(tenant, approval_policy="always")
    bob = factories.make_user(tenant, "bob")
    gina = make_supervisor(tenant, "gina")
    factories.grant(tools["echo"], use=[bob], approve=[gina])
    echo_call_agent(tenant, tools["echo"], name="refunder", arguments=REFUND)
    return SimpleNamespace(
        tenant=tenant, tools=tools, bob=bob, gina=gina, approval=park_on_approval(bob, "refunder")
    )


@pytest.fixture
def operator(transactional_db):
    return get_user_model().objects.create_superuser("ops", password="pw")


@pytest.fixture
def as_ravi(client, acme):
    client.force_login(acme.ravi)
    return client
