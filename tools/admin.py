from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.utils.html import format_html_join

from approvals.tool_rules import RuleError, check
from connections.services import ConnectionUnusable
from tenants.admin_site import (
    OperatorsWrite,
    TenantGuardedAdmin,
    TenantScopedAdmin,
    is_operator,
    money,
    site,
)
from tenants.crypto import SecretKeyError
from tools.catalog import refresh, release_quarantine
from tools.models import SandboxCaps, Tool, ToolServer
from tools.services import configure_tool
from tools.types import ToolFailed, ToolNotSent


@admin.register(ToolServer, site=site)
class ToolServerAdmin(TenantScopedAdmin):
    list_display = ["name", "tenant", "kind", "transport", "url", "last_synced_at"]
    list_filter = ["kind"]
    actions = ["sync_tools"]

    def get_readonly_fields(self, request, obj=None):
        readonly = ["last_synced_at"]
        if not is_operator(request.user):
            # Where calls go and which secret they carry is configuration (apply, operators): a
            # supervisor who could edit the URL could have the tenant's secret sent to a host of
            # theirs. A stdio command also runs on the platform's machines.
            readonly += ToolServer.DESTINATION_FIELDS
        return readonly

    def has_add_permission(self, request):
        # A server is a destination: created by apply or by an operator.
        return is_operator(request.user) and super().has_add_permission(request)

    @admin.action(
        description="Sync the tool list from the server (changed tools are quarantined)",
        permissions=["change"],
    )
    def sync_tools(self, request, queryset):
        for server in queryset:
            try:
                # A server that takes each user's token is listed with the admin's own connection.
                report = refresh(server, request.user.pk)
            except (ToolFailed, ToolNotSent, SecretKeyError, ConnectionUnusable) as exc:
                messages.error(request, f"{server}: {exc}")
                continue
            messages.success(
                request,
                f"{server}: {len(report.added)} new (disabled until reviewed), "
                f"{len(report.quarantined)} quarantined, {len(report.unchanged)} unchanged, "
                f"{len(report.missing)} no longer listed"
                + (
                    f", {len(report.differs)} declared differently (quarantined, declaration kept)"
                    if report.differs
                    else ""
                ),
            )


def hints_html(annotations: dict) -> str:
    """MCP annotations as the server declared them: hints to a reviewer, never trusted."""
    hints = [
        (name.removesuffix("Hint"), "yes" if value is True else "no" if value is False else value)
        for name, value in sorted((annotations or {}).items())
        if name.endswith("Hint")
    ]
    if not hints:
        return "—"
    return format_html_join(", ", '<span class="hint">{}: {}</span>', hints)


class ToolForm(forms.ModelForm):
    class Meta:
        model = Tool
        fields = ["approval_policy"]  # the admin adds the rest from its fieldsets
        help_texts = {
            "approval_policy": 'never, always, or one Cedar permit annotated @approval("why") for this '
            'tool\'s calls: action == Action::"<tool>" (docs/policies.md)'
        }

    def clean_approval_policy(self):
        """never, always or one Cedar @approval permit for this tool (approvals/tool_rules.py)."""
        try:
            return check(self.cleaned_data["approval_policy"], tool=self.instance.name)
        except RuleError as exc:
            raise forms.ValidationError(str(exc)) from None


@admin.register(Tool, site=site)
class ToolAdmin(TenantGuardedAdmin):
    """Tools come from their server (sync); here they are reviewed, configured and granted.

    Grants (use_tool, approve_tool) are made on the "Object permissions" page of a tool.
    """

    form = ToolForm
    list_display = [
        "name",
        "server",
        "effect_class",
        "approval_policy",
        "enabled",
        "quarantined",
        "quarantine_note",
        "hints",
        "price",
    ]
    list_filter = ["enabled", "quarantined", "effect_class", ("server", admin.RelatedOnlyFieldListFilter)]
    list_select_related = ["server"]
    search_fields = ["name", "description"]
    actions = ["release_selected"]
    fieldsets = [
        (None, {"fields": ["name", "server", "tenant", "declared", "description", "input_schema", "hints"]}),
        ("Review", {"fields": ["enabled", "quarantined", "quarantine_reason"]}),
        ("Effects and approval", {"fields": ["effect_class", "approval_policy", "approval_ttl_seconds"]}),
        (
            "Calls",
            {
                "fields": [
                    "timeout_seconds",
                    "settle_seconds",
                    "price_micros",
                    "max_attempts",
                    "backoff_seconds",
                    "http_url",
                    "status_url",
                ],
                "description": "settle seconds: how long the provider may take, after the timeout, to make an "
                "accepted call visible to a status lookup or to de-duplicate its key. No lookup "
                "or retry of an idempotent or reconcilable call happens before sent + timeout + "
                "settle. Empty: 60 s for idempotent and reconcilable tools, 0 otherwise.",
            },
        ),
    ]
    readonly_fields = [
        "name",
        "server",
        "tenant",
        "declared",
        "description",
        "input_schema",
        "hints",
        "quarantined",
        "quarantine_reason",
    ]

    def get_readonly_fields(self, request, obj=None):
        readonly = list(super().get_readonly_fields(request, obj))
        if not is_operator(request.user):
            readonly += Tool.DESTINATION_FIELDS  # see ToolServerAdmin.get_readonly_fields
        return readonly

    @admin.display(description="hints (from the server, untrusted)")
    def hints(self, tool):
        return hints_html(tool.annotations)

    @admin.display(description="quarantine reason")
    def quarantine_note(self, tool):
        return tool.quarantine_reason or "—"

    @admin.display(description="price", ordering="price_micros")
    def price(self, tool):
        return money(tool.price_micros)

    def has_add_permission(self, request):
        # Tools are discovered by syncing their server, never typed in.
        return False

    def save_model(self, request, obj, form, change):
        # Through the service, so a new approval policy bumps policy_version and approvals
        # granted under the old policy no longer cover the call.
        stored = Tool.objects.get(pk=obj.pk)
        configure_tool(stored, {name: form.cleaned_data[name] for name in form.changed_data})

    @admin.action(description="Re-enable after review (release from quarantine)", permissions=["change"])
    def release_selected(self, request, queryset):
        released = [tool for tool in queryset if tool.quarantined]
        for tool in released:
            release_quarantine(tool)
            # The admin history is the only record of who reviewed the change.
            self.log_change(request, tool, f"released from quarantine (was: {tool.quarantine_reason})")
        messages.success(request, f"released {len(released)} tool(s) from quarantine")


@admin.register(SandboxCaps, site=site)
class SandboxCapsAdmin(OperatorsWrite, TenantScopedAdmin):
    """A tenant's ceiling on run_python's limits: set by platform operators, read by the tenant
    (a tenant raising its own ceiling would make it no ceiling)."""

    list_display = ["tenant", "wall_seconds", "cpu_seconds", "cores", "memory_bytes", "processes"]
