"""A run started with files in the same request (JSON with base64, multipart, or copies of
artifacts the caller may read): stored with the run or not at all, with field-level errors; the
model is shown each file's description and id, and pages through its text with read_result."""

from __future__ import annotations

import base64

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import override_settings
from rest_framework.test import APIClient

from artifacts.models import Artifact, ArtifactLimits
from artifacts.services import content_of
from llm.gateway import first_message
from runs.models import Run, RunEvent, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)

CSV = b"txn_id,amount\n" + b"".join(b"T%04d,%d\n" % (i, i * 10) for i in range(400))  # ~5,000 bytes


def client_for(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def b64(content: bytes) -> str:
    return base64.b64encode(content).decode()


@pytest.fixture
def agent(tenant, builtins):
    return factories.make_agent(
        tenant,
        tools=[builtins["echo"]],
        turns=[
            {"tool_calls": [{"name": "read_result", "arguments": {"artifact": "$artifact.0"}}]},
            {
                "tool_calls": [
                    {"name": "read_result", "arguments": {"artifact": "$artifact.0", "offset": 1000}}
                ]
            },
            {"text": "done"},
        ],
        context={"result_limit_chars": 1_000},
    )


def start(user, body, **kwargs):
    return client_for(user).post("/v1/runs", body, format="json", **kwargs)


def test_it_starts_a_run_with_files_and_the_model_pages_through_one(asha, agent):
    body = {
        "agent": "agent",
        "input": {"task": "compare"},
        "files": [
            {"name": "card.csv", "media_type": "text/csv", "content_b64": b64(CSV)},
            {"name": "notes.txt", "media_type": "text/plain", "content_b64": b64(b"ledger of March\n")},
        ],
    }
    response = start(asha, body)
    assert response.status_code == 201, response.content
    run = Run.objects.get(pk=response.json()["id"])
    stored = {a.name: a for a in Artifact.objects.filter(run=run)}
    assert set(stored) == {"card.csv", "notes.txt"}
    assert content_of(stored["card.csv"]) == CSV and stored["card.csv"].given_at_start
    created = RunEvent.objects.get(run=run, kind="created")
    assert [f["name"] for f in created.data["files"]] == ["card.csv", "notes.txt"]

    run = drive(run.pk)
    assert run.status == "succeeded"
    first = Step.objects.get(run=run, seq=1).request
    shown = first_message(run).content
    # A description and the id, never the rows: the 400th line is not in the prompt.
    assert f"artifact {stored['card.csv'].pk}: card.csv (text/csv" in shown
    assert "columns: txn_id, amount" in shown and "T0399" not in shown
    assert "read_result" in first["tools"]
    pages = list(Step.objects.filter(run=run, tool_name="read_result").order_by("seq"))
    assert [p.status for p in pages] == ["succeeded", "succeeded"]
    text = CSV.decode()
    assert pages[0].observation.startswith(text[:1000])
    assert "offset=1000 to read on" in pages[0].observation
    assert pages[1].observation.startswith(text[1000:2000])


def test_it_starts_a_run_with_multipart_files_and_copies_of_readable_artifacts(asha, agent):
    earlier, _ = start_run(user=asha, agent="agent", input={})
    report = Artifact.objects.create(
        tenant_id=earlier.tenant_id,
        run=earlier,
        source="sandbox",
        name="report.md",
        media_type="text/markdown",
        size=6,
        sha256="0" * 64,
        content=b"# done",
    )
    response = client_for(asha).post(
        "/v1/runs",
        {
            "agent": "agent",
            "input": '{"task": "compare"}',
            "files": [SimpleUploadedFile("card.csv", CSV, content_type="text/csv")],
            "artifact_ids": [str(report.pk)],
        },
        format="multipart",
    )
    assert response.status_code == 201, response.content
    run = Run.objects.get(pk=response.json()["id"])
    assert run.input == {"task": "compare"}
    rows = {a.name: a for a in Artifact.objects.filter(run=run)}
    assert content_of(rows["card.csv"]) == CSV and rows["card.csv"].media_type == "text/csv"
    assert content_of(rows["report.md"]) == b"# done" and rows["report.md"].media_type == "text/markdown"
    files = RunEvent.objects.get(run=run, kind="created").data["files"]
    assert files[1]["copied_from"] == str(report.pk)


@pytest.mark.parametrize(
    "bad,field,status",
    [
        ({"name": "b.csv", "media_type": "text/csv", "content_b64": "%%%"}, "files[1].content_b64", 400),
        ({"name": "../b.csv", "media_type": "text/csv", "content_b64": b64(CSV)}, "files[1].name", 400),
        ({"name": "a.csv", "media_type": "text/csv", "content_b64": b64(CSV)}, "files[1].name", 400),
        ({"name": "b.bin", "media_type": "application/zip", "content_b64": b64(CSV)}, "files", 400),
        ({"name": "b.csv", "media_type": "text/csv", "content_b64": b64(CSV * 3)}, "files[1].content", 413),
        ({"artifact_id": "6f1c1d0e-0000-4000-8000-000000000000"}, "files[1].artifact_id", 400),
        ({"name": "b.csv", "content_b64": b64(CSV)}, "files", 400),
    ],
)
def test_a_bad_file_refuses_the_whole_start_with_its_field_and_stores_nothing(
    tenant, asha, agent, bad, field, status
):
    ArtifactLimits.objects.create(
        tenant=tenant, max_artifact_bytes=2 * len(CSV), max_run_bytes=10 * len(CSV), max_run_artifacts=5
    )
    good = {"name": "a.csv", "media_type": "text/csv", "content_b64": b64(CSV)}
    response = start(asha, {"agent": "agent", "input": {}, "files": [good, bad]})
    assert response.status_code == status, response.content
    fields = response.json()["error"]["fields"]
    assert field in fields or field in str(fields), fields
    assert not Run.objects.exists() and not Artifact.objects.exists()


def test_the_run_total_and_count_are_held_before_anything_is_stored(tenant, asha, agent):
    ArtifactLimits.objects.create(
        tenant=tenant, max_artifact_bytes=len(CSV), max_run_bytes=2 * len(CSV), max_run_artifacts=2
    )
    file = {"name": "a.csv", "media_type": "text/csv", "content_b64": b64(CSV)}
    three = [dict(file, name=f"{i}.csv") for i in range(3)]
    response = start(asha, {"agent": "agent", "input": {}, "files": three})
    assert response.status_code == 413 and "files" in response.json()["error"]["fields"]
    assert not Run.objects.exists() and not Artifact.objects.exists()


def test_another_tenants_artifact_cannot_be_copied(asha, agent):
    other_tenant_user = factories.make_user(factories.make_tenant("other"), "omar")
    theirs_run, _ = start_run(user=asha, agent="agent", input={})
    theirs = Artifact.objects.create(
        tenant_id=theirs_run.tenant_id,
        run=theirs_run,
        source="upload",
        name="secret.csv",
        media_type="text/csv",
        size=3,
        sha256="0" * 64,
        content=b"a,b",
    )
    factories.make_agent(other_tenant_user.tenant, turns=[{"text": "done"}])
    response = start(
        other_tenant_user, {"agent": "agent", "input": {}, "files": [{"artifact_id": str(theirs.pk)}]}
    )
    assert response.status_code == 400
    assert "files[0].artifact_id" in response.json()["error"]["fields"]
    assert Run.objects.filter(tenant=other_tenant_user.tenant).count() == 0


def test_a_replayed_start_with_files_is_the_same_run_and_other_files_are_refused(asha, agent):
    body = {
        "agent": "agent",
        "input": {},
        "files": [{"name": "a.csv", "media_type": "text/csv", "content_b64": b64(CSV)}],
    }
    first = start(asha, body, HTTP_IDEMPOTENCY_KEY="k1")
    again = start(asha, body, HTTP_IDEMPOTENCY_KEY="k1")
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    assert Artifact.objects.count() == 1
    other = dict(body, files=[dict(body["files"][0], content_b64=b64(CSV + b"T9,1\n"))])
    assert start(asha, other, HTTP_IDEMPOTENCY_KEY="k1").status_code == 422


@override_settings(API_MAX_UPLOAD_BYTES=2048)
def test_a_multipart_body_over_the_upload_bound_is_refused_before_it_is_read(asha, agent):
    response = client_for(asha).post(
        "/v1/runs",
        {
            "agent": "agent",
            "input": "{}",
            "files": [SimpleUploadedFile("a.csv", CSV, content_type="text/csv")],
        },
        format="multipart",
    )
    assert response.status_code == 413
    assert not Run.objects.exists()


def test_read_result_refuses_an_artifact_of_another_run_or_without_text(asha, tenant, builtins):
    factories.make_agent(tenant, name="other", turns=[{"text": "x"}])
    other, _ = start_run(user=asha, agent="other", input={})
    elsewhere = Artifact.objects.create(
        tenant_id=other.tenant_id,
        run=other,
        source="upload",
        name="x.csv",
        media_type="text/csv",
        size=3,
        sha256="0" * 64,
        content=b"a,b",
    )
    factories.make_agent(
        tenant,
        turns=[
            {"tool_calls": [{"name": "read_result", "arguments": {"artifact": str(elsewhere.pk)}}]},
            {"tool_calls": [{"name": "read_result", "arguments": {"artifact": "not-an-id"}}]},
            {"tool_calls": [{"name": "read_result", "arguments": {"artifact": "$artifact.0"}}]},
            {"tool_calls": [{"name": "read_result", "arguments": {"artifact": "$artifact.1", "offset": 99}}]},
            {"tool_calls": [{"name": "read_result", "arguments": {"artifact": "$artifact.1", "step": 1}}]},
            {"text": "done"},
        ],
    )
    response = start(
        asha,
        {
            "agent": "agent",
            "input": {},
            "files": [
                {
                    "name": "t.parquet",
                    "media_type": "application/vnd.apache.parquet",
                    "content_b64": b64(b"PAR1"),
                },
                {"name": "n.txt", "media_type": "text/plain", "content_b64": b64(b"short")},
            ],
        },
    )
    run = drive(response.json()["id"])
    assert run.status == "succeeded"
    calls = [s.observation for s in Step.objects.filter(run=run, tool_name="read_result").order_by("seq")]
    assert "no artifact" in calls[0] and "in this run" in calls[0]
    assert "not an artifact id" in calls[1]
    assert "not text: pass its artifact_id to run_python" in calls[2]
    assert "past the end of artifact" in calls[3]
    assert "not both" in calls[4]
    assert all(c.startswith("ERROR: read_result: ") for c in calls)
