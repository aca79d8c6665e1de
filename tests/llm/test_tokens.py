"""The offline token estimate behind every model reservation, measured against provider-reported usage.

The fake servers report usage the way the real APIs do (tests/fakes/model_servers.py); the
requests below are shaped like real agent traffic: long instructions, the bank tool schemas, a
history of tool calls with JSON results, non-ASCII customer text, a large capped result.
A reservation must never be smaller than the charge, so the estimate must be at least the
reported input tokens for every one of them.
"""

from __future__ import annotations

import json

import pytest

from llm.providers.anthropic import AnthropicProvider
from llm.providers.openai import OpenAIProvider
from llm.tokens import estimate_input_tokens, estimate_text
from llm.types import Message, ModelRequest, ToolCall, ToolSpec
from tests.fakes.model_servers import FakeAnthropic, FakeOpenAI

pytestmark = pytest.mark.timeout(60)


def _schema(**props: str) -> dict:
    return {
        "type": "object",
        "properties": {name: {"type": kind, "description": f"The {name}."} for name, kind in props.items()},
        "required": list(props),
        "additionalProperties": False,
    }


BANK_TOOLS = [
    ToolSpec(
        "bank__issue_refund",
        "Refund (part of) a transaction. Honours the idempotency key sent in _meta.",
        _schema(transaction_id="string", amount="number", currency="string", reason="string"),
    ),
    ToolSpec(
        "bank__lookup_transaction", "Look up a card transaction by id.", _schema(transaction_id="string")
    ),
    ToolSpec("bank__search_tickets", "Search past support tickets.", _schema(query="string")),
    ToolSpec(
        "bank__send_customer_email",
        "Send an email to the customer.",
        _schema(to="string", subject="string", body="string"),
    ),
    ToolSpec(
        "bank__transfer_funds",
        "Move money to another account.",
        _schema(to_account="string", amount="number"),
    ),
]
MANY_TOOLS = BANK_TOOLS + [
    ToolSpec(
        f"crm__tool_{i:02d}",
        f"CRM operation number {i}: reads or updates customer records.",
        _schema(customer_id="string", field="string", value="string"),
    )
    for i in range(20)
]
INSTRUCTIONS = (
    "You are the dispute assistant of a retail bank's support team. You act for the support agent who "
    "started this run and you may only use the tools you are given. Look the transaction up before you "
    "propose anything, search past tickets for duplicates, and never refund more than the transaction "
    "amount. Refunds above INR 5,000 need a supervisor's approval; say so when you propose one. Write "
    "short, plain replies.\n"
)
LONG_INSTRUCTIONS = INSTRUCTIONS + "\n".join(
    f"Rule {i}: when the customer mentions case type {i}, check the policy section {i}.{i % 7} and quote "
    f"the relevant paragraph before acting; escalate if the amount exceeds {1000 * i} rupees."
    for i in range(60)
)
TRANSACTION = {
    "transaction_id": "TXN-1001",
    "amount": 12499,
    "currency": "INR",
    "merchant": "ShopKart",
    "status": "settled",
    "card": "**** 4242",
    "posted_at": "2025-03-14T10:22:05Z",
    "duplicate_of": None,
}
TICKETS = {
    "tickets": [
        {
            "ticket_id": f"TCK-{i}",
            "transaction_id": "TXN-1001",
            "subject": "Charged twice",
            "body": "Customer reports two identical charges at ShopKart on the same day.",
        }
        for i in range(3)
    ]
}


def _history(turns: int, *, result: dict, text: str = "") -> list[Message]:
    messages = [
        Message(
            "user",
            json.dumps({"transaction_id": "TXN-1001", "amount": 12499, "customer_email": "c@example.com"}),
        )
    ]
    for i in range(turns):
        call = ToolCall(
            id=f"call_{i}", name="bank__lookup_transaction", arguments={"transaction_id": "TXN-1001"}
        )
        messages.append(Message("assistant", text, tool_calls=[call]))
        messages.append(Message("tool", json.dumps(result), tool_call_id=f"call_{i}"))
    return messages


HINDI = (
    "ग्राहक का कहना है कि उनके कार्ड से ₹12,499 दो बार कटे। कृपया जाँच करें और रिफंड की स्थिति बताएं। "
    "Customer writes: मेरे पैसे कब वापस आएंगे? 😟"
)
REQUESTS = {
    "first call, bank tools": (INSTRUCTIONS, BANK_TOOLS, _history(0, result={})),
    "10 steps of JSON results": (INSTRUCTIONS, BANK_TOOLS, _history(10, result=TRANSACTION)),
    "25 steps, tickets": (
        INSTRUCTIONS,
        BANK_TOOLS,
        _history(25, result=TICKETS, text="Checking the ticket log."),
    ),
    "long instructions, 25 tools": (LONG_INSTRUCTIONS, MANY_TOOLS, _history(3, result=TRANSACTION)),
    "Hindi and emoji": (INSTRUCTIONS, BANK_TOOLS, [Message("user", HINDI * 5)]),
    "large capped result": (INSTRUCTIONS, BANK_TOOLS, _history(1, result={"rows": [TRANSACTION] * 40})),
    "no tools, plain chat": (
        INSTRUCTIONS,
        [],
        [
            Message("user", "Summarise the dispute policy in three lines."),
            Message("assistant", "Sure."),
            Message("user", "Go on."),
        ],
    ),
}


@pytest.fixture(scope="module")
def providers():
    openai, anthropic = FakeOpenAI(), FakeAnthropic()
    clients = {
        "openai": OpenAIProvider(openai.start(), "sk-test", "m"),
        "anthropic": AnthropicProvider(anthropic.start(), "sk-test", "m"),
    }
    yield clients
    openai.stop()
    anthropic.stop()


def _request(name: str) -> ModelRequest:
    instructions, tools, messages = REQUESTS[name]
    return ModelRequest(
        model="fake-model",
        instructions=instructions,
        messages=messages,
        tools=tools,
        max_output_tokens=512,
        timeout_seconds=10,
    )


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
@pytest.mark.parametrize("name", list(REQUESTS))
def test_it_never_estimates_fewer_input_tokens_than_the_provider_reports(providers, kind, name):
    request = _request(name)
    reported = providers[kind].complete(request).usage.total_input
    estimate = estimate_input_tokens(request)
    assert estimate >= reported, f"{kind} {name}: estimate {estimate} < reported {reported}"
    assert estimate <= 2 * reported, f"{kind} {name}: estimate {estimate} is wasteful against {reported}"


def test_it_counts_cached_tokens_as_input_too():
    """A prompt-cache hit lowers the price, not the token count the estimate must cover."""
    fake = FakeAnthropic()
    provider = AnthropicProvider(fake.start(), "sk-test", "m")
    try:
        request = _request("10 steps of JSON results")
        first = provider.complete(request).usage
        second = provider.complete(request).usage
    finally:
        fake.stop()
    assert first.cache_write_tokens > 0 and second.cached_input_tokens == first.cache_write_tokens
    assert estimate_input_tokens(request) >= second.total_input == first.total_input


def test_it_grows_with_the_text_and_counts_every_message():
    assert estimate_text("") == 0
    assert estimate_text("a" * 35) < estimate_text("a" * 36 * 2)
    base = ModelRequest(
        model="m", instructions="x", messages=[Message("user", "hi")], tools=[], max_output_tokens=1
    )
    more = ModelRequest(
        model="m", instructions="x", messages=[Message("user", "hi")] * 3, tools=[], max_output_tokens=1
    )
    assert estimate_input_tokens(more) > estimate_input_tokens(base)


def measured_ratios() -> dict[str, dict[str, float]]:
    """estimate / reported for every request and provider (printed by `python -m tests.llm.test_tokens`)."""
    openai, anthropic = FakeOpenAI(), FakeAnthropic()
    clients = {
        "openai": OpenAIProvider(openai.start(), "sk-test", "m"),
        "anthropic": AnthropicProvider(anthropic.start(), "sk-test", "m"),
    }
    try:
        return {
            name: {
                kind: estimate_input_tokens(_request(name))
                / client.complete(_request(name)).usage.total_input
                for kind, client in clients.items()
            }
            for name in REQUESTS
        }
    finally:
        openai.stop()
        anthropic.stop()


if __name__ == "__main__":
    for name, ratios in measured_ratios().items():
        print(f"{name:32} " + "  ".join(f"{kind} {ratio:.2f}" for kind, ratio in ratios.items()))
