"""Typed, checked final answers (agents/output.py, runs/engine/model_step.py): a version's
output_schema, the retries that give the model its errors, invalid_output, grounded fields, and
the parsed `output` the API answers. Through the engine against the fake OpenAI server, which sees
what the model is told.
"""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from agents import output as output_contract
from agents.services import create_version
from core.errors import DomainError
from runs.engine import decisions
from runs.models import RunEvent, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tests.fakes.model_servers import FakeOpenAI

SCHEMA = {
    "type": "object",
    "properties": {
        "transaction_id": {"type": "string", "pattern": "^TXN-[0-9]+$"},
        "amount": {"type": "integer"},
        "disputable": {"type": "boolean"},
    },
    "required": ["transaction_id", "amount", "disputable"],
    "additionalProperties": False,
}
GOOD = {"transaction_id": "TXN-1001", "amount": 12499, "disputable": True}


@pytest.fixture
def fake():
    server = FakeOpenAI(min_cacheable_tokens=0)
    server.start()
    yield server
    server.stop()


def agent(tenant, fake, *, tools=(), **spec):
    endpoint = factories.make_endpoint(tenant, name="local", kind="openai", base_url=fake.base_url)
    return factories.make_agent(tenant, endpoint=endpoint, tools=tools, output_schema=SCHEMA, **spec)


def run_once(asha):
    run, _ = start_run(user=asha, agent="agent", input={"case": "TXN-1001"})
    return drive(run.pk)


@pytest.mark.django_db(transaction=True)
def test_a_valid_answer_succeeds_and_the_api_answers_it_parsed(tenant, asha, fake):
    agent(tenant, fake)
    fake.queue({"text": "```json\n" + json.dumps(GOOD) + "\n```"})
    run = run_once(asha)
    assert run.status == "succeeded", run.error
    # The model was told the shape with its instructions.
    system = fake.requests[0]["messages"][0]["content"]
    assert system.startswith("You help bank support agents.") and '"transaction_id"' in system
    client = APIClient()
    client.force_authenticate(asha)
    answer = client.get(f"/v1/runs/{run.pk}").json()
    assert answer["output"] == GOOD
    assert answer["final_output"].startswith("```json")


@pytest.mark.django_db(transaction=True)
def test_an_invalid_answer_is_given_back_with_its_errors_and_a_valid_one_then_succeeds(tenant, asha, fake):
    agent(tenant, fake)
    fake.queue(
        {"text": "The transaction TXN-1001 can be disputed."},
        {"text": json.dumps({**GOOD, "amount": "12,499"})},
    )
    fake.queue({"text": json.dumps(GOOD)})
    run = run_once(asha)
    assert run.status == "succeeded", run.error
    assert len(fake.requests) == 3
    second, third = fake.requests[1]["messages"], fake.requests[2]["messages"]
    assert second[-1]["role"] == "user" and "the answer is not JSON" in second[-1]["content"]
    assert "amount: '12,499' is not of type 'integer'" in third[-1]["content"], third[-1]["content"]
    refused = RunEvent.objects.filter(run=run, kind="output_refused").order_by("id")
    assert [e.step_seq for e in refused] == [1, 2]
    assert Step.objects.get(run=run, seq=3).result.get("output_errors") is None


@pytest.mark.django_db(transaction=True)
def test_after_the_allowed_retries_the_run_fails_invalid_output_never_succeeded(tenant, asha, fake):
    agent(tenant, fake, output_retries=1)
    fake.queue(
        {"text": json.dumps({"transaction_id": "1001"})}, {"text": json.dumps({"transaction_id": "1001"})}
    )
    run = run_once(asha)
    assert run.status == "failed"
    assert run.stop_reason == "invalid_output"
    assert run.error.startswith("invalid_output: the final answer did not match the version's output_schema")
    assert "transaction_id: '1001' does not match" in run.error
    assert "'amount' is a required property" in run.error
    assert len(fake.requests) == 2  # one answer and one retry
    client = APIClient()
    client.force_authenticate(asha)
    assert client.get(f"/v1/runs/{run.pk}").json()["output"] is None


@pytest.mark.django_db(transaction=True)
def test_a_grounded_field_must_come_from_a_tool_result_of_the_run(tenant, asha, builtins, fake):
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    agent(tenant, fake, tools=[echo], grounded_fields=["transaction_id"])
    fake.queue(
        {"tool_calls": [{"name": echo.name, "arguments": {"found": "TXN-1001", "amount": 12499}}]},
        # Made up: a well-formed id the lookup never returned.
        {"text": json.dumps({**GOOD, "transaction_id": "TXN-7777"})},
        {"text": json.dumps(GOOD)},
    )
    run = run_once(asha)
    assert run.status == "succeeded", run.error
    refused = RunEvent.objects.get(run=run, kind="output_refused")
    assert (
        "transaction_id: 'TXN-7777' does not appear in any result of this run's tool calls" in refused.message
    )
    assert (
        "copied from the results of your tool calls: transaction_id"
        in fake.requests[0]["messages"][0]["content"]
    )


@pytest.mark.django_db
def test_the_spec_refuses_a_bad_output_contract_at_its_path(tenant):
    factories.make_endpoint(tenant, name="local")
    cases = [
        ({"output_schema": {"type": "objekt"}}, "output_schema.type"),
        ({"output_schema": "json"}, "output_schema"),
        ({"output_retries": 2}, "output_retries"),
        ({"output_schema": SCHEMA, "output_retries": 11}, "output_retries"),
        ({"output_schema": SCHEMA, "grounded_fields": ["txn"]}, "grounded_fields[0]"),
    ]
    for extra, path in cases:
        spec = {"model": "local", "instructions": "x", **extra}
        with pytest.raises(DomainError) as caught:
            create_version(tenant=tenant, agent="typed", spec=spec)
        assert path in caught.value.fields, (extra, caught.value.fields)


@pytest.mark.parametrize(
    ("errors", "refused", "retries", "verdict"),
    [
        ([], 0, 2, "accept"),
        ([], 5, 0, "accept"),
        (["x"], 0, 2, "retry"),
        (["x"], 1, 2, "retry"),
        (["x"], 2, 2, "fail"),
        (["x"], 0, 0, "fail"),
    ],
)
def test_output_turn(errors, refused, retries, verdict):
    assert decisions.output_turn(errors, refused, retries) == verdict


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('{"a": 1}', {"a": 1}),
        ('```json\n{"a": 1}\n```', {"a": 1}),
        ('Here it is: {"a": 1} as asked.', {"a": 1}),
        ("no json here", None),
    ],
)
def test_parse_reads_the_json_small_models_wrap(text, value):
    assert output_contract.parse(text)[0] == value
