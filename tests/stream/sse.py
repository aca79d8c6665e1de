"""A server-sent events client for the tests (the wire format of the HTML standard, as EventSource reads it),
and the API served by a real uvicorn process."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.servers import ROOT, process_env


@dataclass
class Message:
    event: str
    data: dict
    id: int | None


@dataclass
class Stream:
    """What one connection received: events in order, heartbeat comments, the retry hint."""

    status: int = 0
    messages: list[Message] = field(default_factory=list)
    heartbeats: int = 0
    retry: int | None = None
    content_type: str = ""

    @property
    def events(self) -> list[Message]:
        return [m for m in self.messages if m.event != "end"]

    @property
    def end(self) -> Message | None:
        return next((m for m in self.messages if m.event == "end"), None)


def follow(
    client: httpx.Client,
    url: str,
    *,
    headers=None,
    until=None,
    stream: Stream | None = None,
    seconds: float | None = None,
) -> Stream:
    """Read a stream until the server closes it, or until `until(stream)` is true (then disconnect).

    `seconds`: disconnect after that long even so (checked at every line, heartbeats included), so
    that a run which never ends fails its test's assertions instead of holding it until the timeout."""
    stream = stream or Stream()
    deadline = None if seconds is None else time.monotonic() + seconds
    with client.stream("GET", url, headers=headers or {}) as response:
        stream.status = response.status_code
        stream.content_type = response.headers.get("content-type", "")
        if response.status_code != 200:
            response.read()
            stream.messages.append(Message("error", response.json(), None))
            return stream
        fields: dict[str, str] = {}
        for line in response.iter_lines():
            if deadline is not None and time.monotonic() > deadline:
                return stream
            if line.startswith(":"):
                stream.heartbeats += 1
            elif line:
                name, _, value = line.partition(":")
                fields[name] = fields.get(name, "") + value.removeprefix(" ")
            elif fields:
                if "retry" in fields:
                    stream.retry = int(fields.pop("retry"))
                if "data" in fields:
                    event_id = fields.get("id")
                    stream.messages.append(
                        Message(
                            fields.get("event", "message"),
                            json.loads(fields["data"]),
                            event_id and int(event_id),
                        )
                    )
                fields = {}
                if until is not None and until(stream):
                    return stream
    return stream


class ApiServer:
    """The API under ASGI: `uvicorn agentplatform.asgi:application`, one process, on a free port."""

    def __init__(self, **env: str):
        self.log = tempfile.NamedTemporaryFile(prefix="uvicorn-", suffix=".log", delete=False)
        self.env = process_env(**env)
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 60) -> ApiServer:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "agentplatform.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-access-log",
                "--no-proxy-headers",
                "--timeout-graceful-shutdown",
                "2",
            ],
            cwd=ROOT,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = Path(self.log.name).read_text(errors="replace")
            if "Uvicorn running on http://127.0.0.1:" in text:
                port = text.split("Uvicorn running on http://127.0.0.1:")[1].split()[0]
                self.url = f"http://127.0.0.1:{port}"
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"uvicorn did not start: {self.output()[-3000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
