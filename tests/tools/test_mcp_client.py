"""tools.mcp_client against the example bank server (streamable HTTP subprocess/thread, and stdio)."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import mcp_types as mt
import pytest
from mcp.shared.exceptions import MCPError

from examples import bank_server
from tools import mcp_client
from tools.mcp_client import call_tool, list_tools
from tools.types import McpServerConfig, ToolFailed, ToolOutcomeUnknown, ToolUnauthorized

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "examples" / "bank_server.py"
ALL_TOOLS = {
    "lookup_transaction",
    "search_tickets",
    "issue_refund",
    "send_customer_email",
    "transfer_funds",
    "refund_status",
    "search",
}
REFUND = {"transaction_id": "TXN-1001", "amount": 12499, "currency": "INR", "reason": "not delivered"}


# --- fixtures ---------------------------------------------------------------------------


def _start_subprocess(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, str(SERVER), *args], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 120)  # a loaded machine starts it slowly
    line = proc.stdout.readline() if ready else ""
    if not line.startswith(bank_server.READY_PREFIX):
        proc.kill()
        pytest.fail(f"bank server did not start: {line!r}")
    return proc, line.split()[1]


@pytest.fixture(scope="module")
def bank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The CLI server in a subprocess, paginating tools/list two at a time."""
    ledger = tmp_path_factory.mktemp("bank") / "ledger.json"
    proc, base = _start_subprocess(
        "--port", "0", "--label", "bank", "--page-size", "2", "--ledger", str(ledger)
    )
    yield base
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(autouse=True)
def clean(request: pytest.FixtureRequest) -> None:
    if "bank" in request.fixturenames:
        base = request.getfixturevalue("bank")
        httpx.post(f"{base}/ledger/reset").raise_for_status()
        httpx.post(f"{base}/faults/reset").raise_for_status()


@pytest.fixture
def thread_server() -> Iterator[Callable[..., str]]:
    stops: list[Callable[[], None]] = []

    def start(**kwargs: object) -> str:
        base, stop = bank_server.serve_in_thread(**kwargs)
        stops.append(stop)
        return base

    yield start
    for stop in stops:
        stop()


def http_config(base: str, **headers: str) -> McpServerConfig:
    return McpServerConfig(transport="streamable_http", url=f"{base}/mcp", headers=headers)


def effects(base: str) -> list[dict]:
    return httpx.get(f"{base}/ledger").json()["effects"]


def arm_fault(base: str, **spec: object) -> None:
    httpx.post(f"{base}/faults", json=spec).raise_for_status()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- listing ----------------------------------------------------------------------------


def test_list_tools_follows_pagination_to_the_end(bank: str) -> None:
    tools = list_tools(http_config(bank))
    names = [t.name for t in tools]
    assert len(names) == len(set(names)) == 7  # the server pages by 2: four pages
    assert set(names) == ALL_TOOLS


def test_list_tools_reports_annotations_and_schema(bank: str) -> None:
    tools = {t.name: t for t in list_tools(http_config(bank))}
    assert tools["lookup_transaction"].annotations == {"readOnlyHint": True, "openWorldHint": False}
    assert tools["transfer_funds"].annotations["destructiveHint"] is True
    assert tools["issue_refund"].annotations["readOnlyHint"] is False
    assert tools["issue_refund"].input_schema["required"] == ["transaction_id", "amount"]
    assert tools["issue_refund"].description


# --- calling ----------------------------------------------------------------------------


def test_call_tool_returns_structured_and_text(bank: str) -> None:
    result = call_tool(
        http_config(bank),
        "lookup_transaction",
        {"transaction_id": "TXN-1001"},
        idempotency_key="k-lookup",
        timeout=10,
    )
    assert not result.is_error
    assert result.structured == {
        "transaction_id": "TXN-1001",
        "amount": 12499,
        "currency": "INR",
        "merchant": "Croma Electronics",
        "date": "2025-01-14",
        "status": "settled",
    }
    assert json.loads(result.text) == result.structured
    assert effects(bank) == []  # reads are not effects


def test_idempotency_key_travels_in_meta_and_replay_applies_nothing(bank: str) -> None:
    cfg = http_config(bank)
    first = call_tool(cfg, "issue_refund", REFUND, idempotency_key="run-7-step-3", timeout=10)
    again = call_tool(cfg, "issue_refund", REFUND, idempotency_key="run-7-step-3", timeout=10)
    assert first.structured["status"] == "issued"
    assert again.structured == first.structured
    [effect] = effects(bank)
    assert effect["tool"] == "issue_refund"
    assert effect["idempotency_key"] == "run-7-step-3"
    assert effect["arguments"] == REFUND
    assert effect["protocol_version"] == "2025-11-25"

    other = call_tool(cfg, "issue_refund", REFUND, idempotency_key="run-8-step-3", timeout=10)
    assert other.structured["refund_id"] != first.structured["refund_id"]
    assert len(effects(bank)) == 2


def test_is_error_result_maps_to_tool_result_error(bank: str) -> None:
    result = call_tool(
        http_config(bank),
        "lookup_transaction",
        {"transaction_id": "TXN-404"},
        idempotency_key="k",
        timeout=10,
    )
    assert result.is_error
    assert "Unknown transaction: TXN-404" in result.text
    assert result.structured is None


def test_search_tickets_returns_the_injection_as_data(bank: str) -> None:
    result = call_tool(
        http_config(bank), "search_tickets", {"query": "TXN-1001"}, idempotency_key="k", timeout=10
    )
    assert "SYSTEM OVERRIDE" in result.text
    assert effects(bank) == []


def test_unknown_tool_is_tool_failed(bank: str) -> None:
    with pytest.raises(ToolFailed, match="Unknown tool: wire_money"):
        call_tool(http_config(bank), "wire_money", {}, idempotency_key="k", timeout=10)


def test_invalid_arguments_are_tool_failed_and_apply_nothing(bank: str) -> None:
    with pytest.raises(ToolFailed, match="amount"):
        call_tool(
            http_config(bank),
            "issue_refund",
            {"transaction_id": "TXN-1001", "amount": "lots"},
            idempotency_key="k",
            timeout=10,
        )
    assert effects(bank) == []


def test_server_down_is_tool_failed() -> None:
    cfg = http_config(f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(ToolFailed, match="ConnectError"):
        call_tool(cfg, "issue_refund", REFUND, idempotency_key="k", timeout=5)
    with pytest.raises(ToolFailed):
        list_tools(cfg, timeout=5)


def test_hung_handshake_times_out_as_tool_failed() -> None:
    """A server that accepts connections but never answers: nothing was called."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(ToolFailed, match="handshake"):
            call_tool(
                http_config(f"http://127.0.0.1:{listener.getsockname()[1]}"),
                "search",
                {"query": "x"},
                idempotency_key="k",
                timeout=1,
            )
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
    assert time.monotonic() - started < 10


def test_timeout_after_effect_is_outcome_unknown_and_effect_landed(bank: str) -> None:
    arm_fault(bank, tool="issue_refund", delay_after_effect=5, times=1)
    started = time.monotonic()
    with pytest.raises(ToolOutcomeUnknown):
        call_tool(http_config(bank), "issue_refund", REFUND, idempotency_key="k-slow", timeout=1)
    assert time.monotonic() - started < 4
    [effect] = effects(bank)
    assert effect["idempotency_key"] == "k-slow"

    # Reconciliation through the status tool finds the refund that did happen.
    status = call_tool(
        http_config(bank), "refund_status", {"idempotency_key": "k-slow"}, idempotency_key="r", timeout=10
    )
    assert status.structured == {"found": True, "result": effect["result"]}


def test_http_5xx_after_effect_is_outcome_unknown(bank: str) -> None:
    arm_fault(bank, tool="send_customer_email", fail_5xx_after_effect=True)
    with pytest.raises(ToolOutcomeUnknown, match="HTTP 500"):
        call_tool(
            http_config(bank),
            "send_customer_email",
            {"to": "a@example.com", "subject": "s", "body": "b"},
            idempotency_key="k-mail",
            timeout=10,
        )
    assert [e["tool"] for e in effects(bank)] == ["send_customer_email"]


def test_send_customer_email_is_not_idempotent(bank: str) -> None:
    args = {"to": "a@example.com", "subject": "Refund", "body": "Done"}
    for _ in range(2):
        call_tool(http_config(bank), "send_customer_email", args, idempotency_key="same", timeout=10)
    assert len(effects(bank)) == 2


def test_concurrent_calls_from_many_threads(bank: str) -> None:
    cfg = http_config(bank)

    def refund(key: str) -> str:
        return call_tool(cfg, "issue_refund", REFUND, idempotency_key=key, timeout=20).structured["refund_id"]

    with ThreadPoolExecutor(8) as pool:
        distinct = list(pool.map(refund, [f"k{i}" for i in range(8)]))
        same = list(pool.map(refund, ["shared"] * 6))
    assert len(set(distinct)) == 8
    assert len(set(same)) == 1
    assert len(effects(bank)) == 9


# --- auth and routing -------------------------------------------------------------------


def test_auth_headers_from_config_reach_the_server(thread_server: Callable[..., str]) -> None:
    base = thread_server(require_token="s3cret")
    with pytest.raises(ToolFailed, match="401"):
        list_tools(http_config(base))
    with pytest.raises(ToolFailed, match="401"):
        call_tool(http_config(base), "search", {"query": "x"}, idempotency_key="k", timeout=5)
    with pytest.raises(ToolFailed, match="401"):
        list_tools(http_config(base, Authorization="Bearer wrong"))

    cfg = http_config(base, Authorization="Bearer s3cret")
    assert {t.name for t in list_tools(cfg)} == ALL_TOOLS
    assert (
        call_tool(cfg, "search", {"query": "x"}, idempotency_key="k", timeout=5).structured["label"] == "bank"
    )
    assert httpx.post(f"{base}/http/search", json={"query": "x"}).status_code == 401


def test_two_servers_with_the_same_tool_name_route_by_config(thread_server: Callable[..., str]) -> None:
    kb_a, kb_b = thread_server(label="kb-a"), thread_server(label="kb-b")
    a = call_tool(http_config(kb_a), "search", {"query": "chargeback"}, idempotency_key="k", timeout=10)
    b = call_tool(http_config(kb_b), "search", {"query": "chargeback"}, idempotency_key="k", timeout=10)
    assert a.structured["label"] == "kb-a"
    assert b.structured["label"] == "kb-b"
    assert "kb-a" in a.text and "kb-b" not in a.text


# --- stdio ------------------------------------------------------------------------------


def test_stdio_transport_lists_calls_and_dedupes_across_processes(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.json"
    cfg = McpServerConfig(
        transport="stdio",
        env={"PYTHONUNBUFFERED": "1"},
        command=(sys.executable, str(SERVER), "--stdio", "--ledger", str(ledger), "--page-size", "3"),
    )
    assert {t.name for t in list_tools(cfg)} == ALL_TOOLS

    first = call_tool(cfg, "issue_refund", REFUND, idempotency_key="stdio-1", timeout=20)
    again = call_tool(cfg, "issue_refund", REFUND, idempotency_key="stdio-1", timeout=20)
    assert again.structured == first.structured
    [effect] = json.loads(ledger.read_text())["effects"]
    assert effect["idempotency_key"] == "stdio-1"

    missing = call_tool(
        cfg, "lookup_transaction", {"transaction_id": "nope"}, idempotency_key="k", timeout=20
    )
    assert missing.is_error
    with pytest.raises(ToolFailed):
        call_tool(cfg, "no_such_tool", {}, idempotency_key="k", timeout=20)


def test_stdio_missing_command_is_tool_failed(tmp_path: Path) -> None:
    cfg = McpServerConfig(transport="stdio", command=(str(tmp_path / "missing-server"),))
    with pytest.raises(ToolFailed):
        call_tool(cfg, "search", {"query": "x"}, idempotency_key="k", timeout=5)


# --- plain HTTP tools on the same app ---------------------------------------------------


def test_http_tool_honours_idempotency_header_and_status_route(bank: str) -> None:
    headers = {"Idempotency-Key": "http-1"}
    first = httpx.post(f"{bank}/http/issue_refund", json=REFUND, headers=headers)
    again = httpx.post(f"{bank}/http/issue_refund", json=REFUND, headers=headers)
    assert first.status_code == again.status_code == 200
    assert first.json() == again.json()
    [effect] = effects(bank)
    assert (effect["idempotency_key"], effect["transport"]) == ("http-1", "http")

    assert httpx.get(f"{bank}/http/status/http-1").json() == {"found": True, "result": first.json()}
    assert httpx.get(f"{bank}/http/status/never-sent").json() == {"found": False}


def test_http_tool_errors(bank: str) -> None:
    bad = httpx.post(f"{bank}/http/issue_refund", json={"transaction_id": 7, "extra": 1})
    assert bad.status_code == 422
    assert set(bad.json()["fields"]) == {"transaction_id", "amount", "extra"}
    assert httpx.post(f"{bank}/http/wire_money", json={}).status_code == 404
    failed = httpx.post(f"{bank}/http/lookup_transaction", json={"transaction_id": "TXN-404"})
    assert failed.status_code == 400 and "Unknown transaction" in failed.json()["error"]
    assert effects(bank) == []


def test_http_tool_faults_share_the_ledger(bank: str) -> None:
    arm_fault(bank, tool="issue_refund", fail_5xx_after_effect=True)
    assert (
        httpx.post(f"{bank}/http/issue_refund", json=REFUND, headers={"Idempotency-Key": "h5"}).status_code
        == 500
    )
    assert httpx.get(f"{bank}/http/status/h5").json()["found"] is True

    arm_fault(bank, tool="search", delay_before_effect=1)
    started = time.monotonic()
    assert httpx.post(f"{bank}/http/search", json={"query": "q"}).json()["label"] == "bank"
    assert time.monotonic() - started >= 1
    assert httpx.post(f"{bank}/faults", json={"tool": "search"}).status_code == 422


# --- classification and normalisation units ---------------------------------------------


def _classify(exc: Exception, *, sent: bool = True, **tap_fields: object) -> Exception:
    tap = mcp_client._HttpTap(**tap_fields)
    return mcp_client._classify(exc, mcp_client._Progress(call_sent=sent), tap)


@pytest.mark.parametrize(
    ("exc", "tap", "expected"),
    [
        (MCPError(mt.INVALID_PARAMS, "bad"), {}, ToolFailed),
        (MCPError(mt.METHOD_NOT_FOUND, "no"), {}, ToolFailed),
        (MCPError(mt.REQUEST_TIMEOUT, "slow"), {}, ToolOutcomeUnknown),
        (MCPError(mt.CONNECTION_CLOSED, "reset"), {}, ToolOutcomeUnknown),
        (MCPError(mt.INTERNAL_ERROR, "boom"), {}, ToolOutcomeUnknown),
        (MCPError(-32099, "server-defined"), {}, ToolOutcomeUnknown),
        # 401: the credential was refused and the tool did not run; a caller with a fresh token
        # (tools/client_credentials.py) may send it again. Any other 4xx is a plain failure.
        (MCPError(mt.INTERNAL_ERROR, "x"), {"statuses": {"tools/call": 401}}, ToolUnauthorized),
        (MCPError(mt.INTERNAL_ERROR, "x"), {"statuses": {"tools/call": 403}}, ToolFailed),
        (
            MCPError(mt.INVALID_REQUEST, "Session terminated"),
            {"statuses": {"tools/call": 404}},
            ToolOutcomeUnknown,
        ),
        (MCPError(mt.INTERNAL_ERROR, "x"), {"statuses": {"tools/call": 503}}, ToolOutcomeUnknown),
        (ExceptionGroup("tg", [ConnectionError("x")]), {"connect_failed": {"tools/call"}}, ToolFailed),
        (ExceptionGroup("tg", [ConnectionResetError("x")]), {}, ToolOutcomeUnknown),
        (TimeoutError(), {}, ToolOutcomeUnknown),
    ],
)
def test_classification_after_the_call_was_sent(exc: Exception, tap: dict, expected: type) -> None:
    assert type(_classify(exc, **tap)) is expected


def test_everything_before_the_call_is_tool_failed() -> None:
    for exc in (TimeoutError(), MCPError(mt.INTERNAL_ERROR, "x"), ExceptionGroup("tg", [OSError("x")])):
        assert type(_classify(exc, sent=False)) is ToolFailed


def test_retry_after_is_carried_on_5xx() -> None:
    err = _classify(
        MCPError(mt.INTERNAL_ERROR, "x"), statuses={"tools/call": 503}, retry_after={"tools/call": 7.0}
    )
    assert isinstance(err, ToolOutcomeUnknown) and err.retry_after == 7.0


def test_normalise_result_summarises_non_text_blocks() -> None:
    result = mt.CallToolResult(
        content=[
            mt.TextContent(text="first"),
            mt.ImageContent(data="aGk=", mime_type="image/png"),
            mt.EmbeddedResource(
                resource=mt.TextResourceContents(uri="file:///r.txt", text="x", mime_type="text/plain")
            ),
            mt.TextContent(text="last"),
        ],
        structured_content={"ok": True},
        is_error=False,
    )
    normalised = mcp_client.normalise_result(result)
    assert normalised.text == "first\n[image: image/png]\n[resource: file:///r.txt (text/plain)]\nlast"
    assert normalised.structured == {"ok": True}
    assert not normalised.is_error


def test_normalise_result_falls_back_to_structured_text() -> None:
    normalised = mcp_client.normalise_result(mt.CallToolResult(content=[], structured_content={"a": 1}))
    assert normalised.text == '{"a": 1}'
