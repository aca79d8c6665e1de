"""A self-hosted server's refusal through the engine and the configuration (llm/compat.py).

What a new user met with llama-cpp-python: every run failed with "model call failed 5 times in a
row" after minutes of retries. Now the refused request fails the run at once, one request at the
server, with the server's words and the setting to change; the setting, read from the
configuration file like any endpoint field, makes the next run succeed.
"""

from __future__ import annotations

import pytest

from configuration.apply import ConfigError, apply_config
from llm.models import ModelEndpoint
from runs.services import start_run
from tests import factories
from tests.configuration.test_apply import config
from tests.conftest import drive
from tests.fakes.model_servers import FakeOpenAI

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture
def fussy():
    fake = FakeOpenAI(quirks=("string_content",), tool_turns=1, min_cacheable_tokens=0)
    fake.start()
    yield fake
    fake.stop()


def test_a_refused_shape_fails_the_run_at_once_naming_the_setting_and_the_setting_fixes_it(
    tenant, asha, builtins, fussy
):
    endpoint = factories.make_endpoint(tenant, name="local", kind="openai", base_url=fussy.base_url)
    factories.grant(builtins["echo"], use=[asha])
    factories.make_agent(tenant, endpoint=endpoint, tools=[builtins["echo"]])

    run, _ = start_run(user=asha, agent="agent", input={"case": "TXN-1"})
    run = drive(run.pk)
    assert run.status == "failed"
    assert "set compat.tool_call_content: empty_string" in run.error, run.error
    assert "Input should be a valid string" in run.error
    # The first call (no tool-call turn yet) and the refused second one: nothing repeated.
    assert len(fussy.requests) == 2

    endpoint.compat = {"tool_call_content": "empty_string"}
    endpoint.save()
    run, _ = start_run(user=asha, agent="agent", input={"case": "TXN-2"})
    run = drive(run.pk)
    assert run.status == "succeeded", run.error
    assert fussy.requests[-1]["messages"][2]["content"] == ""


def test_the_configuration_file_sets_compat_and_refuses_a_bad_value_at_its_path():
    data = config()
    data["model_endpoints"].append(
        {
            "name": "local",
            "kind": "openai",
            "base_url": "http://127.0.0.1:9/v1",
            "compat": {"max_tokens_field": "max_tokens", "system_message": "in_user"},
        }
    )
    apply_config(data)
    assert ModelEndpoint.objects.get(name="local").compat == {
        "max_tokens_field": "max_tokens",
        "system_message": "in_user",
    }

    data["model_endpoints"][-1]["compat"] = {"max_tokens_field": "max_new_tokens"}
    with pytest.raises(ConfigError) as caught:
        apply_config(data)
    assert caught.value.errors == [
        ("model_endpoints[1].compat.max_tokens_field", "must be one of max_completion_tokens, max_tokens")
    ]
    data["model_endpoints"][-1]["compat"] = {"stream": False}
    with pytest.raises(ConfigError) as caught:
        apply_config(data)
    assert caught.value.errors[0][0] == "model_endpoints[1].compat.stream"


@pytest.mark.parametrize(
    ("compat", "answer"), [({}, "done"), ({"tool_results": "user"}, "done nonce-5eed1234")]
)
def test_a_template_that_drops_tool_messages_hides_the_result_unless_results_go_as_user_turns(
    tenant, asha, builtins, compat, answer
):
    fake = FakeOpenAI(quirks=("drops_tool_messages",), min_cacheable_tokens=0)
    fake.start()
    try:
        endpoint = factories.make_endpoint(tenant, name="local", kind="openai", base_url=fake.base_url)
        endpoint.compat = compat
        endpoint.save()
        echo = builtins["echo"]
        factories.grant(echo, use=[asha])
        factories.make_agent(tenant, endpoint=endpoint, tools=[echo])
        fake.queue({"tool_calls": [{"name": echo.name, "arguments": {"check": "nonce-5eed1234"}}]})
        run, _ = start_run(user=asha, agent="agent", input={"case": "TXN-1"})
        run = drive(run.pk)
    finally:
        fake.stop()
    assert run.status == "succeeded", run.error
    # The model answers from the result only when it can read it.
    assert run.final_output == answer
