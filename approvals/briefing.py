"""What a supervisor reads above the Approve and Deny buttons: the facts of one pending call.

    parties       for whom: the customer, the account and the transaction the call is about,
                  from its arguments, else from the run's input
    request_text  what the run is for: the request it was started with
    sources       the facts the agent gathered that bear on the call: each earlier tool result
                  of the run that holds one of the call's values (the transaction it looked up),
                  with its main fields, and a flag when the call's amount is more than the
                  amount that result shows (a INR 12,499 refund of a INR 899 payment)
    why           the Cedar policies that asked for the approval: id, reason and text

Reads only: everything here informs a decision and never makes one (the policies decide). How a
value reads (`show`) and which arguments are money (`money`) come from tools/display.py through
the admin page, so this room imports no tool code (tools sit below approvals on the ladder but
import it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

from approvals.models import Approval
from core.money import CURRENCY_CODE, amount
from runs.models import Step, StepKind, StepStatus

PARTIES = (
    ("customer", re.compile(r"customer|email|account_holder|payee|recipient", re.IGNORECASE)),
    ("account", re.compile(r"account|iban", re.IGNORECASE)),
    ("transaction", re.compile(r"transaction|payment|order_id|txn", re.IGNORECASE)),
)
# Keys of the run's input that hold what it is for, in the order they are tried.
REQUEST_KEYS = ("request", "message", "text", "ticket", "question", "query", "prompt", "body", "subject")
FACTS_PER_SOURCE = 6  # fields of a looked-up result shown: enough for a transaction's
AMOUNT_KEYS = ("amount", "total", "value")


@dataclass(frozen=True)
class Source:
    """One earlier tool result the call's arguments came from."""

    seq: int
    tool: str
    matched: str  # the call's value found in it (TXN-1003)
    facts: list[tuple[str, str]]
    flags: list[str] = field(default_factory=list)


def parties(approval: Approval) -> list[tuple[str, str]]:
    """(customer | account | transaction, value): the first matching argument, else input field."""
    found: list[tuple[str, str]] = []
    for label, pattern in PARTIES:
        for source in (approval.arguments, approval.run.input):
            value = _first(source, pattern, skip=[v for _, v in found])
            if value:
                found.append((label, value))
                break
    return found


def _first(source, pattern: re.Pattern, *, skip: list[str]) -> str:
    if not isinstance(source, dict):
        return ""
    for key, value in source.items():
        if pattern.search(str(key)) and isinstance(value, str | int) and not isinstance(value, bool):
            if str(value) not in skip:
                return str(value)
    return ""


def request_text(run) -> str:
    """What the run was started for: its input's request text (or the input itself, shortly)."""
    source = run.input
    if isinstance(source, str):
        return source
    if not isinstance(source, dict):
        return ""
    for key in REQUEST_KEYS:
        if isinstance(source.get(key), str) and source[key].strip():
            return source[key]
    return ", ".join(
        f"{key} {value if isinstance(value, str) else json.dumps(value)}" for key, value in source.items()
    )


def _structured(result) -> dict | None:
    if not isinstance(result, dict):
        return None
    if isinstance(result.get("structured"), dict):
        return result["structured"]
    text = result.get("text")
    if isinstance(text, str) and text.lstrip().startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) else None
    return None


def number(value) -> Decimal | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return Decimal(str(value))
    except InvalidOperation:
        return None


def _facts(found: dict, tenant_currency: str, show: Callable) -> list[tuple[str, str]]:
    code = found.get("currency") if isinstance(found.get("currency"), str) else None
    facts = []
    for key, value in found.items():
        if isinstance(value, dict | list) or key == "currency":
            continue
        if key in AMOUNT_KEYS and number(value) is not None:
            facts.append((key, amount(value, code or tenant_currency)))
        else:
            facts.append((key, show(value)))
        if len(facts) == FACTS_PER_SOURCE:
            break
    return facts


Money = list[tuple[str, Decimal, str]]  # (argument, value, currency code) of the call's amounts


def sources(approval: Approval, *, money: Money, show: Callable[[object], str]) -> list[Source]:
    """The run's earlier results that hold one of the call's values, latest first per value."""
    arguments = approval.arguments if isinstance(approval.arguments, dict) else {}
    wanted = {
        str(value)
        for name, value in arguments.items()
        if isinstance(value, str) and value.strip() and not CURRENCY_CODE.match(value)
    }
    if not wanted:
        return []
    steps = (
        Step.objects.filter(
            run_id=approval.run_id,
            kind=StepKind.TOOL,
            seq__lt=approval.step.seq,
            status__in=[StepStatus.SUCCEEDED, StepStatus.RESOLVED_SUCCEEDED],
        )
        .order_by("-seq")
        .only("seq", "tool_name", "result")
    )
    tenant_currency = approval.tenant.currency
    found: list[Source] = []
    seen: set[str] = set()
    for step in steps:
        structured = _structured(step.result)
        if structured is None:
            continue
        matched = next(
            (str(v) for v in structured.values() if isinstance(v, str) and v in wanted and v not in seen),
            None,
        )
        if matched is None:
            continue
        seen.add(matched)
        found.append(
            Source(
                seq=step.seq,
                tool=step.tool_name,
                matched=matched,
                facts=_facts(structured, tenant_currency, show),
                flags=_exceeds(money, structured, matched),
            )
        )
    return found


def _exceeds(money: Money, structured: dict, matched: str) -> list[str]:
    """A flag for each money argument above the amount the looked-up record shows."""
    shown_amount = next((n for key in AMOUNT_KEYS if (n := number(structured.get(key))) is not None), None)
    if shown_amount is None:
        return []
    their_code = structured.get("currency") if isinstance(structured.get("currency"), str) else None
    flags = []
    for name, value, code in money:
        if their_code is not None and their_code != code:
            continue  # amounts in two currencies are not compared
        if value > shown_amount:
            flags.append(
                f"the {name} {amount(value, code)} is more than the {amount(shown_amount, code)} "
                f"that {matched} shows"
            )
    return flags


@dataclass(frozen=True)
class Policy:
    id: str
    text: str


def why(approval: Approval) -> list[Policy]:
    """The Cedar policies that asked for the approval, with their text as it was then."""
    texts = list(approval.policy_texts or [])
    return [
        Policy(pid, texts[i] if i < len(texts) else "") for i, pid in enumerate(approval.policy_ids or [])
    ]
