"""Artifacts through the API: upload with a run, list, download; typed, bounded, readable only by
whoever may read the run; an oversized or untyped upload is refused and nothing is stored."""

from __future__ import annotations

import base64
import hashlib

import pytest
from rest_framework.test import APIClient

from artifacts import services
from artifacts.models import Artifact, ArtifactLimits
from runs.services import start_run
from tests import factories

pytestmark = pytest.mark.django_db

CSV = b"txn_id,amount\nT1,100\nT2,250\n"


def client_for(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def run(tenant, asha, builtins):
    factories.make_agent(tenant, tools=[builtins["echo"]], turns=[{"text": "done"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    return run


def upload(user, run, content=CSV, *, name="t.csv", media_type="text/csv"):
    body = {"name": name, "media_type": media_type, "content_b64": base64.b64encode(content).decode()}
    return client_for(user).post(f"/v1/runs/{run.pk}/artifacts", body, format="json")


def test_it_stores_an_upload_once_lists_and_downloads_it(asha, run):
    response = upload(asha, run)
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["name"], body["media_type"], body["size"]) == ("t.csv", "text/csv", len(CSV))
    assert body["sha256"] == hashlib.sha256(CSV).hexdigest()
    again = upload(asha, run)
    assert again.json()["id"] == body["id"]
    assert Artifact.objects.filter(run=run).count() == 1
    listed = client_for(asha).get(f"/v1/runs/{run.pk}/artifacts").json()
    assert [a["id"] for a in listed] == [body["id"]]
    download = client_for(asha).get(body["download"])
    assert download.status_code == 200
    assert download.content == CSV and download["Content-Type"] == "text/csv"


def test_it_refuses_an_oversized_upload_with_a_field_error_and_stores_nothing(tenant, asha, run):
    ArtifactLimits.objects.create(
        tenant=tenant, max_artifact_bytes=1024, max_run_bytes=4096, max_run_artifacts=3
    )
    response = upload(asha, run, b"x," * 1000)
    assert response.status_code == 413
    assert "file" in response.json()["error"]["fields"]
    not_base64 = client_for(asha).post(
        f"/v1/runs/{run.pk}/artifacts",
        {"name": "a.csv", "media_type": "text/csv", "content_b64": "%%%"},
        format="json",
    )
    assert not_base64.status_code == 400 and "content_b64" in not_base64.json()["error"]["fields"]
    assert not Artifact.objects.filter(run=run).exists()
    for i in range(4):
        upload(asha, run, CSV + str(i).encode() * 900, name=f"f{i}.csv")
    assert Artifact.objects.filter(run=run).count() == 3
    assert sum(Artifact.objects.filter(run=run).values_list("size", flat=True)) <= 4096


def test_it_refuses_untyped_uploads_and_bad_names(asha, run):
    response = upload(asha, run, b"\x7fELF", media_type="application/octet-stream")
    assert response.status_code == 400 and "media_type" in response.json()["error"]["fields"]
    response = upload(asha, run, name="../etc/passwd")
    assert response.status_code == 400 and "name" in response.json()["error"]["fields"]
    assert not Artifact.objects.filter(run=run).exists()


def test_only_who_may_read_the_run_reads_its_artifacts(tenant, asha, run):
    artifact_id = upload(asha, run).json()["id"]
    colleague = factories.make_user(tenant, "kiran")
    supervisor = factories.make_user(tenant, "meera", staff=True)
    outsider = factories.make_user(factories.make_tenant("other"), "eve", staff=True)
    for who in (colleague, outsider):
        assert client_for(who).get(f"/v1/artifacts/{artifact_id}/content").status_code == 404
        assert client_for(who).get(f"/v1/runs/{run.pk}/artifacts").status_code == 404
        assert upload(who, run).status_code == 404
    assert client_for(supervisor).get(f"/v1/artifacts/{artifact_id}/content").content == CSV


def test_the_model_sees_a_description_never_the_whole_file(asha, run):
    big = b"txn_id,amount\n" + b"".join(b"T%06d,%d\n" % (i, i) for i in range(30_000))
    artifact = services.store(run=run, name="card.csv", media_type="text/csv", content=big, source="upload")
    description = services.describe(artifact)
    text = services.describe_text(description)
    assert description["columns"] == ["txn_id", "amount"] and description["lines"] == 30_001
    assert str(artifact.pk) in text and len(text) < 1000
