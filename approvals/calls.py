"""A tool call decided by Cedar at dispatch, under the lock of its day's totals (approvals/cedar.py).

Inside the claim's transaction (runs/engine/claim.py), after the run and its steps are locked:

    check_call   lock this tool's totals row for the tenant's local day (SELECT ... FOR UPDATE),
                 read the run's and the day's history, and evaluate the tenant's policies: a
                 denial names its policy; the verdict (approval, shadow decisions) stays on the step
    count_call   when the call goes on to be dispatched (no approval needed, or approved): add it
                 to the day's totals, the tenant's and the user's, once per step (CountedCall)

Because the totals row stays locked until the claim commits, and the claim commits the step as
`dispatching` in the same transaction, twenty runs racing for the same tool see each other's
calls one after another: a rule over "refunded today" cannot be got around. A call counts when
it is dispatched, not when it succeeds (a call that fails still counted; a budget refusal right
after the count is counted too: the totals err on the side of the limit).

Lock order: the totals row sits after the run and its steps and before the budget accounts of
the call's reservation (runs/engine/__init__.py): one totals row per claim, and nothing that
holds budget accounts waits for it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from decimal import ROUND_CEILING, Decimal

from django.db import connection
from django.db.models import Count, F, Q

from approvals import cedar
from approvals.models import CountedCall, ShadowDecision, ToolArgumentDayTotal, ToolDayTotal
from budgets.models import BudgetAccount
from budgets.services import local_day
from core import sql
from runs.models import Run, Step, StepKind, StepStatus
from tenants.models import TenantGroup

# Steps that reached the provider (or may have): what "calls in this run" counts.
DISPATCHED = {
    StepStatus.DISPATCHING,
    StepStatus.SUCCEEDED,
    StepStatus.FAILED,
    StepStatus.OUTCOME_UNKNOWN,
    StepStatus.RESOLVED_SUCCEEDED,
    StepStatus.RESOLVED_FAILED,
    StepStatus.RETRIED,
}


def groups_of(user) -> list[str]:
    return sorted(TenantGroup.objects.filter(group__user=user).values_list("name", flat=True))


def approval_rules(run: Run, tool) -> tuple[str, ...]:
    """The tool's approval rule and the version's override of it (approvals/tool_rules.py)."""
    override = (run.version.spec.get("approval_overrides") or {}).get(tool.name)
    return (tool.approval_policy or "never", str(override) if override else "")


def request_for(
    run: Run, tool, arguments: dict, *, user, history=None, editor=None, tool_names=None
) -> cedar.CallRequest:
    reads = run.claim_reads
    return cedar.CallRequest(
        tenant_id=run.tenant_id,
        user=user,
        # The creator's groups as the claim read them with the run's lock, else read now.
        groups=list(reads.groups) if reads is not None and user.pk == run.created_by_id else groups_of(user),
        tool=tool,
        arguments=arguments,
        agent_name=run.agent.name,
        version_number=run.version.number,
        history=history or cedar.History(),
        tool_names=tool_names if tool_names is not None else list(run.version.spec.get("tools", [])),
        editor=editor,
        editor_groups=groups_of(editor) if editor is not None else [],
    )


def counted_amount(arguments: dict, name: str | None) -> int:
    """The value of the argument the tenant totals for this tool, as a whole number (rounded up)."""
    if not name:
        return 0
    value = (arguments or {}).get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return 0
    return int(Decimal(repr(value) if isinstance(value, float) else value).to_integral_value(ROUND_CEILING))


def _locked_totals(run: Run, tool, user) -> tuple[ToolDayTotal, ToolDayTotal]:
    """The tenant's and the user's rows of this tool's day, both locked in one statement, in id
    order: the tenant row was created with the day's first user row, before any other user's."""
    day = local_day(run.tenant)
    keys = {"tenant_id": run.tenant_id, "tool_id": tool.pk, "day": day}
    mine = Q(user__isnull=True) | Q(user_id=user.pk)
    for _ in range(2):
        rows = list(ToolDayTotal.objects.select_for_update().filter(mine, **keys).order_by("id"))
        if len(rows) == 2:
            tenant_row, user_row = sorted(rows, key=lambda r: r.user_id is not None)
            return tenant_row, user_row
        _create_totals(run, tool, user, day)
    raise RuntimeError("the day's totals rows could not be created")  # a constraint refused them


def argument_key(value) -> str | None:
    """The text a per-argument total is kept under (None: the call has no value for it)."""
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))
    if len(text) > 200:  # the column's width; the hash keeps distinct values apart
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    return text


def _locked_argument_totals(run: Run, tool, arguments: dict, names: list[str]) -> dict:
    """This call's per-argument rows of the day (name -> row), locked in id order. Called with the
    tool's ToolDayTotal rows already locked: claims of one tool's day come here one at a time."""
    keys = {name: key for name in names if (key := argument_key((arguments or {}).get(name))) is not None}
    if not keys:
        return {}
    base = {"tenant_id": run.tenant_id, "tool_id": tool.pk, "day": local_day(run.tenant)}
    wanted = Q()
    for name, key in keys.items():
        wanted |= Q(argument=name, value=key)
    for _ in range(2):
        rows = list(ToolArgumentDayTotal.objects.select_for_update().filter(wanted, **base).order_by("id"))
        if len(rows) == len(keys):
            return {row.argument: row for row in rows}
        ToolArgumentDayTotal.objects.bulk_create(
            [ToolArgumentDayTotal(**base, argument=n, value=k) for n, k in keys.items()],
            ignore_conflicts=True,
        )
    raise RuntimeError("the day's per-argument totals rows could not be created")


def _locked_history(
    run: Run, tool, user, *, uses_spend: bool
) -> tuple[ToolDayTotal, ToolDayTotal, cedar.History]:
    """The tool's day rows locked (the tenant's, the user's) and the history a decision reads:
    the run's calls per tool from its whole log (counted by PostgreSQL, no row of it built here;
    the engine's step window would undercount them), the day's totals and, where a policy reads
    it, the run's spend. On PostgreSQL one statement: it is on every dispatch of a tenant with
    policies (bench/policies.py)."""
    if connection.vendor != "postgresql":
        tenant_row, user_row = _locked_totals(run, tool, user)
        return tenant_row, user_row, _history(run, tenant_row, user_row, uses_spend=uses_spend)
    day = local_day(run.tenant)
    params = {
        "tenant": run.tenant_id,
        "tool": tool.pk,
        "day": day,
        "user": user.pk,
        "run": sql.adapt(run.pk),
        "kind": StepKind.TOOL,
    }
    for _ in range(2):
        found = sql.fetch_with_rest(_locked_history_sql(uses_spend), params, ToolDayTotal)
        by_kind = {instances[0].user_id is None: (instances[0], rest) for instances, rest in found}
        if len(found) == 2 and len(by_kind) == 2:  # the tenant's row (user null) and the user's
            tenant_row, (calls, spend) = by_kind[True]
            user_row = by_kind[False][0]
            history = cedar.History(
                spend_micros=int(spend or 0),
                calls_by_tool={name: int(n) for name, n in (calls or {}).items()},
                today_calls=tenant_row.calls,
                today_amount=tenant_row.amount,
                user_calls=user_row.calls,
                user_amount=user_row.amount,
            )
            return tenant_row, user_row, history
        _create_totals(run, tool, user, day)
    raise RuntimeError("the day's totals rows could not be created")  # a constraint refused them


@functools.cache
def _locked_history_sql(uses_spend: bool) -> str:
    dispatched = ", ".join(f"'{status}'" for status in sorted(DISPATCHED))
    totals = sql.table(ToolDayTotal)
    spend = (
        f"(SELECT b.spent_micros + b.reserved_micros + b.held_micros FROM {sql.table(BudgetAccount)} b "
        "WHERE b.run_id = %(run)s LIMIT 1)"
        if uses_spend
        else "NULL::bigint"
    )
    return (
        f"WITH locked AS MATERIALIZED (SELECT {sql.columns(ToolDayTotal, 't')} FROM {totals} t "
        "WHERE t.tenant_id = %(tenant)s AND t.tool_id = %(tool)s AND t.day = %(day)s "
        "AND (t.user_id IS NULL OR t.user_id = %(user)s) ORDER BY t.id FOR UPDATE), "
        f"calls AS (SELECT s.tool_name, count(*) AS n FROM {sql.table(Step)} s WHERE s.run_id = %(run)s "
        f"AND s.kind = %(kind)s AND s.status IN ({dispatched}) GROUP BY s.tool_name) "
        f"SELECT {sql.columns(ToolDayTotal, 'locked')}, "
        "(SELECT json_object_agg(c.tool_name, c.n) FROM calls c), "
        f"{spend} FROM locked ORDER BY locked.id"
    )


def _create_totals(run: Run, tool, user, day) -> None:
    keys = {"tenant_id": run.tenant_id, "tool_id": tool.pk, "day": day}
    ToolDayTotal.objects.bulk_create(
        [ToolDayTotal(**keys, user=None), ToolDayTotal(**keys, user_id=user.pk)], ignore_conflicts=True
    )


def _history(
    run: Run, tenant_row: ToolDayTotal, user_row: ToolDayTotal, *, uses_spend: bool
) -> cedar.History:
    calls = dict(
        Step.objects.filter(run_id=run.pk, kind=StepKind.TOOL, status__in=DISPATCHED)
        .order_by()
        .values_list("tool_name")
        .annotate(n=Count("pk"))
    )
    spend = None
    if uses_spend:  # one query fewer on every call of a tenant whose policies never read it
        spend = (
            BudgetAccount.objects.filter(run_id=run.pk)
            .values_list(F("spent_micros") + F("reserved_micros") + F("held_micros"), flat=True)
            .first()
        )
    return cedar.History(
        spend_micros=spend or 0,
        calls_by_tool=calls,
        today_calls=tenant_row.calls,
        today_amount=tenant_row.amount,
        user_calls=user_row.calls,
        user_amount=user_row.amount,
    )


def policies_of(run: Run) -> cedar.Compiled | None:
    """The tenant's compiled policies, at the version the claim read with the run's lock (else read now)."""
    reads = run.claim_reads
    if reads is None:
        return cedar.compiled(run.tenant_id)
    return cedar.compiled(run.tenant_id, version=reads.policy_version)


def check_call(run: Run, step: Step, *, user, steps=None) -> str | None:
    """Why the tenant's policies refuse this call now, or None (see the module's opening)."""
    policies = policies_of(run)
    if policies is None:
        return None  # no tenant policies: only the tool's approval rule, in decision_for
    tool = step.tool
    tenant_row, user_row, history = _locked_history(run, tool, user, uses_spend=policies.uses_spend)
    history, by_argument = _with_argument_totals(run, tool, step.arguments or {}, policies, history)
    request = request_for(
        run,
        tool,
        step.arguments or {},
        user=user,
        history=history,
        tool_names=policies.config.tool_names,  # what context.run.calls_by_tool was validated with
    )
    verdict = cedar.evaluate(
        request,
        rules=approval_rules(run, tool),
        with_approval=step.status == StepStatus.PROPOSED,
        policies=policies,  # at the version the claim read: not looked up a second time
    )
    # Read by decision_for and count_call in the same transaction (attributes of this instance only).
    setattr(step, "policy_verdict", verdict)  # noqa: B010
    setattr(step, "policy_totals", (tenant_row.pk, user_row.pk))  # noqa: B010
    setattr(step, "policy_config", policies.config)  # noqa: B010
    setattr(step, "policy_argument_totals", [row.pk for row in by_argument.values()])  # noqa: B010
    record_shadow(run, step, verdict)
    return str(verdict.denial) if verdict.denial else None


def _with_argument_totals(run: Run, tool, arguments: dict, policies: cedar.Compiled, history):
    names = policies.config.totals_by.get(tool.name) or []
    if not names:
        return history, {}
    rows = _locked_argument_totals(run, tool, arguments, names)
    by_argument = {name: (rows[name].calls, rows[name].amount) if name in rows else (0, 0) for name in names}
    return dataclasses.replace(history, by_argument=by_argument), rows


def check_correction(run: Run, step: Step, *, requester, editor, arguments: dict) -> str | None:
    """Why the tenant's policies refuse an approver's corrected call, or None: the requester is the
    principal, the approver `context.editor`; read under the day's totals lock like any call."""
    policies = cedar.compiled(run.tenant_id)
    if policies is None:
        return None
    tenant_row, user_row, history = _locked_history(run, step.tool, requester, uses_spend=policies.uses_spend)
    history, _ = _with_argument_totals(run, step.tool, arguments, policies, history)
    request = request_for(
        run,
        step.tool,
        arguments,
        user=requester,
        history=history,
        editor=editor,
        tool_names=policies.config.tool_names,
    )
    verdict = cedar.evaluate(request, with_approval=False, policies=policies)
    return str(verdict.denial) if verdict.denial else None


def record_shadow(run: Run, step: Step, verdict: cedar.Verdict) -> None:
    if not verdict.shadow:
        return
    ShadowDecision.objects.bulk_create(
        [
            ShadowDecision(
                tenant_id=run.tenant_id,
                run_id=run.pk,
                step_seq=step.seq,
                tool_name=step.tool_name,
                policy_set=shadow.policy_set,
                outcome=shadow.outcome,
                policies=list(shadow.policies),
            )
            for shadow in verdict.shadow
        ]
    )
    for shadow in verdict.shadow:
        cedar.SHADOW_DECISIONS.labels(run.tenant.slug, shadow.policy_set, shadow.outcome).inc()


def count_call(step: Step) -> None:
    """Add a call about to be dispatched to its day's totals, once (the totals row is locked)."""
    rows = getattr(step, "policy_totals", None)
    if rows is None:
        return
    tool = step.tool
    if tool is None:
        return
    config = getattr(step, "policy_config", None)  # set by check_call in this transaction
    if config is None:
        policies = cedar.compiled(tool.tenant_id)
        config = policies.config if policies else None
    name = config.totals.get(tool.name) if config else None
    amount = counted_amount(step.arguments or {}, name)
    by_argument = list(getattr(step, "policy_argument_totals", None) or [])
    if connection.vendor != "postgresql":
        # SQLite (make demo) has no INSERT inside WITH; its writers queue anyway.
        if not CountedCall.objects.filter(step_id=step.pk).exists():
            CountedCall.objects.create(step_id=step.pk, total_id=rows[0], amount=amount)
            ToolDayTotal.objects.filter(pk__in=rows).update(calls=F("calls") + 1, amount=F("amount") + amount)
            ToolArgumentDayTotal.objects.filter(pk__in=by_argument).update(
                calls=F("calls") + 1, amount=F("amount") + amount
            )
        return
    # One round trip: the step is counted once (CountedCall's key), and only then the totals move.
    with connection.cursor() as cursor:
        cursor.execute(
            f"WITH counted AS (INSERT INTO {CountedCall._meta.db_table} (step_id, total_id, amount) "
            "VALUES (%(step)s, %(total)s, %(amount)s) ON CONFLICT DO NOTHING RETURNING step_id), "
            f"per_value AS (UPDATE {ToolArgumentDayTotal._meta.db_table} "
            "SET calls = calls + 1, amount = amount + %(amount)s "
            "WHERE id = ANY(%(by_argument)s) AND EXISTS (SELECT 1 FROM counted) RETURNING 1) "
            f"UPDATE {ToolDayTotal._meta.db_table} SET calls = calls + 1, amount = amount + %(amount)s "
            "WHERE id IN (%(total)s, %(user_total)s) AND EXISTS (SELECT 1 FROM counted)",
            {
                "step": step.pk,
                "total": rows[0],
                "user_total": rows[1],
                "amount": amount,
                "by_argument": by_argument,
            },
        )
