"""Offline token estimate used for reservations (no network, no tokenizer download).

A reservation that is too high is released at settlement; one that is too low would let a run
overshoot its budget. So the estimate counts what goes over the wire, generously:
- text at one token per 3.5 characters of its JSON-escaped form (BPE tokenizers average about 4
  characters of English or JSON per token; escaping counts quotes inside JSON tool results twice
  and non-ASCII text, like Hindi or emoji, at 6 characters per UTF-16 unit, which covers scripts
  that take one or more tokens per character);
- the wire structure around each message, tool call and tool schema at fixed overheads.

Measured in tests/llm/test_tokens.py against the usage the fake OpenAI and Anthropic servers
report (`python -m tests.llm.test_tokens` prints the table) for requests shaped like real agent
traffic (bank tools, 0-25 steps of JSON tool results, 6 kB of instructions with 25 tools, Hindi
with emoji, a large tool result, plain chat): estimate / reported is 1.06 to 1.25, median
1.15, for both providers, never below 1; the test fails if any falls below 1 or above 2.
"""

from __future__ import annotations

import functools
import json
import math

from llm.types import Message, ModelRequest

CHARS_PER_TOKEN = 3.5
REQUEST_OVERHEAD = 24  # model name, output limit, the system message wrapper
MESSAGE_OVERHEAD = 16  # {"role": ..., "content": ..., "tool_call_id": ...}
TOOL_CALL_OVERHEAD = 24  # {"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}
TOOL_OVERHEAD = 20  # {"type": "function", "function": {"name", "description", "parameters"}}


@functools.lru_cache(maxsize=16_384)
def estimate_text(text: str) -> int:
    """Cached: a conversation re-sends the same texts every step, so each is escaped once."""
    if not text:
        return 0
    return math.ceil(len(json.dumps(text)) / CHARS_PER_TOKEN)


def _estimate_json(value) -> int:
    return math.ceil(len(json.dumps(value, sort_keys=True)) / CHARS_PER_TOKEN)


def estimate_input_tokens(request: ModelRequest) -> int:
    total = REQUEST_OVERHEAD + estimate_text(request.instructions)
    for tool in request.tools:
        total += (
            TOOL_OVERHEAD
            + estimate_text(tool.name)
            + estimate_text(tool.description)
            + _estimate_json(tool.input_schema)
        )
    for message in request.messages:
        total += message_tokens(message)
    return total


def message_tokens(message: Message) -> int:
    """A message's estimate, kept on the message (Message.estimated_tokens): the tool calls'
    arguments were dumped to JSON anew on every call, 0.5 ms a call at step 200
    (bench/profile_step.py --stagger)."""
    if message.estimated_tokens is None:
        known = MESSAGE_OVERHEAD + estimate_text(message.content)
        for call in message.tool_calls:
            # OpenAI sends the arguments as a JSON string: escaped once more on the wire.
            known += (
                TOOL_CALL_OVERHEAD
                + estimate_text(call.id)
                + estimate_text(call.name)
                + estimate_text(json.dumps(call.arguments, sort_keys=True))
            )
        message.estimated_tokens = known
    return message.estimated_tokens
