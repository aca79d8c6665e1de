"""The Redis broker transport: kombu's, with one Redis client per channel instead of one per command.

kombu 5.7's Redis channel builds a new `redis.Redis` around its connection pool for every command it
sends outside the consumer's poll (`Channel.conn_or_acquire`): every published message. redis-py 8
fills a case-insensitive table of ~170 response callbacks in each new client's constructor, which
made building the client the largest single cost of publishing the engine's next step
(bench/publish_hop.py). A client holds no connection of its own (each command takes one from the
pool and gives it back) and is safe to share between threads, so the channel keeps one, for as long
as its pool lives: a channel that drops its pools (a lost connection, a fork) gets a new client
with its new pool.

`register()` (agentplatform/celery.py) makes it the transport of redis:// URLs in this process,
through kombu's table of transport names rather than Celery's `broker_transport` setting, so that
the URL and what Celery logs of it stay `redis://...`. Everything else about the transport is
kombu's; rediss:// (TLS) keeps kombu's own.
"""

from __future__ import annotations

from contextlib import contextmanager

from kombu import transport
from kombu.transport import redis


class Channel(redis.Channel):
    _shared_client = None

    @contextmanager
    def conn_or_acquire(self, client=None):
        if client:
            yield client
            return
        shared = self._shared_client
        if shared is None or shared.connection_pool is not self.pool:
            shared = self._shared_client = self._create_client()
        yield shared


class Transport(redis.Transport):
    Channel = Channel


def register() -> None:
    transport.TRANSPORT_ALIASES["redis"] = f"{__name__}:Transport"
