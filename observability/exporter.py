"""A Celery worker's own /metrics, for workers that share no PROMETHEUS_MULTIPROC_DIR with the API.

Started by the worker when WORKER_METRICS_PORT is set (agentplatform/celery.py); one thread, the
same token and allowlist as the API's /metrics, only what this worker recorded (steps, calls,
tokens, spend, sweeper recoveries). The database gauges stay with the API's /metrics.
"""

from __future__ import annotations

import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from django.conf import settings
from django.core.handlers.wsgi import WSGIRequest

from observability import views


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # a scrape every 15 s is not worth a log line
        pass


def _app(environ, start_response):
    if environ.get("PATH_INFO") != "/metrics" or environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"only GET /metrics is served here\n"]
    response = views.worker_metrics(WSGIRequest(environ))
    start_response(f"{response.status_code} {response.reason_phrase}", list(response.items()))
    return [response.content]


def serve() -> int | None:
    """Start the exporter if configured; return the port it listens on."""
    if not settings.WORKER_METRICS_PORT:
        return None
    server = make_server(
        settings.WORKER_METRICS_ADDR,
        settings.WORKER_METRICS_PORT,
        _app,
        server_class=_Server,
        handler_class=_QuietHandler,
    )
    threading.Thread(target=server.serve_forever, name="metrics-exporter", daemon=True).start()
    return server.server_port
