"""The streamed-answer reader (llm/providers/http.stream_events) on the byte streams servers send.

A server's stream arrives in blocks cut wherever the network cut it: in the middle of an event, of
a CRLF, of a multibyte character. Each case below is a byte stream a real server can send (the
network edge played by httpx's MockTransport), read in every cut, and must give the same events.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from llm.providers.http import stream_events
from llm.types import ProviderError

OPENAI = [{"choices": [{"index": 0, "delta": {"content": word}}]} for word in ("Le", " café", " ☕", " ok")]


def read(body: bytes, cut: int) -> list[tuple[str, Any]]:
    """The events of `body` when it arrives in blocks of `cut` bytes."""
    blocks = [body[i : i + cut] for i in range(0, len(body), cut)]

    class Blocks(httpx.SyncByteStream):
        def __iter__(self):
            return iter(blocks)

    client = httpx.Client(
        transport=httpx.MockTransport(
            lambda request: httpx.Response(
                200, headers={"content-type": "text/event-stream"}, stream=Blocks()
            )
        )
    )
    return list(
        stream_events(
            client,
            "http://server/v1/chat/completions",
            headers={},
            body={},
            timeout_seconds=10,
            first_token_seconds=None,
            provider="openai",
            secret="sk-secret-1",
            is_token=lambda name, data: True,
        )
    )


def openai_body(newline: bytes) -> bytes:
    events = [b"data: " + json.dumps(data, ensure_ascii=False).encode() for data in OPENAI]
    return b"".join(event + newline * 2 for event in [b": keep-alive", *events, b"data: [DONE]"])


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF (sse-starlette)", "CR"])
@pytest.mark.parametrize("cut", [1, 2, 3, 7, 4096])
def test_every_line_ending_and_every_cut_gives_the_same_events(newline, cut):
    # A cut of 1 or 2 splits every CRLF and the three bytes of "☕" between blocks.
    assert read(openai_body(newline), cut) == [("", data) for data in OPENAI]


@pytest.mark.parametrize("cut", [1, 5, 4096])
def test_named_events_multiline_data_and_events_without_data(cut):
    body = (
        b'event: message_start\ndata: {"type": "message_start"}\n\n'
        b"event: ping\n\n"  # a name and no data: no event
        b'event: content_block_delta\ndata: {"type": "content_block_delta",\ndata:  "index": 0}\n\n'
        b'data:{"tight": true}\n\n'  # no space after the colon
        b'event: message_stop\ndata: {"type": "message_stop"}\n\n'
        b'data: {"unfinished": '  # the stream ends mid-event: never dispatched
    )
    assert read(body, cut) == [
        ("message_start", {"type": "message_start"}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0}),
        ("", {"tight": True}),
        ("message_stop", {"type": "message_stop"}),
    ]


@pytest.mark.parametrize("data", [b'{"a": 1} trailing', b"not json sk-secret-1", b'{"a": '])
def test_an_event_that_is_not_json_is_a_retried_error_with_the_key_redacted(data):
    with pytest.raises(ProviderError) as caught:
        read(b"data: " + data + b"\n\n", 4096)
    assert "a streamed event is not JSON" in str(caught.value)
    assert caught.value.retryable and caught.value.sent
    assert "sk-secret-1" not in str(caught.value)
