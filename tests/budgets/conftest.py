"""Budget tests: real PostgreSQL, real threads, fake model servers and a counting search server.

Money is asserted on rows (accounts, reservations, ledger entries), never on calls made.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.db import connection

from budgets.models import BudgetAccount, Reservation
from budgets.selectors import ledger_mismatches
from tests import factories
from tests.fakes.model_servers import FakeAnthropic, FakeOpenAI
from tools.models import Tool, ToolServer

MODEL_KEY = "sk-ant-budget-tests-5b1d"


@pytest.fixture
def fake_openai():
    fake = FakeOpenAI(min_cacheable_tokens=0)  # tiny prompts: cache them anyway
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def fake_anthropic():
    fake = FakeAnthropic(api_key=MODEL_KEY, min_cacheable_tokens=0)
    fake.start()
    yield fake
    fake.stop()


def openai_endpoint(tenant, fake: FakeOpenAI, *, name: str = "gpt", **fields):
    return factories.make_endpoint(tenant, name=name, kind="openai", base_url=fake.base_url, **fields)


def anthropic_endpoint(tenant, fake: FakeAnthropic, *, name: str = "claude", **fields):
    from tenants.models import Secret

    secret = Secret(tenant=tenant, name=f"{name}-key")
    secret.set_value(MODEL_KEY)
    secret.save()
    return factories.make_endpoint(
        tenant, name=name, kind="anthropic", base_url=fake.base_url, secret=secret, **fields
    )


class SearchServer:
    """A search tool provider over plain HTTP that counts the calls it answers."""

    def __init__(self, answer=None):
        self.answer = answer if answer is not None else {"results": []}
        self.status = 200
        self.calls: Counter[str] = Counter()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                server.calls[str(body.get("query"))] += 1
                payload = json.dumps(server.answer).encode()
                self.send_response(server.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


@pytest.fixture
def search_server():
    server = SearchServer()
    server.thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def search_tool(tenant, user, server: SearchServer, *, price_micros: int = 0) -> Tool:
    tool_server = ToolServer.objects.create(
        tenant=tenant, name="kb", kind=ToolServer.Kind.HTTP, url=server.url
    )
    tool = Tool.objects.create(
        tenant=tenant,
        server=tool_server,
        name="kb__search",
        remote_name="search",
        description="Search the knowledge base.",
        enabled=True,
        effect_class="read_only",
        price_micros=price_micros,
        timeout_seconds=5,
        input_schema={"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    )
    factories.grant(tool, use=[user])
    return tool


def in_threads(count: int, target) -> list:
    """Run target(i) in `count` threads started together; each closes its own DB connection."""
    barrier = threading.Barrier(count)
    results: list = [None] * count
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            results[i] = target(i)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    return results


def assert_books_balance(tenant) -> None:
    """No negative balance, nothing left open, and every account agrees with its ledger."""
    assert not Reservation.objects.filter(tenant=tenant, status=Reservation.Status.OPEN).exists()
    for account in BudgetAccount.objects.filter(tenant=tenant):
        assert min(account.reserved_micros, account.spent_micros, account.held_micros) >= 0, account
        assert ledger_mismatches(account) == {}, account
