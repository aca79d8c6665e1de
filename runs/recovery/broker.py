"""What the broker can tell the sweeper about the engine's queue, read without consuming it.

Only a Redis broker can be asked cheaply: Kombu keeps a queue as a list (LPUSH to publish,
BRPOP to consume), so its oldest message is the list's last element. Any other broker answers
"unknown", and the sweeper relies on its back-off alone.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging

from django.conf import settings

log = logging.getLogger(__name__)


def oldest_queued_enqueue() -> dt.datetime | None:
    """When the oldest advance_run message still waiting in the queue was enqueued.

    None: the queue is empty, or it cannot be known (another broker, Redis unreachable, a
    message of another shape). FIFO order means every run enqueued at or after this moment may
    still have its message in the queue, behind a backlog rather than lost.
    """
    url = settings.CELERY_BROKER_URL or ""
    if not url.startswith(("redis://", "rediss://")):
        return None
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        raw = client.lindex(settings.CELERY_TASK_DEFAULT_QUEUE, -1)
    except redis.RedisError:
        log.warning("could not read the broker queue; re-sending by back-off alone", exc_info=True)
        return None
    if raw is None:
        return None
    try:
        message = json.loads(raw)
        args = json.loads(base64.b64decode(message["body"]))[0]
        return dt.datetime.fromisoformat(args[1])
    except (ValueError, KeyError, IndexError, TypeError):
        return None
