"""/healthz, /readyz and /metrics (served by observability.middleware.ProbeMiddleware)."""

from __future__ import annotations

import hmac
import ipaddress

from django.conf import settings
from django.http import HttpResponse, JsonResponse
from django.utils.module_loading import import_string
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from observability import health


def healthz(request) -> JsonResponse:
    """The process answers. Nothing else is checked: a restart would not fix the database."""
    return JsonResponse({"status": "ok"})


def readyz(request) -> JsonResponse:
    """Database reachable, migrations applied, broker reachable: 200, or 503 saying what failed."""
    ready, checks = health.readiness()
    return JsonResponse(
        {"status": "ready" if ready else "not ready", "checks": checks}, status=200 if ready else 503
    )


def metrics(request) -> HttpResponse:
    """What processes recorded, and the gauges of what is stored (read now). The gauges read every
    app's rows, so they sit on the top floor (agentplatform/gauges.py) and settings name them, as
    Django names middleware."""
    refusal = _refusal(request)
    if refusal is not None:
        return refusal
    return HttpResponse(
        generate_latest(
            _Scrape(_recorded(), *(import_string(path)() for path in settings.METRICS_COLLECTORS))
        ),
        content_type=CONTENT_TYPE_LATEST,
    )


def worker_metrics(request) -> HttpResponse:
    """A worker's own exporter (WORKER_METRICS_PORT): what it recorded; the gauges are the API's."""
    refusal = _refusal(request)
    if refusal is not None:
        return refusal
    return HttpResponse(generate_latest(_recorded()), content_type=CONTENT_TYPE_LATEST)


def _recorded():
    if settings.PROMETHEUS_MULTIPROC_DIR:
        from prometheus_client import multiprocess

        # Every process's counters and histograms, added up from their files.
        source = CollectorRegistry()
        multiprocess.MultiProcessCollector(source, path=settings.PROMETHEUS_MULTIPROC_DIR)
        return source
    return REGISTRY


class _Scrape:
    """The recorded metrics plus the gauges computed for this scrape (kept out of the global
    registry: each scrape computes them once, whichever process answers it)."""

    def __init__(self, *sources):
        self.sources = sources

    def collect(self):
        for source in self.sources:
            yield from source.collect()


def _refusal(request) -> HttpResponse | None:
    """With METRICS_TOKEN and/or METRICS_ALLOW_FROM set, a request needs the token or an allowed address;
    with neither, production refuses every request and dev answers all."""
    token, allowed = settings.METRICS_TOKEN, settings.METRICS_ALLOW_FROM
    if not token and not allowed:
        if settings.PRODUCTION:
            return HttpResponse(
                "metrics are closed in production until METRICS_TOKEN or METRICS_ALLOW_FROM is set\n",
                status=403,
                content_type="text/plain",
            )
        return None
    if token:
        given = request.headers.get("Authorization", "")
        if given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip().encode(), token.encode()):
            return None
    if allowed and _address_allowed(request.META.get("REMOTE_ADDR", ""), allowed):
        return None
    if token:
        response = HttpResponse("metrics need a bearer token\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse("metrics are not served to this address\n", status=403, content_type="text/plain")


def _address_allowed(address: str, allowed: list[str]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in ipaddress.ip_network(entry, strict=False) for entry in allowed)
