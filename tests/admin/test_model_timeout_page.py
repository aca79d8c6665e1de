"""The run page after a model call timed out (issue 38): it names the endpoint and the step and
says what a person should do, instead of a garbled "needs a person ... Look it up at , ..." while
the desk counted nobody needing attention. And a run on an endpoint whose last probe failed says
so on its page.
"""

from __future__ import annotations

import pytest
from django.urls import reverse

from llm.models import ModelEndpoint
from runs.engine import advance
from runs.models import Run
from runs.services import start_run
from tests import factories
from tests.fakes.model_servers import FakeOpenAI

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def slow_server():
    fake = FakeOpenAI(min_cacheable_tokens=0)
    fake.start()
    yield fake
    fake.stop()


def test_a_timed_out_model_call_names_the_endpoint_and_step_and_asks_no_person(acme, as_ravi, slow_server):
    endpoint = factories.make_endpoint(
        acme.tenant, name="local-gemma", kind="openai", base_url=slow_server.base_url
    )
    # A long backoff: the run is still waiting for its next call when the page is read.
    ModelEndpoint.objects.filter(pk=endpoint.pk).update(
        first_token_timeout_seconds=0.5, timeout_backoff_seconds=120
    )
    factories.make_agent(acme.tenant, name="gemma-agent", endpoint=endpoint)
    slow_server.queue({"text": "late", "first_token_delay": 3})
    run, _ = start_run(user=acme.asha, agent="gemma-agent", input={"case": "TXN-1001"})
    advance(run.pk)
    run = Run.objects.get(pk=run.pk)
    assert not run.is_terminal and run.steps.get(seq=1).status == "outcome_unknown"

    page = as_ravi.get(reverse("admin:runs_run_change", args=[run.pk])).content.decode()
    assert "A model call got no answer" in page
    assert 'Step <a href="#step-1">1</a>: the call to the model endpoint <strong>local-gemma</strong>' in page
    assert "no first token within 0.5s" in page
    assert "Nothing for a person to do here" in page
    assert "manage.py probe_endpoint local-gemma" in page
    # What the old page said for a lost model call: a person asked to look up a tool call.
    assert "This run needs a person" not in page
    assert "Look it up at" not in page
    # The desk and the page agree: nobody is asked to act on this run.
    desk = as_ravi.get(reverse("admin:index")).context["desk"]
    assert desk["attention"] == 0


def test_a_run_on_an_endpoint_whose_last_probe_failed_says_so(acme, as_ravi):
    endpoint = factories.make_endpoint(
        acme.tenant, name="local-gemma", kind="openai", base_url="http://127.0.0.1:9/v1"
    )
    factories.make_agent(acme.tenant, name="gemma-agent", endpoint=endpoint)
    run, _ = start_run(user=acme.asha, agent="gemma-agent", input={"case": "TXN-1001"})
    url = reverse("admin:runs_run_change", args=[run.pk])
    assert 'id="run-probe"' not in as_ravi.get(url).content.decode()  # never probed: nothing said

    ModelEndpoint.objects.filter(pk=endpoint.pk).update(
        probe={
            "at": "2026-12-03T10:00:00+00:00",
            "ok": False,
            "calls": 6,
            "checks": [
                {"name": "tools", "ok": True, "detail": "called", "setting": "", "required": True},
                {
                    "name": "tool_result",
                    "ok": False,
                    "detail": "the model did not repeat the nonce",
                    "setting": "set compat.tool_results: user",
                    "required": True,
                },
            ],
        }
    )
    page = as_ravi.get(url).content.decode()
    assert (
        "local-gemma: the endpoint&#x27;s last probe failed (tool_result): set compat.tool_results: user"
        in page
    ), page
