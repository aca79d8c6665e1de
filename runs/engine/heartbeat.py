"""One thread per worker process extends the leases of calls still in flight.

A stalled or killed process stops extending, so its lease runs out and the sweeper hands the
run to another worker, which then fences the stale one out.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time

from django.db import close_old_connections, connection
from django.utils import timezone
from psycopg.pq import TransactionStatus

from runs.models import Run

_lock = threading.Condition()
_active: dict[str, tuple[str, int]] = {}  # run id -> (lease token, lease seconds)
_extending: str | None = None  # the run whose lease the thread is extending right now
_thread: threading.Thread | None = None
TICK_SECONDS = 1.0
# How long untrack waits out an extension under way: bounded, should its UPDATE hang.
UNTRACK_WAIT_SECONDS = 2.0
log = logging.getLogger(__name__)


def track(run_id, token, lease_seconds: int) -> None:
    global _thread
    with _lock:
        _active[str(run_id)] = (str(token), lease_seconds)
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_loop, name="lease-heartbeat", daemon=True)
            _thread.start()


def untrack(run_id) -> None:
    """Stop extending the run's lease. Once this returns the thread extends it no more: an
    extension under way (the run read before it was let go) is waited out, so that a lease the
    caller then ends or lets expire is not pushed forward behind its back."""
    run_id = str(run_id)
    with _lock:
        _active.pop(run_id, None)
        _lock.wait_for(lambda: _extending != run_id, timeout=UNTRACK_WAIT_SECONDS)


def _loop() -> None:
    global _extending
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
                with _lock:
                    if run_id not in _active:
                        continue  # let go since this tick read the list
                    _extending = run_id
                try:
                    Run.objects.filter(pk=run_id, lease_token=token).update(
                        lease_expires_at=timezone.now() + dt.timedelta(seconds=seconds)
                    )
                finally:
                    with _lock:
                        _extending = None
                        _lock.notify_all()
                last[run_id] = now
            for run_id in set(last) - {r for r, _ in items}:
                last.pop(run_id)
            leave_no_transaction()
        except Exception:  # the database may be restarting; the next tick tries again
            _quietly(close_old_connections)
        finally:
            if not items:
                _quietly(connection.close)


def leave_no_transaction() -> None:
    """Each update commits on its own (autocommit). Should this thread's connection ever be found
    inside a transaction after a tick, it would hold its lock on `runs_run` until the next tick
    and beyond, blocking every DDL, TRUNCATE and partition attach behind it (seen once in CI, an
    idle transaction after the UPDATE; its cause not found): closing it rolls it back."""
    raw = connection.connection
    if raw is None:
        return
    info = getattr(raw, "info", None)  # psycopg; sqlite3 says it directly
    open_ = info.transaction_status != TransactionStatus.IDLE if info is not None else raw.in_transaction
    if open_ or connection.in_atomic_block:
        log.warning("lease heartbeat: its connection was left inside a transaction; closing it")
        _quietly(connection.close)


def _quietly(close) -> None:
    """Closing may fail too (the connection half gone): the loop must outlive it, or every call
    in flight on this process would lose its lease."""
    try:
        close()
    except Exception:
        pass
