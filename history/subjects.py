"""Where a data subject's identifier appears: every run, step, event, approval and artifact of a
tenant carrying it as an exact value (a customer id, an email, an account number).

"Exact": the identifier as a whole token, not as part of a longer one (`C-77` matches
`"C-77"` and `customer C-77 called`, not `C-775`): a regular expression with the identifier
between non-word characters, over the text of each content column (JSON as PostgreSQL prints
it), and a byte search in artifacts' content. The scan covers the tenant's rows; it does not use
the run search's GIN index, which holds input and metadata only (docs/history.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db import connection

from approvals.models import Approval
from artifacts.models import Artifact
from core import sql
from core.errors import DomainError
from runs.models import Run, RunEvent, Step

RUNS, STEPS, EVENTS = sql.table(Run), sql.table(Step), sql.table(RunEvent)
APPROVALS, ARTIFACTS = sql.table(Approval), sql.table(Artifact)


@dataclass
class Found:
    """The items carrying an identifier, by run."""

    runs: set = field(default_factory=set)  # run ids whose own content carries it
    steps: dict = field(default_factory=dict)  # run id -> [step seq]
    events: dict = field(default_factory=dict)  # run id -> [event seq]
    approvals: dict = field(default_factory=dict)  # run id -> [approval id]
    artifacts: dict = field(default_factory=dict)  # run id -> [artifact id]

    def run_ids(self) -> set:
        ids = set(self.runs)
        for items in (self.steps, self.events, self.approvals, self.artifacts):
            ids |= set(items)
        return ids

    def counts(self) -> dict[str, int]:
        return {
            "runs": len(self.runs),
            "steps": sum(map(len, self.steps.values())),
            "events": sum(map(len, self.events.values())),
            "approvals": sum(map(len, self.approvals.values())),
            "artifacts": sum(map(len, self.artifacts.values())),
        }


def pattern(identifier: str) -> str:
    """A PostgreSQL regular expression matching the identifier as a whole token."""
    escaped = "".join(c if c.isalnum() else "\\" + c for c in identifier)
    return f"(^|[^[:alnum:]_]){escaped}($|[^[:alnum:]_])"


def _rows(text: str, params: list) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(text, params)
        return cursor.fetchall()


def find(tenant_id, identifier: str, *, within: list | None = None) -> Found:
    """Every item of the tenant (of the runs `within`, when given) carrying `identifier`."""
    identifier = identifier.strip()
    if len(identifier) < 3:
        raise DomainError("an identifier must be at least 3 characters", code="identifier_too_short")
    if connection.vendor != "postgresql":
        raise DomainError("finding a data subject needs PostgreSQL", code="not_supported")
    p = pattern(identifier)
    only = " AND r.id = ANY(%s)" if within is not None else ""
    extra = [list(within)] if within is not None else []
    found = Found()
    for (run_id,) in _rows(
        f"SELECT r.id FROM {RUNS} r WHERE r.tenant_id = %s{only} AND (r.input::text ~ %s OR "
        "r.metadata::text ~ %s OR r.final_output ~ %s OR r.error ~ %s)",
        [tenant_id, *extra, p, p, p, p],
    ):
        found.runs.add(run_id)
    for run_id, seq in _rows(
        f"SELECT s.run_id, s.seq FROM {STEPS} s JOIN {RUNS} r ON r.id = s.run_id WHERE r.tenant_id = %s{only} "
        "AND (coalesce(s.arguments::text, '') ~ %s OR coalesce(s.request::text, '') ~ %s OR "
        "coalesce(s.result::text, '') ~ %s OR s.observation ~ %s OR s.error ~ %s OR s.resolution ~ %s)",
        [tenant_id, *extra, p, p, p, p, p, p],
    ):
        found.steps.setdefault(run_id, []).append(seq)
    for run_id, seq in _rows(
        f"SELECT e.run_id, e.seq FROM {EVENTS} e JOIN {RUNS} r ON r.id = e.run_id WHERE r.tenant_id = %s{only} "
        "AND (e.message ~ %s OR e.data::text ~ %s)",
        [tenant_id, *extra, p, p],
    ):
        found.events.setdefault(run_id, []).append(seq)
    for run_id, approval_id in _rows(
        f"SELECT a.run_id, a.id FROM {APPROVALS} a JOIN {RUNS} r ON r.id = a.run_id WHERE a.tenant_id = %s{only} "
        "AND (a.arguments::text ~ %s OR coalesce(a.original_arguments::text, '') ~ %s OR "
        "a.decision_reason ~ %s OR a.correction_reason ~ %s)",
        [tenant_id, *extra, p, p, p, p],
    ):
        found.approvals.setdefault(run_id, []).append(approval_id)
    for run_id, artifact_id in _rows(
        f"SELECT a.run_id, a.id FROM {ARTIFACTS} a JOIN {RUNS} r ON r.id = a.run_id WHERE a.tenant_id = %s{only} "
        "AND (position(convert_to(%s, 'UTF8') in a.content) > 0 OR a.name ~ %s)",
        [tenant_id, *extra, identifier, p],
    ):
        found.artifacts.setdefault(run_id, []).append(artifact_id)
    return found


def runs_carrying(tenant_id, identifier: str, *, within: list | None = None) -> set:
    return find(tenant_id, identifier, within=within).run_ids()
