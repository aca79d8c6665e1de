"""The production path: Celery beat schedules the pass, a worker consuming the sweeper's queue runs
it, and a parked run's approval reaches the receiver within one scan interval."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from django.conf import settings

from notifications.models import Delivery, DeliveryStatus, Event, ScanCursor
from tests.notifications.conftest import make_webhook, parked_approval
from tests.servers import ROOT, Worker, process_env, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

INTERVAL = 1.0
PASS_ENDED = re.compile(r"notifications\.tasks\.notify\[[^\]]+\] succeeded in")  # Celery's log line


@pytest.fixture
def beat_and_worker(tmp_path):
    # LOG_QUIET_PERIODIC=0: the test counts the passes by the worker's log lines of each.
    env = {
        "NOTIFY_INTERVAL_SECONDS": str(INTERVAL),
        "SWEEP_INTERVAL_SECONDS": "3600",
        "LOG_QUIET_PERIODIC": "0",
    }
    worker = Worker("notify", env=env)
    queue = worker.args.index("-Q") + 1
    worker.args[queue] = f"{settings.CELERY_TASK_DEFAULT_QUEUE},{settings.SWEEP_QUEUE}"
    worker.start()
    log = open(tmp_path / "beat.log", "wb")
    beat = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "agentplatform", "beat", "-s", str(tmp_path / "schedule")],
        cwd=ROOT,
        env=process_env(**env),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    yield worker
    beat.terminate()
    beat.wait(10)
    worker.stop()
    log.close()


def test_beat_and_a_worker_deliver_a_requested_approval_within_one_interval(acme, receiver, beat_and_worker):
    make_webhook(acme.tenant, receiver.url, [Event.APPROVAL_REQUESTED])
    # Beat and the worker take seconds to start on a loaded machine: wait for the first pass.
    wait_for(ScanCursor.objects.exists, timeout=60, what="the first scheduled pass")

    approval = parked_approval(acme)
    committed = time.time()

    wait_for(lambda: receiver.requests, timeout=30, what="the webhook to be called")
    latency = receiver.requests[0].wall - committed
    print(f"event committed -> webhook received: {latency:.2f} s (interval {INTERVAL} s)")
    assert latency <= INTERVAL + 1.0, beat_and_worker.output()[-6000:]
    # Three more passes of the scan end (the worker logs each), none sending the webhook again.
    passes = len(PASS_ENDED.findall(beat_and_worker.output()))
    wait_for(
        lambda: len(PASS_ENDED.findall(beat_and_worker.output())) >= passes + 3,
        timeout=30,
        what="three more scheduled passes",
    )
    assert len(receiver.requests) == 1 and receiver.requests[0].verified
    delivery = Delivery.objects.get()
    assert (delivery.status, delivery.approval_id) == (DeliveryStatus.DELIVERED, approval.pk)
