"""`manage.py apply` with hostile or careless files: duplicate keys, values out of range, bad text,
alias bombs and huge values. Every one is a `path: message` line, never a traceback, and nothing is
applied. Each of these was accepted silently, hung, or answered with a 34-90 line traceback before."""

from __future__ import annotations

import time
from io import StringIO

import pytest
import yaml
from django.core.management import CommandError, call_command

from configuration.apply import ConfigError, apply_config, load_text
from tenants.models import Tenant
from tests.configuration.test_apply import SLUG, config
from tools.models import Tool

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def apply_text(text: str, tmp_path) -> list[str]:
    """Run the command on `text`; return its error lines (the command must refuse the file)."""
    path = tmp_path / "tenant.yaml"
    path.write_text(text, encoding="utf-8")
    err = StringIO()
    with pytest.raises(CommandError, match="nothing was applied"):
        call_command("apply", str(path), stdout=StringIO(), stderr=err)
    lines = err.getvalue().splitlines()
    assert lines and not any("Traceback" in line or line.startswith("  File ") for line in lines), lines
    return lines


def dump(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def test_a_duplicate_key_is_refused_with_its_path(tmp_path):
    text = dump(config()).replace("  name: Acme Test\n", "  name: Acme Test\n  name: Acme Other\n", 1)
    lines = apply_text(text, tmp_path)
    assert len(lines) == 1 and lines[0].startswith("tenant.name: duplicate key (first at line")
    tools_twice = dump(config()) + "tools: []\n"
    assert apply_text(tools_twice, tmp_path)[0].startswith("tools: duplicate key")
    assert not Tenant.objects.filter(slug=SLUG).exists()


@pytest.mark.parametrize(
    "change, path",
    [
        (
            lambda c: c["tenant"]["quotas"].update(max_active_runs=3_000_000_000),
            "tenant.quotas.max_active_runs",
        ),
        (lambda c: c["tenant"].update(daily_budget=10_000_000_000_000), "tenant.daily_budget"),
        (lambda c: c["tenant"].update(name="Acme\x00Test"), "tenant.name"),
        (lambda c: c["model_endpoints"][0]["prices"].update(input=1e30), "model_endpoints[0].prices.input"),
        (lambda c: c["tools"][1].update(timeout_seconds="1e400"), "tools[1].timeout_seconds"),
        (lambda c: c["tools"][1].update(timeout_seconds=100_000), "tools[1].timeout_seconds"),
        (lambda c: c["tools"][1].update(max_attempts="1e999999999"), "tools[1].max_attempts"),
        (lambda c: c["tools"][1].update(price=1e30), "tools[1].price"),
        (lambda c: c["tools"][1].update(backoff_seconds=float("inf")), "tools[1].backoff_seconds"),
        (lambda c: c["tenant"].update(approval_ttl_seconds=10**12), "tenant.approval_ttl_seconds"),
        (lambda c: c["tools"][1].update(description="x" * 10_001), "tools[1].description"),
        (lambda c: c["tools"][1]["input_schema"].update(title="\ud800"), "tools[1].input_schema.title"),
        (
            lambda c: c["model_endpoints"][0]["config"].update(scale=float("nan")),
            "model_endpoints[0].config.scale",
        ),
        (
            lambda c: c["agents"][0]["versions"][0].update(description="a\x00b"),
            "agents[0].versions[0].description",
        ),
    ],
    ids=[
        "int-range",
        "bigint-range",
        "nul",
        "price-1e30",
        "timeout-1e400",
        "timeout-bound",
        "huge-int",
        "money",
        "infinity",
        "ttl",
        "description",
        "surrogate",
        "nan",
        "nul-in-spec",
    ],
)
def test_every_bad_value_is_one_line_with_its_path(tmp_path, change, path):
    data = config()
    change(data)
    text = dump(data) if "\ud800" not in repr(data) else dump(data).replace("\\uD800", "\\ud800")
    lines = apply_text(text, tmp_path)
    assert len(lines) == 1 and lines[0].startswith(f"{path}: "), lines
    assert not Tenant.objects.filter(slug=SLUG).exists()


def test_bad_values_from_code_are_reported_the_same_way():
    data = config()
    data["tools"][1]["timeout_seconds"] = "1e400"
    data["tenant"]["caps"]["max_steps"] = 2**40
    with pytest.raises(ConfigError) as caught:
        apply_config(data)
    assert [path for path, _ in caught.value.errors] == ["tenant.caps.max_steps", "tools[1].timeout_seconds"]
    assert not Tool.objects.exists()


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    levels = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, 9):
        name, previous = chr(ord("a") + i), chr(ord("a") + i - 1)
        levels.append(f"{name}: &{name} [{', '.join(['*' + previous] * 9)}]")
    bomb = "\n".join(levels) + "\n" + dump(config())
    assert len(bomb.encode()) < 8_000
    started = time.monotonic()
    lines = apply_text(bomb, tmp_path)
    assert time.monotonic() - started < 5
    assert lines == [
        "the file has more than 100000 values once its aliases are expanded (a YAML alias bomb?)"
    ]


def test_aliases_and_merge_keys_within_bounds_still_work():
    text = dump(config()) + "x-defaults: &defaults {enabled: true}\n"
    data = load_text(text)
    assert data["x-defaults"] == {"enabled": True}
    merged = load_text("base: &b {x: 1}\nother:\n  <<: *b\n  y: 2\n")
    assert merged["other"] == {"x": 1, "y": 2}


def test_sizes_are_bounded(tmp_path):
    big = dump(config()).replace("description: Open a ticket.", "description: " + "x" * 2_000_000)
    assert apply_text(big, tmp_path) == ["the file is larger than 1048576 bytes"]
    deep = dump(config()) + "x: " + "[" * 200 + "]" * 200 + "\n"
    assert any("nested more than 64 levels deep" in line for line in apply_text(deep, tmp_path))
    long_value = dump(config()) + "x: " + "y" * 100_001 + "\n"
    assert apply_text(long_value, tmp_path)[0].startswith("x: longer than 100000 characters")


def test_a_description_from_the_environment_is_bounded_too(tmp_path, monkeypatch):
    monkeypatch.setenv("HUGE_DESCRIPTION", "x" * 30_000)
    text = dump(config()).replace("description: Open a ticket.", "description: ${HUGE_DESCRIPTION}")
    assert apply_text(text, tmp_path) == ["tools[1].description: must be at most 10000 characters"]


def test_yaml_values_json_cannot_hold_are_refused(tmp_path):
    text = dump(config()).replace("config:\n", "config:\n    since: 2026-01-01\n", 1)
    lines = apply_text(text, tmp_path)
    assert lines == [
        "model_endpoints[0].config.since: must be text, a number, a boolean, a list or a mapping, not date"
    ]
