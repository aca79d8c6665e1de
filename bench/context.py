"""Context and cost of long runs (DESIGN.md section 8): the reference runs on both wires.

    .venv/bin/python bench/context.py

The reference run: 25 tool turns (26 model calls), about 24,000 characters of instructions and
tool schemas, tool results of about 6,000 characters; the long run: 95 tool turns (96 model
calls, 191 steps); the flatness run: 500 tool turns (1,000 steps and the final answer). They go
through the real provider clients (llm/providers) against the fake servers of
tests/fakes/model_servers.py on 127.0.0.1, which bill prompt caches the way the providers document
(OpenAI: automatic prefix caching from 1,024 tokens in 128-token steps, cached tokens at 0.1x;
Anthropic: reads only at breakpoints with a 20-block lookback, writes at 1.25x, reads at 0.1x,
minimum cacheable length 1,024 tokens). The history is built and shaped by the same code the
engine uses (llm.context.shaped: heads, masking, compaction; read_result offered as
llm.gateway.shaped_request offers it) and every call is reserved and priced by
llm.gateway.estimate_cost_micros / cost_micros, as the engine does.

Printed per wire and run, side by side: naive (every call sends the whole history, nothing
cached), caching only (the context policy off), the masking policy without compaction (the
policy before compaction), the default policy (masking and deterministic compaction) and, on
the Anthropic wire, the provider's own clearing of old tool results (`compaction: provider` at an
endpoint with `context_editing: clear_tool_uses`; "sent" then counts what the client sent, the
model's read in brackets; OpenAI's stored state is the Responses API's, not this wire's): input
tokens sent, billed input cost, the last request's size, the share of input read from cache from
call 5 on; then reserved and spent per call. Goals (DESIGN.md 8): 25 steps: sent <= 30% of
naive, billed input <= 6% of naive uncached, cached share >= 90% from call 5; 191 steps: sent <=
15% of naive, last request <= 20,000 tokens; 1,000 steps: the last request within 10% of the
request at step 200 (flat).

Options (environment): BENCH_MAX_OUTPUT_TOKENS (512, the version's output cap), BENCH_VERBOSE
(1: print reserved/spent for every call of the 25-step run; 0: a summary), BENCH_FLAT (1: run the
1,000-step flatness run, about a minute; 0: skip it).
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
from llm.compat import Compat
from llm.models import ModelEndpoint
from llm.providers.anthropic import AnthropicProvider
from llm.providers.openai import OpenAIProvider
from llm.types import Message, ModelRequest, ToolCall, ToolSpec
from tests.fakes.model_servers import FakeAnthropic, FakeOpenAI

TOOL_TURNS = 25
LONG_TOOL_TURNS = 95  # 191 steps
FLAT_TOOL_TURNS = 500  # 1,000 steps, then the answer
RESULT_CHARS = 6_000
MAX_OUTPUT_TOKENS = int(os.environ.get("BENCH_MAX_OUTPUT_TOKENS", 512))
VERBOSE = os.environ.get("BENCH_VERBOSE", "1") == "1"
FLAT = os.environ.get("BENCH_FLAT", "1") == "1"
GOALS = {
    TOOL_TURNS: {"sent": 0.30, "billed": 0.06, "cached": 0.90},
    LONG_TOOL_TURNS: {"sent": 0.15, "last": 20_000},
}
FLAT_WITHIN = 0.10

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
    seq: int  # the model call's step
    sent: int  # input tokens the client sent (the provider's count, plus what its context editing cleared)
    cached: int
    written: int
    billed_micros: Decimal  # input part of the bill
    reserved: int
    spent: int
    read: int = 0  # input tokens the model read (billed): `sent` less what the provider cleared


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


def run(
    kind: str, policy: context.ContextPolicy, turns: int = TOOL_TURNS, *, clears: bool = False
) -> Outcome:
    """`clears`: the endpoint clears old tool results itself (Anthropic's context editing), as
    llm.gateway.shaped_request applies a `compaction: provider` policy there."""
    fake_class = FakeAnthropic if kind == "anthropic" else FakeOpenAI
    fake = fake_class(tool_turns=turns, min_cacheable_tokens=1024)
    base_url = fake.start()
    compat = Compat(context_editing="clear_tool_uses") if clears else None
    provider = (AnthropicProvider if kind == "anthropic" else OpenAIProvider)(
        base_url, "sk-bench", "bench-model", compat=compat
    )
    endpoint = ModelEndpoint(
        kind=kind, model="bench-model", **{k: Decimal(v) for k, v in PRICES[kind].items()}
    )
    text = instructions()
    messages = [Message(role="user", content=json.dumps({"case": "DSP-2291", "customer": "C-1001"}))]
    results: dict[int, context.Result] = {}
    outcome = Outcome()
    seq = 0
    try:
        while True:
            seq += 1
            shaped = context.shaped(messages, results, policy.at(clears=clears))
            request = ModelRequest(
                model="bench-model",
                instructions=text,
                messages=shaped.messages,
                # As llm.gateway.shaped_request offers read_result: once something was shortened
                # (here: from the first result on), from the first call with compaction.
                tools=context.offered(tools(), policy, paged=bool(results) or shaped.paged),
                max_output_tokens=MAX_OUTPUT_TOKENS,
                cache_key="run-bench",
                clear_tool_uses=policy.clearing() if clears and policy.compaction == "provider" else None,
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
                    seq=seq,
                    sent=usage.total_input + reply.cleared_input_tokens,
                    read=usage.total_input,
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


# The policy before compaction, as it was: 2,000-character heads, masking in batches of 8.
MASKING_ONLY = context.ContextPolicy(compaction="off", result_limit_chars=2_000)


def report(kind: str, turns: int) -> list[str]:
    off = run(kind, context.ContextPolicy(enabled=False), turns)
    masking = run(kind, MASKING_ONLY, turns)
    on = run(kind, context.ContextPolicy(), turns)
    price = Decimal(PRICES[kind]["price_input"])
    naive_tokens = off.sent  # with the policy off every call sends the whole history
    naive_cost = Decimal(naive_tokens) * price
    print(
        f"\n== {kind} wire: {turns} tool turns ({len(on.calls) + turns} steps, {len(on.calls)} model calls), "
        f"results of {RESULT_CHARS} characters, "
        f"prefix {len(instructions()) + len(json.dumps([t.__dict__ for t in tools()]))} characters =="
    )
    print(
        f"{'':<26}{'tokens sent':>14}{'of naive':>10}{'billed input':>16}{'of naive':>10}"
        f"{'last request':>14}{'cached from 5':>15}"
    )
    print(
        f"{'naive (no cache)':<26}{naive_tokens:>14,}{percent(1, 1):>10}{f'${naive_cost / 10**6:.4f}':>16}"
        f"{percent(1, 1):>10}{off.calls[-1].sent:>14,}{'0.0%':>15}"
    )
    rows = [
        ("caching only (policy off)", off),
        ("masking, no compaction", masking),
        ("masking + compaction", on),
    ]
    if kind == "anthropic":
        # Side by side: the provider's own context management on the same run (`compaction:
        # provider` at an endpoint with `context_editing: clear_tool_uses`).
        rows.append(
            ("provider clearing", run(kind, context.ContextPolicy(compaction="provider"), turns, clears=True))
        )
    for label, outcome in rows:
        last = outcome.calls[-1]
        read = f" (read {last.read:,})" if last.read != last.sent else ""
        print(
            f"{label:<26}{outcome.sent:>14,}{percent(outcome.sent, naive_tokens):>10}"
            f"{f'${outcome.billed / 10**6:.4f}':>16}{percent(outcome.billed, naive_cost):>10}"
            f"{last.sent:>14,}{percent(outcome.cached_share(), 1):>15}{read}"
        )
    if kind == "openai":
        print(
            f"{'provider stored state':<26}  not measured: OpenAI's stored conversation state is the Responses "
            "API's; this wire is Chat Completions"
        )
    reserved, spent = sum(c.reserved for c in on.calls), sum(c.spent for c in on.calls)
    print(
        f"reserved / spent, compaction: {reserved:,} / {spent:,} micros over {len(on.calls)} calls "
        f"({reserved / spent:.2f}x; never below: min per call "
        f"{min(c.reserved / c.spent for c in on.calls):.2f}x)"
    )
    if VERBOSE and turns == TOOL_TURNS:
        print(f"  {'call':>4}{'sent':>8}{'cached':>8}{'written':>9}{'reserved':>10}{'spent':>8}{'ratio':>7}")
        for i, c in enumerate(on.calls, start=1):
            print(
                f"  {i:>4}{c.sent:>8,}{c.cached:>8,}{c.written:>9,}{c.reserved:>10,}{c.spent:>8,}"
                f"{c.reserved / c.spent:>7.2f}"
            )
    goals = GOALS[turns]
    checks = {
        "sent": on.sent / naive_tokens <= goals["sent"],
        "never short": all(c.reserved >= c.spent for c in on.calls),
    }
    if "billed" in goals:
        checks["billed"] = float(on.billed / naive_cost) <= goals["billed"]
    if "cached" in goals:
        checks["cached"] = on.cached_share() >= goals["cached"]
    if "last" in goals:
        checks["last"] = on.calls[-1].sent <= goals["last"]
    return [f"{kind} {turns} turns: {name}" for name, ok in checks.items() if not ok]


def flatness(kind: str) -> list[str]:
    """The 1,000-step run: its last request against the request at step 200, and the largest."""
    on = run(kind, context.ContextPolicy(), FLAT_TOOL_TURNS)
    at_200 = min(on.calls, key=lambda c: abs(c.seq - 200))
    last = on.calls[-1]
    later = [c.sent for c in on.calls if c.seq >= at_200.seq]
    swing = max(later) / min(later) - 1
    print(
        f"\n== {kind} wire: {FLAT_TOOL_TURNS} tool turns ({on.calls[-1].seq} steps), masking + compaction ==\n"
        f"request at step {at_200.seq}: {at_200.sent:,} tokens; last request (step {last.seq}): {last.sent:,} "
        f"tokens ({last.sent / at_200.sent - 1:+.1%}); from step {at_200.seq} on: {min(later):,} to "
        f"{max(later):,} (the largest {swing:.1%} above the smallest); sent {on.sent:,} tokens, cached from "
        f"call 5 {percent(on.cached_share(), 1).strip()}"
    )
    return [] if abs(last.sent / at_200.sent - 1) <= FLAT_WITHIN else [f"{kind} 1,000 steps: flat"]


if __name__ == "__main__":
    missed = []
    for kind in ("openai", "anthropic"):
        missed += report(kind, TOOL_TURNS) + report(kind, LONG_TOOL_TURNS)
        if FLAT:
            missed += flatness(kind)
    print(
        "\ngoals: 25 steps: tokens sent <= 30% of naive, billed input <= 6% of naive uncached, cached share "
        ">= 90% from call 5; 191 steps: sent <= 15% of naive, last request <= 20,000 tokens; 1,000 steps: "
        "last request within 10% of step 200's; no reservation short"
    )
    print("all goals met" if not missed else "missed: " + ", ".join(missed))
    sys.exit(1 if missed else 0)
