"""What reading a model's answer as a stream costs the worker, against one JSON answer.

    .venv/bin/python bench/streaming.py [--calls 200] [--rounds 3]

Every endpoint streams by default (the platform cuts an answer at its output limit only when it
reads it as it comes). This measures the price: the CPU time of the calling thread for one
`provider.complete()` (build the request, send it, read and parse the answer), streamed and not,
on both wires, for three answers:

  tool call     one tool call with two arguments (the usual turn of an agent)
  short answer  40 words of text (a final answer)
  long answer   400 words of text (a summary, a letter)

The fake servers (tests/fakes/model_servers.py) run in processes of their own, one per wire and
answer, and stream one word of text, or a few characters of a tool's arguments, per event, as
llama.cpp's server, vLLM and the hosted APIs do; their work is not in the figures (CPU time of
this process only). Streamed and JSON calls alternate round by round, so the machine's drift falls on
both alike. No database, no broker. Printed: µs of CPU per call (median of the rounds), the
difference, and the 1-minute load average at the start and the end.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llm.providers.anthropic import AnthropicProvider
from llm.providers.openai import OpenAIProvider
from llm.types import Message, ModelRequest, ToolCall, ToolSpec
from tests.fakes.model_servers import FakeAnthropic, FakeOpenAI

TOOLS = [
    ToolSpec(
        "lookup_transaction",
        "Look a card transaction up by its id.",
        {
            "type": "object",
            "properties": {"transaction_id": {"type": "string"}, "account": {"type": "string"}},
            "required": ["transaction_id"],
        },
    )
]
MESSAGES = [
    Message("user", "The customer disputes transaction TXN-1001 on account ACC-7781; open a dispute."),
    Message(
        "assistant",
        "",
        tool_calls=[ToolCall("call_1", "lookup_transaction", {"transaction_id": "TXN-1001"})],
    ),
    Message(
        "tool",
        '{"id": "TXN-1001", "amount": 12499, "currency": "INR", "merchant": "ACME"}',
        tool_call_id="call_1",
    ),
]
WORDS = [
    "the",
    "transaction",
    "was",
    "found",
    "and",
    "the",
    "dispute",
    "can",
    "be",
    "opened",
    "for",
    "the",
    "customer",
    "today",
]
ANSWERS: dict[str, dict[str, Any]] = {
    "tool call": {
        "text": "",
        "tool_calls": [
            {"name": "lookup_transaction", "arguments": {"transaction_id": "TXN-1001", "account": "ACC-7781"}}
        ],
    },
    "short answer": {"text": " ".join(WORDS[i % len(WORDS)] for i in range(40))},
    "long answer": {"text": " ".join(WORDS[i % len(WORDS)] for i in range(400))},
}


def request() -> ModelRequest:
    return ModelRequest(
        model="m",
        instructions="You help bank support agents open disputes.",
        messages=MESSAGES,
        tools=TOOLS,
        max_output_tokens=1_024,
        timeout_seconds=30,
    )


def serve(kind: str, answer: dict[str, Any], calls: int, pipe: Any) -> None:
    """A fake server in a process of its own, answering `answer` `calls` times."""
    fake = (FakeOpenAI if kind == "openai" else FakeAnthropic)(min_cacheable_tokens=0)
    fake.queue(*([answer] * calls))
    pipe.send(fake.start())
    pipe.recv()  # until the benchmark is done
    fake.stop()


def cpu_per_call(provider: Any, calls: int) -> float:
    """µs of this process's CPU per complete(), over `calls` calls."""
    started = time.process_time()
    for _ in range(calls):
        reply = provider.complete(request())
        assert reply.text or reply.tool_calls, reply
    return (time.process_time() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()

    servers: dict[tuple[str, str], tuple[Any, Any]] = {}
    providers: dict[tuple[str, str, bool], Any] = {}
    try:
        for kind in ("openai", "anthropic"):
            for shape, answer in ANSWERS.items():
                here, there = multiprocessing.Pipe()
                # Enough answers for every round of both modes and the warm-up.
                child = multiprocessing.Process(
                    target=serve, args=(kind, answer, 2 * opts.calls * opts.rounds + 20, there), daemon=True
                )
                child.start()
                servers[kind, shape] = (child, here)
                base_url = here.recv()
                for stream in (False, True):
                    providers[kind, shape, stream] = (
                        OpenAIProvider(base_url, None, "m", stream=stream)
                        if kind == "openai"
                        else AnthropicProvider(base_url, "key", "m", stream=stream)
                    )
        load = os.getloadavg()[0]
        # Not counted: the first calls pay for imports, connections and caches.
        for provider in providers.values():
            cpu_per_call(provider, 3)
        figures: dict[tuple[str, str, bool], list[float]] = {}
        for _ in range(opts.rounds):
            for key, provider in providers.items():
                figures.setdefault(key, []).append(cpu_per_call(provider, opts.calls))
        print(
            f"{opts.calls} calls x {opts.rounds} rounds per cell; load {load:.2f} -> {os.getloadavg()[0]:.2f}"
        )
        print(f"{'wire':10} {'answer':13} {'JSON µs':>9} {'stream µs':>10} {'stream - JSON':>14}")
        for kind, shape in servers:
            whole = statistics.median(figures[kind, shape, False])
            streamed = statistics.median(figures[kind, shape, True])
            print(f"{kind:10} {shape:13} {whole:9.0f} {streamed:10.0f} {streamed - whole:+14.0f}")
    finally:
        for provider in providers.values():
            provider.close()
        for child, pipe in servers.values():
            pipe.send("stop")
            child.join(10)


if __name__ == "__main__":
    main()
