"""The configuration examples in README.md and docs/ read as written, and the fragments of
docs/configuration.md apply as written inside a tenant's file.

The fallback example once failed at apply (`keys must be text, not bool`: YAML 1.1 reads a bare
`on` as true); nothing ran it. Each fragment is taken from the doc's text, not copied here.
"""

from __future__ import annotations

import re

import pytest
import yaml

from agents.models import AgentVersion
from configuration.apply import apply_config
from configuration.loading import load_text
from llm.models import ModelEndpoint
from notifications.models import Webhook
from tests.configuration.test_apply import SLUG, config
from tests.servers import ROOT

DOCS = {path.name: path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
BLOCK = re.compile(r"```yaml\n(.*?)```", re.S)


def blocks() -> list[tuple[str, str]]:
    return [(name, block) for name, text in DOCS.items() for block in BLOCK.findall(text)]


def fragment(needle: str) -> dict:
    """The YAML block of docs/configuration.md that contains `needle`, read as apply reads files."""
    [found] = [b for b in BLOCK.findall(DOCS["configuration.md"]) if needle in b]
    return load_text(found)


def keys_are_text(value, path: str = "") -> list[str]:
    if isinstance(value, dict):
        return [f"{path}.{k!r}" for k in value if not isinstance(k, str)] + [
            problem for k, v in value.items() for problem in keys_are_text(v, f"{path}.{k}")
        ]
    if isinstance(value, list):
        return [problem for i, v in enumerate(value) for problem in keys_are_text(v, f"{path}[{i}]")]
    return []


def test_there_are_examples_to_check():
    assert len(blocks()) >= 8


@pytest.mark.parametrize(("doc", "block"), blocks(), ids=[f"{n}-{i}" for i, (n, _) in enumerate(blocks())])
def test_every_yaml_example_reads_as_written_with_text_keys(doc, block):
    data = load_text(block)  # the configuration loader: YAML 1.2 booleans, no duplicate keys
    assert keys_are_text(data) == [], doc


def endpoint(name: str) -> dict:
    return {**config()["model_endpoints"][0], "name": name}


@pytest.mark.django_db
def test_the_fallback_example_applies_as_written():
    example = fragment("fallbacks:")
    data = config()
    data["model_endpoints"] = [endpoint(n) for n in ("scripted", "openai-main", "azure-backup", "local-vllm")]
    [agent] = example["agents"]
    agent["versions"][0]["instructions"] = "Handle the dispute."  # the doc elides it (...)
    agent["aliases"] = {"prod": 1}
    data["agents"].append(agent)

    apply_config(data)

    stored = AgentVersion.objects.get(agent__tenant__slug=SLUG, agent__name="dispute-agent").spec
    assert stored["fallbacks"] == example["agents"][0]["versions"][0]["fallbacks"]
    assert stored["fallbacks"][0]["on"] == ["rate_limited", "server_error", "timeout"]


@pytest.mark.django_db
def test_the_webhook_example_applies_as_written(monkeypatch):
    monkeypatch.setenv("SUPERVISOR_HOOK_SECRET", "hook-secret-" + "x" * 20)
    data = {**config(), **fragment("webhooks:")}

    apply_config(data)

    hook = Webhook.objects.get(tenant__slug=SLUG, name="supervisors")
    assert sorted(hook.events) == ["approval_expiring", "approval_requested", "run_needs_attention"]


@pytest.mark.django_db
def test_the_self_hosted_endpoint_example_applies_as_written():
    data = config()
    data["model_endpoints"] += fragment("name: local-gemma")["model_endpoints"]
    # The LiteLLM endpoint names its master key as a secret; a tenant's file defines it beside.
    data["secrets"].append({"name": "litellm-key", "value": "sk-litellm-master-1234"})

    apply_config(data)

    gemma = ModelEndpoint.objects.get(tenant__slug=SLUG, name="local-gemma")
    assert gemma.kind == "openai"


def test_the_yaml_loader_is_the_one_the_examples_are_read_with():
    # The same text through PyYAML's own loader: `on` becomes True. The loader above is what apply uses.
    assert yaml.safe_load("on: [timeout]") == {True: ["timeout"]}
    assert load_text("on: [timeout]") == {"on": ["timeout"]}
