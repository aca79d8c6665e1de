import os
from collections.abc import Mapping

from celery import Celery
from celery.signals import worker_ready
from celery.utils.log import get_logger
from celery.worker.consumer import Consumer as CeleryConsumer

from core import broker

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")


class DjangoCelerySettings(Mapping):
    """Django's CELERY_* settings as a plain dict, read on Celery's first look at its configuration.

    Celery looks a setting up on every publish, under two names, through each of its maps:
    through Django's lazy settings object every name that is not set raises an AttributeError
    on the way, which made reading the configuration a fifth of the cost of publishing a task
    (bench/publish_hop.py). The settings module is final by the time Celery first reads it.
    """

    def __init__(self):
        self._values: dict | None = None

    def _load(self) -> dict:
        if self._values is None:
            from django.conf import settings

            self._values = {
                name: getattr(settings, name) for name in dir(settings) if name.startswith("CELERY_")
            }
        return self._values

    def __getitem__(self, key):
        return self._load()[key]

    def __iter__(self):
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


broker.register()
app = Celery("agentplatform")
app.config_from_object(DjangoCelerySettings(), namespace="CELERY")
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
    # Inside: agentplatform/__init__.py imports this module before Django's settings and apps
    # are loaded, and the exporter's views need both.
    from observability import exporter

    exporter.serve()


logger = get_logger(__name__)


class Consumer(CeleryConsumer):
    """Celery's consumer, made to outlive a broker connection that Redis dropped (a restart).

    The worker notices a lost connection on whichever of its Redis sockets reads first. When it
    is a pub/sub socket (the remote-control broadcast queue, or gossip's) while the task channel
    waits in BRPOP with tasks unacknowledged (acks_late: runs in flight), kombu 5.7's
    `Connection.collect()` half-closes the task channel (its pending BRPOP read fails), drops the
    connection's settings (`transport.client = None`), and `Connection.close()` closes the channel
    again: restoring the unacknowledged messages builds a Redis pool from the dropped settings and
    raises `AttributeError: 'NoneType' object has no attribute 'hostname'` (the traceback of
    celery/kombu#582). The channel is left without a pool, so every task that finishes later and
    acknowledges its message on it raises the same error. Neither is a connection error, so Celery
    ends the worker ("Unrecoverable error").

    Both happen on a connection that is being thrown away, for messages Redis lost with its
    restart (the sweeper sends their runs again), so both are logged and dropped. Remote control
    stays on: its socket is always being read, so a worker whose every prefetch slot is busy
    still notices that Redis went away; with no pub/sub consumer at all, such a worker waits on
    the dead connection forever.
    """

    def on_connection_error_after_connected(self, exc):
        try:
            super().on_connection_error_after_connected(exc)
        except AttributeError:
            if self.connection is not None:  # Celery detaches the old connection before closing it
                raise
            logger.warning("lost broker connection: closing it failed inside kombu", exc_info=True)

    def call_soon_ack(self, p, *args, **kwargs):
        return super().call_soon_ack(_dropped_if_connection_lost, p, *args, **kwargs)


def _dropped_if_connection_lost(ack, *args, **kwargs):
    """Run an ack/reject callback; drop it if its message's broker connection was closed meanwhile."""
    try:
        return ack(*args, **kwargs)
    except AttributeError:
        message = getattr(ack, "__self__", None)
        transport = getattr(getattr(message, "channel", None), "connection", None)
        if transport is None or getattr(transport, "client", None) is not None:
            raise
        logger.warning(
            "not acknowledging message %s: its broker connection was lost",
            getattr(message, "delivery_tag", "?"),
        )
