"""The OpenAPI document says what the API does, and /v1/docs shows it without the internet."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import httpx
import pytest
from django.core.management import call_command
from drf_spectacular.generators import SchemaGenerator

ERROR = {"$ref": "#/components/schemas/Error"}


@pytest.fixture(scope="module")
def schema():
    return SchemaGenerator().get_schema(request=None, public=True)


def operations(schema):
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            yield f"{method.upper()} {path}", operation


def json_schema(content_holder) -> dict:
    return content_holder["content"]["application/json"]["schema"]


def test_the_schema_validates_without_a_single_generator_warning(tmp_path):
    # drf-spectacular raises on any warning or error with fail_on_warn (as `manage.py spectacular
    # --validate --fail-on-warn` exits non-zero), and validates against the OpenAPI 3 meta-schema.
    call_command("spectacular", validate=True, fail_on_warn=True, file=str(tmp_path / "schema.yaml"))
    assert "StartRunRequest" in (tmp_path / "schema.yaml").read_text()


def test_every_operation_has_its_own_id_a_summary_and_a_description(schema):
    ids = [op["operationId"] for _, op in operations(schema)]
    assert len(ids) == len(set(ids)) >= 23
    missing = [name for name, op in operations(schema) if not op.get("summary") or not op.get("description")]
    assert missing == []


def test_every_request_body_is_a_component_of_its_own_operation(schema):
    bodies = {
        name: json_schema(op["requestBody"])["$ref"] for name, op in operations(schema) if "requestBody" in op
    }
    assert len(bodies) == 27
    assert len(set(bodies.values())) == len(bodies), bodies
    assert bodies["POST /v1/runs"] == "#/components/schemas/StartRunRequest"
    assert bodies["POST /v1/approvals/{approval_id}/approve"] == "#/components/schemas/ApproveRequest"
    start = schema["components"]["schemas"]["StartRunRequest"]
    assert start["required"] == ["agent", "input"]
    assert set(start["properties"]) == {"agent", "alias", "version", "input", "metadata", "wait", "files"}


def test_json_documents_are_typed_as_objects_in_requests_and_answers(schema):
    components = schema["components"]["schemas"]
    for name in ("input", "metadata", "limits"):
        assert components["Run"]["properties"][name]["type"] == "object", name
    for name in ("input", "metadata"):
        assert components["StartRunRequest"]["properties"][name]["type"] == "object", name
    assert components["Approval"]["properties"]["arguments"]["type"] == "object"
    assert components["CreateVersionRequest"]["properties"]["spec"]["type"] == "object"


def test_paginated_lists_are_documented_as_they_answer(schema):
    for path, item in (
        ("/v1/runs", "Run"),
        ("/v1/approvals", "Approval"),
        ("/v1/reservations", "Reservation"),
    ):
        ref = json_schema(schema["paths"][path]["get"]["responses"]["200"])["$ref"]
        page = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
        bounded = {"count_exact"} if path == "/v1/runs" else set()  # past 1,000 runs, an estimate
        assert set(page["required"]) == {"count", "next", "previous", "results"} | bounded
        assert page["properties"]["results"]["items"] == {"$ref": f"#/components/schemas/{item}"}
        assert page["properties"]["next"]["nullable"] is True


def test_error_answers_carry_the_error_body_where_each_operation_can_answer_them(schema):
    for name, operation in operations(schema):
        responses = operation["responses"]
        errors = {code for code in responses if code[0] in "45"}
        assert {"400", "401", "500"} <= errors, name
        for code in errors:
            assert json_schema(responses[code]) == ERROR, (name, code)
            assert responses[code]["description"], (name, code)
        # A run or agent named in the body or query that is not there: 404 too.
        assert ("404" in errors) == ("{" in name or name in ("POST /v1/runs", "GET /v1/history/export")), name
        assert ("413" in errors) == ("requestBody" in operation), name
        assert ("429" in errors) == (name in ("POST /v1/runs", "POST /v1/auth/token")), name
        if "429" in errors:
            assert "Retry-After" in responses["429"]["headers"]
    conflicts = {name for name, operation in operations(schema) if "409" in operation["responses"]}
    assert conflicts == {
        "POST /v1/runs",
        "POST /v1/runs/{run_id}/cancel",
        "POST /v1/runs/{run_id}/pause",
        "POST /v1/runs/{run_id}/resume",
        "POST /v1/runs/{run_id}/steps/{seq}/resolve",
        "POST /v1/approvals/{approval_id}/approve",
        "POST /v1/approvals/{approval_id}/deny",
        "POST /v1/approvals/{approval_id}/correct",
        "POST /v1/reservations/{reservation_id}/reconcile",
        "POST /v1/reservations/{reservation_id}/write-off",
        "POST /v1/history/erasures",
        "POST /v1/history/holds/{hold_id}/lift",
    }
    assert "403" not in schema["paths"]["/v1/auth/token"]["post"]["responses"]
    error = schema["components"]["schemas"]["Error"]["properties"]["error"]
    assert set(error["properties"]) == {"code", "message", "fields"}


@pytest.mark.django_db
def test_the_docs_page_loads_swagger_ui_from_this_server_only(live_server):
    page = httpx.get(f"{live_server.url}/v1/docs", timeout=10)
    assert page.status_code == 200
    html = page.text
    referenced = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
    scripts = [url for url in referenced if url.endswith(".js")]
    styles = [url for url in referenced if url.endswith(".css")]
    assert len(scripts) == 2 and len(styles) == 1, referenced
    # No absolute URL anywhere in the page.
    assert re.findall(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", html) == []
    for url in referenced:
        assert not urlsplit(url).netloc, url
        answer = httpx.get(f"{live_server.url}{url}", timeout=10)
        assert answer.status_code == 200, url
        assert answer.content, url
        if url.endswith((".js", ".css")):
            assert len(answer.content) > 10_000, url  # the real files, not an error page
    bundle = next(url for url in scripts if "swagger-ui-bundle" in url)
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/" in bundle
    # The init script is served by the same view (?script), not inline (the page's CSP refuses inline scripts).
    init = httpx.get(f"{live_server.url}/v1/docs?script=", timeout=10).text
    assert '"validatorUrl": null' in init
    assert re.findall(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", init) == []
