from __future__ import annotations

import json
from collections.abc import Callable

from django import forms
from django.contrib import admin
from django.utils.html import format_html

from agents.models import AgentDefinition, AgentVersion, Alias
from agents.services import move_alias
from core.errors import Conflict
from tenants.admin_site import ReadOnlyAdmin, TenantGuardedAdmin, TenantScopedAdmin, admin_link, site


class VersionInline(admin.TabularInline):
    model = AgentVersion
    fields = ["version_link", "content_hash", "model_endpoint", "created_by", "created_at"]
    readonly_fields = fields  # type: ignore[assignment]  # every field shown is read-only (stubs: fieldsets' type)
    extra = 0
    can_delete = False
    show_change_link = False

    @admin.display(description="version")
    def version_link(self, version):
        return admin_link(version, f"v{version.number}")

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class AliasInline(VersionInline):
    model = Alias  # type: ignore[assignment]  # the same read-only inline, over another model
    fields = ["name", "version", "updated_at"]
    readonly_fields = fields


@admin.register(AgentDefinition, site=site)
class AgentDefinitionAdmin(TenantGuardedAdmin):
    """Agents and their versions are created through the API (POST a spec); aliases move here.

    Who may start runs of an agent (run_agent) is granted on its "Object permissions" page (or
    in the tenant's configuration file); the agent itself is not edited here.
    """

    list_display = ["name", "tenant", "created_at"]
    search_fields = ["name"]
    inlines = [AliasInline, VersionInline]
    readonly_fields = ["name", "tenant", "created_at"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(AgentVersion, site=site)
class AgentVersionAdmin(ReadOnlyAdmin):
    """There is no way to modify a version: runs pin it, and its content hash must stay true."""

    list_display = ["__str__", "agent", "number", "short_hash", "model_endpoint", "created_by", "created_at"]
    list_filter = [("agent", admin.RelatedOnlyFieldListFilter)]
    list_select_related = ["agent", "model_endpoint", "created_by"]
    fields = ["agent", "number", "content_hash", "model_endpoint", "created_by", "created_at", "spec_json"]

    @admin.display(description="hash")
    def short_hash(self, version):
        return version.content_hash[:12]

    @admin.display(description="spec")
    def spec_json(self, version):
        return format_html('<pre class="spec">{}</pre>', json.dumps(version.spec, indent=2, sort_keys=True))


class AliasForm(forms.ModelForm):
    # The gate a move must pass (evals.gates); the evaluations' admin sets it (evals/admin.py).
    check_move: Callable[..., None] | None = None
    version_number = forms.IntegerField(min_value=1, label="version")

    class Meta:
        model = Alias
        fields = ["agent", "name"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.fields["version_number"].initial = self.instance.version.number

    def clean(self):
        cleaned = super().clean() or {}
        agent = cleaned.get("agent") or (self.instance.agent if self.instance.pk else None)
        number = cleaned.get("version_number")
        if agent and number and not agent.versions.filter(number=number).exists():
            self.add_error("version_number", f"{agent} has no version {number}")
        elif agent and number and self.check_move is not None:
            name = cleaned.get("name") or self.instance.name
            try:
                self.check_move(tenant=agent.tenant, agent=agent.name, alias=name, version=number)
            except Conflict as exc:
                self.add_error("version_number", exc.message)
        return cleaned


@admin.register(Alias, site=site)
class AliasAdmin(TenantScopedAdmin):
    form = AliasForm
    list_display = ["__str__", "agent", "version", "canary", "gated", "updated_at"]
    list_filter = [("agent", admin.RelatedOnlyFieldListFilter)]
    list_select_related = ["agent", "version", "canary_version"]

    @admin.display(description="canary")
    def canary(self, alias):
        if alias.canary_version is None:
            return "—"
        return f"v{alias.canary_version.number} at {alias.canary_percent}%"

    @admin.display(description="gate")
    def gated(self, alias):
        return alias.gate.get("dataset", "—") if alias.gate else "—"

    def get_readonly_fields(self, request, obj=None):
        # Renaming would create a second alias: an alias only moves between versions.
        return ["agent", "name"] if obj else []

    def save_model(self, request, obj, form, change):
        agent = obj.agent
        moved = move_alias(
            tenant=agent.tenant, agent=agent.name, alias=obj.name, version=form.cleaned_data["version_number"]
        )
        obj.pk, obj.version = moved.pk, moved.version

    def has_delete_permission(self, request, obj=None):
        # Deleting `prod` would make every new run of the agent fail to resolve a version.
        return False
