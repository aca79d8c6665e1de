"""A tiny HTTP tool server for bench/peers.py: every scenario's tool calls land here.

    python -m bench.tool_server --port 8766

POST /tools/{name} with a JSON object of arguments (and an Idempotency-Key header) answers
200 {"tool": name, "arguments": {...}, "key": "<the key>", "n": <calls so far>}. It has no
effect to protect, so it answers every call; GET /count says how many calls it took, which
bench/peers.py checks after each scenario (12 tool calls per run, no more, no fewer).
Loopback only. The first stdout line, `BENCH_TOOL_SERVER http://127.0.0.1:<port>`, comes once the port
is bound (with --port 0 the OS picks it); poll GET /count to know it accepts connections.
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

HOST = "127.0.0.1"


def build_app() -> Starlette:
    calls = itertools.count(1)
    seen = {"n": 0}

    async def tool(request: Request) -> JSONResponse:
        try:
            arguments = json.loads(await request.body())
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            return JSONResponse({"error": "body must be a JSON object of arguments"}, status_code=422)
        seen["n"] = next(calls)
        return JSONResponse(
            {
                "tool": request.path_params["name"],
                "arguments": arguments,
                "key": request.headers.get("idempotency-key"),
                "n": seen["n"],
            }
        )

    async def count(request: Request) -> JSONResponse:
        return JSONResponse({"calls": seen["n"]})

    return Starlette(
        routes=[Route("/tools/{name}", tool, methods=["POST"]), Route("/count", count, methods=["GET"])]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, args.port))
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(),
            log_level="warning",
            access_log=False,
            lifespan="off",
            backlog=2048,
            timeout_graceful_shutdown=1,
        )
    )
    print(f"BENCH_TOOL_SERVER http://{HOST}:{sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
