"""What the docs say about the code, checked against the code: the class of drift a newcomer finds in
the first hour (a server the Makefile names that serve.sh does not run, a queue name from an older
layout, a status code the API no longer answers, a stream example that misses event kinds)."""

from __future__ import annotations

import ast
import re

import pytest
from rest_framework.test import APIClient

from tests.admin.conftest import acme  # noqa: F401 (the fixture)
from tests.admin.helpers import park_on_approval
from tests.servers import ROOT

README = (ROOT / "README.md").read_text()
DOCS = README + "".join(path.read_text() for path in sorted((ROOT / "docs").glob("*.md")))
API_DOC = (ROOT / "docs" / "api.md").read_text()
SERVE = (ROOT / "scripts" / "serve.sh").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
SERVERS = ("gunicorn", "uvicorn", "daphne", "hypercorn")


def test_the_makefile_names_the_web_server_that_make_serve_runs():
    line = next(line for line in MAKEFILE.splitlines() if line.startswith("# make serve"))
    named = [server for server in SERVERS if server in line]
    runs = [server for server in SERVERS if re.search(rf"-m {server}\b", SERVE)]
    assert named == runs, (line, runs)


def test_the_docs_name_the_queues_workers_consume():
    queue = re.search(r"^QUEUE=\$\{CELERY_QUEUE:-(\S+?)\}", SERVE, re.M).group(1)
    sweep = re.search(r"^SWEEP_QUEUE=\$\{CELERY_SWEEP_QUEUE:-\$QUEUE(\S*?)\}", SERVE, re.M).group(1)
    expected = f"-Q {queue},{queue}{sweep}"
    found_any = re.findall(r"-Q [\w.,]+", DOCS)
    assert found_any
    for found in found_any:
        assert found == expected, (found, expected)


def recorded_event_kinds() -> set[str]:
    """Every kind the product records (runs.transitions.record_event's second argument), from source;
    an f-string kind (`approval_{verdict}`) stands for each value the code gives it."""
    kinds: set[str] = set()
    for path in ROOT.glob("*/**/*.py"):
        if {"tests", "migrations", ".venv", "bench"} & set(path.relative_to(ROOT).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node, "func", None)
            if (
                not isinstance(node, ast.Call)
                or getattr(name, "id", getattr(name, "attr", "")) != "record_event"
            ):
                continue
            if len(node.args) < 2:
                continue
            kind = node.args[1]
            if isinstance(kind, ast.Constant) and isinstance(kind.value, str):
                kinds.add(kind.value)
            elif isinstance(kind, ast.JoinedStr):
                prefix = "".join(v.value for v in kind.values if isinstance(v, ast.Constant))
                kinds |= {f"{prefix}{verdict}" for verdict in ("approved", "denied")}
    return kinds


def test_the_stream_example_listens_to_every_event_kind():
    example = re.search(r"const kinds = \[(.*?)\];", API_DOC, re.S).group(1)
    listed = set(re.findall(r'"([a-z_]+)"', example))
    recorded = recorded_event_kinds()
    assert {"created", "status", "approval_requested", "approval_approved"} <= recorded
    assert recorded <= listed, f"docs/api.md's stream example misses {sorted(recorded - listed)}"


@pytest.mark.django_db(transaction=True)
def test_a_repeated_approve_answers_as_the_api_doc_says(acme):  # noqa: F811
    assert "the same decision repeated by the same person answers 200" in " ".join(API_DOC.split())
    approval = park_on_approval(acme.asha, "refunder")
    client = APIClient()
    client.force_authenticate(acme.ravi)
    url = f"/v1/approvals/{approval.pk}"
    first = client.post(f"{url}/approve", {"reason": "ok"}, format="json")
    again = client.post(f"{url}/approve", {"reason": "ok"}, format="json")
    other = client.post(f"{url}/deny", {"reason": "no"}, format="json")
    assert (first.status_code, again.status_code, other.status_code) == (200, 200, 409)
