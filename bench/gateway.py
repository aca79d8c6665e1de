"""Tool gateway figures: the cost of the checks per dispatch, and the tool schemas the model sees.

    DATABASE_URL=postgres://root@127.0.0.1:5432/test .venv/bin/python bench/gateway.py

DATABASE_URL only says where PostgreSQL is: the benchmark creates a throwaway database
`bench_gateway_<pid>` with Django's test-database machinery, migrates it, and drops it at the
end. Nothing is sent to a broker or to a tool server.

Catalogue: 400 tools on 12 servers (builtin and http kinds) with generated but realistic names,
descriptions and JSON schemas. The agent user holds use_tool on 60 of them (half directly, half
through a group); the agent version allowlists 40, of which 36 are among the 60.

  checks     tools.checks.check_dispatch on an allowed call (the full path: fresh user, tool
             row, allowlist, guardian object permission, offered list, JSON-schema validation)
             and on a denied call (no permission); queries per call and microseconds, mean and
             p95 (wall clock) and the mean CPU time of this process, over BENCH_CALLS (500) calls
             each. Also offered_tools (once per model call).
  tokens     model-visible tool-schema tokens (llm.tokens estimate, as used for reservations)
             for all 400 tools, the permitted tools, the allowlist, permitted ∩ allowlist
             (what a model call is offered today) and the narrowed set (relevance, plus
             search_tools) at the default VISIBLE_TOOLS_MAX and at 12.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")
os.environ.setdefault("CELERY_BROKER_URL", "memory://")

CALLS = int(os.environ.get("BENCH_CALLS", 500))
SEED = 7

SERVERS = {
    "cards": (
        "card",
        [
            "block",
            "unblock",
            "replace",
            "activate",
            "set_limit",
            "get_limits",
            "list_transactions",
            "dispute_transaction",
            "get_statement",
            "set_pin_retry",
            "toggle_international",
            "list_cards",
            "get_card",
            "report_lost",
            "convert_to_emi",
            "get_reward_points",
        ],
    ),
    "payments": (
        "payment",
        [
            "initiate",
            "cancel",
            "get_status",
            "list_payees",
            "add_payee",
            "remove_payee",
            "schedule",
            "list_scheduled",
            "refund",
            "get_refund_status",
            "validate_iban",
            "get_fees",
            "create_mandate",
            "cancel_mandate",
        ],
    ),
    "loans": (
        "loan",
        [
            "get_offer",
            "apply",
            "get_schedule",
            "prepay",
            "foreclose",
            "get_balance",
            "list_loans",
            "restructure",
            "get_interest_certificate",
            "update_emi_date",
            "get_noc",
        ],
    ),
    "crm": (
        "customer",
        [
            "get_profile",
            "update_address",
            "update_phone",
            "update_email",
            "add_note",
            "list_notes",
            "get_segment",
            "list_interactions",
            "merge_duplicates",
            "flag_vip",
            "get_consents",
            "record_consent",
        ],
    ),
    "kyc": (
        "kyc",
        [
            "get_status",
            "request_documents",
            "verify_document",
            "reject_document",
            "schedule_video_kyc",
            "get_risk_score",
            "refresh_screening",
            "list_alerts",
            "close_alert",
        ],
    ),
    "statements": (
        "statement",
        [
            "generate",
            "email",
            "get_tax_certificate",
            "list_periods",
            "get_balance_history",
            "get_interest_summary",
            "get_charges",
            "reverse_charge",
        ],
    ),
    "disputes": (
        "dispute",
        [
            "open",
            "get",
            "list",
            "add_evidence",
            "escalate",
            "withdraw",
            "get_chargeback_status",
            "assign",
            "close",
            "reopen",
        ],
    ),
    "notify": (
        "message",
        [
            "send_email",
            "send_sms",
            "send_push",
            "get_delivery_status",
            "list_templates",
            "render_template",
            "schedule",
            "cancel_scheduled",
        ],
    ),
    "fx": (
        "fx",
        [
            "get_rate",
            "get_rates",
            "book_deal",
            "cancel_deal",
            "get_forex_card_balance",
            "load_forex_card",
            "list_currencies",
            "get_limits",
        ],
    ),
    "insurance": (
        "policy",
        [
            "get_quote",
            "purchase",
            "get",
            "list",
            "file_claim",
            "get_claim_status",
            "cancel",
            "add_nominee",
            "renew",
        ],
    ),
    "invest": (
        "investment",
        [
            "list_funds",
            "get_fund",
            "buy_units",
            "redeem_units",
            "start_sip",
            "stop_sip",
            "get_portfolio",
            "get_capital_gains",
            "open_deposit",
            "break_deposit",
        ],
    ),
    "branch": (
        "branch",
        [
            "locate",
            "get_hours",
            "book_appointment",
            "cancel_appointment",
            "list_atms",
            "get_queue_status",
            "request_cheque_book",
            "stop_cheque",
        ],
    ),
}
FIELDS = [
    (
        "account_id",
        {
            "type": "string",
            "pattern": "^ACC-[0-9]{6}$",
            "description": "Customer account id, e.g. ACC-004211.",
        },
    ),
    ("customer_id", {"type": "string", "description": "Customer id from the CRM (CUS-...)."}),
    ("amount", {"type": "number", "exclusiveMinimum": 0, "description": "Amount in the account currency."}),
    (
        "currency",
        {
            "type": "string",
            "enum": ["INR", "USD", "EUR", "GBP", "AED", "SGD"],
            "description": "ISO 4217 currency code.",
        },
    ),
    (
        "reason",
        {"type": "string", "maxLength": 500, "description": "Free-text reason, shown to the customer."},
    ),
    ("from_date", {"type": "string", "format": "date", "description": "Start of the period (YYYY-MM-DD)."}),
    (
        "to_date",
        {"type": "string", "format": "date", "description": "End of the period, inclusive (YYYY-MM-DD)."},
    ),
    (
        "channel",
        {
            "type": "string",
            "enum": ["branch", "phone", "web", "app"],
            "description": "Where the request came from.",
        },
    ),
    ("reference", {"type": "string", "description": "External reference or ticket number."}),
    (
        "limit",
        {
            "type": "integer",
            "minimum": 1,
            "maximum": 100,
            "description": "Maximum number of items to return.",
        },
    ),
    ("notify_customer", {"type": "boolean", "description": "Send the customer a confirmation."}),
    (
        "metadata",
        {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "description": "Extra key-value pairs stored with the request.",
        },
    ),
]
PURPOSES = [
    "Use this when the customer asks about it on a support call.",
    "Requires the customer to be authenticated on the current channel.",
    "Returns a JSON object; errors are reported in the `error` field with a code.",
    "Changes are audited and visible to the customer in their activity log.",
    "Read-only: never changes customer data.",
    "Rate limited to 10 calls per minute per customer.",
]


def catalogue(rng: random.Random) -> list[tuple[str, str, str, dict]]:
    """(server, remote name, description, schema) for 400 tools."""
    rows = []
    for server, (noun, verbs) in SERVERS.items():
        for verb in verbs:
            for variant in ("", "_v2", "_bulk"):
                if len(rows) >= 400:
                    break
                fields = rng.sample(FIELDS, rng.randint(2, 6))
                required = [name for name, _ in fields[: rng.randint(1, len(fields))]]
                action = verb.replace("_", " ")
                description = (
                    f"{action.capitalize()} for a {noun}{' (bulk: up to 50 items)' if variant == '_bulk' else ''}"
                    f"{' using the v2 rules' if variant == '_v2' else ''}. "
                    + " ".join(rng.sample(PURPOSES, 2))
                )
                schema = {
                    "type": "object",
                    "properties": dict(fields),
                    "required": required,
                    "additionalProperties": False,
                }
                rows.append((server, f"{noun}_{verb}{variant}", description, schema))
    while len(rows) < 400:  # top up evenly if the lists above come out short
        server, name, description, schema = rows[len(rows) % 300]
        rows.append((server, f"{name}_alt{len(rows)}", description, schema))
    return rows[:400]


def setup_database():
    import django
    from django.db import connection
    from django.test.utils import setup_test_environment

    django.setup()
    setup_test_environment()
    connection.settings_dict.setdefault("TEST", {})["NAME"] = f"bench_gateway_{os.getpid()}"
    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    return connection, old_name


def build(rng: random.Random):
    from django.contrib.auth.models import Group
    from guardian.shortcuts import assign_perm

    from agents.models import Alias
    from agents.services import create_version
    from agents.spec import DEFAULT_LIMITS
    from budgets.services import create_run_account
    from core.digests import digest
    from llm.models import ModelEndpoint
    from runs.engine.proposals import idempotency_key
    from runs.models import Run, Step, StepKind, StepStatus
    from tenants.models import Tenant, TenantGroup, User
    from tools.models import Tool, ToolServer

    tenant = Tenant.objects.create(slug="bench", name="Bench")
    user = User.objects.create_user(username="agent-user", password="x", tenant=tenant)
    group = Group.objects.create(name="bench:support")
    TenantGroup.objects.create(group=group, tenant=tenant, name="support")
    user.groups.add(group)
    ModelEndpoint.objects.create(tenant=tenant, name="m", kind="scripted", model="m")
    servers = {}
    for i, name in enumerate(SERVERS):
        kind = ToolServer.Kind.BUILTIN if i % 3 == 0 else ToolServer.Kind.HTTP
        servers[name] = ToolServer.objects.create(
            tenant=tenant,
            name=name,
            kind=kind,
            url="" if kind == "builtin" else f"http://{name}.bank.internal",
        )
    tools = Tool.objects.bulk_create(
        [
            Tool(
                tenant=tenant,
                server=servers[server],
                name=f"{server}__{remote}",
                remote_name=remote,
                description=description,
                input_schema=schema,
                enabled=True,
                effect_class="read_only",
            )
            for server, remote, description, schema in catalogue(rng)
        ]
    )
    permitted = rng.sample(tools, 60)
    for n, tool in enumerate(permitted):
        assign_perm("tools.use_tool", user if n % 2 else group, tool)
    others = [t for t in tools if t not in permitted]
    allowlist = rng.sample(permitted, 36) + rng.sample(others, 4)
    version, _ = create_version(
        tenant=tenant,
        agent="support",
        spec={
            "model": "m",
            "instructions": "You help bank support agents.",
            "tools": [t.name for t in allowlist],
        },
    )
    Alias.objects.create(agent=version.agent, name="prod", version=version)
    run = Run.objects.create(
        tenant=tenant,
        created_by=user,
        agent=version.agent,
        version=version,
        input={
            "ask": "The customer wants to dispute a card transaction and get a refund "
            "of the payment; check the card statement first."
        },
        limits=dict(DEFAULT_LIMITS),
        status="running",
    )
    create_run_account(run=run, limit_micros=DEFAULT_LIMITS["max_cost_micros"])
    allowed = next(t for t in allowlist if t in permitted)
    denied = next(t for t in allowlist if t not in permitted)
    offered = sorted(t.name for t in allowlist)
    Step.objects.create(
        run=run, seq=1, kind=StepKind.MODEL, status=StepStatus.SUCCEEDED, request={"tools": offered}
    )

    def call(seq, tool):
        arguments = example_arguments(tool.input_schema)
        return Step.objects.create(
            run=run,
            seq=seq,
            kind=StepKind.TOOL,
            status=StepStatus.PROPOSED,
            parent_seq=1,
            tool=tool,
            tool_name=tool.name,
            call_id=f"c{seq}",
            arguments=arguments,
            args_digest=digest(arguments),
            idempotency_key=idempotency_key(run, seq),
        )

    return {
        "tools": tools,
        "permitted": permitted,
        "allowlist": allowlist,
        "run": run,
        "allowed_step": call(2, allowed),
        "denied_step": call(3, denied),
    }


def example_arguments(schema: dict) -> dict:
    samples = {"string": "ACC-004211", "number": 12.5, "integer": 10, "boolean": True, "object": {}}
    arguments = {}
    for name in schema.get("required", []):
        spec = schema["properties"][name]
        arguments[name] = (
            spec["enum"][0]
            if "enum" in spec
            else ("2025-01-14" if spec.get("format") == "date" else samples[spec["type"]])
        )
    return arguments


def timed(fn, calls: int) -> tuple[float, float, float, int]:
    """(wall mean µs, wall p95 µs, CPU mean µs in this process, queries per call).

    Wall time includes the database round trips and whatever else the machine is doing; the
    CPU time of this process is the gateway's own work (Python, ORM, validation) and is stable
    under load.
    """
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    for _ in range(20):
        fn()  # warm caches (content types, compiled queries, schema validators)
    with CaptureQueriesContext(connection) as queries:
        fn()
    per_call = len(queries.captured_queries)
    wall, cpu = [], []
    for _ in range(calls):
        started, started_cpu = time.perf_counter_ns(), time.process_time_ns()
        fn()
        cpu.append((time.process_time_ns() - started_cpu) / 1000)
        wall.append((time.perf_counter_ns() - started) / 1000)
    wall.sort()
    return statistics.fmean(wall), wall[int(0.95 * len(wall)) - 1], statistics.fmean(cpu), per_call


def schema_tokens(specs) -> int:
    from llm.tokens import MESSAGE_OVERHEAD, estimate_input_tokens
    from llm.types import ModelRequest

    request = ModelRequest(model="m", instructions="", messages=[], tools=list(specs), max_output_tokens=1)
    return estimate_input_tokens(request) - MESSAGE_OVERHEAD


def main() -> None:
    connection, old_name = setup_database()
    try:
        from django.conf import settings

        from runs.models import Run
        from tools import checks, offer

        data = build(random.Random(SEED))
        run = Run.objects.select_related("tenant", "version").get(pk=data["run"].pk)
        allowed, denied = data["allowed_step"], data["denied_step"]
        assert checks.check_dispatch(run, allowed) is None, checks.check_dispatch(run, allowed)
        assert "may not use" in (checks.check_dispatch(run, denied) or "")

        print(
            f"tool gateway benchmark: PostgreSQL {connection.pg_version // 10000}, {CALLS} calls per figure"
        )
        print()
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (wall times include it)")
        print(f"{'check':<44}{'queries':>8}{'wall mean µs':>14}{'wall p95 µs':>13}{'CPU mean µs':>13}")
        for label, fn in (
            ("check_dispatch, allowed call", lambda: checks.check_dispatch(run, allowed)),
            ("check_dispatch, denied call (no use_tool)", lambda: checks.check_dispatch(run, denied)),
            ("offered_tools (once per model call)", lambda: offer.offered_tools(run)),
        ):
            mean, p95, cpu, queries = timed(fn, CALLS)
            print(f"{label:<44}{queries:>8}{mean:>14.0f}{p95:>13.0f}{cpu:>13.0f}")

        spec = offer.spec_of
        permitted = {t.pk for t in data["permitted"]}
        both = [t for t in data["allowlist"] if t.pk in permitted]
        narrowed = offer.offered_tools(run)
        small = type(run.version)(spec={**run.version.spec, "max_visible_tools": 12})
        run.version = small
        narrowed_small = offer.offered_tools(run)
        print()
        print(f"{'tool set offered to the model':<44}{'tools':>8}{'tokens':>10}{'per call vs all':>17}")
        everything = schema_tokens(spec(t) for t in data["tools"])
        for label, specs in (
            ("all tools in the catalogue", [spec(t) for t in data["tools"]]),
            ("permitted to the user (use_tool)", [spec(t) for t in data["permitted"]]),
            ("agent allowlist", [spec(t) for t in data["allowlist"]]),
            ("permitted ∩ allowlist", [spec(t) for t in both]),
            (f"narrowed, VISIBLE_TOOLS_MAX={settings.VISIBLE_TOOLS_MAX} (+search_tools)", narrowed),
            ("narrowed, max_visible_tools=12 (+search_tools)", narrowed_small),
        ):
            tokens = schema_tokens(specs)
            print(f"{label:<44}{len(specs):>8}{tokens:>10}{tokens / everything:>16.0%}")
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)


if __name__ == "__main__":
    main()
