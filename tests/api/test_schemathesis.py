"""Schemathesis against /v1/schema on a live server: no 5xx, and every response as documented.

Authenticated as a support agent (who has a run, so reads return real rows) and not authenticated,
with valid (positive) and invalid (negative) inputs. Bounded to about a minute: MAX_EXAMPLES cases
per operation, mode and identity. The figures are printed (pytest -s) for the record.
"""

from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from runs.services import start_run
from tenants.tokens import issue_token
from tests import factories

# About a minute alone; several times that on a machine busy with other suites (the default 300 s
# timeout cut it off mid-case once, which Hypothesis then reported as a flaky strategy).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(1200)]

MAX_EXAMPLES = 12
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture
def support_agent(tenant, builtins, settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    agent = factories.make_user(tenant, "asha")
    factories.make_agent(tenant, tools=[builtins["echo"]], turns=[{"text": "hi"}])
    start_run(user=agent, agent="agent", input={"q": "hello"})
    return agent


def test_the_api_answers_as_its_schema_says_and_never_5xx(live_server, support_agent, capsys):
    token = issue_token(user=support_agent).token
    schema = schemathesis.openapi.from_url(f"{live_server.url}/v1/schema")
    identities = {"support agent": {"Authorization": f"Bearer {token}"}, "anonymous": {}}
    figures = {"cases": 0, "5xx": 0, "mismatches": 0}
    failures: list[str] = []

    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for who, headers in identities.items():
                _runner(operation, mode, who, headers, live_server.url, figures, failures)()

    with capsys.disabled():
        print(
            f"\nschemathesis: {figures['cases']} cases, {figures['5xx']} 5xx, "
            f"{figures['mismatches']} schema mismatches"
        )
    assert figures["cases"] > 300
    assert not failures, "\n".join(failures[:15])


def _runner(operation, mode, who, headers, url, figures, failures):
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    @hypothesis.settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def call(case):
        if who != "anonymous" and "Authorization" in (case.headers or {}):
            case.headers.pop("Authorization")  # our identity, not a generated one
        response = case.call(base_url=url, headers=headers, timeout=10)
        figures["cases"] += 1
        if response.status_code >= 500:
            figures["5xx"] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (AssertionError, FailureGroup) as exc:
            figures["mismatches"] += response.status_code < 500
            failures.append(
                f"{operation.label} [{mode.value}, {who}] -> {response.status_code}: "
                f"{str(exc)[:400]}\n  {case.as_curl_command()[:300]}"
            )

    return call
