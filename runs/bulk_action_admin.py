"""The admin's pause and resume by filter (runs/pausing.py does the work): the audit list of bulk
actions (who, why, the filter, how many) and a form that pauses or resumes every matching run, as
`POST /v1/runs/pause` and `manage.py pause_runs` do. Open to those who may pause runs (platform
operators everywhere, the tenant's supervisors for their tenant's runs)."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages

from core.errors import DomainError
from runs import pausing
from runs.models import BulkAction, RunStatus
from tenants.admin_site import TenantScopedAdmin, site

FILTER_FIELDS = ("tenant", "agent", "version", "tool", "endpoint", "created_by", "status", "created_before")


class BulkForm(forms.ModelForm):
    tenant = forms.SlugField(
        required=False, help_text="a tenant's slug (platform operators; a supervisor's own)"
    )
    agent = forms.SlugField(required=False, max_length=100, help_text="the agent's name")
    version = forms.IntegerField(required=False, min_value=1, help_text="one version of the agent")
    tool = forms.CharField(
        required=False, max_length=200, help_text="runs whose next or pending call is to this tool"
    )
    endpoint = forms.CharField(
        required=False, max_length=100, help_text="runs whose version calls this model endpoint"
    )
    created_by = forms.CharField(required=False, max_length=150, help_text="a username")
    status = forms.ChoiceField(required=False, choices=[("", "any")] + list(RunStatus.choices))
    created_before = forms.DateTimeField(required=False, help_text="runs created before this time")
    until = forms.DateTimeField(
        required=False, help_text="pause only: when the pause ends (the platform resumes them then)"
    )

    class Meta:
        model = BulkAction
        fields = ["kind", "reason"]


@admin.register(BulkAction, site=site)
class BulkActionAdmin(pausing.PausersOnly, TenantScopedAdmin):
    list_display = ["at", "kind", "count", "actor", "reason", "tenant", "filters"]
    list_filter = ["kind"]
    ordering = ["-at"]
    form = BulkForm

    def get_fields(self, request, obj=None):
        if obj is not None:
            return ["kind", "count", "actor", "reason", "tenant", "filters", "at"]
        scoped = [f for f in FILTER_FIELDS if request.user.is_superuser or f != "tenant"]
        return ["kind", "reason", *scoped, "until"]

    def get_readonly_fields(self, request, obj=None):
        return self.get_fields(request, obj) if obj is not None else []

    def has_change_permission(self, request, obj=None):
        return False  # the record of what was done stays as it was

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        filters = {name: data.get(name) for name in FILTER_FIELDS}
        try:
            if data["kind"] == BulkAction.Kind.PAUSE:
                action = pausing.pause_matching(
                    actor=request.user, reason=data["reason"], filters=filters, until=data.get("until")
                )
            else:
                action = pausing.resume_matching(actor=request.user, reason=data["reason"], filters=filters)
        except DomainError as exc:
            messages.error(request, exc.message)
            return
        obj.pk = action.pk
        done = "paused (each at its step boundary)" if action.kind == BulkAction.Kind.PAUSE else "resumed"
        messages.info(request, f"{action.count} run{'s' if action.count != 1 else ''} {done}")

    def log_addition(self, request, obj, message):
        return None  # the BulkAction row and each run's event are the record

    def response_add(self, request, obj, post_url_continue=None):
        return self.response_post_save_add(request, obj)
