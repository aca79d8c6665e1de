"""GET /v1/runs/{id}/stream: a run's events as server-sent events, live, until the run ends.

Opening the stream is an ordinary API request (same authentication, the same visibility rule as
GET /v1/runs/{id}, the same JSON errors); it does its database work in one short synchronous
call and gives its connection back before the first event is written. The body is an async
generator served on the event loop (ASGI: agentplatform/asgi.py, uvicorn in scripts/serve.sh):
it waits on runs.front.stream_feed for new events of its run and reads them in short queries, so an idle
stream holds no database connection and no thread. Under WSGI the body would be buffered until
the run ends: serve the API with ASGI.

Each event is `id: <seq>`, `event: <kind>`, `data: <the event as GET /v1/runs/{id}/events shows
it>`. A client resumes with `Last-Event-ID: <seq>` (browsers' EventSource sends it by itself) or
`?after=<seq>`; the header wins, since EventSource reconnects to the URL it first opened. When
the run has ended and its last event was sent, an `end` event (no id) carries its status, and the
server closes the stream; comment lines (`: heartbeat`) keep an idle stream open.
"""

from __future__ import annotations

import asyncio
import json
import logging

from django.conf import settings
from django.db import DatabaseError, connection
from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from psycopg import Error as PsycopgError
from psycopg_pool import PoolTimeout
from rest_framework import serializers
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.utils.encoders import JSONEncoder
from rest_framework.views import APIView

from core.api import ID_MAX, require_tenant
from runs import selectors
from runs.front import stream_feed
from runs.front.api import EventOutput
from runs.models import TERMINAL

logger = logging.getLogger("agentplatform.runs.stream")

READ_LIMIT = 200  # events per read; a long backlog is sent in several reads
RETRY_MILLISECONDS = 1000  # how soon a disconnected EventSource reconnects


class JsonErrors(BaseContentNegotiation):
    """Refusals are JSON like the rest of the API, whatever Accept says (EventSource asks for text/event-stream)."""

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class RunStreamApi(APIView):
    content_negotiation_class = JsonErrors

    class FilterSerializer(serializers.Serializer):
        after = serializers.IntegerField(min_value=0, max_value=ID_MAX, required=False)

    @extend_schema(
        operation_id="stream_run_events",
        summary="Follow a run's events live (server-sent events)",
        parameters=[
            OpenApiParameter(
                "after",
                {"type": "integer", "minimum": 0, "maximum": ID_MAX},
                description="start after this event id (seq); Last-Event-ID wins when both are given",
            ),
            OpenApiParameter(
                "Last-Event-ID",
                {"type": "integer", "minimum": 0, "maximum": ID_MAX},
                location=OpenApiParameter.HEADER,
                description="the id of the last event received: the stream resumes with the next one",
            ),
        ],
        responses={
            (200, "text/event-stream"): OpenApiResponse(
                OpenApiTypes.STR,
                description="server-sent events: `id: <seq>`, `event: <kind>`, `data: <event JSON as in "
                "/events>`; heartbeat comments; a final `end` event with the run's status, then the "
                "stream closes",
            )
        },
    )
    def get(self, request, run_id):
        """Follow a run live: its events as server-sent events until it ends."""
        require_tenant(request.user)
        found = selectors.visible_run_id(request.user, run_id)  # its content is not read: not needed
        after = self.resume_point(request)
        response = StreamingHttpResponse(events(found, after=after), content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
        return response

    def resume_point(self, request) -> int:
        header = request.headers.get("Last-Event-ID")
        if header is not None:
            parsed = self.FilterSerializer(data={"after": header.strip()})
            if not parsed.is_valid():
                raise serializers.ValidationError({"Last-Event-ID": parsed.errors["after"]})
            return parsed.validated_data["after"]
        parsed = self.FilterSerializer(data=request.query_params)
        parsed.is_valid(raise_exception=True)
        return parsed.validated_data.get("after", 0)

    def dispatch(self, request, *args, **kwargs):
        try:
            return super().dispatch(request, *args, **kwargs)
        finally:
            # The request's database work is done: give the connection back now, not when the
            # stream ends, hours later (inside a transaction someone else opened, e.g. a test's, keep it).
            if not connection.in_atomic_block:
                connection.close()


def message(event) -> str:
    # Streams of one run share the rows of one read (runs.front.stream_feed.Feed.read): the first formats an event,
    # the others reuse the text.
    text = getattr(event, "sse_text", None)
    if text is None:
        data = json.dumps(EventOutput(event).data, cls=JSONEncoder, ensure_ascii=False)
        text = event.sse_text = f"id: {event.seq}\nevent: {event.kind}\ndata: {data}\n\n"
    return text


async def events(run_id, *, after: int):
    """The stream's body: events after `after`, then new ones as they commit, until the run ends."""
    feed = stream_feed.feed()
    subscription = feed.subscribe(run_id)  # before the first read: nothing committed after it is missed
    heartbeat = settings.RUN_STREAM_HEARTBEAT_SECONDS
    loop = asyncio.get_running_loop()
    try:
        yield f"retry: {RETRY_MILLISECONDS}\n\n"
        written = loop.time()
        while True:
            try:
                status, rows = await feed.read(subscription, after=after, limit=READ_LIMIT)
            except (DatabaseError, PsycopgError, PoolTimeout) as exc:
                # The client reconnects with Last-Event-ID and misses nothing.
                logger.warning("run stream %s: cannot read events (%s); closing the stream", run_id, exc)
                return
            for event in rows:
                yield message(event)
                after = event.seq
            if rows:
                written = loop.time()
            if len(rows) == READ_LIMIT:
                continue
            if status is None or status in TERMINAL:
                end = json.dumps({"status": status, "last_event_id": after})
                yield f"event: end\ndata: {end}\n\n"
                return
            # Wait for a notification of a newer event; write a heartbeat whenever nothing was written for a while.
            while not await feed.wait(subscription, after=after, timeout=written + heartbeat - loop.time()):
                yield ": heartbeat\n\n"
                written = loop.time()
    finally:
        feed.unsubscribe(subscription)
