"""The supervisor inbox: pending calls on tools the user may approve, decided one by one or in bulk."""

from __future__ import annotations

import datetime as dt
import hashlib

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import OuterRef
from django.http import JsonResponse
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone

from agentplatform.admin_site import (
    ReadOnlyAdmin,
    admin_link,
    age,
    arguments_html,
    money,
    run_visible,
    site,
    status_filter,
    time_left,
)
from agentplatform.errors import DomainError
from approvals.models import Approval, ApprovalStatus
from approvals.selectors import approvable_tools, approvals_for
from budgets.models import BudgetAccount
from runs.admin import conversation
from runs.lifecycle import correct_approval, decide_approval
from runs.models import Step
from tools.models import EffectClass


class AgeFilter(admin.SimpleListFilter):
    title = "age"
    parameter_name = "age"
    BANDS = {"lt1h": (None, 1), "1to8h": (1, 8), "gt8h": (8, None)}  # (at least, under) hours

    def lookups(self, request, model_admin):
        return [("lt1h", "less than 1 hour"), ("1to8h", "1 to 8 hours"), ("gt8h", "more than 8 hours")]

    def queryset(self, request, queryset):
        if self.value() not in self.BANDS:
            return queryset
        at_least, under = self.BANDS[self.value()]
        now = timezone.now()
        if at_least is not None:
            queryset = queryset.filter(created_at__lte=now - dt.timedelta(hours=at_least))
        if under is not None:
            queryset = queryset.filter(created_at__gt=now - dt.timedelta(hours=under))
        return queryset


# What each effect class means for the person deciding (DESIGN.md section 5).
EFFECT_MEANING = {
    EffectClass.READ_ONLY: "reads only; changes nothing",
    EffectClass.IDEMPOTENT: "repeating the call has no further effect",
    EffectClass.RECONCILABLE: "the provider can say whether the call happened",
    EffectClass.UNSAFE: "may take effect twice if retried; nobody can check",
}


def proposal_text(approval: Approval) -> str:
    """What the model said in the turn that proposed this call."""
    if approval.step.parent_seq is None:
        return ""
    turn = Step.objects.filter(run_id=approval.run_id, seq=approval.step.parent_seq).first()
    return ((turn.result or {}).get("text") or "") if turn else ""


def cost_so_far(run) -> dict:
    account = BudgetAccount.objects.filter(run=run).first()
    if account is None:
        return {"spent": money(0), "limit": ""}
    return {
        "spent": money(account.spent_micros),
        "held": account.held_micros and money(account.held_micros),
        "limit": money(account.limit_micros),
    }


class ReasonForm(forms.Form):
    reason = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        help_text="Recorded with the decision and, for a denial, told to the model.",
    )


class CorrectionForm(forms.Form):
    """An approver corrects the call before approving it (runs.lifecycle.correct_approval)."""

    arguments = forms.JSONField(
        widget=forms.Textarea(attrs={"rows": 8, "cols": 60}),
        help_text="The corrected call's arguments, in full. Checked again like a new call.",
    )
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}), help_text="Required; told to the model."
    )

    def clean_arguments(self):
        value = self.cleaned_data["arguments"]
        if not isinstance(value, dict):
            raise forms.ValidationError("an object of argument names to values")
        return value


@admin.register(Approval, site=site)
class ApprovalAdmin(ReadOnlyAdmin):
    list_display = [
        "tool_link",
        "call_arguments",
        "run_link",
        "requested_by",
        "waiting",
        "left",
        "reason",
        "status",
    ]
    list_display_links = None
    list_filter = [
        status_filter(ApprovalStatus.choices, default=ApprovalStatus.PENDING),
        ("tool", admin.RelatedOnlyFieldListFilter),
        AgeFilter,
    ]
    list_select_related = ["tool", "requested_by", "run"]
    ordering = ["created_at"]
    actions = ["approve_selected", "deny_selected"]

    def get_queryset(self, request):
        if request.user.tenant_id is None:
            approvals = super().get_queryset(request)  # operators: every tenant's, read-only
        else:
            approvals = approvals_for(request.user)
        return approvals.annotate(run_visible=run_visible(request.user, OuterRef("run_id")))

    # Deciding is the only write, and it goes through runs.lifecycle.decide_approval.
    def has_view_permission(self, request, obj=None):
        user = request.user
        if not (user.is_active and user.is_staff):  # e.g. the anonymous user on the login page
            return False
        return user.is_superuser or (user.tenant_id is not None and approvable_tools(user).exists())

    def has_module_permission(self, request):
        return self.has_view_permission(request)

    def has_decide_permission(self, request, obj=None):
        return request.user.tenant_id is not None and self.has_view_permission(request)

    def changelist_view(self, request, extra_context=None):
        context = {
            "title": "Approval inbox",
            "watch_url": reverse("admin:approvals_approval_watch"),
            "marker": self._marker(request),
            **(extra_context or {}),
        }
        return super().changelist_view(request, context)

    def get_urls(self):
        view = self.admin_site.admin_view
        return [
            path("watch/", view(self.watch_view), name="approvals_approval_watch"),
            path("<path:object_id>/correct/", view(self.correct_view), name="approvals_approval_correct"),
            *super().get_urls(),
        ]

    def correct_view(self, request, object_id):
        """Correct the call (for example the amount) with a reason, and approve the corrected one."""
        approval = self.get_object(request, unquote(object_id))
        if approval is None or not self.has_decide_permission(request, approval):
            raise PermissionDenied
        form = CorrectionForm(request.POST or None, initial={"arguments": approval.arguments})
        if request.method == "POST" and form.is_valid():
            try:
                correct_approval(
                    approval_id=approval.pk,
                    user=request.user,
                    arguments=form.cleaned_data["arguments"],
                    reason=form.cleaned_data["reason"],
                )
            except DomainError as exc:
                form.add_error(None, exc.message)
            else:
                messages.success(request, f"corrected and approved: {approval.tool.name}")
                return redirect(self._inbox_url(request))
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Correct {approval.tool.name}",
            "approval": approval,
            "arguments": arguments_html(approval.arguments),
            "form": form,
            "inbox_url": self._inbox_url(request),
        }
        return TemplateResponse(request, "admin/approvals/approval/correct.html", context)

    def watch_view(self, request):
        """A change marker of the inbox for the page's poller: which approvals are pending."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        return JsonResponse({"marker": self._marker(request)})

    def _marker(self, request) -> str:
        # Any approval arriving, decided, expired or voided changes the set of pending ids.
        pending = self.get_queryset(request).filter(status=ApprovalStatus.PENDING)
        ids = "".join(str(pk) for pk in pending.order_by("pk").values_list("pk", flat=True))
        return hashlib.sha256(ids.encode()).hexdigest()[:16]

    # --- columns ---

    @admin.display(description="tool", ordering="tool__name")
    def tool_link(self, approval):
        return admin_link(approval, approval.tool.name)

    # Column methods must not share a name with a model field: Django would show the field instead.
    @admin.display(description="arguments")
    def call_arguments(self, approval):
        return arguments_html(approval.arguments, limit=120)

    @admin.display(description="age", ordering="created_at")
    def waiting(self, approval):
        return age(approval.created_at)

    @admin.display(description="time left", ordering="expires_at")
    def left(self, approval):
        return time_left(approval.expires_at) if approval.status == ApprovalStatus.PENDING else "—"

    @admin.display(description="run")
    def run_link(self, approval):
        # A link the user cannot open is not shown: approvers who may not read the run see its id.
        short = str(approval.run_id)[:8]
        return admin_link(approval.run, short) if getattr(approval, "run_visible", False) else short

    def get_list_display(self, request):
        columns = list(self.list_display)
        # The inbox opens on pending calls; a status column repeating "pending" only costs width.
        if request.GET.get("status", ApprovalStatus.PENDING) == ApprovalStatus.PENDING:
            columns.remove("status")
        return columns

    # --- deciding ---

    def _decide(self, request, approval, *, approve: bool, reason: str) -> bool:
        try:
            decide_approval(approval_id=approval.pk, user=request.user, approve=approve, reason=reason)
        except DomainError as exc:
            messages.error(request, f"{approval.tool.name} for run {str(approval.run_id)[:8]}: {exc.message}")
            return False
        return True

    def change_view(self, request, object_id, form_url="", extra_context=None):
        """One approval: the call, why it needs approval, the run's conversation, approve/deny."""
        approval = self.get_object(request, unquote(object_id))
        if not self.has_view_permission(request, approval):
            raise PermissionDenied
        form = ReasonForm(request.POST or None)
        if request.method == "POST":
            if not self.has_decide_permission(request, approval):
                raise PermissionDenied
            # Only an explicit button decides: a POST without one must never count as a denial.
            approve = "_approve" in request.POST
            if not approve and "_deny" not in request.POST:
                messages.error(request, "choose Approve or Deny")
            elif form.is_valid() and self._decide(
                request, approval, approve=approve, reason=form.cleaned_data["reason"]
            ):
                messages.success(
                    request,
                    f"{'approved' if approve else 'denied'}: {approval.tool.name} "
                    f"for run {str(approval.run_id)[:8]}",
                )
                return redirect(self._inbox_url(request))
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Approve {approval.tool.name}?",
            "approval": approval,
            "arguments": arguments_html(approval.arguments),
            "age": age(approval.created_at),
            "time_left": time_left(approval.expires_at),
            "form": form,
            "inbox_url": self._inbox_url(request),
            "can_decide": approval.status == ApprovalStatus.PENDING and self.has_decide_permission(request),
            "conversation": conversation(approval.run, highlight_seq=approval.step.seq),
            "proposal": proposal_text(approval),
            "effect": EFFECT_MEANING.get(approval.tool.effect_class, ""),
            "cost_so_far": cost_so_far(approval.run),
            "can_open_run": approval.run_visible,
        }
        return TemplateResponse(request, "admin/approvals/approval/detail.html", context)

    def _inbox_url(self, request) -> str:
        url = reverse("admin:approvals_approval_changelist")
        filters = request.GET.get("_changelist_filters")
        return f"{url}?{filters}" if filters else url

    @admin.action(description="Approve selected calls…", permissions=["decide"])
    def approve_selected(self, request, queryset):
        return self._decide_in_bulk(request, queryset, approve=True)

    @admin.action(description="Deny selected calls…", permissions=["decide"])
    def deny_selected(self, request, queryset):
        return self._decide_in_bulk(request, queryset, approve=False)

    def _decide_in_bulk(self, request, queryset, *, approve: bool):
        """First call: a confirmation page asking for the reason. Second call: decide each one."""
        form = ReasonForm(request.POST if "confirm" in request.POST else None)
        approvals = list(queryset)
        if form.is_bound and form.is_valid():
            decided = [
                a
                for a in approvals
                if self._decide(request, a, approve=approve, reason=form.cleaned_data["reason"])
            ]
            if decided:
                messages.success(request, f"{'approved' if approve else 'denied'} {len(decided)} call(s)")
            gone = len(request.POST.getlist(ACTION_CHECKBOX_NAME)) - len(approvals)
            if gone > 0:
                messages.warning(
                    request, f"{gone} selected call(s) left this list meanwhile (decided or expired)"
                )
            return None
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"{'Approve' if approve else 'Deny'} {len(approvals)} call(s)?",
            "approvals": [(a, arguments_html(a.arguments, limit=120)) for a in approvals],
            "approve": approve,
            "form": form,
            "action": "approve_selected" if approve else "deny_selected",
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/approvals/approval/decide_selected.html", context)
