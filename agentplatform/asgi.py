"""ASGI entry point: `uvicorn agentplatform.asgi:application` (scripts/serve.sh).

Django's handler, with one change for long-lived requests. Django runs a request's synchronous
code (signal receivers, synchronous middleware and views) on a thread of the request's own,
kept until the request ends; for a live run stream, which lasts as long as its run, that is an
idle thread per connected client. Streams share a few threads instead: their synchronous part
(authentication, the visibility check) is one short call when they open (runs/front/stream.py), and
their body runs on the event loop.
"""

import os
import re
from concurrent.futures import ThreadPoolExecutor

# Each ordinary request has a thread of its own here, which ends with the request: a connection
# kept open in it past the request (CONN_MAX_AGE) would be left behind with it. Close them at the
# end of each request unless a pool (DB_POOL_MAX) takes them back.
os.environ.setdefault("DB_CONN_MAX_AGE", "0")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")

import django
from asgiref.sync import ThreadSensitiveContext
from django.core.handlers.asgi import ASGIHandler

STREAM_PATH = re.compile(r"^/v1/runs/[^/]+/stream/?$")
STREAM_THREADS = 4


class Handler(ASGIHandler):
    def __init__(self):
        super().__init__()
        self.stream_threads = ThreadPoolExecutor(max_workers=STREAM_THREADS, thread_name_prefix="stream-open")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and STREAM_PATH.match(scope["path"]):
            async with ThreadSensitiveContext(executor=self.stream_threads):
                await self.handle(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


django.setup(set_prefix=False)
application = Handler()
