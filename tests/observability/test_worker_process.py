"""A real Celery worker process configured as in production: counters in PROMETHEUS_MULTIPROC_DIR
(read back through /metrics), JSON log lines, spans exported by OTLP/HTTP to a local collector,
and task results that say what each step did."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from django.test import override_settings
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from rest_framework.test import APIClient

from runs.models import Run, Step
from tests import factories
from tests.observability.conftest import parse, scrape, value
from tests.servers import wait_for
from tests.services import free_port

pytestmark = pytest.mark.django_db(transaction=True)


class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1: keeps the spans it is sent."""

    def __init__(self):
        self.spans: list = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/v1/traces":
                    request = ExportTraceServiceRequest.FromString(body)
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            collector.spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def stop(self):
        self.server.shutdown()


def test_a_worker_process_exports_metrics_logs_spans_and_readable_results(
    tenant, asha, builtins, workers, tmp_path
):
    collector = Collector()
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    try:
        echo = builtins["echo"]
        factories.grant(echo, use=[asha])
        type(echo).objects.filter(pk=echo.pk).update(price_micros=1000)
        factories.make_agent(
            tenant,
            tools=[echo],
            turns=[{"tool_calls": [{"name": echo.name, "arguments": {"say": "hi"}}]}, {"text": "done"}],
        )
        worker = workers(
            "obs",
            env={
                "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
                "LOG_FORMAT": "json",
                "LOG_LEVEL": "INFO",
                "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
                "OTEL_BSP_SCHEDULE_DELAY": "100",
                "OTEL_SERVICE_NAME": "agent-worker",
            },
        )
        run = start_and_finish(asha)
        steps = list(Step.objects.filter(run=run).order_by("seq"))

        # Counters written by the worker process, read through /metrics in multi-process mode.
        with override_settings(PROMETHEUS_MULTIPROC_DIR=str(metrics_dir)):
            samples = scrape()
        assert value(samples, "agentplatform_steps_total", kind="model", tool="", outcome="succeeded") == 2
        assert (
            value(samples, "agentplatform_steps_total", kind="tool", tool=echo.name, outcome="succeeded") == 1
        )
        assert value(samples, "agentplatform_step_call_seconds_count", kind="tool", outcome="succeeded") == 1
        assert (
            value(samples, "agentplatform_spend_micros_total", tenant="acme", kind="model")
            == sum(s.cost_micros for s in steps if s.kind == "model")
            > 0
        )
        assert value(
            samples, "agentplatform_model_tokens_total", tenant="acme", model="test-model", type="output"
        ) == sum(s.usage["output_tokens"] for s in steps if s.kind == "model")
        assert (
            value(
                samples, "agentplatform_run_transitions_total", tenant="acme", status="succeeded", reason=""
            )
            == 1
        )
        assert value(samples, "agentplatform_runs", tenant="acme", status="running") == 0

        # Spans, exported in batches: wait for the last step's.
        wait_for(lambda: len(collector.spans) >= 3, timeout=20, what="spans at the collector")
        names = sorted(span.name for span in collector.spans)
        assert names == sorted(["chat test-model", f"execute_tool {echo.name}", "chat test-model"])
        assert {span.trace_id.hex() for span in collector.spans} == {run.pk.hex}
    finally:
        collector.stop()

    worker.stop()
    lines = [json.loads(line) for line in worker.output().splitlines() if line.startswith("{")]
    mine = [line for line in lines if line["run_id"] == str(run.pk)]
    assert len(mine) >= 5, lines[-20:]
    assert {line["tenant"] for line in mine} == {"acme"}
    assert any(line["tool"] == echo.name and line["step_seq"] == 2 for line in mine)
    # Celery's own line for each task shows its result: what the step did, not None.
    results = [
        line["message"]
        for line in lines
        if "advance_run" in line["message"] and " succeeded in " in line["message"]
    ]
    step_2 = f"'step': 2, 'kind': 'tool', 'tool': '{echo.name}', 'outcome': 'succeeded'"
    assert any(step_2 in r for r in results), results
    assert not any(r.endswith(": None") for r in results), results

    # A worker on another host or in another container shares no directory with the API: it
    # serves what it recorded itself, behind the same token.
    port = free_port()
    workers(
        "loner",
        env={
            "WORKER_METRICS_PORT": str(port),
            "WORKER_METRICS_ADDR": "127.0.0.1",
            "METRICS_TOKEN": "worker-token",
        },
    )
    second = start_and_finish(asha)
    exported = f"http://127.0.0.1:{port}/metrics"
    assert httpx.get(exported, timeout=10).status_code == 401
    own = parse(httpx.get(exported, headers={"Authorization": "Bearer worker-token"}, timeout=10).text)
    assert value(own, "agentplatform_steps_total", kind="model", tool="", outcome="succeeded") == 2
    assert value(own, "agentplatform_steps_total", kind="tool", tool=echo.name, outcome="succeeded") == 1
    assert (
        value(own, "agentplatform_spend_micros_total", tenant="acme", kind="model")
        == sum(s.cost_micros for s in Step.objects.filter(run=second, kind="model"))
        > 0
    )
    assert not [name for name, _ in own if name.startswith("agentplatform_runs")]  # the gauges are the API's


def start_and_finish(user) -> Run:
    client = APIClient()
    client.force_authenticate(user)
    response = client.post("/v1/runs", {"agent": "agent", "input": {}}, format="json")
    assert response.status_code == 201, response.content
    run = wait_for(lambda: (r := Run.objects.get(pk=response.json()["id"])).is_terminal and r, what="run end")
    assert run.status == "succeeded", run.error
    return run
