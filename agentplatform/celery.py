import os

from celery import Celery
from celery.signals import worker_ready

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")

app = Celery("agentplatform")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_ready.connect
def _import_gateway_clients(**kwargs) -> None:
    """Import the tool and model clients before taking work: the MCP SDK alone takes seconds to
    import, and a worker started to take over runs should not spend them inside its first lease."""
    import llm.gateway  # noqa: F401
    import tools.mcp_client  # noqa: F401


@worker_ready.connect
def _serve_worker_metrics(**kwargs) -> None:
    """A worker with no metrics directory shared with the API serves its own counters."""
    from observability import exporter

    exporter.serve()
