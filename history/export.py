"""A signed export of run history for an auditor (docs/history.md, "Export").

    build_bundle(tenant_id, run_ids)   a zip: records.jsonl, manifest.json, manifest.sig, jwks.json
    runs_between(tenant_id, start, end) the tenant's runs created in [start, end)

records.jsonl, one JSON object a line, `type` first: each run (skeleton, its content if still
kept, its chain head, its cost), each event (the chain's fields in the form core/chain.py hashes
them: verifiable line by line), each step (skeleton, content if kept, cost), each approval (the
policy text and version it was decided under, requester, decider, arguments if kept), the latest
signed checkpoint and the leaves it and earlier ones hold for these runs. Identity assertions are
events of kind `identity` (jti, subject, audience). manifest.json names the scope, the time, the
SHA-256 of records.jsonl and the signing key; manifest.sig is Ed25519 over manifest.json's bytes
with the platform's signing key (authority/keys.py); jwks.json is the published key set at export
time (an auditor checks it against the copy they keep of /.well-known/jwks.json).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import io
import json
import zipfile

from django.core.serializers.json import DjangoJSONEncoder
from django.utils import timezone

from approvals.models import Approval
from authority import keys
from core import chain
from history import checkpoints
from history.models import Checkpoint, ContentRemoval
from runs.models import Run, RunEvent, Step

VERSION = "ap-export-v1"
MAX_RUNS = 10_000  # one bundle; a wider range is several bundles


def _t(value: dt.datetime | None) -> str | None:
    return chain.format_at(value) if value is not None else None


def runs_between(tenant_id, start: dt.datetime, end: dt.datetime) -> list:
    return list(
        Run.objects.filter(tenant_id=tenant_id, created_at__gte=start, created_at__lt=end)
        .order_by("created_at")
        .values_list("pk", flat=True)[: MAX_RUNS + 1]
    )


def _records(run_ids: list) -> list[dict]:
    removed = dict(ContentRemoval.objects.filter(run_id__in=run_ids).values_list("run_id", "why"))
    out: list[dict] = []
    runs = (
        Run.objects.filter(pk__in=run_ids)
        .select_related("agent", "version", "created_by", "budget")
        .order_by("created_at")
    )
    for run in runs:
        budget = getattr(run, "budget", None)
        out.append(
            {
                "type": "run",
                "id": str(run.pk),
                "agent": run.agent.name,
                "version": run.version.number,
                "version_hash": run.version.content_hash,
                "created_by": run.created_by.username,
                "status": run.status,
                "stop_reason": run.stop_reason,
                "created_at": _t(run.created_at),
                "started_at": _t(run.started_at),
                "finished_at": _t(run.finished_at),
                "spent_micros": budget.spent_micros if budget else None,
                "event_seq": run.event_seq,
                "chain_head": bytes(run.chain_head).hex(),
                "content_removed": removed.get(run.pk),
                "input": run.input,
                "metadata": run.metadata,
                "final_output": run.final_output,
                "error": run.error,
            }
        )
        for event in RunEvent.objects.filter(run=run).select_related("actor").order_by("seq"):
            out.append(
                {
                    "type": "event",
                    "run": str(run.pk),
                    "seq": event.seq,
                    "at": chain.format_at(event.at),
                    "kind": event.kind,
                    "step_seq": event.step_seq,
                    "actor_id": event.actor_id,
                    "actor": event.actor.username if event.actor else None,
                    "message": event.message,
                    # once its content went, what stays (a removal's own record is all that)
                    "data": event.details,
                    "content_digest": event.content_digest,
                    "chain_hash": bytes(event.chain_hash).hex() if event.chain_hash is not None else None,
                }
            )
        for step in Step.objects.filter(run=run).select_related("tool").order_by("seq"):
            out.append(
                {
                    "type": "step",
                    "run": str(run.pk),
                    "seq": step.seq,
                    "kind": step.kind,
                    "status": step.status,
                    "tool": step.tool_name,
                    "effect_class": step.tool.effect_class if step.tool else None,
                    "args_digest": step.args_digest,
                    "idempotency_key": step.idempotency_key,
                    "usage": step.usage,
                    "cost_micros": step.cost_micros,
                    "attempts": step.attempts,
                    "created_at": _t(step.created_at),
                    "finished_at": _t(step.finished_at),
                    **{name: getattr(step, name) for name in chain.STEP_CONTENT},
                }
            )
        for approval in Approval.objects.filter(run=run).select_related(
            "tool", "step", "requested_by", "decided_by"
        ):
            out.append(
                {
                    "type": "approval",
                    "run": str(run.pk),
                    "id": str(approval.pk),
                    "step_seq": approval.step.seq,
                    "tool": approval.tool.name,
                    "status": approval.status,
                    "policy": approval.policy,
                    "policy_version": approval.policy_version,
                    "reason": approval.reason,
                    "digest": approval.digest,
                    "requested_by": approval.requested_by.username,
                    "decided_by": approval.decided_by.username if approval.decided_by else None,
                    "decided_at": _t(approval.decided_at),
                    "arguments": approval.arguments,
                }
            )
    out += _checkpoint_records(run_ids)
    return out


def _checkpoint_records(run_ids: list) -> list[dict]:
    """The latest checkpoint, and for each run it holds, its leaf with the audit path to the
    signed root (RFC 6962): the run's head at that seq is provably in what the platform signed."""
    latest = Checkpoint.objects.order_by("-number").first()
    if latest is None:
        return []
    out: list[dict] = [
        {
            "type": "checkpoint",
            "number": latest.number,
            "statement": latest.statement,
            "signature": latest.signature,
            "kid": latest.kid,
        }
    ]
    leaves = checkpoints.latest_leaves(upto=latest.number)
    order = checkpoints.ordered(leaves)
    hashes = [checkpoints.leaf_hash(r, *leaves[r]) for r in order]
    index = {run_id: i for i, run_id in enumerate(order)}
    for run_id in run_ids:
        if run_id not in index:
            continue  # created or first written after the checkpoint
        seq, head = leaves[run_id]
        path = checkpoints.inclusion_path(hashes, index[run_id])
        out.append(
            {
                "type": "leaf",
                "run": str(run_id),
                "checkpoint": latest.number,
                "event_seq": seq,
                "head": head.hex(),
                "index": index[run_id],
                "size": len(order),
                "path": [p.hex() for p in path],
            }
        )
    return out


def build_bundle(*, tenant_id, run_ids: list, scope: dict) -> bytes:
    """The zip of a signed bundle over the runs `run_ids` of the tenant; `scope` says how they were chosen."""
    records = b"".join(
        json.dumps(record, sort_keys=False, ensure_ascii=False, cls=DjangoJSONEncoder).encode("utf-8") + b"\n"
        for record in _records(run_ids)
    )
    kid, private = keys.signing_key()
    manifest = json.dumps(
        {
            "version": VERSION,
            "tenant": tenant_id,
            "scope": scope,
            "created_at": chain.format_at(timezone.now()),
            "runs": len(run_ids),
            "files": {"records.jsonl": hashlib.sha256(records).hexdigest()},
            "kid": kid,
        },
        sort_keys=True,
        indent=1,
    ).encode("utf-8")
    signature = base64.urlsafe_b64encode(private.sign(manifest)).rstrip(b"=")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bundle:
        bundle.writestr("records.jsonl", records)
        bundle.writestr("manifest.json", manifest)
        bundle.writestr("manifest.sig", signature)
        bundle.writestr("jwks.json", json.dumps(keys.jwks(), indent=1))
    return out.getvalue()
