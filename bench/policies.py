"""Cedar policy figures: decisions per second, and the latency a tenant's policies add per dispatch.

    DATABASE_URL=postgres://root@127.0.0.1:5432/test .venv/bin/python bench/policies.py

DATABASE_URL only says where PostgreSQL is: the benchmark creates a throwaway database
`bench_policies_<pid>` with Django's test-database machinery, migrates it, and drops it at the
end. Nothing is sent to a broker or to a tool server.

The tenant has 50 policies (BENCH_POLICIES) in one enforced set: forbids over arguments, user
attributes, groups and the day's totals, permits, and @approval permits, across 10 tools.

  decide     approvals.cedar.evaluate on one call (entities and context built, the compiled set
             taken from the per-tenant cache, the enforced and @approval policies in one evaluation), in a loop:
             decisions per second and p95 µs
  dispatch   tools.checks.check_dispatch on an allowed call, each in its own transaction, with
             the tenant's policies (the day-totals row locked, history read, Cedar) and without
             them (the tenant has none): the difference of the p95s is what policies add. Once
             reading everything fresh (as a caller outside the engine does), once as the engine's
             claim calls it (the run locked with its ClaimReads, the step window read), the figure
             the target is about
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")
os.environ.setdefault("CELERY_BROKER_URL", "memory://")

CALLS = int(os.environ.get("BENCH_CALLS", 2000))
POLICIES = int(os.environ.get("BENCH_POLICIES", 50))
TOOLS = 10
SCHEMA = {
    "type": "object",
    "properties": {"amount": {"type": "integer"}, "currency": {"type": "string"}},
    "required": ["amount", "currency"],
}


def setup_database():
    import django
    from django.db import connection
    from django.test.utils import setup_test_environment

    django.setup()
    setup_test_environment()
    connection.settings_dict.setdefault("TEST", {})["NAME"] = f"bench_policies_{os.getpid()}"
    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    return connection, old_name


def policy_text(count: int) -> str:
    shapes = [
        '@id("ceiling-{i}")\n@reason("ceiling")\nforbid (principal, action == Action::"{t}", resource)\n'
        "when {{ context.arguments.amount > {n} }};",
        '@id("limit-{i}")\n@reason("own limit")\nforbid (principal, action == Action::"{t}", resource)\n'
        "when {{ context.arguments.amount > principal.refund_limit + {n} }};",
        '@id("daily-{i}")\n@reason("daily total")\nforbid (principal, action == Action::"{t}", resource)\n'
        "when {{ context.today.amount + context.arguments.amount > {n}00 }};",
        '@id("group-{i}")\n@reason("support only")\nforbid (principal, action == Action::"{t}", resource)\n'
        'unless {{ principal in Group::"support-agents" || principal in Group::"supervisors" }};',
        '@id("approval-{i}")\n@approval("large")\npermit (principal, action == Action::"{t}", resource)\n'
        'when {{ context.arguments.amount > {n} && context.arguments.currency == "INR" }};',
        '@id("currency-{i}")\n@reason("INR only")\nforbid (principal, action in Action::"call_tool", resource)\n'
        'when {{ resource.name == "{t}" && context.run.calls > {n} }};',
    ]
    out = []
    for i in range(count):
        tool = f"pay__tool{i % TOOLS}"
        out.append(shapes[i % len(shapes)].format(i=i, t=tool, n=100000 + i))
    return "\n".join(out)


def build():
    from approvals.policy_sets import PolicySpec, SourceSet, check, install
    from runs.models import Step, StepKind, StepStatus
    from runs.services import start_run
    from tests import factories
    from tools.models import Tool, ToolServer

    def tenant_with_tools(slug):
        tenant = factories.make_tenant(slug)
        user = factories.make_user(tenant, "asha" if slug == "bench-policies" else "asha-plain")
        group = factories.make_group(tenant, f"support-agents-{slug}")
        user.groups.add(group)
        server = ToolServer.objects.create(tenant=tenant, name="pay", kind=ToolServer.Kind.HTTP)
        tools = [
            Tool.objects.create(
                tenant=tenant,
                server=server,
                name=f"pay__tool{i}",
                remote_name=f"tool{i}",
                input_schema=SCHEMA,
                enabled=True,
                effect_class="idempotent",
                http_url="http://127.0.0.1:9/x",
            )
            for i in range(TOOLS)
        ]
        for tool in tools:
            factories.grant(tool, use=[user])
        factories.make_agent(tenant, tools=tools, turns=[{"text": "ok"}])
        run, _ = start_run(user=user, agent="agent", input={})
        step = Step.objects.create(
            run=run,
            seq=99,
            kind=StepKind.TOOL,
            status=StepStatus.APPROVED,
            tool=tools[0],
            tool_name=tools[0].name,
            arguments={"amount": 1200, "currency": "INR"},
            idempotency_key=f"bench-{slug}",
        )
        run.revealed_tools = [t.name for t in tools]
        run.save(update_fields=["revealed_tools"])
        return tenant, user, tools, run, step

    with_policies = tenant_with_tools("bench-policies")
    spec = PolicySpec(
        sets=[SourceSet(name="bank", text=policy_text(POLICIES))],
        user_attribute_types={"refund_limit": {"type": "long", "default": 0}},
        user_attributes={"asha": {"refund_limit": 10000}},
        totals={f"pay__tool{i}": "amount" for i in range(TOOLS)},
    )
    problems = check(with_policies[0], spec)
    assert problems == [], problems
    install(with_policies[0], spec)
    without = tenant_with_tools("bench-plain")
    return with_policies, without


def timed(fn, calls: int) -> tuple[float, float, float, float]:
    """(wall mean, wall p95, CPU mean, CPU p95) in µs. Wall time includes the database round trips
    and whatever else the machine is doing; CPU time is this process's own work."""
    for _ in range(50):
        fn()
    wall, cpu = [], []
    for _ in range(calls):
        started, started_cpu = time.perf_counter_ns(), time.thread_time_ns()
        fn()
        cpu.append((time.thread_time_ns() - started_cpu) / 1000)
        wall.append((time.perf_counter_ns() - started) / 1000)
    wall.sort()
    cpu.sort()
    p95 = int(0.95 * len(wall)) - 1
    return statistics.fmean(wall), wall[p95], statistics.fmean(cpu), cpu[p95]


def line(label: str, figures) -> None:
    print(f"{label:<48}" + "".join(f"{f:>11.0f}" for f in figures))


def main() -> None:
    connection, old_name = setup_database()
    try:
        from django.db import transaction

        from approvals import calls, cedar
        from runs import statements
        from runs.models import Run
        from runs.transitions import lock_run
        from tools import checks

        (tenant, user, tools, run, step), plain = build()
        run = Run.objects.select_related("tenant", "version", "agent", "created_by").get(pk=run.pk)
        step.tool = tools[0]
        request = calls.request_for(run, tools[0], step.arguments, user=user)
        verdict = cedar.evaluate(request)
        assert verdict.denial is None, verdict.denial
        assert len(cedar.compiled(tenant.pk).enforce.effects) >= POLICIES * 5 // 6

        if os.environ.get("BENCH_PROFILE"):
            import cProfile
            import pstats

            cProfile.runctx(
                "for _ in range(300): cedar.evaluate(request)", globals(), locals(), "/tmp/cedar/prof"
            )
            pstats.Stats("/tmp/cedar/prof").sort_stats("cumulative").print_stats(15)
        print(f"Cedar policy benchmark: {POLICIES} policies, {CALLS} calls per figure")
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (wall times include it)")
        print()
        print(f"{'µs per call':<48}{'wall mean':>11}{'wall p95':>11}{'CPU mean':>11}{'CPU p95':>11}")
        policies = cedar.compiled(tenant.pk)
        engine = timed(lambda: cedar.evaluate(request, policies=policies), CALLS)
        line("Cedar alone (entities, context, 1 evaluation)", engine)
        decide = timed(lambda: cedar.evaluate(request), CALLS)
        line("cedar.evaluate (+ the tenant's version query)", decide)

        def dispatch(run, step):
            def go():
                with transaction.atomic():
                    assert checks.check_dispatch(run, step) is None

            return go

        plain_run = Run.objects.select_related("tenant", "version", "agent", "created_by").get(pk=plain[3].pk)
        base = timed(dispatch(plain_run, plain[4]), CALLS)
        with_policies = timed(dispatch(run, step), CALLS)
        line("check_dispatch, tenant without policies", base)
        line("check_dispatch, with policies (lock, history, Cedar)", with_policies)
        line("  added per dispatch", [w - b for w, b in zip(with_policies, base, strict=True)])

        def claimed(run_pk, step):
            # As the engine's claim calls it: the run locked with its ClaimReads (the creator's
            # groups, the policy version, the grant) and the step window read in the same
            # transaction; both figures include those two statements.
            def go():
                with transaction.atomic():
                    locked = lock_run(run_pk, for_step=True)
                    window = statements.step_window(locked)
                    assert checks.check_dispatch(locked, step, user=locked.created_by, steps=window) is None

            return go

        base = timed(claimed(plain_run.pk, plain[4]), CALLS)
        with_policies = timed(claimed(run.pk, step), CALLS)
        line("in the claim, tenant without policies", base)
        line("in the claim, with policies", with_policies)
        line("  added per dispatch in the claim", [w - b for w, b in zip(with_policies, base, strict=True)])
        print()
        print(
            f"decisions per second, one thread, Cedar alone: {1e6 / engine[2]:.0f} (CPU), {1e6 / engine[0]:.0f} (wall)"
        )
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)


if __name__ == "__main__":
    main()
