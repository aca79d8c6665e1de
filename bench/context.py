"""Context and cost of a long run (DESIGN.md section 8): the reference run on both wires.

    .venv/bin/python bench/context.py

The reference run: 25 tool turns (26 model calls), about 24,000 characters of instructions and
tool schemas, tool results of about 6,000 characters. It goes through the real provider clients
(llm/providers) against the fake servers of tests/fakes/model_servers.py on 127.0.0.1, which bill
prompt caches the way the providers document (OpenAI: automatic prefix caching from 1,024 tokens
in 128-token steps, cached tokens at 0.1x; Anthropic: reads only at breakpoints with a 20-block
lookback, writes at 1.25x, reads at 0.1x, minimum cacheable length 1,024 tokens). The history is
built and shaped by the same code the engine uses (llm.gateway.build_messages' shape, the version's
context policy in llm.context, read_result offered by llm.context.offered) and every call is
reserved and priced by llm.gateway.estimate_cost_micros / cost_micros, as the engine does.

Printed per wire: naive (every call sends the whole history, nothing cached), the run with the
context policy switched off (caching only), and the run with the default policy: input tokens
sent, billed input cost, the last request's size, the share of input read from cache from step 5
on; then reserved and spent per call. Goals: tokens sent <= 40% of naive, billed input <= 15% of
the naive uncached cost, last request <= 25,000 tokens, cached share >= 90% from step 5 on.

Options (environment): BENCH_MAX_OUTPUT_TOKENS (512, the version's output cap), BENCH_VERBOSE
(1: print reserved/spent for every call; 0: a summary).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")

import django

django.setup()

from llm import context, gateway
from llm.models import ModelEndpoint
from llm.providers.anthropic import AnthropicProvider
from llm.providers.openai import OpenAIProvider
from llm.types import Message, ModelRequest, ToolCall, ToolSpec
from tests.fakes.model_servers import FakeAnthropic, FakeOpenAI

TOOL_TURNS = 25
RESULT_CHARS = 6_000
MAX_OUTPUT_TOKENS = int(os.environ.get("BENCH_MAX_OUTPUT_TOKENS", 512))
VERBOSE = os.environ.get("BENCH_VERBOSE", "1") == "1"
GOALS = {"sent": 0.40, "billed": 0.15, "last": 25_000, "cached": 0.90}

# Prices per million tokens (Claude Sonnet; an OpenAI model whose cached input is 0.1x).
PRICES = {
    "anthropic": {
        "price_input": "3",
        "price_cached_input": "0.30",
        "price_cache_write": "3.75",
        "price_output": "15",
    },
    "openai": {
        "price_input": "1.25",
        "price_cached_input": "0.125",
        "price_cache_write": "1.25",
        "price_output": "10",
    },
}


def instructions() -> str:
    rule = (
        "When a customer disputes a card transaction, first read the transaction, the merchant record and "
        "the customer's recent tickets; quote amounts with their currency; never promise a refund before "
        "the policy check has passed; write every finding into the case notes in plain language. "
    )
    text = "You are the disputes assistant of a retail bank.\n"
    i = 0
    while len(text) < 16_000:
        i += 1
        text += f"Rule {i}. {rule}\n"
    return text


def tools() -> list[ToolSpec]:
    specs = []
    for _i, name in enumerate(
        [
            "accounts_lookup",
            "cards_block",
            "cases_note",
            "cases_open",
            "customers_get",
            "disputes_file",
            "fx_rate",
            "ledger_search",
            "merchants_get",
            "policy_check",
            "refunds_quote",
            "tickets_search",
        ]
    ):
        properties = {
            f"field_{k}": {
                "type": "string",
                "description": f"Filter {k} of {name}: an exact value, "
                "an ISO 8601 date range or a prefix followed by an asterisk.",
            }
            for k in range(4)
        }
        specs.append(
            ToolSpec(
                name=name,
                description=(
                    f"{name.replace('_', ' ')}: reads or writes the bank's records for one customer case. "
                )
                * 2,
                input_schema={"type": "object", "properties": properties},
            )
        )
    return specs


def tool_result(i: int) -> str:
    rows, n = [], 0
    while len(json.dumps(rows)) < RESULT_CHARS - 120:
        rows.append(
            {
                "id": f"txn_{i:02d}_{n:03d}",
                "date": f"2026-11-{1 + n % 28:02d}",
                "amount": 1250 + 37 * n,
                "currency": "INR",
                "merchant": f"Merchant {n % 17}",
                "status": "posted" if n % 3 else "pending",
            }
        )
        n += 1
    return json.dumps({"page": i, "rows": rows})


@dataclass
class Call:
    sent: int  # input tokens the provider counted (uncached + cached + written)
    cached: int
    written: int
    billed_micros: Decimal  # input part of the bill
    reserved: int
    spent: int


@dataclass
class Outcome:
    calls: list[Call] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return sum(c.sent for c in self.calls)

    @property
    def billed(self) -> Decimal:
        return sum((c.billed_micros for c in self.calls), Decimal(0))

    def cached_share(self, from_step: int = 5) -> float:
        later = self.calls[from_step - 1 :]
        return sum(c.cached for c in later) / max(sum(c.sent for c in later), 1)


def run(kind: str, policy: context.ContextPolicy) -> Outcome:
    fake_class = FakeAnthropic if kind == "anthropic" else FakeOpenAI
    fake = fake_class(tool_turns=TOOL_TURNS, min_cacheable_tokens=1024)
    base_url = fake.start()
    provider = (AnthropicProvider if kind == "anthropic" else OpenAIProvider)(
        base_url, "sk-bench", "bench-model"
    )
    endpoint = ModelEndpoint(
        kind=kind, model="bench-model", **{k: Decimal(v) for k, v in PRICES[kind].items()}
    )
    offered = context.offered(tools(), policy)
    text = instructions()
    messages = [Message(role="user", content=json.dumps({"case": "DSP-2291", "customer": "C-1001"}))]
    results: dict[int, context.Result] = {}
    outcome = Outcome()
    seq = 0
    try:
        while True:
            seq += 1
            request = ModelRequest(
                model="bench-model",
                instructions=text,
                messages=context.shape(messages, results, policy),
                tools=offered,
                max_output_tokens=MAX_OUTPUT_TOKENS,
                cache_key="run-bench",
            )
            reserved = gateway.estimate_cost_micros(endpoint, request)
            reply = provider.complete(request)
            usage = reply.usage
            billed = (
                Decimal(usage.input_tokens) * endpoint.price_input
                + Decimal(usage.cached_input_tokens) * endpoint.price_cached_input
                + Decimal(usage.cache_write_tokens) * endpoint.price_cache_write
            )
            outcome.calls.append(
                Call(
                    sent=usage.total_input,
                    cached=usage.cached_input_tokens,
                    written=usage.cache_write_tokens,
                    billed_micros=billed,
                    reserved=reserved,
                    spent=gateway.cost_micros(endpoint, usage),
                )
            )
            if not reply.tool_calls:
                return outcome
            messages.append(
                Message(
                    role="assistant",
                    content=reply.text,
                    tool_calls=[
                        ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in reply.tool_calls
                    ],
                )
            )
            for call in reply.tool_calls:
                seq += 1
                body = tool_result(seq)
                results[len(messages)] = context.Result(seq=seq, tool_name=call.name, total_chars=len(body))
                messages.append(Message(role="tool", content=body, tool_call_id=call.id))
    finally:
        provider.close()
        fake.stop()


def percent(part, whole) -> str:
    return f"{100 * float(part) / float(whole):5.1f}%"


def report(kind: str) -> list[str]:
    off = run(kind, context.ContextPolicy(enabled=False))
    on = run(kind, context.ContextPolicy())
    price = Decimal(PRICES[kind]["price_input"])
    naive_tokens = off.sent  # with the policy off every call sends the whole history
    naive_cost = Decimal(naive_tokens) * price
    print(
        f"\n== {kind} wire: {len(on.calls)} calls, {TOOL_TURNS} tool turns, results of {RESULT_CHARS} characters, "
        f"prefix {len(instructions()) + len(json.dumps([t.__dict__ for t in tools()]))} characters =="
    )
    print(
        f"{'':<22}{'tokens sent':>14}{'of naive':>10}{'billed input':>16}{'of naive':>10}"
        f"{'last request':>14}{'cached from 5':>15}"
    )
    print(
        f"{'naive (no cache)':<22}{naive_tokens:>14,}{percent(1, 1):>10}{f'${naive_cost / 10**6:.4f}':>16}"
        f"{percent(1, 1):>10}{off.calls[-1].sent:>14,}{'0.0%':>15}"
    )
    for label, outcome in (("policy off (cache)", off), ("policy on", on)):
        print(
            f"{label:<22}{outcome.sent:>14,}{percent(outcome.sent, naive_tokens):>10}"
            f"{f'${outcome.billed / 10**6:.4f}':>16}{percent(outcome.billed, naive_cost):>10}"
            f"{outcome.calls[-1].sent:>14,}{percent(outcome.cached_share(), 1):>15}"
        )
    reserved, spent = sum(c.reserved for c in on.calls), sum(c.spent for c in on.calls)
    print(
        f"reserved / spent, policy on: {reserved:,} / {spent:,} micros over {len(on.calls)} calls "
        f"({reserved / spent:.2f}x; never below: min per call "
        f"{min(c.reserved / c.spent for c in on.calls):.2f}x)"
    )
    if VERBOSE:
        print(f"  {'call':>4}{'sent':>8}{'cached':>8}{'written':>9}{'reserved':>10}{'spent':>8}{'ratio':>7}")
        for i, c in enumerate(on.calls, start=1):
            print(
                f"  {i:>4}{c.sent:>8,}{c.cached:>8,}{c.written:>9,}{c.reserved:>10,}{c.spent:>8,}"
                f"{c.reserved / c.spent:>7.2f}"
            )
    checks = {
        "sent": on.sent / naive_tokens <= GOALS["sent"],
        "billed": float(on.billed / naive_cost) <= GOALS["billed"],
        "last": on.calls[-1].sent <= GOALS["last"],
        "cached": on.cached_share() >= GOALS["cached"],
        "never short": all(c.reserved >= c.spent for c in on.calls),
    }
    return [f"{kind}: {name}" for name, ok in checks.items() if not ok]


if __name__ == "__main__":
    missed = report("openai") + report("anthropic")
    print(
        "\ngoals: tokens sent <= 40% of naive, billed input <= 15% of naive uncached, last request <= 25,000 "
        "tokens, cached share >= 90% from step 5 on, no reservation short"
    )
    print("all goals met" if not missed else "missed: " + ", ".join(missed))
    sys.exit(1 if missed else 0)
