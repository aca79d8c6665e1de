"""`manage.py probe_endpoint` (llm/probe.py) against fake servers that play each failure.

For every check: a server with the quirk fails it, the report names the setting, and with that
setting the probe passes. The result is stored on the endpoint; the command exits non-zero on a
failed probe; `apply --probe` probes the file's endpoints after applying.
"""

from __future__ import annotations

import datetime
from io import StringIO
from typing import Any

import pytest
import yaml
from django.contrib.auth.models import Permission
from django.core.management import CommandError, call_command
from django.utils import timezone

from llm.models import ModelEndpoint
from llm.probe import failed_probe, probe, probe_lines
from tenants.models import Secret
from tests import factories
from tests.configuration.test_apply import config
from tests.fakes.model_servers import FakeAnthropic, FakeOpenAI

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(120)]


@pytest.fixture
def server():
    started: list[Any] = []

    def start(kind: str = "openai", *quirks: str, cache: bool = True) -> Any:
        fake_class = FakeOpenAI if kind == "openai" else FakeAnthropic
        fake = fake_class(quirks=quirks, tool_turns=1, min_cacheable_tokens=0 if cache else 1024)
        fake.start()
        started.append(fake)
        return fake

    yield start
    for fake in started:
        fake.stop()


def endpoint_for(tenant, fake, kind: str = "openai", **fields: Any) -> ModelEndpoint:
    secret = None
    if kind == "anthropic":
        secret = Secret(tenant=tenant, name="proxy-key")
        secret.set_value("sk-proxy-7788")
        secret.save()
    return factories.make_endpoint(
        tenant, name="local", kind=kind, base_url=fake.base_url, secret=secret, **fields
    )


def check(result, name: str):
    return next(c for c in result.checks if c.name == name)


def test_a_server_that_does_everything_passes_and_the_result_is_stored(tenant, server):
    fake = server()
    endpoint = endpoint_for(tenant, fake)
    result = probe(endpoint)
    assert result.ok, result.render()
    assert [c.name for c in result.checks] == ["tools", "tool_result", "output_limit", "usage", "caching"]
    assert all(c.ok for c in result.checks)
    assert result.calls == len(fake.requests) <= 8
    assert all((b.get("max_completion_tokens") or 0) <= 128 for b in fake.requests)  # bounded
    stored = ModelEndpoint.objects.get(pk=endpoint.pk).probe
    assert stored["ok"] is True and [c["name"] for c in stored["checks"]][0] == "tools"
    assert probe_lines(stored)[0].startswith("passed at ")
    assert failed_probe(stored) == ""


def test_tools_offered_only_with_tool_choice_auto(tenant, server):
    fake = server("openai", "tools_need_choice")
    endpoint = endpoint_for(tenant, fake)
    result = probe(endpoint)
    assert not result.ok
    tools = check(result, "tools")
    assert not tools.ok and tools.setting == "set compat.tool_choice: auto"
    assert "with tool_choice: auto it did" in tools.detail
    assert (
        failed_probe(endpoint.probe)
        == "the endpoint's last probe failed (tools): set compat.tool_choice: auto"
    )

    endpoint.compat = {"tool_choice": "auto"}
    endpoint.save()
    assert probe(endpoint).ok


@pytest.mark.parametrize(
    ("kind", "quirk"), [("openai", "drops_tool_messages"), ("anthropic", "drops_tool_results")]
)
def test_a_template_that_drops_tool_results_is_found_and_the_setting_named(tenant, server, kind, quirk):
    fake = server(kind, quirk)
    endpoint = endpoint_for(tenant, fake, kind=kind)
    result = probe(endpoint)
    reached = check(result, "tool_result")
    assert not reached.ok and reached.setting == "set compat.tool_results: user", reached
    assert "the model did not repeat the nonce; the prompt grew 0 tokens" in reached.detail
    assert "with tool_results: user, the model repeated the nonce" in reached.detail

    endpoint.compat = {"tool_results": "user"}
    endpoint.save()
    assert check(probe(endpoint), "tool_result").ok


def test_an_ignored_output_limit_fails_unstreamed_and_is_cut_streamed(tenant, server):
    fake = server("openai", "ignores_max_tokens")
    endpoint = endpoint_for(tenant, fake, stream=False)
    limit = check(probe(endpoint), "output_limit")
    assert not limit.ok and limit.setting.startswith("set stream: true")
    assert "against a limit of 16" in limit.detail

    endpoint.stream = True
    endpoint.save()
    limit = check(probe(endpoint), "output_limit")
    assert limit.ok and "the platform stopped reading at the limit" in limit.detail
    assert any(stream["closed_early"] for stream in fake.streams)


def test_a_server_that_reports_no_usage_fails_usage(tenant, server):
    fake = server("openai", "no_usage")
    endpoint = endpoint_for(tenant, fake, compat={"stream_usage": "omit"})
    usage = check(probe(endpoint), "usage")
    assert not usage.ok and usage.setting == "set compat.stream_usage: include"
    assert "the platform's own count" in usage.detail


def test_no_cache_report_is_a_note_not_a_failure(tenant, server):
    fake = server("openai", cache=False)
    result = probe(endpoint_for(tenant, fake))
    caching = check(result, "caching")
    assert not caching.ok and not caching.required
    assert result.ok
    assert caching.line().startswith("note caching: the server reports no cached input tokens")


def test_a_refused_call_lifts_the_setting_its_error_names_into_the_check(tenant, server):
    # llama-cpp-python refuses content: null on the tool-call turn with an HTTP 500 (as measured):
    # the probe's line and the endpoint's page must say what to change, not only the error.
    fake = server("openai", "string_content_500")
    endpoint = endpoint_for(tenant, fake)
    result = probe(endpoint)
    reached = check(result, "tool_result")
    assert not reached.ok and "HTTP 500" in reached.detail, reached
    assert reached.setting == "set compat.tool_call_content: empty_string", reached
    assert "-> set compat.tool_call_content: empty_string" in result.render()
    assert failed_probe(endpoint.probe).endswith("set compat.tool_call_content: empty_string")
    assert check(result, "tools").ok and check(result, "usage").ok

    endpoint.compat = {"tool_call_content": "empty_string"}
    endpoint.save()
    assert probe(endpoint).ok, probe(endpoint).render()


def test_a_litellm_proxy_is_refused_until_its_settings_are_set(tenant, server):
    fake = server("anthropic", "string_system", "no_cache_control", "drops_tool_results")
    endpoint = endpoint_for(tenant, fake, kind="anthropic")
    result = probe(endpoint)
    tools = check(result, "tools")
    assert not tools.ok and "set compat.system: string" in tools.detail, tools.detail
    assert "sk-proxy-7788" not in str(endpoint.probe)

    endpoint.compat = {"prompt_cache": "none", "system": "string", "tool_results": "user"}
    endpoint.save()
    assert probe(endpoint).ok, probe(endpoint).render()


def test_the_command_prints_the_report_and_exits_non_zero_on_a_failure(tenant, server):
    endpoint_for(tenant, server("openai", "tools_need_choice"))
    out = StringIO()
    with pytest.raises(CommandError, match="the probe of local failed"):
        call_command("probe_endpoint", "local", stdout=out)
    assert "FAIL tools: the model did not call the offered tool" in out.getvalue()
    assert "-> set compat.tool_choice: auto" in out.getvalue()
    with pytest.raises(CommandError, match="no model endpoint named 'other'"):
        call_command("probe_endpoint", "other")


def test_apply_probe_probes_the_files_endpoints_after_applying(server, tmp_path):
    fake = server()
    data = config()
    data["model_endpoints"].append(
        {"name": "local", "kind": "openai", "base_url": fake.base_url, "model": "m"}
    )
    path = tmp_path / "tenant.yaml"
    path.write_text(yaml.safe_dump(data))
    out = StringIO()
    call_command("apply", str(path), "--probe", stdout=out)
    assert "probe of local: passed" in out.getvalue()
    assert ModelEndpoint.objects.get(name="local").probe["ok"] is True


def test_the_admin_shows_the_last_probes_result_and_time(tenant, server, client):
    """What an operator reads on the endpoint's admin page and in the list: never probed (and
    the command to run), then the last probe's verdict, its time in UTC and every check with the
    setting to change; the model's own words in a check are shown as text, never as markup."""
    fake = server("openai", "tools_need_choice")
    endpoint = endpoint_for(tenant, fake)
    supervisor = factories.make_user(tenant, "ravi", staff=True)
    supervisor.user_permissions.add(Permission.objects.get(codename="view_modelendpoint"))
    client.force_login(supervisor)
    change, listing = f"/admin/llm/modelendpoint/{endpoint.pk}/change/", "/admin/llm/modelendpoint/"

    assert "never probed: manage.py probe_endpoint local" in client.get(change).content.decode()
    assert '<td class="field-probed">-</td>' in client.get(listing).content.decode()

    # The model's first answer, quoted in the tools check's detail.
    fake.queue({"text": "<script>alert(1)</script>"})
    before = timezone.now()
    probe(endpoint)
    at = datetime.datetime.fromisoformat(ModelEndpoint.objects.get(pk=endpoint.pk).probe["at"])
    assert before <= at <= timezone.now()
    page = client.get(change).content.decode()
    assert f"FAILED at {at.astimezone(datetime.UTC):%Y-%m-%d %H:%M:%S} UTC" in page
    assert (
        "FAIL tools: the model did not call the offered tool (it answered "
        "&#x27;&lt;script&gt;alert(1)&lt;/script&gt;&#x27;); with tool_choice: auto it did "
        "-&gt; set compat.tool_choice: auto"
    ) in page
    assert "<script>alert(1)</script>" not in page
    assert "ok   tool_result: the model repeated the nonce from the result" in page
    assert '<td class="field-probed">FAILED</td>' in client.get(listing).content.decode()

    # The setting named, the probe run again: the page shows the newer probe, and only it.
    ModelEndpoint.objects.filter(pk=endpoint.pk).update(compat={"tool_choice": "auto"})
    probe(ModelEndpoint.objects.get(pk=endpoint.pk))
    later = datetime.datetime.fromisoformat(ModelEndpoint.objects.get(pk=endpoint.pk).probe["at"])
    assert later > at
    page = client.get(change).content.decode()
    assert f"passed at {later.astimezone(datetime.UTC):%Y-%m-%d %H:%M:%S} UTC" in page
    assert "FAILED at" not in page and "FAIL tools" not in page
    assert "ok   tools: the model called lookup_record" in page
    assert '<td class="field-probed">passed</td>' in client.get(listing).content.decode()
