"""The link between two regions as a TCP proxy the test owns: cut it, heal it, or lose replies.

`cut()` closes every open connection and refuses new ones (what a partition looks like to
both sides: connection reset, then connection refused... as fast as a firewall's REJECT);
`lose_replies = True` forwards requests but closes the caller's side before any answer
byte reaches it (the request was applied at the far end, its answer lost); a path instead of
True loses only the answers to requests for that path (the keeper's probe still gets through,
so the keeper goes on to send the request whose answer is lost).
"""

from __future__ import annotations

import socket
import threading

from tests.services import free_port

METHODS = (b"GET", b"POST", b"PUT", b"PATCH", b"DELETE")


class Link:
    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = free_port()
        self.up = True
        self.lose_replies: bool | str = False
        self.forwarded = 0
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        with self._lock:
            self.up = False
            for sock in list(self._open):
                _close(sock)
            self._open.clear()

    def heal(self) -> None:
        with self._lock:
            self.up = True

    def close(self) -> None:
        self.cut()
        _close(self._server)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                if not self.up:
                    _close(client)
                    continue
                try:
                    upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                except OSError:
                    _close(client)
                    continue
                self._open.update((client, upstream))
                self.forwarded += 1
            asked = {"path": ""}  # the path of the connection's latest request (keep-alive reuses it)
            threading.Thread(target=self._pump, args=(client, upstream, None, asked), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, asked, None), daemon=True).start()

    def _losing(self, path: str) -> bool:
        losing = self.lose_replies
        return losing is True or (isinstance(losing, str) and path.startswith(losing))

    def _pump(
        self, source: socket.socket, sink: socket.socket, reply_to: dict | None, asking: dict | None
    ) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if asking is not None and data.split(b" ", 1)[0] in METHODS:  # a request's first line
                    asking["path"] = data.split(b" ", 2)[1].decode("latin-1")
                if reply_to is not None and self._losing(reply_to["path"]):
                    break
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
