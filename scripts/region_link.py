"""The link between two regions on one machine: a TCP proxy an operator or a test cuts and heals.

    python scripts/region_link.py serve --state-dir DIR --route 8100=127.0.0.1:8000 [--route ...]
    python scripts/region_link.py cut  --state-dir DIR
    python scripts/region_link.py heal --state-dir DIR
    python scripts/region_link.py status --state-dir DIR

| operation | what it does |
|---|---|
| `serve` | listens on each route's port (127.0.0.1) and forwards every connection to its target |
| `cut` | creates `DIR/down`; the proxy closes every open connection and refuses new ones |
| `heal` | removes `DIR/down`; the proxy forwards new connections again |
| `status` | prints `up` or `down` as the proxy last applied it (`DIR/state`) |

scripts/serve_regions.sh runs it with two routes from the region away from home to the home: the
home's API (the slice keeper's signed calls) and the home's PostgreSQL (the subscription to its
authority), so a cut is a partition of both, as a firewall's REJECT would be: open connections
reset, new ones refused.

The state is the file `DIR/down`, so `touch DIR/down` and `rm DIR/down` do the same as `cut` and
`heal`, and a cut made while the proxy is stopped holds when it starts. The proxy looks at the
file every 0.1 s and, once it has applied a state, writes it to `DIR/state`: `cut` and `heal` wait
for that, so when they return every connection open before a cut is closed. Only the standard
library: it runs before the platform's processes and holds none of their settings.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from pathlib import Path

POLL_SECONDS = 0.1


class Link:
    """Forwards each listening port to its target while up; closes and refuses everything while down."""

    def __init__(self, state_dir: Path, routes: dict[int, tuple[str, int]]):
        self.state_dir = state_dir
        self.up = True
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._servers = []
        for port, target in routes.items():
            server = socket.create_server(("127.0.0.1", port))
            self._servers.append(server)
            threading.Thread(target=self._accept, args=(server, target), daemon=True).start()

    def watch(self, stop: threading.Event) -> None:
        """Apply the state the file says, until stopped."""
        self._apply(not (self.state_dir / "down").exists())
        while not stop.wait(POLL_SECONDS):
            up = not (self.state_dir / "down").exists()
            if up != self.up:
                self._apply(up)

    def _apply(self, up: bool) -> None:
        with self._lock:
            self.up = up
            if not up:
                for sock in list(self._open):
                    _close(sock)
                self._open.clear()
        _write_state(self.state_dir, "up" if up else "down")
        print(f"link {'up: forwarding' if up else 'cut: connections closed, new ones refused'}", flush=True)

    def close(self) -> None:
        with self._lock:
            for sock in [*self._servers, *self._open]:
                _close(sock)
            self._open.clear()

    def _accept(self, server: socket.socket, target: tuple[str, int]) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            with self._lock:
                if not self.up:
                    _close(client)
                    continue
            try:
                upstream = socket.create_connection(target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if not self.up:  # cut while connecting
                    _close(client)
                    _close(upstream)
                    continue
                self._open.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(source)
                self._open.discard(sink)
            _close(source)
            _close(sink)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _write_state(state_dir: Path, state: str) -> None:
    tmp = state_dir / "state.tmp"
    tmp.write_text(state + "\n")
    tmp.replace(state_dir / "state")


def _read_state(state_dir: Path) -> str:
    try:
        return (state_dir / "state").read_text().strip()
    except OSError:
        return "unknown (the link proxy has not started)"


def _route(text: str) -> tuple[int, tuple[str, int]]:
    listen, _, target = text.partition("=")
    host, _, port = target.rpartition(":")
    if not (listen.isdigit() and port.isdigit() and host):
        raise argparse.ArgumentTypeError(f"expected PORT=HOST:PORT, got {text!r}")
    return int(listen), (host, int(port))


def _set(state_dir: Path, want: str, timeout: float) -> int:
    state_dir.mkdir(parents=True, exist_ok=True)
    down = state_dir / "down"
    if want == "down":
        down.touch()
    else:
        down.unlink(missing_ok=True)
    deadline = time.monotonic() + timeout
    while _read_state(state_dir) != want:
        if time.monotonic() > deadline:
            print(f"link set {want} (in {down}); the proxy has not applied it: is it running?")
            return 1
        time.sleep(POLL_SECONDS)
    print(want)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("action", choices=["serve", "cut", "heal", "status"])
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--route", type=_route, action="append", default=[], help="PORT=HOST:PORT")
    parser.add_argument("--timeout", type=float, default=10.0, help="cut/heal: wait this long for the proxy")
    args = parser.parse_args(argv)
    if args.action == "status":
        print(_read_state(args.state_dir))
        return 0
    if args.action in ("cut", "heal"):
        return _set(args.state_dir, "down" if args.action == "cut" else "up", args.timeout)
    if not args.route:
        parser.error("serve needs at least one --route")
    args.state_dir.mkdir(parents=True, exist_ok=True)
    (args.state_dir / "state").unlink(missing_ok=True)
    link = Link(args.state_dir, dict(args.route))
    for port, (host, target) in args.route:
        print(f"link 127.0.0.1:{port} -> {host}:{target}", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        link.watch(stop)
    finally:
        link.close()
        (args.state_dir / "state").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
