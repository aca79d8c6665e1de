"""Declarative tenant configuration: `manage.py apply FILE.yaml` (see docs/configuration.md).

Three phases, so that nothing is half-applied and no transaction is open across a network call:

1. parse: shapes and types of the whole file, without the database;
2. discover: list the tools of MCP and builtin servers, outside any transaction;
3. write: one transaction that creates or updates rows and checks every reference against the
   database as it now stands (agent specs go through agents.spec.validate_spec). Any error from
   any phase, or a dry run, rolls the whole transaction back.

Items with errors are left out of phase 3, which still runs so that errors that need the
database are reported in the same answer; references to items left out are not reported twice.
"""
from __future__ import annotations

import decimal
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from django.contrib.auth.models import Group
from django.contrib.auth.validators import UnicodeUsernameValidator
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import ValidationError
from django.core.validators import URLValidator, validate_email, validate_slug
from django.db import transaction
from guardian.shortcuts import assign_perm, remove_perm
from guardian.utils import get_group_obj_perms_model, get_user_obj_perms_model

from agents.models import AgentDefinition, Alias
from agents.services import create_version, move_alias
from agents.spec import validate_spec
from approvals.policy import PolicyError, parse_policy
from budgets.models import BudgetAccount
from budgets.services import local_day, set_day_limit
from llm.models import ModelEndpoint
from runs.services import digest
from tenants.crypto import redact
from tenants.models import Secret, Tenant, TenantGroup, User, validate_time_zone
from tools.catalog import SyncReport, fetch_remote, schema_hash, sync_server, tool_name
from tools.services import configure_tool
from tools.models import EffectClass, Tool, ToolServer
from tools.types import McpServerConfig, RemoteTool

MICROS = 1_000_000
KINDS = ("tenant", "secrets", "groups", "users", "model_endpoints", "tool_servers", "tools", "grants",
         "agents", "versions", "aliases", "budgets")
PERMS = {"use": "use_tool", "approve": "approve_tool"}


class ConfigError(Exception):
    """The file was rejected as a whole; `errors` lists every (path, message)."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = list(errors)
        super().__init__("\n".join(f"{path}: {message}" if path else message for path, message in self.errors))


# --- report --------------------------------------------------------------------------------------

_RANK = {"unchanged": 0, "updated": 1, "created": 2, "removed": 2}


@dataclass
class ApplyReport:
    """Per kind, what happened to each object (created, updated, unchanged, removed)."""

    tenant: str = ""
    dry_run: bool = False
    outcomes: dict[str, dict[str, str]] = field(default_factory=lambda: {kind: {} for kind in KINDS})
    changes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def record(self, kind: str, label: str, outcome: str, fields: list[str] | tuple = ()) -> None:
        seen = self.outcomes[kind]
        # A tool created by discovery and then configured from the file was created, not updated.
        if _RANK[outcome] < _RANK[seen.get(label, "unchanged")]:
            return
        seen[label] = outcome
        if outcome != "unchanged":
            detail = f" ({', '.join(fields)})" if fields else ""
            self.changes.append(f"{outcome} {kind} {label}{detail}")

    def counts(self, kind: str) -> dict[str, int]:
        values = list(self.outcomes[kind].values())
        return {name: values.count(name) for name in ("created", "updated", "unchanged", "removed")}

    @property
    def changed(self) -> bool:
        return any(outcome != "unchanged" for kind in KINDS for outcome in self.outcomes[kind].values())

    @property
    def state(self) -> str:
        return "dry run, nothing written" if self.dry_run else ("applied" if self.changed else "unchanged")

    def __str__(self) -> str:
        totals = {name: sum(self.counts(kind)[name] for kind in KINDS)
                  for name in ("created", "updated", "unchanged", "removed")}
        return f"tenant {self.tenant}: {self.state} ({', '.join(f'{n} {v}' for n, v in totals.items())})"

    def render(self) -> str:
        lines = [f"tenant {self.tenant}: {self.state}",
                 f"{'kind':<16}{'created':>8}{'updated':>8}{'unchanged':>10}{'removed':>8}"]
        for kind in KINDS:
            c = self.counts(kind)
            lines.append(f"{kind:<16}{c['created']:>8}{c['updated']:>8}{c['unchanged']:>10}{c['removed']:>8}")
        lines += ["changes:"] + [f"  {line}" for line in self.changes or ["none"]]
        if self.notes:
            lines += ["notes:"] + [f"  {line}" for line in self.notes]
        return "\n".join(lines)


# --- problems and plan ---------------------------------------------------------------------------

class Problems:
    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, path: str, message: str) -> None:
        self.items.append((path, message))

    def __len__(self) -> int:
        return len(self.items)

    def in_file_order(self) -> list[tuple[str, str]]:
        """Errors come from three phases; readers expect them in the order of the file."""
        order = ["tenant", *SECTIONS]

        def position(entry: tuple[str, str]) -> tuple[int, int]:
            match = re.match(r"([a-z_]+)(?:\[(\d+)\])?", entry[0])
            if match is None or match.group(1) not in order:
                return (-1, 0)
            return (order.index(match.group(1)), int(match.group(2) or 0))

        return sorted(self.items, key=position)


@dataclass
class Item:
    path: str      # "tools[2]"
    key: str       # identity within its kind: a name, or "<server>__<remote>" for tools
    values: dict   # converted values, keyed by model field (plus a few non-model keys)


@dataclass
class Plan:
    tenant: Item | None = None
    sections: dict[str, list[Item]] = field(default_factory=dict)
    dropped: dict[str, set[str]] = field(default_factory=dict)
    secret_values: dict[str, str] = field(default_factory=dict)

    def drop(self, kind: str, key: str) -> None:
        self.dropped.setdefault(kind, set()).add(key)

    def is_dropped(self, kind: str, key: str) -> bool:
        if kind == "tools" and "__" in key and self.is_dropped("tool_servers", key.split("__", 1)[0]):
            return True
        return key in self.dropped.get(kind, set())


# --- environment substitution --------------------------------------------------------------------

_ENV_REF = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(value: Any, problems: Problems, path: str = "") -> Any:
    """Replace ${NAME} and ${NAME:-default} in string values; "$${" stands for a literal "${"."""
    if isinstance(value, dict):
        return {key: expand_env(item, problems, _join(path, key)) for key, item in value.items()}
    if isinstance(value, list):
        return [expand_env(item, problems, f"{path}[{i}]") for i, item in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$${":
            return "${"
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is None:
            problems.add(path, f"environment variable {name} is not set")
            return ""
        return default

    return _ENV_REF.sub(substitute, value)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


# --- converters: raise _Invalid; messages never echo values that could be secrets ----------------

class _Invalid(Exception):
    def __init__(self, message: str, at: str = ""):
        super().__init__(message)
        self.message = message
        self.at = at


Convert = Callable[[Any], Any]


def _text(max_length: int = 0, *, empty: bool = True) -> Convert:
    def convert(value: Any) -> str:
        if not isinstance(value, str):
            raise _Invalid("must be text")
        if not empty and not value.strip():
            raise _Invalid("must not be empty")
        if max_length and len(value) > max_length:
            raise _Invalid(f"must be at most {max_length} characters")
        return value
    return convert


def _slug(max_length: int) -> Convert:
    def convert(value: Any) -> str:
        text = _text(max_length, empty=False)(value)
        try:
            validate_slug(text)
        except ValidationError:
            raise _Invalid("must be a slug: letters, digits, hyphens and underscores") from None
        return text
    return convert


def _django(validator: Callable[[Any], None], message: str, max_length: int = 0) -> Convert:
    def convert(value: Any) -> str:
        text = _text(max_length, empty=False)(value)
        try:
            validator(text)
        except ValidationError:
            raise _Invalid(message) from None
        return text
    return convert


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):   # what ${VAR} substitution produces
        return value == "true"
    raise _Invalid("must be true or false")


def _decimal(value: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, float, str, Decimal)):
        raise _Invalid("must be a number")
    try:
        number = Decimal(str(value).strip())
    except decimal.InvalidOperation:
        raise _Invalid("must be a number") from None
    if not number.is_finite():
        raise _Invalid("must be a finite number")
    return number


def _int(minimum: int = 1) -> Convert:
    def convert(value: Any) -> int:
        number = _decimal(value)
        if number != number.to_integral_value():
            raise _Invalid("must be a whole number")
        if number < minimum:
            raise _Invalid(f"must be at least {minimum}")
        return int(number)
    return convert


def _seconds(value: Any) -> float:
    number = _decimal(value)
    if number <= 0:
        raise _Invalid("must be greater than 0")
    return float(number)


def _non_negative(value: Any) -> float:
    number = _decimal(value)
    if number < 0:
        raise _Invalid("must not be negative")
    return float(number)


def _money(value: Any) -> int:
    """Currency units to integer micros; refuse what micros cannot hold exactly."""
    micros = _decimal(value) * MICROS
    if micros < 0:
        raise _Invalid("must not be negative")
    if micros != micros.to_integral_value():
        raise _Invalid("must have at most 6 decimal places")
    return int(micros)


def _price(value: Any) -> Decimal:
    number = _decimal(value)
    if number < 0:
        raise _Invalid("must not be negative")
    if number != number.quantize(Decimal("0.0001"), rounding=decimal.ROUND_DOWN):
        raise _Invalid("must have at most 4 decimal places")
    if number >= Decimal("100000000"):
        raise _Invalid("must be below 100000000")
    return number


def _choice(options: list[str]) -> Convert:
    def convert(value: Any) -> str:
        if value not in options:
            raise _Invalid(f"must be one of {', '.join(options)}")
        return value
    return convert


def _nullable(inner: Convert) -> Convert:
    return lambda value: None if value is None else inner(value)


def _mapping(value: Any) -> dict:
    if not isinstance(value, dict):
        raise _Invalid("must be a mapping")
    return value


def _text_list(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise _Invalid("must be a list")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise _Invalid("must be non-empty text", at=f"[{i}]")
    return value


def _time_zone(value: Any) -> str:
    text = _text(64, empty=False)(value)
    try:
        validate_time_zone(text)
    except ValidationError:
        raise _Invalid(f"unknown time zone {text!r}; use an IANA name such as Asia/Kolkata") from None
    return text


def _policy(value: Any) -> str:
    if not isinstance(value, str):
        raise _Invalid('must be text: "never", "always" or a rule such as "amount > 5000"')
    try:
        return parse_policy(value).text
    except PolicyError as exc:
        raise _Invalid(str(exc)) from None


def _json_schema(value: Any) -> dict:
    schema = _mapping(value)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise _Invalid(f"not a valid JSON schema: {exc.message}") from None
    return schema


def _spec_list(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise _Invalid("must be a list of agent specs")
    for i, spec in enumerate(value):
        if not isinstance(spec, dict):
            raise _Invalid("must be a mapping (an agent spec)", at=f"[{i}]")
    return value


def _aliases(value: Any) -> dict[str, int]:
    aliases = _mapping(value)
    for name, number in aliases.items():
        try:
            _slug(50)(name)
            aliases[name] = _int(1)(number)
        except _Invalid as exc:
            raise _Invalid(exc.message, at=f".{name}") from None
    return aliases


_url = _django(URLValidator(schemes=["http", "https"]), "must be an http(s) URL", 500)
_email = _django(validate_email, "must be an email address", 254)
_username = _django(UnicodeUsernameValidator(), "must be a username: letters, digits and @.+-_", 150)


# --- field specifications ------------------------------------------------------------------------

@dataclass(frozen=True)
class Field:
    target: str
    convert: Convert
    required: bool = False


Spec = dict[str, "Field | Spec"]

TENANT: Spec = {
    "slug": Field("slug", _slug(50), required=True),
    "name": Field("name", _text(200, empty=False)),
    "time_zone": Field("time_zone", _time_zone),
    "daily_budget": Field("daily_budget_micros", _money),
    "user_daily_budget": Field("user_daily_budget_micros", _nullable(_money)),
    "on_budget_exhausted": Field("on_budget_exhausted", _choice(Tenant.OnBudgetExhausted.values)),
    "approval_ttl_seconds": Field("approval_ttl_seconds", _int(1)),
    "quotas": {"max_active_runs": Field("max_active_runs", _int(1)),
               "max_starts_per_minute": Field("max_starts_per_minute", _int(1))},
    "caps": {"max_steps": Field("max_steps_cap", _int(1)),
             "max_tool_calls": Field("max_tool_calls_cap", _int(1)),
             "max_wall_seconds": Field("max_wall_seconds_cap", _int(1)),
             "max_output_tokens": Field("max_output_tokens_cap", _int(1)),
             "max_cost": Field("max_cost_micros_cap", _money)},
}
SECRET: Spec = {"name": Field("name", _text(100, empty=False), required=True),
                "value": Field("value", _text(empty=False)),
                "value_env": Field("value_env", _text(empty=False))}
GROUP: Spec = {"name": Field("name", _text(100, empty=False), required=True)}
USER: Spec = {"username": Field("username", _username, required=True),
              "email": Field("email", _email),
              "password": Field("password", _text(empty=False)),
              "password_env": Field("password_env", _text(empty=False)),
              "groups": Field("groups", _text_list),
              "staff": Field("is_staff", _bool),
              "active": Field("is_active", _bool)}
ENDPOINT: Spec = {"name": Field("name", _slug(100), required=True),
                  "kind": Field("kind", _choice(ModelEndpoint.Kind.values), required=True),
                  "base_url": Field("base_url", _url),
                  "model": Field("model", _text(200)),
                  "secret": Field("secret", _nullable(_text(100, empty=False))),
                  "timeout_seconds": Field("timeout_seconds", _seconds),
                  "prices": {"input": Field("price_input", _price),
                             "cached_input": Field("price_cached_input", _price),
                             "cache_write": Field("price_cache_write", _price),
                             "output": Field("price_output", _price)},
                  "config": Field("config", _mapping)}
SERVER: Spec = {"name": Field("name", _slug(50), required=True),
                "kind": Field("kind", _choice(ToolServer.Kind.values), required=True),
                "transport": Field("transport", _choice(ToolServer.Transport.values)),
                "url": Field("url", _url),
                "command": Field("command", _text_list),
                "secret": Field("secret", _nullable(_text(100, empty=False))),
                "auth_header": Field("auth_header", _text(100)),
                "auth_scheme": Field("auth_scheme", _text(20)),
                "status_tool": Field("status_tool", _text(200)),
                "discover": Field("discover", _bool)}
TOOL: Spec = {"server": Field("server", _slug(50), required=True),
              "name": Field("remote_name", _text(150, empty=False), required=True),
              "enabled": Field("enabled", _bool),
              "effect": Field("effect_class", _choice(EffectClass.values)),
              "approval": Field("approval_policy", _policy),
              "approval_ttl_seconds": Field("approval_ttl_seconds", _nullable(_int(1))),
              "timeout_seconds": Field("timeout_seconds", _seconds),
              "price": Field("price_micros", _money),
              "max_attempts": Field("max_attempts", _int(1)),
              "backoff_seconds": Field("backoff_seconds", _non_negative),
              "description": Field("description", _text()),
              "input_schema": Field("input_schema", _json_schema),
              "http_url": Field("http_url", _url),
              "status_url": Field("status_url", _text(500, empty=False))}
GRANT: Spec = {"tool": Field("tool", _text(200, empty=False), required=True),
               "use": Field("use", _text_list),
               "approve": Field("approve", _text_list)}
AGENT: Spec = {"name": Field("name", _slug(100), required=True),
               "versions": Field("versions", _spec_list),
               "aliases": Field("aliases", _aliases)}
HTTP_ONLY = ("description", "input_schema", "http_url", "status_url")


def _read(raw: Any, path: str, spec: Spec, problems: Problems) -> dict:
    """Convert the known keys of one mapping; every bad or unknown key is a problem at its path."""
    if not isinstance(raw, dict):
        problems.add(path, "must be a mapping")
        return {}
    out: dict = {}
    for key in raw:
        if key not in spec:
            problems.add(_join(path, key), f"unknown field; one of {', '.join(spec)}")
    for key, rule in spec.items():
        where = _join(path, key)
        if key not in raw:
            if isinstance(rule, Field) and rule.required:
                problems.add(where, "required")
        elif isinstance(rule, dict):
            out.update(_read(raw[key], where, rule, problems))
        else:
            try:
                out[rule.target] = rule.convert(raw[key])
            except _Invalid as exc:
                problems.add(where + exc.at, exc.message)
    return out


# --- phase 1: parse ------------------------------------------------------------------------------

def _check_secret(values: dict, path: str, problems: Problems) -> None:
    _exactly_one(values, path, "value", "value_env", problems)
    _from_env(values, path, "value_env", "value", problems)


def _check_user(values: dict, path: str, problems: Problems) -> None:
    if "password" in values and "password_env" in values:
        problems.add(f"{path}.password", "give password or password_env, not both")
    _from_env(values, path, "password_env", "password", problems)


def _check_server(values: dict, path: str, problems: Problems) -> None:
    kind = values.get("kind")
    if kind == ToolServer.Kind.MCP:
        values.setdefault("transport", ToolServer.Transport.STREAMABLE_HTTP)
        needed = "command" if values["transport"] == ToolServer.Transport.STDIO else "url"
        if not values.get(needed):
            problems.add(f"{path}.{needed}", f"required for an mcp server over {values['transport']}")
        return
    for key in ("transport", "command", "status_tool"):
        if key in values:
            problems.add(f"{path}.{key}", "only for mcp servers")
    if kind == ToolServer.Kind.HTTP and "discover" in values:
        problems.add(f"{path}.discover", "http tools are declared in this file, not discovered")


def _check_grant(values: dict, path: str, problems: Problems) -> None:
    for verb in PERMS:
        for i, holder in enumerate(values.get(verb, [])):
            kind, _, name = holder.partition(":")
            if kind not in ("user", "group") or not name:
                problems.add(f"{path}.{verb}[{i}]", 'must be "user:<username>" or "group:<name>"')


def _exactly_one(values: dict, path: str, first: str, second: str, problems: Problems) -> None:
    if (first in values) == (second in values):
        problems.add(f"{path}.{first}", f"give exactly one of {first} or {second}")


def _from_env(values: dict, path: str, env_key: str, target: str, problems: Problems) -> None:
    if env_key not in values:
        return
    name = values.pop(env_key)
    if not os.environ.get(name):
        problems.add(f"{path}.{env_key}", f"environment variable {name} is not set")
    else:
        values[target] = os.environ[name]


@dataclass(frozen=True)
class Section:
    spec: Spec
    key: Callable[[dict], str]
    check: Callable[[dict, str, Problems], None] | None = None


SECTIONS: dict[str, Section] = {
    "secrets": Section(SECRET, lambda v: v["name"], _check_secret),
    "groups": Section(GROUP, lambda v: v["name"]),
    "users": Section(USER, lambda v: v["username"], _check_user),
    "model_endpoints": Section(ENDPOINT, lambda v: v["name"]),
    "tool_servers": Section(SERVER, lambda v: v["name"], _check_server),
    "tools": Section(TOOL, lambda v: f"{v['server']}__{v['remote_name']}"),
    "grants": Section(GRANT, lambda v: v["tool"], _check_grant),
    "agents": Section(AGENT, lambda v: v["name"]),
}


def parse(data: Any, problems: Problems) -> Plan:
    plan = Plan()
    if not isinstance(data, dict):
        problems.add("", "the file must be a mapping with a tenant section")
        return plan
    for key in data:
        if key != "tenant" and key not in SECTIONS:
            problems.add(str(key), f"unknown section; one of tenant, {', '.join(SECTIONS)}")
    if "tenant" not in data:
        problems.add("tenant", "required")
    else:
        values = _read(data["tenant"], "tenant", TENANT, problems)
        # A bad tenant field is dropped and reported; the rest is still checked against it.
        plan.tenant = Item("tenant", values["slug"], values) if "slug" in values else None
    for name, section in SECTIONS.items():
        plan.sections[name] = _parse_section(data.get(name, []), name, section, plan, problems)
    plan.secret_values = {item.key: item.values["value"] for item in plan.sections["secrets"]}
    return plan


def _parse_section(raw: Any, name: str, section: Section, plan: Plan, problems: Problems) -> list[Item]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        problems.add(name, "must be a list")
        return []
    items: list[Item] = []
    first_at: dict[str, str] = {}
    for i, entry in enumerate(raw):
        path = f"{name}[{i}]"
        before = len(problems)
        values = _read(entry, path, section.spec, problems)
        if section.check is not None and len(problems) == before:
            section.check(values, path, problems)
        try:
            key = section.key(values)
        except KeyError:
            continue
        if key in first_at:
            problems.add(path, f"{key!r} is already defined at {first_at[key]}")
            continue
        first_at[key] = path
        if len(problems) == before:
            items.append(Item(path, key, values))
        else:
            plan.drop(name, key)
    return items


# --- phase 2: discover (network, outside any transaction) ----------------------------------------

def discover(plan: Plan, problems: Problems) -> dict[str, list[RemoteTool]]:
    """List the tools of MCP servers with discover: true and of builtin servers."""
    remote: dict[str, list[RemoteTool]] = {}
    slug = plan.tenant.key if plan.tenant else ""
    for item in list(plan.sections.get("tool_servers", [])):
        kind = item.values["kind"]
        default = kind == ToolServer.Kind.BUILTIN
        if kind == ToolServer.Kind.HTTP or not item.values.get("discover", default):
            continue
        if kind == ToolServer.Kind.BUILTIN:
            remote[item.key] = fetch_remote(ToolServer(name=item.key, kind=kind))
            continue
        fetched = _discover_mcp(item, plan, slug, problems)
        if fetched is None:
            plan.sections["tool_servers"].remove(item)
            plan.drop("tool_servers", item.key)
        else:
            remote[item.key] = fetched
    return remote


def _discover_mcp(item: Item, plan: Plan, slug: str, problems: Problems) -> list[RemoteTool] | None:
    from tools import mcp_client   # the MCP SDK is only needed here, as in tools.catalog

    existing = ToolServer.objects.filter(tenant__slug=slug, name=item.key).select_related("secret").first()
    secret_name = item.values.get("secret", existing.secret.name if existing and existing.secret else None)
    try:
        secret = _secret_plaintext(secret_name, plan, slug)
    except LookupError:
        if not plan.is_dropped("secrets", secret_name):
            problems.add(f"{item.path}.secret", f"no secret named {secret_name!r}")
        return None
    config = server_config(item.values, existing, secret)
    try:
        return mcp_client.list_tools(config)
    except Exception as exc:  # any failure to list means the file cannot be applied as written
        where = "command" if config.transport == ToolServer.Transport.STDIO else "url"
        message = redact(str(exc), [secret] if secret else [])
        problems.add(f"{item.path}.{where}", f"cannot list the server's tools: {message}")
        return None


def _secret_plaintext(name: str | None, plan: Plan, slug: str) -> str | None:
    """The value the secret will have once applied: from this file, else as stored."""
    if name is None:
        return None
    if name in plan.secret_values:
        return plan.secret_values[name]
    stored = Secret.objects.filter(tenant__slug=slug, name=name).first()
    if stored is None:
        raise LookupError(name)
    return stored.reveal()


def server_config(values: dict, existing: ToolServer | None, secret: str | None) -> McpServerConfig:
    """Like tools.gateway.mcp_config, for a server that may not be saved yet.

    The secret is passed as plaintext because it may be new in this file, so not yet stored.
    """
    def pick(key: str, default: Any) -> Any:
        return values[key] if key in values else getattr(existing, key, default)

    headers = {}
    if secret is not None:
        scheme = pick("auth_scheme", "Bearer")
        headers[pick("auth_header", "Authorization") or "Authorization"] = f"{scheme} {secret}".strip()
    return McpServerConfig(transport=pick("transport", ToolServer.Transport.STREAMABLE_HTTP),
                           url=pick("url", ""), command=tuple(pick("command", ())), headers=headers)


# --- phase 3: write ------------------------------------------------------------------------------

@dataclass
class _Context:
    tenant: Tenant
    plan: Plan
    problems: Problems
    report: ApplyReport
    remote: dict[str, list[RemoteTool]]

    def missing(self, kind: str, key: str, path: str, message: str) -> None:
        # Whatever refers to an item left out for its own errors is skipped without a second error.
        if not self.plan.is_dropped(kind, key):
            self.problems.add(path, message)

    def skip(self, kind: str, item: Item) -> None:
        self.plan.drop(kind, item.key)


def _assign(obj: Any, values: dict) -> list[str]:
    """Set the fields that differ and save only those, so concurrent changes to others survive."""
    changed = [name for name, value in values.items() if getattr(obj, name) != value]
    for name in changed:
        setattr(obj, name, values[name])
    if changed:
        obj.save(update_fields=changed)
    return changed


def write(plan: Plan, remote: dict[str, list[RemoteTool]], problems: Problems) -> ApplyReport:
    assert plan.tenant is not None
    report = ApplyReport(tenant=plan.tenant.key)
    ctx = _Context(_apply_tenant(plan.tenant, report), plan, problems, report, remote)
    steps: list[tuple[str, Callable[[Item, _Context], None]]] = [
        ("secrets", _apply_secret), ("groups", _apply_group), ("users", _apply_user),
        ("model_endpoints", _apply_endpoint), ("tool_servers", _apply_server), ("tools", _apply_tool),
        ("grants", _apply_grant), ("agents", _apply_agent)]
    for section, apply_item in steps:
        for item in plan.sections[section]:
            apply_item(item, ctx)
    return report


def _apply_tenant(item: Item, report: ApplyReport) -> Tenant:
    values = {k: v for k, v in item.values.items() if k != "slug"}
    tenant = Tenant.objects.filter(slug=item.key).first()
    if tenant is None:
        values.setdefault("name", item.key)
        tenant = Tenant.objects.create(slug=item.key, **values)
        report.record("tenant", item.key, "created")
        return tenant
    changed = _assign(tenant, values)
    report.record("tenant", item.key, "updated" if changed else "unchanged", changed)
    if {"daily_budget_micros", "user_daily_budget_micros"} & set(changed):
        _update_today_limits(tenant, report)
    return tenant


def _update_today_limits(tenant: Tenant, report: ApplyReport) -> None:
    """Today's accounts were opened with the old limit; the new one applies from now on."""
    day = local_day(tenant)
    if BudgetAccount.objects.filter(tenant=tenant, day=day, scope=BudgetAccount.Scope.TENANT_DAY).exists() \
            and set_day_limit(tenant, day, tenant.daily_budget_micros):
        report.record("budgets", f"tenant_day {day}", "updated", ["limit"])
    limit = tenant.user_daily_budget_micros
    if limit is None:
        return
    accounts = BudgetAccount.objects.filter(tenant=tenant, day=day, scope=BudgetAccount.Scope.USER_DAY) \
        .exclude(limit_micros=limit).select_related("user")
    for account in accounts:
        BudgetAccount.objects.filter(pk=account.pk).update(limit_micros=limit)
        report.record("budgets", f"user_day {day} {account.user.username}", "updated", ["limit"])


def _apply_secret(item: Item, ctx: _Context) -> None:
    secret = Secret.objects.filter(tenant=ctx.tenant, name=item.key).first()
    plaintext = item.values["value"]
    if secret is None:
        secret = Secret(tenant=ctx.tenant, name=item.key)
        secret.set_value(plaintext)
        secret.save()
        ctx.report.record("secrets", item.key, "created")
    elif secret.reveal() != plaintext:
        # Fernet is randomised: re-encrypting an unchanged value would look like a change.
        secret.set_value(plaintext)
        secret.save(update_fields=["ciphertext", "updated_at"])
        ctx.report.record("secrets", item.key, "updated", ["value"])
    else:
        ctx.report.record("secrets", item.key, "unchanged")


def _apply_group(item: Item, ctx: _Context) -> None:
    if TenantGroup.objects.filter(tenant=ctx.tenant, name=item.key).exists():
        ctx.report.record("groups", item.key, "unchanged")
        return
    # Django group names are global, so the tenant's slug keeps tenants apart.
    group, _ = Group.objects.get_or_create(name=f"{ctx.tenant.slug}:{item.key}")
    if TenantGroup.objects.filter(group=group).exists():
        ctx.problems.add(f"{item.path}.name", f"the auth group {group.name!r} belongs to another tenant group")
        ctx.skip("groups", item)
        return
    TenantGroup.objects.create(group=group, tenant=ctx.tenant, name=item.key)
    ctx.report.record("groups", item.key, "created")


def _tenant_groups(names: list[str], path: str, ctx: _Context) -> list[Group] | None:
    found = {link.name: link.group for link in
             TenantGroup.objects.filter(tenant=ctx.tenant, name__in=names).select_related("group")}
    ok = True
    for i, name in enumerate(names):
        if name not in found:
            ctx.missing("groups", name, f"{path}[{i}]", f"no group named {name!r}")
            ok = False
    return [found[name] for name in names] if ok else None


def _apply_user(item: Item, ctx: _Context) -> None:
    values = {k: v for k, v in item.values.items() if k != "username"}
    password = values.pop("password", None)
    names = values.pop("groups", None)
    groups = None if names is None else _tenant_groups(names, f"{item.path}.groups", ctx)
    user = User.objects.filter(username=item.key).first()
    foreign = user is not None and user.tenant_id != ctx.tenant.pk
    if foreign:
        ctx.problems.add(f"{item.path}.username", "this username belongs to another tenant or to an operator")
    if foreign or (names is not None and groups is None):
        ctx.skip("users", item)
        return
    if user is None:
        user, changed = _create_user(item.key, values, password, ctx.tenant), None
    else:
        changed = _update_user(user, values, password)
    if groups is not None and _set_memberships(user, groups, ctx.tenant) and changed is not None:
        changed.append("groups")
    outcome = "created" if changed is None else ("updated" if changed else "unchanged")
    ctx.report.record("users", item.key, outcome, changed or ())


def _create_user(username: str, values: dict, password: str | None, tenant: Tenant) -> User:
    user = User(username=username, tenant=tenant, **values)
    if password:
        user.set_password(password)
    else:
        user.set_unusable_password()
    user.save()
    return user


def _update_user(user: User, values: dict, password: str | None) -> list[str]:
    changed = _assign(user, values)
    # Hashes are salted: only a password that no longer matches is hashed again.
    if password and not user.check_password(password):
        user.set_password(password)
        user.save(update_fields=["password"])
        changed.append("password")
    return changed


def _set_memberships(user: User, groups: list[Group], tenant: Tenant) -> bool:
    """Make the user's groups of this tenant exactly `groups`; other groups are not ours to touch."""
    current = set(user.groups.filter(tenant_link__tenant=tenant))
    wanted = set(groups)
    user.groups.remove(*(current - wanted))
    user.groups.add(*(wanted - current))
    return current != wanted


def _secret_ref(values: dict, path: str, ctx: _Context) -> bool:
    """Replace the secret's name by the row; False when it names no secret of the tenant."""
    if values.get("secret") is None:
        return True
    name = values["secret"]
    values["secret"] = Secret.objects.filter(tenant=ctx.tenant, name=name).first()
    if values["secret"] is None:
        ctx.missing("secrets", name, f"{path}.secret", f"no secret named {name!r}")
        return False
    return True


def _upsert(model: type, kind: str, item: Item, values: dict, ctx: _Context) -> Any:
    obj = model.objects.filter(tenant=ctx.tenant, name=item.key).first()
    if obj is None:
        obj = model.objects.create(tenant=ctx.tenant, name=item.key, **values)
        ctx.report.record(kind, item.key, "created")
        return obj
    changed = _assign(obj, values)
    ctx.report.record(kind, item.key, "updated" if changed else "unchanged", changed)
    return obj


def _apply_endpoint(item: Item, ctx: _Context) -> None:
    values = {k: v for k, v in item.values.items() if k != "name"}
    if not _secret_ref(values, item.path, ctx):
        ctx.skip("model_endpoints", item)
        return
    _upsert(ModelEndpoint, "model_endpoints", item, values, ctx)


def _apply_server(item: Item, ctx: _Context) -> None:
    values = {k: v for k, v in item.values.items() if k not in ("name", "discover")}
    if not _secret_ref(values, item.path, ctx):
        ctx.skip("tool_servers", item)
        return
    server = _upsert(ToolServer, "tool_servers", item, values, ctx)
    if item.key not in ctx.remote:
        return
    remote = ctx.remote[item.key]
    _record_sync(server, sync_server(server, remote), ctx)
    if server.status_tool and server.status_tool not in {tool.name for tool in remote}:
        ctx.problems.add(f"{item.path}.status_tool", f"the server lists no tool named {server.status_tool!r}")


def _record_sync(server: ToolServer, sync: SyncReport, ctx: _Context) -> None:
    for remote_name in sync.added:
        ctx.report.record("tools", tool_name(server, remote_name), "created")
    for remote_name in sync.unchanged:
        ctx.report.record("tools", tool_name(server, remote_name), "unchanged")
    for remote_name in sync.quarantined:
        name = tool_name(server, remote_name)
        ctx.report.record("tools", name, "updated", ["quarantined"])
        ctx.report.notes.append(f"tool {name} changed on the server and is quarantined until an admin "
                                f"releases it")
    for remote_name in sync.missing:
        ctx.report.notes.append(f"tool {tool_name(server, remote_name)} is no longer listed by {server.name}")
    listed = {item.key for item in ctx.plan.sections["tools"]}
    for remote_name in sync.added:
        name = tool_name(server, remote_name)
        if name not in listed:
            ctx.report.notes.append(f"tool {name} was discovered and stays disabled until configured")


def _apply_tool(item: Item, ctx: _Context) -> None:
    values = dict(item.values)
    server_name, remote_name = values.pop("server"), values.pop("remote_name")
    server = ToolServer.objects.filter(tenant=ctx.tenant, name=server_name).first()
    if server is None:
        ctx.missing("tool_servers", server_name, f"{item.path}.server", f"no tool server named {server_name!r}")
        ctx.skip("tools", item)
        return
    if not _tool_fields_fit(server, values, item.path, ctx):
        ctx.skip("tools", item)
        return
    tool = Tool.objects.filter(server=server, remote_name=remote_name).first()
    if tool is None and server.kind == ToolServer.Kind.HTTP:
        _create_http_tool(server, remote_name, values, ctx)
        return
    if tool is None:
        hint = "" if server_name in ctx.remote else " (is discover: true set on the server?)"
        ctx.problems.add(f"{item.path}.name", f"server {server_name!r} has no tool named {remote_name!r}{hint}")
        ctx.skip("tools", item)
        return
    changed = configure_tool(tool, values)
    ctx.report.record("tools", tool.name, "updated" if changed else "unchanged", changed)
    if tool.quarantined and values.get("enabled"):
        ctx.report.notes.append(f"tool {tool.name} is enabled but quarantined: an admin must release it")


def _tool_fields_fit(server: ToolServer, values: dict, path: str, ctx: _Context) -> bool:
    if server.kind == ToolServer.Kind.HTTP:
        if "input_schema" not in values:
            ctx.problems.add(f"{path}.input_schema", "required for http tools")
            return False
        return True
    wrong = [key for key in HTTP_ONLY if key in values]
    for key in wrong:
        source = "builtin" if server.kind == ToolServer.Kind.BUILTIN else "discovered from the mcp server"
        ctx.problems.add(f"{path}.{_file_key(key)}", f"only for http tools; {server.kind} tools are {source}")
    return not wrong


def _file_key(target: str) -> str:
    return next(key for key, rule in TOOL.items() if isinstance(rule, Field) and rule.target == target)


def _create_http_tool(server: ToolServer, remote_name: str, values: dict, ctx: _Context) -> None:
    values.setdefault("description", "")
    Tool.objects.create(tenant=ctx.tenant, server=server, name=tool_name(server, remote_name),
                        remote_name=remote_name, schema_hash=schema_hash(values["description"],
                                                                         values["input_schema"]), **values)
    ctx.report.record("tools", tool_name(server, remote_name), "created")


# --- grants ---

def _apply_grant(item: Item, ctx: _Context) -> None:
    tool = Tool.objects.filter(tenant=ctx.tenant, name=item.key).first()
    if tool is None:
        ctx.missing("tools", item.key, f"{item.path}.tool", f"no tool named {item.key!r}")
        return
    wanted = _wanted_grants(item, ctx)
    if wanted is None:
        return
    current = _current_grants(tool)
    for key in sorted(wanted.keys() - current.keys()):
        perm, holder, label = wanted[key]
        assign_perm(f"tools.{perm}", holder, tool)
        ctx.report.record("grants", f"{tool.name} {perm} {label}", "created")
    for key in sorted(current.keys() - wanted.keys()):
        perm, holder, label = current[key]
        remove_perm(f"tools.{perm}", holder, tool)
        ctx.report.record("grants", f"{tool.name} {perm} {label}", "removed")
    for key in sorted(wanted.keys() & current.keys()):
        perm, _, label = wanted[key]
        ctx.report.record("grants", f"{tool.name} {perm} {label}", "unchanged")


GrantKey = tuple[str, str, int]   # (codename, "user" | "group", pk)


def _wanted_grants(item: Item, ctx: _Context) -> dict[GrantKey, tuple] | None:
    wanted: dict[GrantKey, tuple] = {}
    ok = True
    for verb, perm in PERMS.items():
        for i, holder in enumerate(item.values.get(verb, [])):
            found = _holder(holder, f"{item.path}.{verb}[{i}]", ctx)
            if found is None:
                ok = False
            else:
                wanted[(perm, holder.split(":")[0], found.pk)] = (perm, found, holder)
    return wanted if ok else None


def _holder(holder: str, path: str, ctx: _Context) -> User | Group | None:
    kind, _, name = holder.partition(":")
    if kind == "user":
        user = User.objects.filter(tenant=ctx.tenant, username=name).first()
        if user is None:
            ctx.missing("users", name, path, f"no user named {name!r} in this tenant")
        return user
    link = TenantGroup.objects.filter(tenant=ctx.tenant, name=name).select_related("group").first()
    if link is None:
        ctx.missing("groups", name, path, f"no group named {name!r}")
    return link.group if link else None


def _current_grants(tool: Tool) -> dict[GrantKey, tuple]:
    """Direct object permissions on the tool, read from guardian's tables (no checker cache)."""
    lookup = {"content_type": ContentType.objects.get_for_model(Tool), "object_pk": str(tool.pk),
              "permission__codename__in": list(PERMS.values())}
    current: dict[GrantKey, tuple] = {}
    for row in get_user_obj_perms_model(tool).objects.filter(**lookup).select_related("user", "permission"):
        current[(row.permission.codename, "user", row.user_id)] = (
            row.permission.codename, row.user, f"user:{row.user.username}")
    for row in get_group_obj_perms_model(tool).objects.filter(**lookup).select_related("group", "permission"):
        link = TenantGroup.objects.filter(group=row.group).first()
        current[(row.permission.codename, "group", row.group_id)] = (
            row.permission.codename, row.group, f"group:{link.name if link else row.group.name}")
    return current


# --- agents ---

def _apply_agent(item: Item, ctx: _Context) -> None:
    definition, created = AgentDefinition.objects.get_or_create(tenant=ctx.tenant, name=item.key)
    ctx.report.record("agents", item.key, "created" if created else "unchanged")
    stored = [_apply_version(definition, spec, f"{item.path}.versions[{j}]", ctx)
              for j, spec in enumerate(item.values.get("versions", []))]
    if not all(stored):
        return   # the numbers the aliases name may belong to the versions that failed
    for alias, number in item.values.get("aliases", {}).items():
        _apply_alias(definition, alias, number, f"{item.path}.aliases.{alias}", ctx)


def _apply_version(definition: AgentDefinition, spec: dict, path: str, ctx: _Context) -> bool:
    errors = validate_spec(spec, ctx.tenant)
    if errors:
        for key, messages in errors.items():
            if not _reported_elsewhere(spec, key, ctx):
                for message in messages:
                    ctx.problems.add(path if key == "spec" else f"{path}.{key}", message)
        return False
    # Any earlier version with this content counts, not only the latest as in create_version,
    # so that re-applying [v1, v2] does not store v1 again as v3.
    existing = definition.versions.filter(content_hash=digest(spec)).order_by("number").first()
    if existing is not None:
        ctx.report.record("versions", f"{definition.name} v{existing.number}", "unchanged")
        return True
    version, _ = create_version(tenant=ctx.tenant, agent=definition.name, spec=spec)
    ctx.report.record("versions", f"{definition.name} v{version.number}", "created")
    return True


def _reported_elsewhere(spec: dict, key: str, ctx: _Context) -> bool:
    """A spec naming an endpoint or tool that was left out for its own errors."""
    if key == "model":
        return ctx.plan.is_dropped("model_endpoints", str(spec.get("model")))
    match = re.fullmatch(r"tools\[(\d+)\]", key)
    return bool(match) and ctx.plan.is_dropped("tools", str(spec["tools"][int(match.group(1))]))


def _apply_alias(definition: AgentDefinition, alias: str, number: int, path: str, ctx: _Context) -> None:
    label = f"{definition.name}@{alias}"
    if not definition.versions.filter(number=number).exists():
        ctx.problems.add(path, f"agent {definition.name!r} has no version {number}")
        return
    current = Alias.objects.filter(agent=definition, name=alias).select_related("version").first()
    if current is not None and current.version.number == number:
        ctx.report.record("aliases", label, "unchanged")
        return
    move_alias(tenant=ctx.tenant, agent=definition.name, alias=alias, version=number)
    ctx.report.record("aliases", label, "created" if current is None else "updated", [f"v{number}"])


# --- entry points --------------------------------------------------------------------------------

def load_file(path: str | Path) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([("", f"cannot read {path}: {exc.strerror or exc}")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([(where, f"invalid YAML: {getattr(exc, 'problem', None) or exc}")]) from None
    if not isinstance(data, dict):
        raise ConfigError([("", "the file must be a mapping with a tenant section")])
    return data


def apply_config(data: dict, *, dry_run: bool = False) -> ApplyReport:
    """Create or update one tenant from `data`, all or nothing; raise ConfigError with every error."""
    problems = Problems()
    plan = parse(expand_env(data, problems), problems)
    remote = discover(plan, problems)
    if plan.tenant is None:
        raise ConfigError(problems.in_file_order())
    with transaction.atomic():
        report = write(plan, remote, problems)
        if problems:
            raise ConfigError(problems.in_file_order())
        if dry_run:
            transaction.set_rollback(True)
    report.dry_run = dry_run
    return report
