"""Answer the probe and scrape paths before the rest of the stack.

Kubernetes probes and Prometheus address a pod by its IP, which is not in ALLOWED_HOSTS: Django's
host check (CommonMiddleware) would answer 400. These paths also need no session, user or CSRF
token, so they skip that work. Nothing else is served here.
"""

from __future__ import annotations

from observability import views

PATHS = {"/healthz": views.healthz, "/readyz": views.readyz, "/metrics": views.metrics}


class ProbeMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        view = PATHS.get(request.path_info)
        if view is not None and request.method in ("GET", "HEAD"):
            return view(request)
        return self.get_response(request)
