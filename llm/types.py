"""Provider-neutral shapes that cross the model gateway."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolSpec:
    """A tool as offered to the model: name, description, JSON schema of its arguments."""

    name: str
    description: str
    input_schema: dict


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict


@dataclass
class Message:
    """One conversation turn.

    role is "user", "assistant" or "tool". An assistant message may carry tool_calls;
    a tool message answers exactly one call (tool_call_id) and may be an error.
    System instructions travel separately in ModelRequest.instructions.
    """

    role: str
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str = ""
    is_error: bool = False
    # llm.tokens' estimate of this message, made once: a run's messages are sent again on every
    # model call, and a message is never changed once made (the context policy makes new ones).
    estimated_tokens: int | None = field(default=None, init=False, repr=False, compare=False)
    # A tool message's line in a compact record (llm.compaction.Line), made once when it is first
    # folded: a long run's folds are replayed on every call.
    record_line: object = field(default=None, init=False, repr=False, compare=False)


@dataclass(frozen=True)
class ModelRequest:
    model: str
    instructions: str
    messages: list[Message]
    tools: list[ToolSpec]
    max_output_tokens: int
    timeout_seconds: float = 60.0
    # A streamed answer whose first token has not come within this many seconds is given up (a
    # server queueing behind another generation, or stuck); None: only timeout_seconds bounds it.
    # It also bounds any silence later in the stream.
    first_token_timeout_seconds: float | None = None
    # Groups the requests of one run for providers that route prompt caches by a key
    # (OpenAI's prompt_cache_key); empty: none is sent.
    cache_key: str = ""
    # The provider's own context management, where the version's policy asks for it and the
    # endpoint supports it (llm/context.py, `compaction: provider`): Anthropic's clearing of old
    # tool results, {"trigger": tokens, "keep": tool uses, "clear_at_least": tokens}.
    clear_tool_uses: dict[str, int] | None = None


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0  # uncached input tokens
    cached_input_tokens: int = 0  # input tokens read from the provider's prompt cache
    cache_write_tokens: int = 0  # input tokens written to the prompt cache (Anthropic)
    output_tokens: int = 0
    # "server": the provider's own usage report. "platform": the platform stopped reading (the
    # output limit was reached) or the server reported none, so these are its own count: input by
    # llm.tokens' estimate unless the server had reported it, output as read from the stream.
    counted_by: str = "server"

    @property
    def total_input(self) -> int:
        return self.input_tokens + self.cached_input_tokens + self.cache_write_tokens


@dataclass(frozen=True)
class ModelReply:
    text: str
    tool_calls: list[ToolCall]
    usage: Usage
    stop_reason: str = ""
    # What the provider's context management cleared from this request (tokens and tool uses):
    # the client sent them, the model did not read them and they were not billed.
    cleared_input_tokens: int = 0
    cleared_tool_uses: int = 0


class ProviderError(Exception):
    """A model provider call failed.

    retryable: 429, 5xx, timeouts, connection resets. permanent: other 4xx.
    sent: the request may have reached the provider (so it may have been charged).
    timed_out: no answer within the call's timeout (llm/fallback.error_class: `timeout`).
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        sent: bool,
        status: int | None = None,
        retry_after: float | None = None,
        timed_out: bool = False,
    ):
        super().__init__(message)
        self.timed_out = timed_out
        self.retryable = retryable
        self.sent = sent
        self.status = status
        self.retry_after = retry_after
