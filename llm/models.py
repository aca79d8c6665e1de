from __future__ import annotations

from decimal import Decimal

from django.db import models


class ModelEndpoint(models.Model):
    """A provider endpoint with its prices, in budget currency per million tokens."""

    # Where calls go and which key they carry: apply and operators only (ToolServer's note).
    DESTINATION_FIELDS = ("kind", "base_url", "secret")
    # The provider account's limits (llm/quotas.py), shared with other tenants: operators only.
    # How a server is spoken to (llm/compat.py): the configuration file's, shown in the admin.
    SERVER_FIELDS = ("compat", "sampling", "stream", "first_token_timeout_seconds", "timeout_backoff_seconds")
    QUOTA_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_in_flight")

    class Kind(models.TextChoices):
        OPENAI = "openai"
        ANTHROPIC = "anthropic"
        SCRIPTED = "scripted"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="model_endpoints")
    name = models.SlugField(max_length=100)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    base_url = models.URLField(blank=True)
    model = models.CharField(max_length=200, blank=True)
    secret = models.ForeignKey(
        "tenants.Secret", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    price_input = models.DecimalField(max_digits=12, decimal_places=4, default=Decimal("0"))
    price_cached_input = models.DecimalField(max_digits=12, decimal_places=4, default=Decimal("0"))
    price_cache_write = models.DecimalField(max_digits=12, decimal_places=4, default=Decimal("0"))
    price_output = models.DecimalField(max_digits=12, decimal_places=4, default=Decimal("0"))
    timeout_seconds = models.FloatField(default=60.0)
    # OpenAI-compatible: send the run as `prompt_cache_key` (OpenAI routes requests with one key
    # to one cache). Off for servers that reject fields they do not know.
    send_cache_key = models.BooleanField(default=True)
    # OpenAI-compatible: how this server differs from OpenAI's API (llm/compat.py: output limit's
    # name, content of a tool-call turn, tool_choice, system message); {} is OpenAI's shape.
    compat = models.JSONField(default=dict, blank=True)
    # Sampling defaults sent with every call ({"temperature": 0.2, "top_p": 0.9}; llm/compat.py):
    # small self-hosted models wander at the servers' default temperature.
    sampling = models.JSONField(default=dict, blank=True)
    # Read answers as they stream and close the connection at the call's output limit
    # (llm/providers/http.py): the output is bounded by the platform, not only by the server.
    stream = models.BooleanField(default=True)
    # A streamed answer whose first token has not come in this many seconds is given up (and so
    # is any later silence that long); null: timeout_seconds alone.
    first_token_timeout_seconds = models.FloatField(null=True, blank=True)
    # At most this many calls to the endpoint at once, across every worker and tenant on the same
    # account (llm/quotas.py): a one-slot llama.cpp server queues a second call behind the first,
    # where it times out. null: not capped here. Runs over the cap wait as rows, holding no worker.
    max_in_flight = models.PositiveIntegerField(null=True, blank=True)
    # After a call to the endpoint timed out, no call goes to it for this long, times a random
    # factor from 1 to 2 (jitter), so retries do not queue behind the abandoned generation.
    timeout_backoff_seconds = models.FloatField(default=5.0)
    # The last `manage.py probe_endpoint` (llm/probe.py): when, whether every check passed, and
    # each check's outcome with the setting to change; {} never probed.
    probe = models.JSONField(default=dict, blank=True)
    # The provider's quota for this account and model (llm/quotas.py), shared by every worker and
    # every tenant whose endpoint reaches the same account; null: not limited here.
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    # Scripted endpoints keep their script here ({"turns": [...], "latency_ms": 0}).
    config = models.JSONField(default=dict, blank=True)
    # The circuit breaker (llm/breaker.py): this many failures (5xx, refused connection, timeout)
    # within the window open it for `breaker_open_seconds`; then one probe call decides. 0: off.
    breaker_failures = models.PositiveIntegerField(default=5)
    breaker_window_seconds = models.PositiveIntegerField(default=60)
    breaker_open_seconds = models.PositiveIntegerField(default=30)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="uniq_endpoint_name"),
            models.CheckConstraint(
                condition=models.Q(requests_per_minute__isnull=True) | models.Q(requests_per_minute__gt=0),
                name="endpoint_rpm_positive",
            ),
            models.CheckConstraint(
                condition=models.Q(tokens_per_minute__isnull=True) | models.Q(tokens_per_minute__gt=0),
                name="endpoint_tpm_positive",
            ),
            models.CheckConstraint(
                condition=models.Q(max_in_flight__isnull=True) | models.Q(max_in_flight__gt=0),
                name="endpoint_max_in_flight_positive",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.kind})"


class EndpointCircuit(models.Model):
    """An endpoint's circuit breaker, shared by every worker process (llm/breaker.py).

    closed: calls go. open: calls fail over (or wait) without being sent, until `until`. half_open:
    one probe call is out, until `until` (its lease; past it another caller probes); its answer
    closes or reopens the circuit. Every move is one conditional UPDATE; the row is written only on
    a failure, a probe or a move, never on a call that simply answered.
    """

    class State(models.TextChoices):
        CLOSED = "closed"
        OPEN = "open"
        HALF_OPEN = "half_open"

    endpoint = models.OneToOneField(
        ModelEndpoint, primary_key=True, on_delete=models.CASCADE, related_name="circuit"
    )
    state = models.CharField(max_length=10, choices=State.choices, default=State.CLOSED)
    failures = models.PositiveIntegerField(default=0)  # in the window that began at window_started_at
    window_started_at = models.DateTimeField(null=True, blank=True)
    opened_at = models.DateTimeField(null=True, blank=True)
    until = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    changed_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.endpoint_id}: {self.state}"
