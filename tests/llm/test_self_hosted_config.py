"""The endpoint settings for self-hosted servers in the configuration file (configuration/schema.py,
llm/compat.py): each kind takes its own wire's settings, and an unknown setting, or one the
endpoint's kind does not read, is an error at its path, never stored and ignored.
"""

from __future__ import annotations

from typing import Any

import pytest

from configuration.apply import ConfigError, apply_config
from llm.models import ModelEndpoint
from tests.configuration.test_apply import config

pytestmark = pytest.mark.django_db


def with_endpoint(**fields: Any) -> dict:
    data = config()
    data["model_endpoints"].append({"name": "local", "base_url": "http://127.0.0.1:9/v1", **fields})
    return data


def errors(**fields: Any) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        apply_config(with_endpoint(**fields))
    return caught.value.errors


def test_an_openai_endpoint_stores_every_setting():
    apply_config(
        with_endpoint(
            kind="openai",
            compat={"tool_results": "user", "tool_choice": "auto", "stream_usage": "omit"},
            sampling={"temperature": 0.2, "top_p": 0.9},
            stream=True,
            timeout_seconds=120,
            first_token_timeout_seconds=30,
            max_in_flight=1,
            timeout_backoff_seconds=15,
        )
    )
    endpoint = ModelEndpoint.objects.get(name="local")
    assert endpoint.compat == {"tool_results": "user", "tool_choice": "auto", "stream_usage": "omit"}
    assert endpoint.sampling == {"temperature": 0.2, "top_p": 0.9}
    assert (endpoint.stream, endpoint.first_token_timeout_seconds) == (True, 30.0)
    assert (endpoint.max_in_flight, endpoint.timeout_backoff_seconds) == (1, 15.0)


def test_an_anthropic_endpoint_takes_the_proxy_settings():
    apply_config(
        with_endpoint(
            kind="anthropic",
            compat={"prompt_cache": "none", "system": "string", "tool_results": "user"},
            sampling={"temperature": 0},
            stream=False,
        )
    )
    endpoint = ModelEndpoint.objects.get(name="local")
    assert endpoint.compat == {"prompt_cache": "none", "system": "string", "tool_results": "user"}
    assert (endpoint.sampling, endpoint.stream) == ({"temperature": 0}, False)


@pytest.mark.parametrize(
    ("fields", "path", "message"),
    [
        # Another wire's setting: the old platform stored it and ignored it.
        (
            {"kind": "anthropic", "compat": {"max_tokens_field": "max_tokens"}},
            "compat.max_tokens_field",
            "only for openai endpoints",
        ),
        (
            {"kind": "openai", "compat": {"prompt_cache": "none"}},
            "compat.prompt_cache",
            "only for anthropic endpoints",
        ),
        ({"kind": "anthropic", "compat": {"cache": "off"}}, "compat.cache", "unknown setting"),
        (
            {"kind": "openai", "compat": {"tool_results": "system"}},
            "compat.tool_results",
            "must be one of tool, user",
        ),
        (
            {"kind": "anthropic", "compat": {"system": "none"}},
            "compat.system",
            "must be one of blocks, string",
        ),
        ({"kind": "scripted", "compat": {"tool_results": "user"}}, "compat", "only for openai and anthropic"),
        ({"kind": "anthropic", "send_cache_key": False}, "send_cache_key", "only for openai endpoints"),
        ({"kind": "openai", "sampling": {"temperature": 3}}, "sampling.temperature", "from 0 to 2"),
        ({"kind": "anthropic", "sampling": {"temperature": 1.5}}, "sampling.temperature", "from 0 to 1"),
        ({"kind": "openai", "sampling": {"top_k": 40}}, "sampling.top_k", "unknown setting"),
        ({"kind": "openai", "sampling": {"top_p": "high"}}, "sampling.top_p", "must be a number"),
        ({"kind": "openai", "sampling": [0.2]}, "sampling", "must be a mapping"),
        ({"kind": "scripted", "max_in_flight": 1}, "max_in_flight", "only for openai and anthropic"),
        ({"kind": "openai", "max_in_flight": 0}, "max_in_flight", ""),
        (
            {"kind": "openai", "timeout_seconds": 30, "first_token_timeout_seconds": 45},
            "first_token_timeout_seconds",
            "at most timeout_seconds",
        ),
        ({"kind": "openai", "streaming": True}, "streaming", ""),
    ],
)
def test_an_unknown_or_inapplicable_setting_is_an_error_at_its_path(fields, path, message):
    found = errors(**fields)
    assert [p for p, _ in found] == [f"model_endpoints[1].{path}"], found
    assert message in found[0][1], found
    assert not ModelEndpoint.objects.filter(name="local").exists()
