"""Phase 1: the shapes and types of the whole file, without the database; errors name their path."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings

from approvals import tool_rules
from configuration.convert import (
    Convert,
    _aliases,
    _approval_rule,
    _bool,
    _choice,
    _compat,
    _currency,
    _duration,
    _email,
    _exchange_rate,
    _hosts,
    _int,
    _Invalid,
    _json_schema,
    _mapping,
    _money,
    _money_arguments,
    _non_negative,
    _nullable,
    _price,
    _region_name,
    _region_names,
    _sandbox,
    _seconds,
    _slug,
    _spec_list,
    _summary,
    _text,
    _text_list,
    _time_zone,
    _url,
    _username,
)
from llm.compat import problems as compat_problems
from llm.compat import sampling_problems
from llm.models import ModelEndpoint
from notifications.models import Event as WebhookEvent
from tenants.models import QUOTA_WEIGHT_MAX, Tenant
from tenants.roles import ROLES
from tools.models import EffectClass, ToolServer

# Grant verbs in the file and the object permissions they stand for, per kind of object.
PERMS = {"use": "use_tool", "approve": "approve_tool"}  # grants[] with tool:
AGENT_PERMS = {"run": "run_agent"}  # grants[] with agent:
TENANT_PERMS = {"view_runs": "view_runs"}  # tenant.view_runs
DAY = 24 * 3600
REACH_MAX = 3600  # an hour-old copy of who may do what is already more than a bank would accept
# The tenant's regions, as parsed: stored in regions.TenantRegions, not on the tenant row.
REGION_KEYS = (
    "region_home",
    "region_allowed",
    "revocation_reach_seconds",
    "slice_micros",
    "away_share_percent",
)
APPROVAL_TTL_MAX = 30 * DAY
RETENTION_MAX = 2**31 - 1  # whole seconds, as the file's numbers are: about 68 years


def _retention_by_agent(value: Any) -> dict[str, int]:
    """{agent name: period} (`dispute-agent: 30d`): the agent's runs keep content (or, under
    `skeleton_agents`, their skeleton) this long."""
    periods = _mapping(value)
    out = {}
    for name, period in periods.items():
        try:
            out[_slug(100)(name)] = _duration(RETENTION_MAX)(period)
        except _Invalid as exc:
            raise _Invalid(exc.message, at=f".{name}{exc.at}") from None
    return out


# A call must end inside one worker task (CELERY_TASK_SOFT_TIME_LIMIT, 330 s by default); a longer
# timeout (or "1e400", once stored as Infinity) left every run using the tool stuck.
CALL_TIMEOUT_MAX = 300
QUOTA_PER_MINUTE_MAX = 2_000_000_000  # a PositiveIntegerField
IN_FLIGHT_MAX = 100_000
BACKOFF_MAX = 600  # llm/quotas.MAX_PAUSE_SECONDS: a longer pause would be cut to it
# Endpoint keys that only one wire reads: given for another kind they would be silently ignored.
WIRE_ONLY = {"send_cache_key": ("openai",)}
STREAMING_KEYS = ("stream", "first_token_timeout_seconds", "max_in_flight", "timeout_backoff_seconds")


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
    path: str  # "tools[2]"
    key: str  # identity within its kind: a name, or "<server>__<remote>" for tools
    values: dict  # converted values, keyed by model field (plus a few non-model keys)


@dataclass
class Plan:
    tenant: Item | None = None
    sections: dict[str, list[Item]] = field(default_factory=dict)
    dropped: dict[str, set[str]] = field(default_factory=dict)
    secret_values: dict[str, str] = field(default_factory=dict)
    identity_provider: Item | None = None  # None: the tenant has none (the file owns it)

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
    "currency": Field("currency", _currency),
    "exchange_rate": Field("exchange_rate", _exchange_rate),
    "daily_budget": Field("daily_budget_micros", _money),
    "user_daily_budget": Field("user_daily_budget_micros", _nullable(_money)),
    "on_budget_exhausted": Field("on_budget_exhausted", _choice(Tenant.OnBudgetExhausted.values)),
    "approval_ttl_seconds": Field("approval_ttl_seconds", _int(1, APPROVAL_TTL_MAX)),
    "approval_reason_required": Field("approval_reason_required", _bool),
    # Reminders and escalation of pending approvals (configuration/reminders.py); null: none.
    "remind_after": Field("remind_after_seconds", _nullable(_duration(APPROVAL_TTL_MAX))),
    "escalate_after": Field("escalate_after_seconds", _nullable(_duration(APPROVAL_TTL_MAX))),
    "escalate_to": Field("escalate_to", _nullable(_text(100, empty=False))),
    "pauses": {
        "on_killed_tool": Field("on_killed_tool", _choice(Tenant.OnKilledTool.values)),
        "paused_time_counts": Field("paused_time_counts", _bool),
    },
    "view_runs": Field("view_runs", _text_list),
    "egress_hosts": Field("egress_hosts", _nullable(_hosts)),
    # How long runs' content, and the whole run (its skeleton), are kept after they end
    # (history/retention.py); null: for ever.
    "retention": {
        "content": Field("content_retention_seconds", _nullable(_duration(RETENTION_MAX))),
        "agents": Field("content_retention_by_agent", _retention_by_agent),
        "skeleton": Field("skeleton_retention_seconds", _nullable(_duration(RETENTION_MAX))),
        "skeleton_agents": Field("skeleton_retention_by_agent", _retention_by_agent),
    },
    "quotas": {
        "max_active_runs": Field("max_active_runs", _int(1, 1_000_000)),
        "max_starts_per_minute": Field("max_starts_per_minute", _int(1, 1_000_000)),
        "model_quota_weight": Field("quota_weight", _int(1, QUOTA_WEIGHT_MAX)),
    },
    # Where the tenant's runs may execute and which region's ledger is authoritative
    # (configuration/tenant_regions.py, docs/regions.md); left out: as stored.
    "regions": {
        "home": Field("region_home", _region_name, required=True),
        "allowed": Field("region_allowed", _region_names),
        "revocation_reach": Field("revocation_reach_seconds", _seconds(REACH_MAX)),
        "slice": Field("slice_micros", _money),
        "away_share_percent": Field("away_share_percent", _int(1, 100)),
    },
    "caps": {
        "max_steps": Field("max_steps_cap", _int(1, 100_000)),
        "max_tool_calls": Field("max_tool_calls_cap", _int(1, 100_000)),
        "max_wall_seconds": Field("max_wall_seconds_cap", _int(1, 90 * DAY)),
        "max_output_tokens": Field("max_output_tokens_cap", _int(1, 1_000_000)),
        "max_cost": Field("max_cost_micros_cap", _money),
    },
}
SECRET: Spec = {
    "name": Field("name", _text(100, empty=False), required=True),
    "value": Field("value", _text(empty=False)),
    "value_env": Field("value_env", _text(empty=False)),
}
# --- roles (tenants/roles.py): users and groups name the roles whose model permissions they hold ---


def _roles(value: Any) -> list[str]:
    names = _text_list(value)
    for i, name in enumerate(names):
        if name not in ROLES:
            raise _Invalid(f"must be one of {', '.join(ROLES)}", at=f"[{i}]")
        if name in names[:i]:
            raise _Invalid("listed twice", at=f"[{i}]")
    return names


def _check_user_roles(values: dict, path: str, problems: Problems) -> None:
    # Every role works in the admin: a user who holds one and may not log in to it is a mistake.
    if values.get("roles") and values.get("is_staff") is False:
        problems.add(f"{path}.staff", "a user with roles works in the admin: leave staff out or set it true")


GROUP: Spec = {
    "name": Field("name", _text(100, empty=False), required=True),
    "roles": Field("roles", _roles),
}
USER: Spec = {
    "username": Field("username", _username, required=True),
    "email": Field("email", _email),
    "password": Field("password", _text(4096, empty=False)),
    "password_env": Field("password_env", _text(empty=False)),
    "groups": Field("groups", _text_list),
    "roles": Field("roles", _roles),
    "staff": Field("is_staff", _bool),
    "active": Field("is_active", _bool),
}
ENDPOINT: Spec = {
    "name": Field("name", _slug(100), required=True),
    "kind": Field("kind", _choice(ModelEndpoint.Kind.values), required=True),
    "base_url": Field("base_url", _url),
    "model": Field("model", _text(200)),
    "secret": Field("secret", _nullable(_text(100, empty=False))),
    "timeout_seconds": Field("timeout_seconds", _seconds(CALL_TIMEOUT_MAX)),
    "send_cache_key": Field("send_cache_key", _bool),
    "compat": Field("compat", _compat),
    "sampling": Field("sampling", _compat),
    "stream": Field("stream", _bool),
    "first_token_timeout_seconds": Field(
        "first_token_timeout_seconds", _nullable(_seconds(CALL_TIMEOUT_MAX))
    ),
    "max_in_flight": Field("max_in_flight", _nullable(_int(1, IN_FLIGHT_MAX))),
    "timeout_backoff_seconds": Field("timeout_backoff_seconds", _non_negative(BACKOFF_MAX)),
    "quota": {
        "requests_per_minute": Field("requests_per_minute", _nullable(_int(1, QUOTA_PER_MINUTE_MAX))),
        "tokens_per_minute": Field("tokens_per_minute", _nullable(_int(1, QUOTA_PER_MINUTE_MAX))),
    },
    "prices": {
        "input": Field("price_input", _price),
        "cached_input": Field("price_cached_input", _price),
        "cache_write": Field("price_cache_write", _price),
        "output": Field("price_output", _price),
    },
    "config": Field("config", _mapping),
    "circuit_breaker": {
        "failures": Field("breaker_failures", _int(0, 10_000)),
        "window_seconds": Field("breaker_window_seconds", _int(1, DAY)),
        "open_seconds": Field("breaker_open_seconds", _int(1, DAY)),
    },
}
SERVER: Spec = {
    "name": Field("name", _slug(50), required=True),
    "kind": Field("kind", _choice(ToolServer.Kind.values), required=True),
    "transport": Field("transport", _choice(ToolServer.Transport.values)),
    "url": Field("url", _url),
    "command": Field("command", _text_list),
    "secret": Field("secret", _nullable(_text(100, empty=False))),
    "auth_header": Field("auth_header", _text(100)),
    "auth_scheme": Field("auth_scheme", _text(20)),
    "status_tool": Field("status_tool", _text(200)),
    "discover": Field("discover", _bool),
    "delegation": Field("delegation", _mapping),  # read by _check_server with DELEGATION
    "oauth": Field("oauth", _mapping),  # read by _check_server with OAUTH
    # Each user's own OAuth token (connections/): its tools are declared here, not discovered.
    "user_oauth": Field("user_oauth", _bool),
}
# The platform's own OAuth token for an MCP server (client credentials grant,
# tools/client_credentials.py); the client secret is a secret's name.
OAUTH: Spec = {
    "token_url": Field("oauth_token_url", _url, required=True),
    "client_id": Field("oauth_client_id", _text(200, empty=False), required=True),
    "client_secret": Field("oauth_client_secret", _text(100, empty=False), required=True),
    "scopes": Field("oauth_scopes", _text_list),
    "audience": Field("oauth_audience", _text(500, empty=False)),
    "client_auth": Field("oauth_client_auth", _choice(["basic", "post"])),
}
OAUTH_NONE: dict[str, Any] = {
    "oauth_token_url": "",
    "oauth_client_id": "",
    "oauth_client_secret": None,
    "oauth_scopes": [],
    "oauth_audience": "",
    "oauth_client_auth": "",
}
# How a server's calls carry the user's authority (authority.models.Delegation, docs/authority.md).
DELEGATION: Spec = {
    "auth": Field("mode", _choice(["assertion", "token_exchange"])),
    "audience": Field("audience", _text(500, empty=False)),
    "scopes": Field("scopes", _text_list),
    "header": Field("header", _text(100)),
    "mcp_meta": Field("mcp_meta", _bool),
    "mcp_authorization": Field("mcp_authorization", _bool),
}
# The tenant's identity provider for token exchange; the client credentials are secret names.
IDENTITY_PROVIDER: Spec = {
    "token_url": Field("token_url", _url, required=True),
    "client_id": Field("client_id", _text(100, empty=False), required=True),
    "client_secret": Field("client_secret", _text(100, empty=False), required=True),
    "timeout_seconds": Field("timeout_seconds", _seconds(60)),
}
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,100}$")
_RESERVED_HEADERS = {"authorization", "idempotency-key", "content-type", "content-length", "host"}
TOOL: Spec = {
    "server": Field("server", _slug(50), required=True),
    "name": Field("remote_name", _text(150, empty=False), required=True),
    "enabled": Field("enabled", _bool),
    "effect": Field("effect_class", _choice(EffectClass.values)),
    "approval": Field("approval_policy", _approval_rule),
    "approval_ttl_seconds": Field("approval_ttl_seconds", _nullable(_int(1, APPROVAL_TTL_MAX))),
    # Override the tenant's, key by key; null turns the tool's reminder or escalation off.
    "remind_after": Field("remind_after_seconds", _nullable(_duration(APPROVAL_TTL_MAX))),
    "escalate_after": Field("escalate_after_seconds", _nullable(_duration(APPROVAL_TTL_MAX))),
    "escalate_to": Field("escalate_to", _text(100, empty=False)),
    "timeout_seconds": Field("timeout_seconds", _seconds(CALL_TIMEOUT_MAX)),
    "price": Field("price_micros", _money),
    "max_attempts": Field("max_attempts", _int(1, 20)),
    "backoff_seconds": Field("backoff_seconds", _non_negative(3600)),
    "settle_seconds": Field("settle_seconds", _nullable(_int(0, DAY))),
    "description": Field("description", _text()),
    "input_schema": Field("input_schema", _json_schema),
    "http_url": Field("http_url", _url),
    "status_url": Field("status_url", _text(500, empty=False)),
    "summary": Field("summary", _summary),
    "money": Field("money_arguments", _money_arguments),
    "sandbox": Field("sandbox", _sandbox),
}
GRANT: Spec = {
    "tool": Field("tool", _text(200, empty=False)),
    "agent": Field("agent", _slug(100)),
    "use": Field("use", _text_list),
    "approve": Field("approve", _text_list),
    "run": Field("run", _text_list),
}
AGENT: Spec = {
    "name": Field("name", _slug(100), required=True),
    "versions": Field("versions", _spec_list),
    "aliases": Field("aliases", _aliases),
}
REMINDER_KEYS = ("remind_after_seconds", "escalate_after_seconds", "escalate_to")
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
    _check_user_roles(values, path, problems)


# Where calls go and which secret they carry is owned by the file: an omitted destination field
# is set to its default, not left as stored, so a change made elsewhere (say in the admin) is
# undone by the next apply and reported as drift.
SERVER_DESTINATION: dict[str, Any] = {
    "transport": "",
    "url": "",
    "command": [],
    "secret": None,
    "auth_header": "Authorization",
    "auth_scheme": "Bearer",
    "status_tool": "",
    "user_oauth": False,
}
ENDPOINT_DESTINATION = {"base_url": "", "secret": None}
TOOL_DESTINATION = {"http_url": "", "status_url": ""}


def _check_server(values: dict, path: str, problems: Problems) -> None:
    kind = values.get("kind")
    if kind == ToolServer.Kind.MCP:
        values.setdefault("transport", ToolServer.Transport.STREAMABLE_HTTP)
        needed = "command" if values["transport"] == ToolServer.Transport.STDIO else "url"
        if not values.get(needed):
            problems.add(f"{path}.{needed}", f"required for an mcp server over {values['transport']}")
    else:
        for key in ("transport", "command", "status_tool"):
            if key in values:
                problems.add(f"{path}.{key}", "only for mcp servers")
        if kind == ToolServer.Kind.HTTP and "discover" in values:
            problems.add(f"{path}.discover", "http tools are declared in this file, not discovered")
        if kind == ToolServer.Kind.HTTP and not values.get("url"):
            problems.add(f"{path}.url", "required for an http server: its tools' calls go to its origin")
    for key, default in SERVER_DESTINATION.items():
        values.setdefault(key, default)
    if "delegation" in values:
        values["delegation"] = _check_delegation(values, f"{path}.delegation", problems)
    else:
        values["delegation"] = None  # the file owns it: an omitted block means the defaults
    # Like the destination: an omitted block means no OAuth, whatever was stored.
    values.update(OAUTH_NONE)
    if "oauth" in values:
        values.update(_check_oauth(values, f"{path}.oauth", problems))
    if values["user_oauth"]:
        _check_user_oauth(values, path, problems)


def _check_user_oauth(server: dict, path: str, problems: Problems) -> None:
    """The user's token goes in the Authorization header of an HTTP request: nothing else may take it."""
    where = f"{path}.user_oauth"
    if server.get("kind") != ToolServer.Kind.MCP or server.get("transport") == ToolServer.Transport.STDIO:
        problems.add(
            where, "only for mcp servers over streamable_http: the user's token goes in an HTTP header"
        )
    if server.get("oauth_token_url"):
        problems.add(
            where,
            "the server takes either each user's token or the platform's own (the oauth block), not both",
        )
    if server.get("secret") and (server.get("auth_header") or "").lower() == "authorization":
        problems.add(
            where,
            "the user's token goes in the Authorization header, which this server's secret already uses "
            "(give the secret another auth_header)",
        )
    delegation = server.get("delegation") or {}
    if delegation.get("mode") == "token_exchange" or delegation.get("mcp_authorization"):
        problems.add(
            where,
            "the user's OAuth token takes the Authorization header, which delegation.auth: token_exchange "
            "or mcp_authorization also wants; send the assertion in _meta or another header",
        )


def _check_oauth(server: dict, path: str, problems: Problems) -> dict:
    values = _read(server.pop("oauth"), path, OAUTH, problems)
    if server.get("kind") != ToolServer.Kind.MCP or server.get("transport") == ToolServer.Transport.STDIO:
        problems.add(path, "only for mcp servers over streamable_http: the token goes in an HTTP header")
    url = values.get("oauth_token_url", "")
    if (
        url
        and settings.PRODUCTION
        and urlsplit(url).scheme != "https"
        and urlsplit(url).hostname
        not in (
            "localhost",
            "127.0.0.1",
            "::1",
        )
    ):
        problems.add(f"{path}.token_url", "must use https in production: the client secret is sent to it")
    if server.get("secret") and (server.get("auth_header") or "").lower() == "authorization":
        problems.add(
            path,
            "the OAuth token goes in the Authorization header, which this server's secret already uses "
            "(give the secret another auth_header)",
        )
    delegation = server.get("delegation") or {}
    if delegation.get("mode") == "token_exchange" or delegation.get("mcp_authorization"):
        problems.add(
            path,
            "the user's authority already takes the Authorization header (delegation.auth: "
            "token_exchange or mcp_authorization); send it in _meta or another header",
        )
    return values


def _check_delegation(server: dict, path: str, problems: Problems) -> dict:
    values = _read(server["delegation"], path, DELEGATION, problems)
    mode = values.setdefault("mode", "assertion")
    is_mcp = server.get("kind") == ToolServer.Kind.MCP
    header = values.get("header")
    if header and (not _HEADER_NAME.match(header) or header.lower() in _RESERVED_HEADERS):
        problems.add(
            f"{path}.header", "must be a plain HTTP header name other than Authorization or Idempotency-Key"
        )
    for key in ("mcp_meta", "mcp_authorization"):
        if key in values and not is_mcp:
            problems.add(f"{path}.{key}", "only for mcp servers")
    if "scopes" in values and mode != "token_exchange":
        problems.add(f"{path}.scopes", "only with auth: token_exchange")
    takes_authorization = mode == "token_exchange" or values.get("mcp_authorization")
    if (
        takes_authorization
        and server.get("secret")
        and (server.get("auth_header") or "").lower() == "authorization"
    ):
        problems.add(
            f"{path}.auth" if mode == "token_exchange" else f"{path}.mcp_authorization",
            "the user's token goes in the Authorization header, which this server's secret already uses "
            "(give the secret another auth_header)",
        )
    if mode == "token_exchange" and values.get("mcp_authorization"):
        problems.add(
            f"{path}.mcp_authorization", "with auth: token_exchange, Authorization carries the IdP's token"
        )
    if server.get("transport") == ToolServer.Transport.STDIO and (
        "header" in values or values.get("mcp_authorization")
    ):
        problems.add(path, "a stdio server has no HTTP headers: the assertion goes in _meta")
    return values


def _check_endpoint(values: dict, path: str, problems: Problems) -> None:
    for key, default in ENDPOINT_DESTINATION.items():
        values.setdefault(key, default)
    kind = values.get("kind")
    if kind is None:
        return  # already an error of its own
    for key, kinds in WIRE_ONLY.items():
        if key in values and kind not in kinds:
            problems.add(f"{path}.{key}", f"only for {' and '.join(kinds)} endpoints, not {kind}")
    if kind == ModelEndpoint.Kind.SCRIPTED:
        for key in STREAMING_KEYS:
            if key in values:
                problems.add(f"{path}.{key}", "only for openai and anthropic endpoints, not scripted")
    for key, check in (("compat", compat_problems), ("sampling", sampling_problems)):
        for at, message in check(values.get(key, {}), kind):
            problems.add(f"{path}.{key}{at}", message)
    first, total = values.get("first_token_timeout_seconds"), values.get("timeout_seconds", 60.0)
    if first is not None and first > total:
        problems.add(
            f"{path}.first_token_timeout_seconds",
            f"must be at most timeout_seconds ({total:g}), the whole call's",
        )


def _check_grant(values: dict, path: str, problems: Problems) -> None:
    if ("tool" in values) == ("agent" in values):
        problems.add(path, "give exactly one of tool (with use, approve) or agent (with run)")
        return
    verbs, other = (PERMS, AGENT_PERMS) if "tool" in values else (AGENT_PERMS, PERMS)
    for verb in other:
        if verb in values:
            problems.add(f"{path}.{verb}", f"only with {'agent' if 'tool' in values else 'tool'}")
    for verb in verbs:
        _check_holders(values.get(verb, []), f"{path}.{verb}", problems)


def _check_holders(holders: list[str], path: str, problems: Problems) -> None:
    for i, holder in enumerate(holders):
        kind, _, name = holder.partition(":")
        if kind not in ("user", "group") or not name:
            problems.add(f"{path}[{i}]", 'must be "user:<username>" or "group:<name>"')


def grant_key(values: dict) -> str:
    """A grant's identity: its tool's name, or "agent:<name>"."""
    return values["tool"] if "tool" in values else f"agent:{values['agent']}"


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


# --- webhooks (notifications/) ---

# An HMAC key shorter than this is guessable from signed requests; tokens are 32+ characters.
WEBHOOK_SECRET_MIN = 16


def _webhook_events(value: Any) -> list[str]:
    events = _text_list(value)
    for i, event in enumerate(events):
        if event not in WebhookEvent.values:
            raise _Invalid(f"must be one of {', '.join(WebhookEvent.values)}", at=f"[{i}]")
    if not events:
        raise _Invalid("give at least one event")
    return sorted(set(events))


WEBHOOK: Spec = {
    "name": Field("name", _slug(50), required=True),
    "url": Field("url", _url, required=True),
    "signing_secret": Field("signing_secret", _text(4096, empty=False)),
    "signing_secret_env": Field("signing_secret_env", _text(empty=False)),
    "events": Field("events", _webhook_events, required=True),
    "enabled": Field("enabled", _bool),
}


def _check_webhook(values: dict, path: str, problems: Problems) -> None:
    _exactly_one(values, path, "signing_secret", "signing_secret_env", problems)
    _from_env(values, path, "signing_secret_env", "signing_secret", problems)
    secret = values.get("signing_secret")
    if secret is not None and len(secret) < WEBHOOK_SECRET_MIN:
        problems.add(f"{path}.signing_secret", f"must be at least {WEBHOOK_SECRET_MIN} characters")
    # Like a server's URL, the file owns the webhook: an omitted flag means enabled.
    values.setdefault("enabled", True)


def _check_tool(values: dict, path: str, problems: Problems) -> None:
    """The approval rule is never, always or a Cedar @approval permit for this tool's calls."""
    if "approval_policy" not in values or "server" not in values or "remote_name" not in values:
        return
    try:
        values["approval_policy"] = tool_rules.check(
            values["approval_policy"], tool=f"{values['server']}__{values['remote_name']}"
        )
    except tool_rules.RuleError as exc:
        problems.add(f"{path}.approval", str(exc))


@dataclass(frozen=True)
class Section:
    spec: Spec
    key: Callable[[dict], str]
    check: Callable[[dict, str, Problems], None] | None = None


SECTIONS: dict[str, Section] = {
    "secrets": Section(SECRET, lambda v: v["name"], _check_secret),
    "groups": Section(GROUP, lambda v: v["name"]),
    "users": Section(USER, lambda v: v["username"], _check_user),
    "model_endpoints": Section(ENDPOINT, lambda v: v["name"], _check_endpoint),
    "tool_servers": Section(SERVER, lambda v: v["name"], _check_server),
    "tools": Section(TOOL, lambda v: f"{v['server']}__{v['remote_name']}", _check_tool),
    "grants": Section(GRANT, grant_key, _check_grant),
    "agents": Section(AGENT, lambda v: v["name"]),
    "webhooks": Section(WEBHOOK, lambda v: v["name"], _check_webhook),
}


def parse(data: Any, problems: Problems) -> Plan:
    plan = Plan()
    if not isinstance(data, dict):
        problems.add("", "the file must be a mapping with a tenant section")
        return plan
    for key in data:
        if key not in ("tenant", "identity_provider") and key not in SECTIONS:
            problems.add(
                str(key), f"unknown section; one of tenant, identity_provider, {', '.join(SECTIONS)}"
            )
    if data.get("identity_provider") is not None:
        before = len(problems)
        values = _read(data["identity_provider"], "identity_provider", IDENTITY_PROVIDER, problems)
        if len(problems) == before:
            plan.identity_provider = Item("identity_provider", "identity_provider", values)
    if "tenant" not in data:
        problems.add("tenant", "required")
    else:
        values = _read(data["tenant"], "tenant", TENANT, problems)
        before = len(problems)
        _check_holders(values.get("view_runs", []), "tenant.view_runs", problems)
        if len(problems) > before:
            values.pop("view_runs")
        if values.get("currency", "USD") != "USD" and "exchange_rate" not in data["tenant"]:
            problems.add(
                "tenant.exchange_rate", f"required with currency {values['currency']}: units per one USD"
            )
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
