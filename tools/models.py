from __future__ import annotations

from django.db import models


class EffectClass(models.TextChoices):
    READ_ONLY = "read_only"
    IDEMPOTENT = "idempotent"
    RECONCILABLE = "reconcilable"
    UNSAFE = "unsafe"


# How long a provider may take, after our call ended, to make an accepted request visible to a
# status lookup or to de-duplicate a repeated key (DESIGN.md 5.1). Only classes that retry need one.
DEFAULT_SETTLE_SECONDS = {
    EffectClass.READ_ONLY: 0,
    EffectClass.IDEMPOTENT: 60,
    EffectClass.RECONCILABLE: 60,
    EffectClass.UNSAFE: 0,
}
# An "in progress" answer is waited on; past this many settle windows (and at least this many
# seconds) it is a person's problem.
IN_PROGRESS_PATIENCE = 10
MIN_IN_PROGRESS_PATIENCE = 300


class ToolServer(models.Model):
    # Where calls go and which secret they carry: configuration owned by `manage.py apply` and
    # platform operators, read-only to everyone else in the admin (DESIGN.md section 7).
    # status_tool too: it names the remote tool that recovery calls on its own (an effectful one
    # named there would be called without the model, the user or an approval).
    DESTINATION_FIELDS = (
        "kind",
        "transport",
        "url",
        "command",
        "secret",
        "auth_header",
        "auth_scheme",
        "status_tool",
        "oauth_token_url",
        "oauth_client_id",
        "oauth_client_secret",
        "oauth_scopes",
        "oauth_audience",
        "oauth_client_auth",
        "user_oauth",
    )

    class Kind(models.TextChoices):
        MCP = "mcp"
        HTTP = "http"
        BUILTIN = "builtin"

    class Transport(models.TextChoices):
        STREAMABLE_HTTP = "streamable_http"
        STDIO = "stdio"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="tool_servers")
    name = models.SlugField(max_length=50)  # prefix of its tools' names: "<name>.<tool>"
    kind = models.CharField(max_length=16, choices=Kind.choices)
    transport = models.CharField(max_length=16, choices=Transport.choices, blank=True)
    url = models.CharField(max_length=500, blank=True)
    command = models.JSONField(default=list, blank=True)
    secret = models.ForeignKey(
        "tenants.Secret", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    auth_header = models.CharField(max_length=100, default="Authorization", blank=True)
    auth_scheme = models.CharField(max_length=20, default="Bearer", blank=True)
    status_tool = models.CharField(max_length=200, blank=True)  # MCP: reconciliation lookup
    # The platform's own OAuth token for the server (client credentials; tools/client_credentials.py):
    # empty token URL, none. The token itself is never stored.
    oauth_token_url = models.CharField(max_length=500, blank=True)
    oauth_client_id = models.CharField(max_length=200, blank=True)
    oauth_client_secret = models.ForeignKey(
        "tenants.Secret", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    oauth_scopes = models.JSONField(default=list, blank=True)
    oauth_audience = models.CharField(max_length=500, blank=True)
    oauth_client_auth = models.CharField(
        max_length=8, blank=True, choices=[("basic", "HTTP Basic"), ("post", "in the form")]
    )
    # Each call carries the run's user's own OAuth token (connections/, docs/authority-oauth.md): the
    # tool list is not readable without one, so the file declares its tools (Tool.declared).
    user_oauth = models.BooleanField(default=False)
    last_synced_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="uniq_server_name")]

    def __str__(self) -> str:
        return self.name


class Tool(models.Model):
    """A tool under tenant control. Discovered tools start disabled; hints grant nothing."""

    DESTINATION_FIELDS = ("http_url", "status_url")  # see ToolServer.DESTINATION_FIELDS

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="tools")
    server = models.ForeignKey(ToolServer, on_delete=models.CASCADE, related_name="tools")
    name = models.CharField(max_length=200)  # "<server>.<remote_name>", what the model sees
    remote_name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    input_schema = models.JSONField(default=dict, blank=True)
    schema_hash = models.CharField(max_length=64, blank=True)
    annotations = models.JSONField(default=dict, blank=True)  # provider hints, display only
    # Description and input schema from the configuration file, not the server's list (a server
    # whose list needs a user's token); a later listing that differs is reported, never copied in.
    declared = models.BooleanField(default=False)
    enabled = models.BooleanField(default=False)
    quarantined = models.BooleanField(default=False)
    quarantine_reason = models.TextField(blank=True)
    effect_class = models.CharField(max_length=16, choices=EffectClass.choices, default=EffectClass.UNSAFE)
    approval_policy = models.TextField(default="never")  # never, always or Cedar: approvals/tool_rules.py
    policy_version = models.PositiveIntegerField(default=1)
    approval_ttl_seconds = models.PositiveIntegerField(null=True, blank=True)
    timeout_seconds = models.FloatField(default=30.0)
    price_micros = models.BigIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=3)
    backoff_seconds = models.FloatField(default=1.0)
    settle_seconds = models.PositiveIntegerField(null=True, blank=True)  # None: DEFAULT_SETTLE_SECONDS
    http_url = models.CharField(max_length=500, blank=True)  # http tools: POST target
    # What approving a call does, in business terms, and which arguments are money (tools/display.py).
    summary = models.CharField(max_length=500, blank=True)
    money_arguments = models.JSONField(default=dict, blank=True)
    status_url = models.CharField(max_length=500, blank=True)  # http reconcilable: GET {key}
    # run_python: {"limits": {<sandbox.limits.Limits name>: value}, "prices": {"cpu_second_micros",
    # "gib_second_micros"}}, from the configuration file (tools/run_python.py reads it).
    sandbox = models.JSONField(default=dict, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="uniq_tool_name")]
        permissions = [("use_tool", "Use tool"), ("approve_tool", "Approve calls of tool")]
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def settle_window(self) -> int:
        """Seconds after a call's timeout before a lookup or retry of it proves anything."""
        if self.settle_seconds is not None:
            return self.settle_seconds
        return DEFAULT_SETTLE_SECONDS[EffectClass(self.effect_class)]

    @property
    def offerable(self) -> bool:
        return self.enabled and not self.quarantined


class SandboxCaps(models.Model):
    """A tenant's ceiling on run_python's limits: a tool configured above it runs at the cap.
    An empty field caps nothing (the runner's own ceiling still holds)."""

    tenant = models.OneToOneField("tenants.Tenant", on_delete=models.CASCADE, related_name="sandbox_caps")
    wall_seconds = models.FloatField(null=True, blank=True)
    cpu_seconds = models.FloatField(null=True, blank=True)
    cores = models.FloatField(null=True, blank=True)
    memory_bytes = models.BigIntegerField(null=True, blank=True)
    processes = models.PositiveIntegerField(null=True, blank=True)
    tmp_bytes = models.BigIntegerField(null=True, blank=True)
    output_bytes = models.BigIntegerField(null=True, blank=True)
    output_files = models.PositiveIntegerField(null=True, blank=True)
    stdout_bytes = models.BigIntegerField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "sandbox caps"

    def __str__(self) -> str:
        return f"sandbox caps of {self.tenant}"
