"""1,000 idle streams on one uvicorn process: a handful of database connections, a bounded number of
threads, and an event still reaches every client promptly."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest
from django.db import connection

from runs.models import RunEvent
from runs.services import cancel_run, start_run
from tenants.tokens import issue_token
from tests import factories
from tests.stream.sse import ApiServer

pytestmark = pytest.mark.django_db(transaction=True)

CLIENTS = 1000


def server_connections(app: str) -> int:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [app])
            return cursor.fetchone()[0]
    finally:
        connection.close()  # this thread's own connection, not left behind


def cancel_in_thread(run_id, actor) -> None:
    try:
        cancel_run(run_id=run_id, actor=actor, reason="enough")
    finally:
        connection.close()  # this thread's own connection, not left behind


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


async def open_streams(url: str, token: str, opened: asyncio.Event, received: dict, ready: list):
    """CLIENTS plain HTTP/1.1 connections reading the stream (a full HTTP client per connection would
    make this process, not the server, the bottleneck of the measurement)."""
    address = httpx.URL(url)

    async def one(i: int):
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(
            f"GET {address.raw_path.decode()} HTTP/1.1\r\nHost: {address.host}\r\n"
            f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n".encode()
        )
        seen = b""
        while chunk := await reader.read(65536):
            if not seen:
                assert chunk.startswith(b"HTTP/1.1 200"), chunk[:300]
            seen += chunk
            if i not in ready and b"retry:" in seen:
                ready.append(i)
                if len(ready) == CLIENTS:
                    opened.set()
            if i not in received and b"event: status" in seen:
                received[i] = time.monotonic()
            if b"event: end" in seen:
                break
            seen = seen[-64:]
        writer.close()

    await asyncio.gather(*(one(i) for i in range(CLIENTS)))


def test_one_process_holds_a_thousand_idle_streams_on_a_handful_of_connections_and_threads(
    tenant, asha, builtins
):
    factories.make_agent(tenant, tools=[builtins["echo"]], turns=[{"text": "hi"}])
    run, _ = start_run(user=asha, agent="agent", input={"q": "hello"})  # no worker: it stays queued
    app = f"stream-idle-{os.getpid()}"
    api = ApiServer(PGAPPNAME=app, DB_POOL_MAX="4", RUN_STREAM_HEARTBEAT_SECONDS="5").start()
    try:
        threads_before = threads_of(api.pid)
        token = issue_token(user=asha).token
        received: dict[int, float] = {}
        ready: list[int] = []
        figures: dict = {}

        async def scenario():
            opened = asyncio.Event()
            clients = asyncio.create_task(
                open_streams(f"{api.url}/v1/runs/{run.pk}/stream", token, opened, received, ready)
            )
            started = time.monotonic()
            await asyncio.wait_for(opened.wait(), 120)
            figures["open_seconds"] = time.monotonic() - started
            await asyncio.sleep(3)  # idle: heartbeats only
            figures["connections"] = await asyncio.to_thread(server_connections, app)
            figures["threads"] = threads_of(api.pid)
            figures["fds"] = len(os.listdir(f"/proc/{api.pid}/fd"))
            figures["cpu_open"] = cpu_seconds(api.pid)
            await asyncio.to_thread(cancel_in_thread, run.pk, asha)
            figures["sent_at"] = time.monotonic()
            await asyncio.wait_for(clients, 60)  # every stream ends after the cancel
            figures["cpu_fanout"] = cpu_seconds(api.pid) - figures["cpu_open"]

        asyncio.run(scenario())
        delays = sorted(at - figures["sent_at"] for at in received.values())
        latest = delays[-1]
        print(
            f"\n{CLIENTS} idle streams: opened in {figures['open_seconds']:.1f} s; server holds "
            f"{figures['connections']} PostgreSQL connections, {figures['threads']} threads "
            f"(before: {threads_before}), {figures['fds']} fds, {figures['cpu_open']:.1f} s of CPU to open them; the "
            f"cancel reached half in {delays[len(delays) // 2]:.2f} s, all in {latest:.2f} s "
            f"({figures['cpu_fanout']:.2f} s of server CPU)"
        )
        assert len(ready) == CLIENTS
        # LISTEN + the streams' pool (4) + the opening requests' pool (4) + the key store's (the one
        # thread opening sealed events: vault/store.py)
        assert figures["connections"] <= 10
        assert figures["threads"] <= threads_before + 12
        assert len(received) == CLIENTS
        assert latest < 10
        assert RunEvent.objects.filter(run=run, kind="status").exists()
    finally:
        api.stop()
        print(Path(api.log.name).read_text(errors="replace")[-2000:])
