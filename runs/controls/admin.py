"""The admin's operator controls (runs/controls/pausing.py and kill_switches.py do the work).

| page or control | what it does |
|---|---|
| Pause / Resume on the run page, list actions with a reason | one run, or the selected runs (PauseAdminMixin, mixed into the run admin) |
| Kill switches | the switches, those on first, and a form that flips one with a reason (turning one off resumes what it paused) |
| Bulk actions | the audit list of pauses and resumes by filter (who, why, the filter, how many) and a form that pauses or resumes every matching run, as `POST /v1/runs/pause` and `manage.py pause_runs` do |

Shown to those who may pause (platform operators everywhere, the tenant's supervisors for their
tenant's runs).
"""

from __future__ import annotations

import json

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ActionForm
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Count
from django.shortcuts import redirect
from django.urls import path, reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.formats import date_format
from django.utils.html import format_html, format_html_join
from django.views.decorators.http import require_POST

from core.errors import DomainError
from core.ids import short
from runs.controls import cancelling, kill_switches, pausing
from runs.models import TERMINAL, BulkAction, KillSwitch, RunStatus
from tenants.admin_site import DATETIME_FORMAT, TenantScopedAdmin, site
from tenants.models import Tenant, User


class ReasonActionForm(ActionForm):
    reason = forms.CharField(
        required=False,
        max_length=2000,
        label="Reason",
        help_text="needed to pause, resume or cancel; kept in each run's events",
    )


class PauseAdminMixin(admin.ModelAdmin):
    """Mixed into runs.front.admin.RunAdmin, before its ModelAdmin class."""

    action_form = ReasonActionForm

    def has_pause_permission(self, request, obj=None):
        tenant_id = obj.tenant_id if obj is not None else request.user.tenant_id
        return pausing.may_pause(request.user, tenant_id)

    def pause_context(self, request, run) -> dict:
        may = not run.is_terminal and self.has_pause_permission(request, run)
        paused = run.status == RunStatus.PAUSED or run.pause_requested
        return {"can_pause": may and not paused and not run.cancel_requested, "can_resume": may and paused}

    def get_urls(self):
        view = self.admin_site.admin_view
        return [
            path("<path:object_id>/pause/", view(require_POST(self.pause_view)), name="runs_run_pause"),
            path("<path:object_id>/resume/", view(require_POST(self.resume_view)), name="runs_run_resume"),
            *super().get_urls(),
        ]

    def pause_view(self, request, object_id):
        return self._one(request, object_id, resume=False)

    def resume_view(self, request, object_id):
        return self._one(request, object_id, resume=True)

    def _one(self, request, object_id, *, resume: bool):
        run = self.get_object(request, unquote(object_id))
        if run is None or not self.has_pause_permission(request, run):
            raise PermissionDenied
        until = request.POST.get("until", "").strip()
        self._act(request, run, reason=request.POST.get("reason", "").strip(), resume=resume, until=until)
        return redirect(reverse("admin:runs_run_change", args=[run.pk]))

    def _act(self, request, run, *, reason: str, resume: bool, until: str = "") -> bool:
        label = short(run.pk)
        if not resume and not reason:
            messages.error(request, f"run {label}: say why it is paused")
            return False
        ends = parse_datetime(until) if until else None
        if until and ends is None:
            messages.error(request, f"run {label}: until: not a date and time")
            return False
        if ends is not None and timezone.is_naive(ends):
            ends = timezone.make_aware(ends, run.tenant.zone)  # as the form says: the tenant's zone
        try:
            if resume:
                pausing.resume_run(run_id=run.pk, actor=request.user, reason=reason)
            else:
                pausing.pause_run(run_id=run.pk, actor=request.user, reason=reason, until=ends)
        except DomainError as exc:
            messages.error(request, f"run {label}: {exc.message}")
            return False
        messages.success(
            request,
            f"run {label}: resumed"
            if resume
            else f"run {label}: paused (a call in flight is recorded first; nothing new is sent)",
        )
        return True

    @admin.action(description="Pause selected runs (give a reason)", permissions=["pause"])
    def pause_selected(self, request, queryset):
        self._selected(request, queryset, resume=False)

    @admin.action(description="Resume selected runs", permissions=["pause"])
    def resume_selected(self, request, queryset):
        self._selected(request, queryset, resume=True)

    def _selected(self, request, queryset, *, resume: bool) -> None:
        reason = request.POST.get("reason", "").strip()
        if not reason:
            messages.error(request, "give a reason in the actions bar")
            return
        runs = queryset.exclude(status__in=TERMINAL)
        runs = runs.filter(status=RunStatus.PAUSED) | runs.filter(pause_requested=True) if resume else runs
        chosen = [run for run in runs.order_by("created_at") if self.has_pause_permission(request, run)]
        action = BulkAction.objects.create(
            kind=BulkAction.Kind.RESUME if resume else BulkAction.Kind.PAUSE,
            tenant_id=request.user.tenant_id,
            actor=request.user,
            reason=reason,
            filters={"selected_in_admin": [str(run.pk) for run in chosen]},
        )
        count = 0
        for run in chosen:
            try:
                if resume:
                    pausing.resume_run(
                        run_id=run.pk,
                        actor=request.user,
                        reason=reason,
                        countdown=count / pausing.RESUME_PER_SECOND,
                        bulk=action.pk,
                    )
                else:
                    pausing.pause_run(run_id=run.pk, actor=request.user, reason=reason, bulk=action.pk)
                count += 1
            except DomainError as exc:
                messages.error(request, f"run {short(run.pk)}: {exc.message}")
        BulkAction.objects.filter(pk=action.pk).update(count=count)
        messages.success(
            request, f"{'resumed' if resume else 'paused'} {count} run{'s' if count != 1 else ''}"
        )


def _target_choices(request, scopes: list[str]) -> list:
    """The targets of the scopes the user may flip, grouped by scope: a picker, not free text.
    A tenant's staff see their tenant's; platform operators every tenant's (the tenant is picked
    beside it)."""
    tenant_id = None if request.user.is_superuser else request.user.tenant_id
    groups = []
    for scope in scopes:
        names = kill_switches.target_names(scope, tenant_id)
        if names:
            groups.append((KillSwitch.Scope(scope).label, [(name, name) for name in names]))
    return [("", "---------"), *groups]


def _tenant_choices() -> list:
    return [("", "the target's tenant"), *Tenant.objects.order_by("slug").values_list("slug", "name")]


class FlipForm(forms.ModelForm):
    target = forms.ChoiceField(help_text="the tenant, or the agent, tool or model endpoint to stop")
    tenant_slug = forms.ChoiceField(
        required=False, label="Tenant", help_text="platform operators: the target's tenant"
    )

    class Meta:
        model = KillSwitch
        fields = ["scope", "on", "reason"]


class FlippersOnly:
    """Whoever may flip any of the tenant's switches (kill_switches.may_flip) sees the page and
    adds; a switch is changed only by whoever may flip its scope."""

    def _may(self, request) -> bool:
        user = request.user
        if not user.is_authenticated or not user.is_active:
            return False
        return kill_switches.may_flip(user, user.tenant_id)

    def has_module_permission(self, request):
        return self._may(request)

    def has_view_permission(self, request, obj=None):
        return self._may(request)

    def has_add_permission(self, request):
        return self._may(request)


@admin.register(KillSwitch, site=site)
class KillSwitchAdmin(FlippersOnly, TenantScopedAdmin):
    list_display = ["scope", "target_name", "tenant", "on", "changed_by", "reason", "changed_at", "flips"]
    list_filter = ["on", "scope"]
    ordering = ["-on", "-changed_at"]
    form = FlipForm

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(flip_count=Count("changes"))

    @admin.display(description="flips", ordering="flip_count")
    def flips(self, obj) -> int:
        return obj.flip_count

    def get_readonly_fields(self, request, obj=None):
        return ["history"] if obj is not None else []

    @admin.display(description="history (every flip, newest first)")
    def history(self, obj) -> str:
        """Every flip of the switch: when, on or off, who, why, and what turning it off resumed."""
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    date_format(timezone.localtime(change.at), DATETIME_FORMAT),
                    "on" if change.on else "off",
                    change.actor.username if change.actor else "",
                    change.reason,
                    change.runs_resumed if not change.on else "",
                )
                for change in obj.changes.select_related("actor").order_by("-at", "-pk")
            ),
        )
        return format_html(
            '<table class="switch-history"><thead><tr><th>when</th><th>switch</th><th>who</th><th>why</th>'
            "<th>runs resumed</th></tr></thead><tbody>{}</tbody></table>",
            rows,
        )

    def get_fields(self, request, obj=None):
        if obj is not None:
            return ["on", "reason", "history"]  # a flip: the target stays
        if request.user.is_superuser:
            return ["scope", "target", "tenant_slug", "on", "reason"]
        return ["scope", "target", "on", "reason"]

    def get_form(self, request, obj=None, change=False, **kwargs):
        form = super().get_form(request, obj, change=change, **kwargs)
        if obj is not None:
            form.base_fields["target"].required = False
            return form
        scopes = kill_switches.scopes_for(request.user, request.user.tenant_id)

        class Checked(form):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.fields["scope"].choices = [c for c in KillSwitch.Scope.choices if c[0] in scopes]
                self.fields["target"].choices = _target_choices(request, scopes)
                if "tenant_slug" in self.fields:
                    self.fields["tenant_slug"].choices = _tenant_choices()

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
        if obj is None:
            return self._may(request)
        return kill_switches.may_flip(request.user, obj.tenant_id, obj.scope)

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        if change:
            tenant, scope, target = obj.tenant, obj.scope, obj.target_name
        else:
            tenant = form._tenant(data.get("tenant_slug"))
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
        return None  # kill_switches.flip wrote the LogEntry (runs/controls/audit.py)

    def log_change(self, request, obj, message):
        return None


FILTER_FIELDS = ("tenant", "agent", "version", "tool", "endpoint", "created_by", "status", "created_before")
PICKED = {"tenant", "agent", "tool", "endpoint", "created_by"}


class BulkForm(forms.ModelForm):
    tenant = forms.ChoiceField(
        required=False, help_text="platform operators: one tenant's runs (or every tenant's)"
    )
    agent = forms.ChoiceField(required=False, help_text="one agent's runs")
    version = forms.IntegerField(required=False, min_value=1, help_text="one version of the agent")
    tool = forms.ChoiceField(required=False, help_text="runs whose next or pending call is to this tool")
    endpoint = forms.ChoiceField(required=False, help_text="runs whose version calls this model endpoint")
    created_by = forms.ChoiceField(required=False, help_text="runs this person started")
    status = forms.ChoiceField(required=False, choices=[("", "any")] + list(RunStatus.choices))
    created_before = forms.DateTimeField(required=False, help_text="runs created before this time")
    until = forms.DateTimeField(
        required=False, help_text="pause only: when the pause ends (the platform resumes them then)"
    )
    previewed = forms.CharField(required=False, widget=forms.HiddenInput)

    class Meta:
        model = BulkAction
        fields = ["kind", "reason"]


def _filter_choices(request) -> dict[str, list]:
    """The pickers' options: what the user's tenant has (every tenant's, for platform operators)."""
    tenant_id = None if request.user.is_superuser else request.user.tenant_id
    names = {
        "agent": kill_switches.target_names(KillSwitch.Scope.AGENT, tenant_id),
        "tool": kill_switches.target_names(KillSwitch.Scope.TOOL, tenant_id),
        "endpoint": kill_switches.target_names(KillSwitch.Scope.ENDPOINT, tenant_id),
        "tenant": list(Tenant.objects.order_by("slug").values_list("slug", flat=True)),
    }
    users = User.objects.order_by("username")
    if tenant_id is not None:
        users = users.filter(tenant_id=tenant_id)
    names["created_by"] = list(users.values_list("username", flat=True))
    return {field: [("", "any"), *((n, n) for n in found)] for field, found in names.items()}


def preview_key(kind: str, filters: dict, until) -> str:
    """What a preview was of: the confirmation counts only for the same action and filters."""
    shown = {k: str(v) for k, v in filters.items() if v not in (None, "")}
    return json.dumps([kind, shown, str(until or "")], sort_keys=True)


DONE: dict[str, str] = {
    BulkAction.Kind.PAUSE: "paused (each at its step boundary)",
    BulkAction.Kind.RESUME: "resumed",
    BulkAction.Kind.CANCEL: "cancelled (a call in flight is recorded first)",
}


@admin.register(BulkAction, site=site)
class BulkActionAdmin(pausing.PausersOnly, TenantScopedAdmin):
    """A bulk action is two steps: Save shows how many runs match now and the first few (nothing
    changes), Save again with the same action and filters applies it."""

    list_display = ["at", "kind", "count", "actor", "reason", "tenant", "filters"]
    list_filter = ["kind"]
    ordering = ["-at"]
    form = BulkForm

    def get_fields(self, request, obj=None):
        if obj is not None:
            return ["kind", "count", "actor", "reason", "tenant", "filters", "at"]
        scoped = [f for f in FILTER_FIELDS if request.user.is_superuser or f != "tenant"]
        return ["kind", "reason", *scoped, "until", "previewed"]

    def get_readonly_fields(self, request, obj=None):
        return self.get_fields(request, obj) if obj is not None else []

    def get_form(self, request, obj=None, change=False, **kwargs):
        form = super().get_form(request, obj, change=change, **kwargs)
        if obj is not None:
            return form

        class Previewed(form):  # type: ignore[misc, valid-type]
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                for name, choices in _filter_choices(request).items():
                    if name in self.fields:
                        self.fields[name].choices = choices

            def clean(self):
                data = super().clean()
                if self.errors or not data.get("kind"):
                    return data
                filters = {name: data.get(name) for name in FILTER_FIELDS}
                key = preview_key(data["kind"], filters, data.get("until"))
                if data.get("previewed") == key:
                    return data
                try:
                    _, count, sample = pausing.preview(actor=request.user, kind=data["kind"], filters=filters)
                except DomainError as exc:
                    for field, errs in (exc.fields or {}).items():
                        self.add_error(field if field in self.fields else None, errs)
                    if not exc.fields:
                        self.add_error(None, exc.message)
                    return data
                shown = self.data.copy()  # type: ignore[has-type]  # a bound form's QueryDict
                shown["previewed"] = key
                self.data = shown  # the next Save, unchanged, goes ahead
                first = ", ".join(f"{short(run.pk)} ({run.agent.name})" for run in sample)
                raise forms.ValidationError(
                    f"Preview: this would {data['kind']} {count} run{'s' if count != 1 else ''} now"
                    + (f" (first: {first})" if first else "")
                    + ". Nothing has changed yet: press Save again to go ahead.",
                    code="preview",
                )

        return Previewed

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
            elif data["kind"] == BulkAction.Kind.CANCEL:
                action = cancelling.cancel_matching(
                    actor=request.user, reason=data["reason"], filters=filters
                )
            else:
                action = pausing.resume_matching(actor=request.user, reason=data["reason"], filters=filters)
        except DomainError as exc:
            messages.error(request, exc.message)
            return
        obj.pk = action.pk
        done = DONE[action.kind]
        messages.info(request, f"{action.count} run{'s' if action.count != 1 else ''} {done}")

    def log_addition(self, request, obj, message):
        # Each run's LogEntry (runs/controls/audit.py), its event and the BulkAction are the record.
        return None

    def response_add(self, request, obj, post_url_continue=None):
        return self.response_post_save_add(request, obj)
