"""The signed export (issue 37, part 7): a bundle of one run or a tenant's date range verifies
offline with the snippet in docs/history.md (run from the page itself) against the published keys;
a changed record, a forged signature and a chain rewritten after a checkpoint are each caught;
erased and purged content is not in it, and what remains still verifies."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import io
import json
import zipfile
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.contrib.auth.models import Permission
from django.utils import timezone
from rest_framework.test import APIClient

from authority import keys
from core import chain
from history.checkpoints import take_checkpoint
from history.erasure import erase_subject
from history.retention import purge_due
from runs.models import Run, RunEvent
from tenants.models import Tenant
from tests import factories
from tests.history.conftest import finished_run
from vault.fields import seal

pytestmark = pytest.mark.django_db(transaction=True)

CUSTOMER = "CUST-7000-EX"


def _snippet() -> dict:
    """The offline verifier, as docs/history.md gives it."""
    text = (Path(settings.BASE_DIR) / "docs" / "history.md").read_text()
    code = text.split("```python verify_bundle\n", 1)[1].split("```", 1)[0]
    namespace: dict = {"__name__": "snippet"}
    exec(compile(code, "docs/history.md", "exec"), namespace)
    return namespace


@pytest.fixture
def auditor(tenant):
    user = factories.make_user(tenant, "audrey", staff=True)
    user.user_permissions.add(Permission.objects.get(codename="export_history"))
    return type(user).objects.get(pk=user.pk)


def _export(user, **params) -> bytes:
    client = APIClient()
    client.force_authenticate(user)
    response = client.get("/v1/history/export", params)
    assert response.status_code == 200, response.content
    assert response["Content-Type"] == "application/octet-stream"
    assert response["Content-Disposition"] == 'attachment; filename="history-export.zip"'
    return response.content


def _check(bundle: bytes, tmp_path) -> list[str]:
    path = tmp_path / "bundle.zip"
    path.write_bytes(bundle)
    return _snippet()["verify_bundle"](str(path), keys.jwks())


def _records(bundle: bytes) -> list[dict]:
    return [
        json.loads(line) for line in zipfile.ZipFile(io.BytesIO(bundle)).read("records.jsonl").splitlines()
    ]


def _rezip(bundle: bytes, **replaced: bytes) -> bytes:
    source = zipfile.ZipFile(io.BytesIO(bundle))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for name in source.namelist():
            target.writestr(name, replaced.get(name.replace(".", "_"), source.read(name)))
    return out.getvalue()


def test_a_runs_bundle_verifies_offline_and_holds_what_an_auditor_needs(
    tenant, asha, auditor, echo_agent, tmp_path
):
    run = finished_run(asha)
    take_checkpoint()

    bundle = _export(auditor, run=str(run.pk))

    assert _check(bundle, tmp_path) == []
    records = _records(bundle)
    kinds = {r["type"] for r in records}
    assert kinds == {"run", "event", "step", "checkpoint", "leaf"}
    (leaf,) = [r for r in records if r["type"] == "leaf"]
    assert leaf["event_seq"] == Run.objects.get(pk=run.pk).event_seq
    step = next(r for r in records if r["type"] == "step" and r["kind"] == "tool")
    assert step["effect_class"] == "read_only" and step["result"]["structured"] == {"say": "hello"}
    manifest = json.loads(zipfile.ZipFile(io.BytesIO(bundle)).read("manifest.json"))
    assert manifest["scope"] == {"run": str(run.pk)} and manifest["runs"] == 1


def test_a_date_range_bundle_verifies_with_runs_before_and_after_the_checkpoint(
    tenant, asha, auditor, echo_agent, tmp_path
):
    other = factories.make_tenant("globex")
    start = timezone.now() - dt.timedelta(minutes=1)
    first = finished_run(asha, word="one")
    take_checkpoint()
    second = finished_run(asha, word="two")  # after the checkpoint: chained, not in it yet

    bundle = _export(
        auditor, **{"from": start.isoformat(), "to": (timezone.now() + dt.timedelta(minutes=1)).isoformat()}
    )

    assert _check(bundle, tmp_path) == []
    runs = {r["id"] for r in _records(bundle) if r["type"] == "run"}
    assert runs == {str(first.pk), str(second.pk)}
    assert [r["run"] for r in _records(bundle) if r["type"] == "leaf"] == [str(first.pk)]
    assert Tenant.objects.get(pk=other.pk)  # another tenant's runs are not the auditor's to export


def test_a_changed_record_and_a_forged_signature_are_caught(tenant, asha, auditor, echo_agent, tmp_path):
    run = finished_run(asha, word=CUSTOMER)
    take_checkpoint()
    bundle = _export(auditor, run=str(run.pk))
    source = zipfile.ZipFile(io.BytesIO(bundle))
    records = source.read("records.jsonl").replace(CUSTOMER.encode(), b"CUST-0000-XX")

    assert _check(_rezip(bundle, records_jsonl=records), tmp_path) == [
        "records.jsonl is not the file the manifest signed"
    ]

    manifest = json.loads(source.read("manifest.json"))
    manifest["files"]["records.jsonl"] = hashlib.sha256(records).hexdigest()
    forged = json.dumps(manifest).encode()
    signature = base64.urlsafe_b64encode(Ed25519PrivateKey.generate().sign(forged)).rstrip(b"=")
    with pytest.raises(InvalidSignature):
        _check(_rezip(bundle, records_jsonl=records, manifest_json=forged, manifest_sig=signature), tmp_path)


def test_a_chain_rewritten_after_the_checkpoint_is_caught_in_the_platforms_own_export(
    tenant, asha, auditor, echo_agent, tmp_path
):
    run = finished_run(asha)
    take_checkpoint()
    # An administrator holding the keys too: the content forged opens.
    forged = seal(RunEvent, "message", run.pk, "forged", tenant=run.tenant_id)
    RunEvent.objects.filter(run=run, seq=2).update(message=forged)
    head = chain.GENESIS
    for event in RunEvent.objects.filter(run=run).order_by("seq"):
        event.content_digest = chain.content_digest(event.message, event.data)
        body = chain.event_body(
            run.pk, event.at, event.kind, event.step_seq, event.actor_id, event.content_digest
        )
        head = chain.link(head, event.seq, body)
        RunEvent.objects.filter(pk=event.pk).update(content_digest=event.content_digest, chain_hash=head)
    Run.objects.filter(pk=run.pk).update(chain_head=head)

    problems = _check(_export(auditor, run=str(run.pk)), tmp_path)

    last = Run.objects.get(pk=run.pk).event_seq
    assert problems == [f"run {run.pk}: differs from checkpoint 1 at event {last}"]


def test_erased_and_purged_content_is_not_in_the_bundle_and_what_remains_verifies(
    tenant, asha, ravi, auditor, echo_agent, tmp_path
):
    erased = finished_run(asha, word=CUSTOMER)
    purged = finished_run(asha, word="ACCT-1234-PP")
    kept = finished_run(asha, word="kept-word")
    take_checkpoint()
    erase_subject(tenant_id=tenant.pk, identifier=CUSTOMER, request_ref="DSR-9", actor=ravi)
    Tenant.objects.filter(pk=tenant.pk).update(content_retention_seconds=3600)
    Run.objects.filter(pk__in=[purged.pk]).update(finished_at=timezone.now() - dt.timedelta(hours=2))
    Run.objects.filter(pk__in=[erased.pk, kept.pk]).update(finished_at=timezone.now())
    assert purge_due().purged == [purged.pk]

    bundle = _export(
        auditor,
        **{
            "from": (timezone.now() - dt.timedelta(hours=1)).isoformat(),
            "to": (timezone.now() + dt.timedelta(hours=1)).isoformat(),
        },
    )

    text = zipfile.ZipFile(io.BytesIO(bundle)).read("records.jsonl").decode()
    assert CUSTOMER not in text and "ACCT-1234-PP" not in text and "kept-word" in text
    assert _check(bundle, tmp_path) == []
    runs = {r["id"]: r["content_removed"] for r in _records(bundle) if r["type"] == "run"}
    assert runs == {str(erased.pk): "erasure", str(purged.pk): "retention", str(kept.pk): None}
