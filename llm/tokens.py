"""Offline token estimate used for reservations (no network, no tokenizer download).

BPE tokenizers of current models average about 4 bytes of English or JSON per token. We count
one token per 3.5 UTF-8 bytes plus a fixed overhead per message and per tool, so the estimate
errs high (about +15% on typical agent traffic, measured in tests/llm/test_tokens.py against
provider-reported usage); a reservation that is too high is released at settlement, one that
is too low would let a run overshoot its budget.
"""
from __future__ import annotations

import json
import math

from llm.types import ModelRequest

BYTES_PER_TOKEN = 3.5
MESSAGE_OVERHEAD = 4
TOOL_OVERHEAD = 8


def estimate_text(text: str) -> int:
    return math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN)


def estimate_input_tokens(request: ModelRequest) -> int:
    total = estimate_text(request.instructions) + MESSAGE_OVERHEAD
    for tool in request.tools:
        total += TOOL_OVERHEAD + estimate_text(tool.name + tool.description +
                                               json.dumps(tool.input_schema, sort_keys=True))
    for message in request.messages:
        total += MESSAGE_OVERHEAD + estimate_text(message.content)
        for call in message.tool_calls:
            total += estimate_text(call.name + json.dumps(call.arguments, sort_keys=True))
    return total
