"""The operators' page of kill switches (runs/kill_switches.py): the switches, those on first, and a
form that flips one with a reason (turning one off resumes what it paused). Open to those who may
pause runs (platform operators, the tenant's supervisors)."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages

from core.errors import DomainError
from runs import kill_switches, pausing
from runs.models import KillSwitch
from tenants.admin_site import TenantScopedAdmin, site
from tenants.models import Tenant


class FlipForm(forms.ModelForm):
    target = forms.CharField(
        max_length=200, help_text="the tenant's slug, or the agent's, tool's or endpoint's name"
    )
    tenant_slug = forms.SlugField(
        required=False, label="Tenant", help_text="platform operators: the target's tenant"
    )

    class Meta:
        model = KillSwitch
        fields = ["scope", "on", "reason"]


@admin.register(KillSwitch, site=site)
class KillSwitchAdmin(pausing.PausersOnly, TenantScopedAdmin):
    list_display = ["scope", "target_name", "tenant", "on", "changed_by", "reason", "changed_at"]
    list_filter = ["on", "scope"]
    ordering = ["-on", "-changed_at"]
    form = FlipForm

    def get_fields(self, request, obj=None):
        if obj is not None:
            return ["on", "reason"]  # a flip: the target stays
        return (
            ["scope", "target", "tenant_slug", "on", "reason"]
            if request.user.is_superuser
            else [
                "scope",
                "target",
                "on",
                "reason",
            ]
        )

    def get_form(self, request, obj=None, change=False, **kwargs):
        form = super().get_form(request, obj, change=change, **kwargs)
        if obj is not None:
            form.base_fields["target"].required = False
            return form

        class Checked(form):  # type: ignore[misc, valid-type]
            def clean(self):
                # A target that does not exist is the form's error, not a failed save.
                data = super().clean()
                tenant = self._tenant(data.get("tenant_slug"))
                if tenant is None:
                    self.add_error("tenant_slug" if request.user.is_superuser else None, "no such tenant")
                elif data.get("scope") and data.get("target"):
                    try:
                        kill_switches.target_of(data["scope"], data["target"], tenant)
                    except DomainError as exc:
                        self.add_error("target", exc.message)
                return data

            def _tenant(self, slug):
                if slug:
                    return Tenant.objects.filter(slug=slug).first()
                return Tenant.objects.filter(pk=request.user.tenant_id).first()

        return Checked

    def has_change_permission(self, request, obj=None):
        return self._may(request)

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        if change:
            tenant, scope, target = obj.tenant, obj.scope, obj.target_name
        else:
            slug = data.get("tenant_slug")
            tenant = (
                Tenant.objects.filter(slug=slug).first()
                if slug
                else Tenant.objects.filter(pk=request.user.tenant_id).first()
            )
            scope, target = data["scope"], data["target"]
        try:
            flipped = kill_switches.flip(
                actor=request.user,
                tenant=tenant,
                scope=scope,
                target=target,
                on=data["on"],
                reason=data["reason"],
            )
        except DomainError as exc:
            messages.error(request, exc.message)
            return
        obj.pk = flipped.switch_id
        note = f"; {flipped.runs_resumed} paused runs resumed" if not data["on"] else ""
        messages.info(request, f"{scope} {target}: switch {'on' if data['on'] else 'off'}{note}")

    def log_addition(self, request, obj, message):
        return None  # the switch's own KillSwitchChange is the record

    def log_change(self, request, obj, message):
        return None
