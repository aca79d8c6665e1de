"""Erasure of a data subject and legal holds (issue 37, parts 4 and 5): a customer id in 30 runs
(input, tool results, an approval's arguments, an artifact) is gone from the API, the admin and a
pg_dump; the skeleton and the chain still verify; a hold refuses with 409, naming itself."""

from __future__ import annotations

import subprocess

import pytest
from django.db import connection
from rest_framework.test import APIClient

from approvals.models import Approval
from artifacts.models import Artifact
from artifacts.services import Given
from history import subjects
from history.checkpoints import take_checkpoint
from history.models import ErasureCertificate, LegalHold
from history.verify import verify
from runs.approval_effects import decide_approval
from runs.models import Run, RunEvent, RunStatus, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tests.history.conftest import finished_run

pytestmark = pytest.mark.django_db(transaction=True)

CUSTOMER = "CUST-4471-XK"
OTHER = "CUST-9002-QZ"


def _client(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def _erase(user, identifier=CUSTOMER, ref="DSR-1"):
    return _client(user).post(
        "/v1/history/erasures",
        {"identifier": identifier, "request_ref": ref, "reason": "art. 17"},
        format="json",
    )


def _approved_run(asha, ravi, echo, word: str) -> Run:
    """A run whose echo call needed an approval (its arguments carry `word`), approved and finished."""
    type(echo).objects.filter(pk=echo.pk).update(approval_policy="always")
    factories.grant(echo, approve=[ravi])
    run, _ = start_run(user=asha, agent="agent", input={"word": word})
    run = drive(run.pk)
    assert run.status == RunStatus.WAITING_APPROVAL, run.status
    decide_approval(approval_id=Approval.objects.get(run=run).pk, user=ravi, approve=True)
    run = drive(run.pk)
    type(echo).objects.filter(pk=echo.pk).update(approval_policy="")
    assert run.status == RunStatus.SUCCEEDED, run.error
    return run


def _pg_dump() -> str:
    db = connection.settings_dict
    env = {"PGPASSWORD": db.get("PASSWORD") or ""}
    out = subprocess.run(
        [
            "pg_dump",
            "--data-only",
            "-h",
            db["HOST"] or "127.0.0.1",
            "-p",
            str(db["PORT"]),
            "-U",
            db["USER"],
            db["NAME"],
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**env, "PATH": "/usr/bin:/bin"},
    )
    return out.stdout


def _api_text(user, run_id) -> str:
    client = _client(user)
    texts = []
    for url in (
        f"/v1/runs/{run_id}",
        f"/v1/runs/{run_id}/steps",
        f"/v1/runs/{run_id}/events",
        f"/v1/runs/{run_id}/artifacts",
    ):
        response = client.get(url)
        assert response.status_code == 200, (url, response.content)
        texts.append(response.content.decode())
    return "\n".join(texts)


def _searched(user, q: str) -> set[str]:
    """The runs `GET /v1/runs?q=` finds."""
    response = _client(user).get("/v1/runs", {"q": q, "limit": 100})
    assert response.status_code == 200, response.content
    return {row["id"] for row in response.json()["results"]}


def test_a_customer_id_in_30_runs_is_gone_everywhere_and_the_skeleton_verifies(
    tenant, asha, ravi, compliance, echo_agent, admin_client
):
    runs = [finished_run(asha, word=CUSTOMER) for _ in range(27)]  # input and the tool's result
    runs.append(_approved_run(asha, ravi, echo_agent, CUSTOMER))  # an approval's arguments
    files = [
        Given(name="statement.txt", media_type="text/plain", content=f"customer {CUSTOMER} disputes".encode())
    ]
    for _ in range(2):  # only an artifact carries it
        run, _ = start_run(user=asha, agent="agent", input={"word": "nothing"}, files=files)
        runs.append(drive(run.pk))
    kept = finished_run(asha, word=OTHER)  # another customer: untouched
    take_checkpoint()
    # The search goes through its index (history/subjects.py): every run covered, none read whole.
    subjects.index_due(batch=1000)
    assert subjects.uncovered(tenant.pk) == set()
    before = {
        r.pk: list(
            Step.objects.filter(run=r)
            .order_by("seq")
            .values_list("seq", "kind", "status", "tool_name", "cost_micros")
        )
        for r in runs
    }
    # Sealed at rest everywhere (vault/): a dump holds it nowhere in the clear, even before.
    assert CUSTOMER not in _pg_dump() and CUSTOMER in _api_text(asha, runs[0].pk)
    assert len(_searched(asha, CUSTOMER)) == 28  # the runs whose input carries it
    admin_page = admin_client.get(f"/admin/runs/run/{runs[0].pk}/change/")
    assert admin_page.status_code == 200 and CUSTOMER in admin_page.content.decode()

    response = _erase(compliance)

    assert response.status_code == 201, response.content
    certificate = response.json()
    assert sorted(certificate["runs"]) == sorted(str(r.pk) for r in runs)
    assert certificate["counts"]["approvals"] == 1 and certificate["counts"]["artifacts"] == 2
    assert certificate["erased_by"] == "clara" and CUSTOMER not in response.content.decode()
    for run in runs:
        assert CUSTOMER not in _api_text(asha, run.pk)
        page = admin_client.get(f"/admin/runs/run/{run.pk}/change/")
        assert page.status_code == 200 and CUSTOMER not in page.content.decode()
        # The skeleton stays: every step, its status, tool and cost; the erasure is in the chain.
        assert (
            list(
                Step.objects.filter(run=run)
                .order_by("seq")
                .values_list("seq", "kind", "status", "tool_name", "cost_micros")
            )
            == before[run.pk]
        )
        erased = RunEvent.objects.get(run=run, kind="content_removed")
        assert erased.skeleton["certificate"] == certificate["id"] and erased.actor_id == compliance.pk
    assert Artifact.objects.filter(run__in=runs, content=b"").count() == 2
    assert CUSTOMER not in _pg_dump()
    assert OTHER in _api_text(asha, kept.pk)  # what was not asked for stays
    # Out of the run search too: its keyed words of the input went with it.
    assert _searched(asha, CUSTOMER) == set() and _searched(asha, OTHER) == {str(kept.pk)}
    assert not Run.objects.filter(pk__in=[r.pk for r in runs], search_words__isnull=False).exists()
    report = verify()
    assert report.ok, [str(f) for f in report.findings]
    take_checkpoint()
    assert verify().ok


def test_a_held_run_refuses_with_409_naming_the_hold_and_keeps_its_data(tenant, asha, compliance, echo_agent):
    held, free = finished_run(asha, word=CUSTOMER), finished_run(asha, word=CUSTOMER)
    response = _client(compliance).post(
        "/v1/history/holds", {"scope": "run", "run": str(held.pk), "reason": "matter 2026-117"}, format="json"
    )
    assert response.status_code == 201, response.content
    hold = response.json()

    refused = _erase(compliance)

    assert refused.status_code == 409
    error = refused.json()["error"]
    assert (
        error["code"] == "legal_hold"
        and hold["id"] in error["message"]
        and "matter 2026-117" in error["message"]
    )
    assert Run.objects.get(pk=held.pk).input == {"word": CUSTOMER}
    assert Run.objects.get(pk=free.pk).input == {"word": CUSTOMER}  # the whole request is refused
    assert not ErasureCertificate.objects.exists()

    lift = _client(compliance).post(
        f"/v1/history/holds/{hold['id']}/lift", {"reason": "matter closed"}, format="json"
    )
    assert lift.status_code == 200 and lift.json()["lifted_by"] == "clara"
    again = _client(compliance).post(
        f"/v1/history/holds/{hold['id']}/lift", {"reason": "twice"}, format="json"
    )
    assert again.status_code == 409 and again.json()["error"]["code"] == "already_lifted"
    assert [
        e.kind for e in RunEvent.objects.filter(run=held, kind__startswith="legal_hold").order_by("seq")
    ] == [
        "legal_hold_placed",
        "legal_hold_lifted",
    ]

    assert _erase(compliance).status_code == 201
    assert Run.objects.get(pk=held.pk).input == {}
    assert verify().ok


@pytest.mark.parametrize("scope", ["tenant", "subject"])
def test_a_tenant_or_subject_hold_refuses_erasure(tenant, asha, compliance, echo_agent, scope):
    run = finished_run(asha, word=CUSTOMER)
    body = {"scope": scope, "reason": "regulator's inquiry"} | (
        {"subject": CUSTOMER} if scope == "subject" else {}
    )
    assert _client(compliance).post("/v1/history/holds", body, format="json").status_code == 201

    refused = _erase(compliance)

    assert refused.status_code == 409 and "regulator's inquiry" in refused.json()["error"]["message"]
    assert Run.objects.get(pk=run.pk).input == {"word": CUSTOMER}


def test_a_subject_hold_on_another_subject_does_not_refuse(tenant, asha, compliance, echo_agent):
    finished_run(asha, word=CUSTOMER)
    finished_run(asha, word=OTHER)
    LegalHold.objects.create(
        tenant=tenant, scope="subject", subject=OTHER, reason="other matter", placed_by=compliance
    )

    assert _erase(compliance).status_code == 201


def test_a_retried_request_gets_the_same_certificate_and_a_reused_reference_is_refused(
    tenant, asha, compliance, echo_agent
):
    finished_run(asha, word=CUSTOMER)
    first = _erase(compliance)
    second = _erase(compliance)
    assert first.status_code == second.status_code == 201 and first.json()["id"] == second.json()["id"]
    reused = _erase(compliance, identifier=OTHER)
    assert reused.status_code == 409 and reused.json()["error"]["code"] == "request_ref_reused"


def test_a_live_run_is_refused(tenant, asha, ravi, compliance, echo_agent):
    type(echo_agent).objects.filter(pk=echo_agent.pk).update(approval_policy="always")
    run, _ = start_run(user=asha, agent="agent", input={"word": CUSTOMER})
    assert drive(run.pk).status == RunStatus.WAITING_APPROVAL

    refused = _erase(compliance)

    assert refused.status_code == 409 and refused.json()["error"]["code"] == "runs_live"
    assert Run.objects.get(pk=run.pk).input == {"word": CUSTOMER}


def test_only_whole_tokens_match_and_people_without_the_permission_are_refused(
    tenant, asha, compliance, echo_agent
):
    longer = finished_run(asha, word=CUSTOMER + "9")
    assert _erase(asha).status_code == 403
    response = _erase(compliance)
    assert response.status_code == 201 and response.json()["runs"] == []
    assert Run.objects.get(pk=longer.pk).input == {"word": CUSTOMER + "9"}


def test_the_admin_form_erases_and_shows_a_holds_refusal(tenant, asha, echo_agent, admin_client, admin_user):
    run = finished_run(asha, word=CUSTOMER)
    hold = LegalHold.objects.create(
        tenant=tenant, scope="run", run=run, reason="matter 88", placed_by=admin_user
    )
    form = {"tenant": tenant.pk, "identifier": CUSTOMER, "request_ref": "DSR-admin", "reason": ""}

    refused = admin_client.post("/admin/history/erasurecertificate/request/", form)

    assert refused.status_code == 200 and "matter 88" in refused.content.decode()
    assert Run.objects.get(pk=run.pk).input == {"word": CUSTOMER}

    lifted = admin_client.post(
        f"/admin/history/legalhold/{hold.pk}/change/", {"lift_reason": "closed", "_save": "Save"}
    )
    assert lifted.status_code == 302, lifted.content.decode()[:2000]
    assert LegalHold.objects.get(pk=hold.pk).lifted_by == admin_user

    done = admin_client.post("/admin/history/erasurecertificate/request/", form)

    certificate = ErasureCertificate.objects.get(request_ref="DSR-admin")
    assert done.status_code == 302 and done["Location"].endswith(f"/{certificate.pk}/change/")
    assert Run.objects.get(pk=run.pk).input == {}
    page = admin_client.get(done["Location"])
    assert page.status_code == 200 and "DSR-admin" in page.content.decode()


def test_the_admin_places_a_hold_through_the_service(tenant, asha, echo_agent, admin_client, admin_user):
    run = finished_run(asha)
    response = admin_client.post(
        "/admin/history/legalhold/add/",
        {
            "tenant": tenant.pk,
            "scope": "run",
            "run": str(run.pk),
            "subject": "",
            "reason": "matter 9",
            "_save": "Save",
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    hold = LegalHold.objects.get()
    assert hold.placed_by == admin_user and hold.run_id == run.pk
    assert RunEvent.objects.filter(run=run, kind="legal_hold_placed", skeleton__hold=str(hold.pk)).exists()
