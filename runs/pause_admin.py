"""The admin's pause and resume (runs/pausing.py does the work): Pause/Resume on the run page next
to Cancel, and list actions with a reason typed in the actions bar. Shown to those who may pause
(platform operators, the tenant's supervisors)."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ActionForm
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.shortcuts import redirect
from django.urls import path, reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_POST

from core.errors import DomainError
from runs import pausing
from runs.models import TERMINAL, BulkAction, RunStatus


class ReasonActionForm(ActionForm):
    reason = forms.CharField(
        required=False,
        max_length=2000,
        label="Reason",
        help_text="needed to pause or resume; kept in each run's events",
    )


class PauseAdminMixin(admin.ModelAdmin):
    """Mixed into runs.admin.RunAdmin, before its ModelAdmin class."""

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
        label = str(run.pk)[:8]
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
                messages.error(request, f"run {str(run.pk)[:8]}: {exc.message}")
        BulkAction.objects.filter(pk=action.pk).update(count=count)
        messages.success(
            request, f"{'resumed' if resume else 'paused'} {count} run{'s' if count != 1 else ''}"
        )
