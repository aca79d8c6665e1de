"""The model gateway: builds the context, prices calls, and calls the provider.

The request prefix (instructions, then tools sorted by name) is byte-stable across the steps of
a run so provider prompt caches hit; history grows at the end only and is shaped by the version's
context policy (llm/context.py): large results shown as a head and a pointer, old results masked
in batches, so the cached prefix is rewritten once per batch, not every step.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from decimal import Decimal

from agents import output as output_contract
from agents.spec import spec_for
from artifacts import services as artifacts
from llm import context
from llm.compat import Compat
from llm.models import ModelEndpoint
from llm.tokens import estimate_input_tokens
from llm.types import Message, ModelReply, ModelRequest, ProviderError, ToolCall, ToolSpec, Usage
from runs.models import OBSERVED, StepKind, StepStatus
from tenants.crypto import redact

_providers: dict[tuple, object] = {}
_providers_lock = threading.Lock()


def _input_text(value) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def build_messages(run, steps, results: dict | None = None) -> list[Message]:
    """The run's conversation in full. `results`, when given, is filled with message index ->
    context.Result for each tool message (what the context policy needs to shape it)."""
    messages = [first_message(run)]
    append_messages(messages, steps, {} if results is None else results)
    return messages


FILES_HEADING = "[platform: files given with this run]"
# A call that was never made, as a compact record names it (llm/compaction.py).
REFUSALS = {
    StepStatus.DENIED: "denied",
    StepStatus.REJECTED: "rejected",
    StepStatus.EXPIRED: "approval expired",
}


def first_message(run) -> Message:
    """The run's input, then a description of each file it was started with (never its content)."""
    text = _input_text(run.input)
    files = artifacts.start_descriptions(run)
    if files:
        text += "\n\n" + FILES_HEADING + "\n" + "\n\n".join(files)
    return Message(role="user", content=text)


def append_messages(
    messages: list[Message], steps, results: dict, decisions: dict[int, str] | None = None
) -> None:
    """Add the steps' turns (finished steps, in seq order) to a conversation, and their tool
    messages to `results` (message index -> context.Result). `decisions`: step seq -> a person's
    decision on its approval ("approved by ravi"), which a compact record names."""
    decisions = decisions or {}
    for step in steps:
        if step.kind == StepKind.MODEL and step.status == StepStatus.SUCCEEDED:
            calls = [
                ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"])
                for c in step.result.get("tool_calls", [])
            ]
            messages.append(Message(role="assistant", content=step.result.get("text", ""), tool_calls=calls))
            if step.result.get("output_errors"):
                # A final answer the version's output_schema refused: its errors go back to the model.
                messages.append(
                    Message(role="user", content=output_contract.feedback(step.result["output_errors"]))
                )
        elif step.kind == StepKind.TOOL and step.status in OBSERVED:
            is_error = step.status not in (StepStatus.SUCCEEDED, StepStatus.RESOLVED_SUCCEEDED) or bool(
                (step.result or {}).get("is_error")
            )
            stored = (step.result or {}).get("text")
            structured = (step.result or {}).get("structured")
            results[len(messages)] = context.Result(
                seq=step.seq,
                tool_name=step.tool_name,
                total_chars=len(stored) if isinstance(stored, str) else len(step.observation),
                artifacts=isinstance(structured, dict)
                and bool(structured.get("artifact") or structured.get("files")),
                refusal=REFUSALS.get(step.status, ""),
                decision=decisions.get(step.seq, ""),
            )
            messages.append(
                Message(role="tool", content=step.observation, tool_call_id=step.call_id, is_error=is_error)
            )


def build_request(
    run, steps, tools: list[ToolSpec], *, policy: context.ContextPolicy | None = None
) -> ModelRequest:
    """The request for the run's next model call, shaped by the version's context policy."""
    results: dict[int, context.Result] = {}
    return request_for(run, build_messages(run, steps, results), results, tools, policy=policy)


def request_for(
    run,
    messages: list[Message],
    results: dict[int, context.Result],
    tools: list[ToolSpec],
    *,
    policy: context.ContextPolicy | None = None,
    endpoint: ModelEndpoint | None = None,
) -> ModelRequest:
    """The request for a conversation already built (the engine keeps it: runs/engine/conversation.py).

    `endpoint`: where it goes, if not the version's primary (a fallback: llm/fallback.py)."""
    return shaped_request(run, messages, results, tools, policy=policy, endpoint=endpoint)[0]


def shaped_request(
    run,
    messages: list[Message],
    results: dict[int, context.Result],
    tools: list[ToolSpec],
    *,
    policy: context.ContextPolicy | None = None,
    endpoint: ModelEndpoint | None = None,
    resume=None,
    summaries: dict[int, str] | None = None,
) -> tuple[ModelRequest, context.Shaped]:
    """request_for's request, and how the context policy shaped it (what it folded, if anything).

    `resume`: the Shaped.plan of the run's previous call (runs/engine/conversation.py keeps it).
    `summaries`: per fold's call point, its summary by the version's summariser, if any."""
    version = run.version
    spec = spec_for(version)
    endpoint = endpoint or version.model_endpoint
    if policy is None:
        policy = context.ContextPolicy.from_spec(dict(spec.context))
    clears = provider_clears(endpoint)
    shaped = context.shaped(messages, results, policy.at(clears=clears), resume=resume, summaries=summaries)
    # read_result only once the policy has shortened, masked or folded something it could page
    # back, or the model has been shown an artifact (whose text it can page through).
    shown_artifacts = any(r.artifacts for r in results.values()) or (
        bool(messages) and FILES_HEADING in messages[0].content
    )
    request = ModelRequest(
        model=endpoint.model,
        instructions=spec.instructions + (output_contract.instructions(spec.output) if spec.output else ""),
        messages=shaped.messages,
        tools=context.offered(tools, policy, paged=shaped.paged, artifacts=shown_artifacts),
        max_output_tokens=run.limits["max_output_tokens"],
        timeout_seconds=endpoint.timeout_seconds,
        first_token_timeout_seconds=endpoint.first_token_timeout_seconds,
        cache_key=f"run-{run.pk}",
        clear_tool_uses=policy.clearing() if clears and policy.compaction == "provider" else None,
    )
    return request, shaped


def provider_clears(endpoint: ModelEndpoint) -> bool:
    """The endpoint clears old tool results itself when asked (Anthropic's context editing)."""
    return endpoint.kind == "anthropic" and Compat.of(endpoint.compat).context_editing == "clear_tool_uses"


def _micros(tokens: int, price_per_million: Decimal) -> Decimal:
    # Prices are per million tokens in currency units; micros are millionths of a unit.
    return Decimal(tokens) * price_per_million


def estimate_cost_micros(
    endpoint: ModelEndpoint, request: ModelRequest, *, input_tokens: int | None = None
) -> int:
    """Worst case: every input token uncached (or written to cache), every output token used.

    `input_tokens`: estimate_input_tokens(request), if the caller has it already.
    """
    if input_tokens is None:
        input_tokens = estimate_input_tokens(request)
    input_price = max(endpoint.price_input, endpoint.price_cache_write)
    cost = _micros(input_tokens, input_price) + _micros(request.max_output_tokens, endpoint.price_output)
    return math.ceil(cost)


def cost_micros(endpoint: ModelEndpoint, usage: Usage) -> int:
    cost = (
        _micros(usage.input_tokens, endpoint.price_input)
        + _micros(usage.cached_input_tokens, endpoint.price_cached_input)
        + _micros(usage.cache_write_tokens, endpoint.price_cache_write)
        + _micros(usage.output_tokens, endpoint.price_output)
    )
    return math.ceil(cost)


def prefix_hash(request: ModelRequest) -> str:
    prefix = json.dumps(
        [request.instructions, [[t.name, t.description, t.input_schema] for t in request.tools]],
        sort_keys=True,
    )
    return hashlib.sha256(prefix.encode()).hexdigest()[:16]


def request_summary(request: ModelRequest, *, input_tokens: int | None = None) -> dict:
    """What the step stores about its request: enough to audit, nothing secret."""
    if input_tokens is None:
        input_tokens = estimate_input_tokens(request)
    return {
        "model": request.model,  # the endpoint's model: what answered, if anything did
        "messages": len(request.messages),
        "tools": [t.name for t in request.tools],
        "max_output_tokens": request.max_output_tokens,
        "estimated_input_tokens": input_tokens,
        "prefix_hash": prefix_hash(request),
    }


def _provider(endpoint: ModelEndpoint):
    # Each provider's client library is imported only by the processes that call that provider.
    from llm.providers.scripted import ScriptedProvider

    if endpoint.kind == ModelEndpoint.Kind.SCRIPTED:
        return ScriptedProvider(endpoint.config)
    api_key = endpoint.secret.reveal() if endpoint.secret is not None else None
    key = (
        endpoint.kind,
        endpoint.base_url,
        endpoint.model,
        endpoint.send_cache_key,
        json.dumps(endpoint.compat or {}, sort_keys=True),
        json.dumps(endpoint.sampling or {}, sort_keys=True),
        endpoint.stream,
        hashlib.sha256((api_key or "").encode()).hexdigest(),
    )
    with _providers_lock:
        provider = _providers.get(key)
        if provider is None:
            if endpoint.kind == ModelEndpoint.Kind.OPENAI:
                from llm.providers.openai import OpenAIProvider  # see _provider's first import

                provider = OpenAIProvider(
                    endpoint.base_url,
                    api_key,
                    endpoint.model,
                    send_cache_key=endpoint.send_cache_key,
                    compat=Compat.of(endpoint.compat),
                    sampling=endpoint.sampling,
                    stream=endpoint.stream,
                )
            else:
                from llm.providers.anthropic import AnthropicProvider  # see _provider's first import

                provider = AnthropicProvider(
                    endpoint.base_url,
                    api_key,
                    endpoint.model,
                    compat=Compat.of(endpoint.compat),
                    sampling=endpoint.sampling,
                    stream=endpoint.stream,
                )
            _providers[key] = provider
    return provider


def call_model(endpoint: ModelEndpoint, request: ModelRequest) -> ModelReply:
    """Call the provider once (the engine owns retries). Secrets never leave in errors."""
    provider = _provider(endpoint)
    try:
        return provider.complete(request)
    except ProviderError as exc:
        secret = [endpoint.secret.reveal()] if endpoint.secret is not None else []
        raise ProviderError(
            redact(str(exc), secret),
            retryable=exc.retryable,
            sent=exc.sent,
            status=exc.status,
            retry_after=exc.retry_after,
            timed_out=exc.timed_out,
        ) from None
