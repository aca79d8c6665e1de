"""The engine and the shared endpoint quota (llm/quotas.py, runs/engine/model_step.quota_wait).

The engine runs in this process (one `advance` per step, as a worker's task would), against real
PostgreSQL and Redis and a fake OpenAI-compatible server that counts what reaches it.
"""

from __future__ import annotations

import pytest

from budgets.models import BudgetAccount, Reservation
from configuration.apply import ConfigError, apply_config
from llm.models import ModelEndpoint
from runs.engine import advance
from runs.models import Run, RunEvent, Step
from runs.services import start_run
from tenants.models import Secret, Tenant
from tests import factories
from tests.configuration.test_apply import SLUG, config
from tests.fakes.model_servers import FakeOpenAI
from tests.servers import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture
def provider():
    fake = FakeOpenAI(tool_turns=1, min_cacheable_tokens=0)
    fake.start()
    yield fake
    fake.stop()


def tenant_on(provider, slug: str, **endpoint_fields):
    """A tenant with a user and an agent whose endpoint spends the bank's one provider account."""
    tenant = factories.make_tenant(slug)
    user = factories.make_user(tenant, f"{slug}-user")
    secret = Secret(tenant=tenant, name="provider-key")
    secret.set_value("sk-the-bank-account")
    secret.save()
    endpoint = factories.make_endpoint(
        tenant, name="gpt", kind="openai", base_url=provider.base_url, secret=secret
    )
    ModelEndpoint.objects.filter(pk=endpoint.pk).update(**endpoint_fields)
    echo = factories.make_builtin_tools(tenant)["echo"]
    factories.grant(echo, use=[user])
    factories.make_agent(tenant, tools=[echo], endpoint=endpoint)
    return user


def test_a_retry_after_slows_another_tenants_run_on_the_same_account(provider):
    told, other = tenant_on(provider, "acme"), tenant_on(provider, "globex")
    provider.queue({"fault": "429", "retry_after": 3})
    first, _ = start_run(user=told, agent="agent", input={"message": "hi"})
    second, _ = start_run(user=other, agent="agent", input={"message": "hi"})

    advance(first.pk)  # the provider answers 429, Retry-After 3
    assert len(provider.requests) == 1
    advance(second.pk)  # another tenant's run: told to wait, nothing sent

    assert len(provider.requests) == 1
    wait = RunEvent.objects.get(run_id=second.pk, kind="quota_wait")
    assert wait.data["limit"] == "retry_after"
    assert 2.0 <= wait.data["countdown"] <= 3.0
    assert "the provider asked to wait" in wait.message
    second = Run.objects.get(pk=second.pk)
    assert second.status == "running" and second.lease_token is None  # a row, no worker
    assert not Step.objects.filter(run=second).exists()


def test_a_call_told_to_wait_reserves_nothing_and_goes_when_its_slot_comes(provider, settings):
    settings.QUOTA_WINDOW_SECONDS = 2.0
    user = tenant_on(provider, "acme", requests_per_minute=2)  # slots 2 s apart
    first, _ = start_run(user=user, agent="agent", input={"message": "one"})
    second, _ = start_run(user=user, agent="agent", input={"message": "two"})
    advance(first.pk)
    advance(second.pk)

    assert len(provider.requests) == 1
    wait = RunEvent.objects.get(run_id=second.pk, kind="quota_wait")
    assert wait.data["limit"] == "requests" and 0 < wait.data["countdown"] <= 2.0
    assert not Reservation.objects.filter(run_id=second.pk).exists()
    assert BudgetAccount.objects.get(run_id=second.pk).reserved_micros == 0

    # The countdown's message: once the slot has come, the call is made.
    wait_for(lambda: (advance(second.pk), len(provider.requests) == 2)[1], timeout=5, what="the second call")
    assert Step.objects.filter(run_id=second.pk, kind="model").count() == 1


def test_the_configuration_file_sets_quotas_and_weights_and_refuses_bad_values_at_their_path():
    data = config()
    data["tenant"]["quotas"]["model_quota_weight"] = 3
    data["model_endpoints"].append(
        {
            "name": "shared",
            "kind": "openai",
            "base_url": "http://127.0.0.1:9/v1",
            "quota": {"requests_per_minute": 600, "tokens_per_minute": 200_000},
        }
    )
    apply_config(data)
    assert Tenant.objects.get(slug=SLUG).quota_weight == 3
    shared = ModelEndpoint.objects.get(name="shared")
    assert (shared.requests_per_minute, shared.tokens_per_minute) == (600, 200_000)

    data["tenant"]["quotas"]["model_quota_weight"] = 0
    data["model_endpoints"][-1]["quota"] = {"requests_per_minute": 0.5, "per_hour": 3}
    with pytest.raises(ConfigError) as caught:
        apply_config(data)
    paths = [path for path, _ in caught.value.errors]
    assert "tenant.quotas.model_quota_weight" in paths
    assert "model_endpoints[1].quota.requests_per_minute" in paths
    assert "model_endpoints[1].quota.per_hour" in paths
