"""A webhook receiver on 127.0.0.1 that counts requests and checks each signature with the snippet
published in docs/notifications.md; tenants whose runs park on approval or need attention."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.utils import timezone

from notifications.models import Webhook
from runs.engine import advance
from runs.models import Run, RunStatus, Step, StepStatus
from runs.services import start_run
from tests import factories
from tests.admin.helpers import echo_call_agent, park_on_approval
from tools.models import Tool

DOC = Path(__file__).resolve().parents[2] / "docs" / "notifications.md"
SECRET = "whsec-0123456789abcdef"


def documented_code() -> str:
    """The verification snippet's text in docs/notifications.md."""
    text = DOC.read_text()
    section = text[text.index("## Verifying the signature") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def documented_verify():
    """The `verify` function exactly as docs/notifications.md prints it."""
    namespace: dict = {}
    exec(compile(documented_code(), str(DOC), "exec"), namespace)
    return namespace["verify"]


@dataclass
class Received:
    headers: dict
    body: bytes
    verified: bool
    at: float  # time.monotonic()
    wall: float  # time.time()


class Receiver:
    """Answers each POST with the next status of `script` (then `then`), after `delay` seconds."""

    def __init__(self, secret: str = SECRET):
        self.secret = secret
        self.verify = documented_verify()
        self.requests: list[Received] = []
        self.script: list[int] = []
        self.then = 200
        self.delay = 0.0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                verified = receiver.verify(receiver.secret, self.headers, body)
                with receiver.lock:
                    receiver.requests.append(
                        Received(dict(self.headers), body, verified, time.monotonic(), time.time())
                    )
                    status = receiver.script.pop(0) if receiver.script else receiver.then
                time.sleep(receiver.delay)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/agentplatform"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> Receiver:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def delivery_ids(self) -> list[str]:
        return [r.headers["X-Delivery-Id"] for r in self.requests]


@pytest.fixture
def receiver():
    server = Receiver().start()
    yield server
    server.stop()


def make_webhook(tenant, url: str, events: list[str], *, name: str = "supervisors", secret: str = SECRET):
    hook = Webhook(tenant=tenant, name=name, url=url, events=events)
    hook.set_signing_secret(secret)
    hook.save()
    return hook


@pytest.fixture
def acme(transactional_db):
    """Tenant acme: asha runs `refunder`, whose one echo call always needs ravi's approval."""
    return approving_tenant("acme")


def approving_tenant(slug: str, requester: str = "asha", approver: str = "ravi") -> SimpleNamespace:
    """A tenant like acme: `asha` is the requester's user and `ravi` the approver's, whatever their names."""
    tenant = factories.make_tenant(slug)
    tools = factories.make_builtin_tools(tenant, approval_policy="always")
    asha = factories.make_user(tenant, requester)
    ravi = factories.make_user(tenant, approver, staff=True)
    factories.grant(tools["echo"], use=[asha], approve=[ravi])
    echo_call_agent(tenant, tools["echo"], name="refunder", arguments={"amount": 12499})
    return SimpleNamespace(tenant=tenant, tools=tools, asha=asha, ravi=ravi)


def parked_approval(acme):
    return park_on_approval(acme.asha, "refunder")


def run_needing_attention(acme) -> Run:
    """An unsafe echo call whose worker died after committing `dispatching`: outcome unknown."""
    Tool.objects.filter(pk=acme.tools["echo"].pk).update(approval_policy="never", effect_class="unsafe")
    run, _ = start_run(user=acme.asha, agent="refunder", input={"case": "lost"})
    advance(run.pk)  # the model step proposes the echo call
    step = Step.objects.get(run=run, seq=2)
    # What a worker leaves behind when it dies right after marking the step dispatching.
    Step.objects.filter(pk=step.pk).update(status=StepStatus.DISPATCHING, attempts=1)
    advance(run.pk)
    run = Run.objects.get(pk=run.pk)
    assert run.status == RunStatus.NEEDS_ATTENTION, run.error
    return run


def deliver_until_settled(send, delivery_id, *, timeout: float = 20.0):
    """Call `send` (one pass) whenever the delivery falls due, until it is delivered or failed."""
    from notifications.models import Delivery, DeliveryStatus

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        delivery = Delivery.objects.get(pk=delivery_id)
        if delivery.status != DeliveryStatus.PENDING:
            return delivery
        wait = (delivery.next_attempt_at - timezone.now()).total_seconds()
        if wait > 0:
            time.sleep(min(wait, 1.0) + 0.005)
            continue
        send()
    raise AssertionError(f"delivery {delivery_id} still pending after {timeout} s")
