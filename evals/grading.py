"""Model-graded checks (`judge`): a judge endpoint reads the case, the run's output and a rubric,
and answers PASS or FAIL with a reason. Reported apart from the deterministic checks, never part
of a case's pass (a judge is a model: useful, not proof).

The judge's call is reserved on the evaluation's budget account before it is sent and settled
at its cost after (budgets.services.reserve_on); no transaction is open while it is sent.
"""

from __future__ import annotations

import json

from budgets import services as budgets
from llm import gateway
from llm.models import ModelEndpoint
from llm.types import Message, ModelRequest

INSTRUCTIONS = (
    "You grade the answer of an AI agent against a rubric. Reply with PASS or FAIL on the first "
    "line, then one sentence saying why."
)


def grade(*, evaluation, check: dict, case_input, output: str) -> tuple[bool, str, int]:
    """(passed, the judge's reason, cost in micros); a judge that cannot answer fails the check."""
    spec = check["judge"]
    endpoint = ModelEndpoint.objects.filter(tenant_id=evaluation.tenant_id, name=spec["endpoint"]).first()
    if endpoint is None:
        return False, f"no model endpoint {spec['endpoint']}", 0
    request = ModelRequest(
        model=endpoint.model,
        instructions=INSTRUCTIONS,
        messages=[
            Message(
                role="user",
                content=f"Rubric:\n{spec['rubric']}\n\nThe agent's input:\n{json.dumps(case_input)}"
                f"\n\nThe agent's final answer:\n{output}",
            )
        ],
        tools=[],
        max_output_tokens=int(spec.get("max_output_tokens", 200)),
        timeout_seconds=float(endpoint.timeout_seconds),
    )
    estimate = gateway.estimate_cost_micros(endpoint, request)
    try:
        reservation = budgets.reserve_on(
            account_id=evaluation.budget_account_id, amount_micros=estimate, purpose="judge"
        )
    except budgets.BudgetExceeded as exc:
        return False, f"not graded: {exc.message}", 0
    try:
        reply = gateway.call_model(endpoint, request)
    except Exception as exc:  # a provider's failure of any kind: the check is not passed
        budgets.release(reservation.pk, note="the judge did not answer")
        return False, f"the judge did not answer: {type(exc).__name__}: {exc}", 0
    cost = gateway.cost_micros(endpoint, reply.usage)
    budgets.settle(reservation.pk, actual_micros=cost)
    verdict, _, reason = (reply.text or "").strip().partition("\n")
    return verdict.strip().upper().startswith("PASS"), (reason.strip() or verdict.strip())[:500], cost
