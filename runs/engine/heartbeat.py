"""One thread per worker process extends the leases of calls still in flight.

A stalled or killed process stops extending, so its lease runs out and the sweeper hands the
run to another worker, which then fences the stale one out.
"""

from __future__ import annotations

import datetime as dt
import threading
import time

from django.db import close_old_connections, connection
from django.utils import timezone

from runs.models import Run

_lock = threading.Lock()
_active: dict[str, tuple[str, int]] = {}  # run id -> (lease token, lease seconds)
_thread: threading.Thread | None = None
TICK_SECONDS = 1.0


def track(run_id, token, lease_seconds: int) -> None:
    global _thread
    with _lock:
        _active[str(run_id)] = (str(token), lease_seconds)
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_loop, name="lease-heartbeat", daemon=True)
            _thread.start()


def untrack(run_id) -> None:
    with _lock:
        _active.pop(str(run_id), None)


def _loop() -> None:
    last: dict[str, float] = {}
    while True:
        time.sleep(TICK_SECONDS)
        with _lock:
            items = list(_active.items())
        now = time.monotonic()
        try:
            for run_id, (token, seconds) in items:
                # Extend at a third of the lease so two missed ticks never lose it.
                if now - last.get(run_id, 0) < seconds / 3:
                    continue
                Run.objects.filter(pk=run_id, lease_token=token).update(
                    lease_expires_at=timezone.now() + dt.timedelta(seconds=seconds)
                )
                last[run_id] = now
            for run_id in set(last) - {r for r, _ in items}:
                last.pop(run_id)
        except Exception:  # the database may be restarting; the next tick tries again
            _quietly(close_old_connections)
        finally:
            if not items:
                _quietly(connection.close)


def _quietly(close) -> None:
    """Closing may fail too (the connection half gone): the loop must outlive it, or every call
    in flight on this process would lose its lease."""
    try:
        close()
    except Exception:
        pass
