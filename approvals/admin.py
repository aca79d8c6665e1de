"""The supervisor inbox: pending calls on tools the user may approve, decided one by one or in bulk."""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
import re

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.db.models import OuterRef, Q
from django.http import JsonResponse
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import dateformat, timezone
from django.utils.html import format_html

from approvals import briefing, reminders
from approvals import services as approvals_services
from approvals.models import Approval, ApprovalStatus
from approvals.selectors import approvable_tools, approvals_for, escalated_to
from approvals.services import MOMENT
from budgets.models import BudgetAccount
from core.errors import DomainError
from core.ids import short
from runs.approval_effects import correct_approval, decide_approval
from runs.front.admin import conversation
from runs.front.flags import risk_flags
from runs.front.search import Q_MAX
from runs.front.search import search as search_runs
from runs.models import Run, Step, StepKind, StepStatus
from tenants.admin_site import (
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
from tools.display import currency_of, formatted_arguments, money_arguments, shown, summary
from tools.models import EffectClass


class AgeFilter(admin.SimpleListFilter):
    title = "age"
    parameter_name = "age"
    BANDS = {"lt1h": (None, 1), "1to8h": (1, 8), "gt8h": (8, None)}  # (at least, under) hours

    def lookups(self, request, model_admin):
        return [("lt1h", "less than 1 hour"), ("1to8h", "1 to 8 hours"), ("gt8h", "more than 8 hours")]

    def queryset(self, request, queryset):
        band = self.value()
        if band is None or band not in self.BANDS:
            return queryset
        at_least, under = self.BANDS[band]
        now = timezone.now()
        if at_least is not None:
            queryset = queryset.filter(created_at__lte=now - dt.timedelta(hours=at_least))
        if under is not None:
            queryset = queryset.filter(created_at__gt=now - dt.timedelta(hours=under))
        return queryset


# What each effect class means for this call, for the person deciding (DESIGN.md section 5):
# what can happen at the provider, not how the platform retries.
EFFECT_MEANING = {
    EffectClass.READ_ONLY: "reads only: approving changes nothing at {server}",
    EffectClass.IDEMPOTENT: "{server} deduplicates this call by its key: even if the platform has to "
    "send it again, it takes effect once",
    EffectClass.RECONCILABLE: "if the answer is lost, the platform asks {server} whether the call took "
    "effect before sending it again: it takes effect at most once",
    EffectClass.UNSAFE: "if the answer is lost, nobody can tell whether it took effect at {server}; it is "
    "never sent twice without a person deciding",
}


def effect_meaning(tool) -> str:
    text = EFFECT_MEANING.get(tool.effect_class, "")
    return text.format(server=tool.server.name if tool.server_id else "the provider")


def latest_results(run) -> dict:
    """Tool name -> the latest stored result of a call that succeeded, for summary templates."""
    results: dict = {}
    for name, result in (
        Step.objects.filter(
            run=run, kind=StepKind.TOOL, status__in=[StepStatus.SUCCEEDED, StepStatus.RESOLVED_SUCCEEDED]
        )
        .order_by("seq")
        .values_list("tool_name", "result")
    ):
        results[name] = result
    return results


CUSTOMER_KEYS = re.compile(r"customer|email|recipient|payee|account_holder|^to$", re.IGNORECASE)


def call_amount(tool, arguments) -> str:
    """The call's first money argument, formatted in its currency (tools/display.py)."""
    readable = formatted_arguments(tool, arguments)
    return next((text for text, is_amount in readable.values() if is_amount), "")


def call_money(approval: Approval) -> briefing.Money:
    """(argument, value, currency code) of each money argument of the call."""
    arguments = approval.arguments if isinstance(approval.arguments, dict) else {}
    found = []
    for name, source in money_arguments(approval.tool).items():
        code = currency_of(source, arguments)
        value = briefing.number(arguments.get(name))
        if code is not None and value is not None:
            found.append((name, value, code))
    return found


def call_customer(arguments, run_input) -> str:
    """Whom the call is about: the first customer-like value of its arguments, else of the run's input."""
    for source in (arguments, run_input):
        if isinstance(source, dict):
            for key, value in source.items():
                if CUSTOMER_KEYS.search(str(key)) and isinstance(value, str | int):
                    return str(value)
    return ""


def call_summary(approval: Approval) -> str:
    return summary(
        approval.tool, approval.arguments, run_input=approval.run.input, results=latest_results(approval.run)
    )


def proposal_text(approval: Approval) -> str:
    """What the model said in the turn that proposed this call."""
    if approval.step.parent_seq is None:
        return ""
    turn = Step.objects.filter(run_id=approval.run_id, seq=approval.step.parent_seq).first()
    return ((turn.result or {}).get("text") or "") if turn else ""


def cost_so_far(run) -> dict:
    tenant = run.tenant
    account = BudgetAccount.objects.filter(run=run).first()
    if account is None:
        return {"spent": money(0, tenant), "limit": ""}
    return {
        "spent": money(account.spent_micros, tenant),
        "held": account.held_micros and money(account.held_micros, tenant),
        "limit": money(account.limit_micros, tenant),
    }


def follow_ups(approval: Approval) -> list[tuple[str, str]]:
    """The approval's reminder and escalation, as (label, what happened or is due), for its page."""
    zone = approval.tenant.zone

    def at(moment) -> str:
        return dateformat.format(moment.astimezone(zone), MOMENT)

    rows = []
    if approval.reminded_at:
        rows.append(("Reminded", f"at {at(approval.reminded_at)}"))
    elif approval.remind_at:
        rows.append(("Reminder", f"due at {at(approval.remind_at)}"))
    group = approval.escalate_to.name if approval.escalate_to else "(group removed)"
    if approval.escalated_at:
        names = ", ".join(user.username for user in reminders.members(approval)) or "no members"
        rows.append(("Escalated", f"to {group} ({names}) at {at(approval.escalated_at)}"))
    elif approval.escalate_at:
        rows.append(("Escalation", f"to {group} due at {at(approval.escalate_at)}"))
    return rows


class ReasonForm(forms.Form):
    reason = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
        help_text="Required to deny; recorded with the decision and, for a denial, told to the model.",
    )

    def __init__(self, *args, reason_to_approve: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if reason_to_approve:
            self.fields["reason"].help_text = "Required to approve or deny; recorded with the decision."

    def require_for(self, approval: Approval, *, approve: bool) -> bool:
        """Whether the reason the decision needs is there (a field error if not)."""
        needed = approvals_services.reason_required(approval, approve=approve)
        if needed and not (self.cleaned_data.get("reason") or "").strip():
            self.add_error("reason", f"a reason is required to {'approve' if approve else 'deny'}")
            return False
        return True


class CorrectionForm(forms.Form):
    """An approver corrects the call before approving it (runs.approval_effects.correct_approval)."""

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
        "agent",
        "amount",
        "customer",
        "run_link",
        "requested_by",
        "waiting",
        "follow_up",
        "left",
        "reason",
        "status",
    ]
    list_display_links = None
    list_filter = [
        status_filter(ApprovalStatus.choices, default=ApprovalStatus.PENDING),
        ("tool", admin.RelatedOnlyFieldListFilter),
        ("run__agent", admin.RelatedOnlyFieldListFilter),
        ("requested_by", admin.RelatedOnlyFieldListFilter),
        AgeFilter,
    ]
    list_select_related = [
        "tool",
        "tool__server",
        "tool__tenant",
        "requested_by",
        "run",
        "run__agent",
        "escalate_to",
    ]
    # The box searches the runs' ids and input/metadata values, tool names and requesters.
    search_fields = ["tool__name"]
    search_help_text = "A tool name, a requester, a run id or its first characters, or a value of the run's input (TXN-1002)."
    ordering = ["created_at"]
    actions = ["approve_selected", "deny_selected"]

    def get_queryset(self, request):
        if request.user.tenant_id is None:
            approvals = super().get_queryset(request)  # operators: every tenant's, read-only
        else:
            approvals = approvals_for(request.user)
        return approvals.annotate(run_visible=run_visible(request.user, OuterRef("run_id")))

    # Deciding is the only write, and it goes through runs.approval_effects.decide_approval.
    def has_view_permission(self, request, obj=None):
        user = request.user
        if not (user.is_active and user.is_staff):  # e.g. the anonymous user on the login page
            return False
        if user.is_superuser:
            return True
        # Members of a group an approval was escalated to see (and decide) that approval.
        return user.tenant_id is not None and (
            approvable_tools(user).exists()
            or Approval.objects.filter(escalated_to(user), tenant_id=user.tenant_id).exists()
        )

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
                corrected = correct_approval(
                    approval_id=approval.pk,
                    user=request.user,
                    arguments=form.cleaned_data["arguments"],
                    reason=form.cleaned_data["reason"],
                )
            except DomainError as exc:
                form.add_error(None, exc.message)
            else:
                changed = ", ".join(
                    f"{name} {(corrected.original_arguments or {}).get(name)!r} → {value!r}"
                    for name, value in corrected.arguments.items()
                    if (corrected.original_arguments or {}).get(name) != value
                )
                self.log_change(
                    request, corrected, f"Corrected ({changed}) and approved: {corrected.correction_reason}"
                )
                if corrected.status == ApprovalStatus.PENDING:
                    messages.success(
                        request,
                        f"corrected and approved by you: {approval.tool.name}; "
                        f"{approvals_services.approvals_given(corrected)} of {corrected.required_approvals} approvals",
                    )
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
    @admin.display(description="call")
    def call_arguments(self, approval):
        # The sentence first; the raw arguments one click away, so the row stays one sentence high.
        return format_html(
            '<div class="call-summary">{}</div><details class="call-arguments"><summary>arguments</summary>{}</details>',
            call_summary(approval),
            arguments_html(
                approval.arguments, limit=120, readable=formatted_arguments(approval.tool, approval.arguments)
            ),
        )

    @admin.display(description="agent", ordering="run__agent__name")
    def agent(self, approval):
        return approval.run.agent.name

    @admin.display(description="amount")
    def amount(self, approval):
        return call_amount(approval.tool, approval.arguments) or "—"

    @admin.display(description="customer")
    def customer(self, approval):
        return call_customer(approval.arguments, approval.run.input) or "—"

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()[:Q_MAX]
        if not term:
            return queryset, False
        runs = search_runs(
            Run.objects.filter(tenant_id=request.user.tenant_id), term, tenants=[request.user.tenant_id]
        ).values("pk")
        return (
            queryset.filter(
                Q(tool__name__icontains=term) | Q(requested_by__username__iexact=term) | Q(run_id__in=runs)
            ),
            False,
        )

    @admin.display(description="age", ordering="created_at")
    def waiting(self, approval):
        return age(approval.created_at)

    @admin.display(description="reminded / escalated")
    def follow_up(self, approval):
        """What already happened to a pending call that waited long (approvals/reminders.py): an
        approver sees at a glance which calls others were already told about."""
        if approval.escalated_at:
            group = approval.escalate_to.name if approval.escalate_to else "(group removed)"
            return f"escalated to {group} {age(approval.escalated_at)} ago"
        if approval.reminded_at:
            return f"reminded {age(approval.reminded_at)} ago"
        return "—"

    @admin.display(description="time left", ordering="expires_at")
    def left(self, approval):
        return time_left(approval.expires_at) if approval.status == ApprovalStatus.PENDING else "—"

    @admin.display(description="run")
    def run_link(self, approval):
        # A link the user cannot open is not shown: approvers who may not read the run see its id.
        label = short(approval.run_id)
        return admin_link(approval.run, label) if getattr(approval, "run_visible", False) else label

    def get_list_display(self, request):
        columns = list(self.list_display)
        # The inbox opens on pending calls; a status column repeating "pending" only costs width.
        if request.GET.get("status", ApprovalStatus.PENDING) == ApprovalStatus.PENDING:
            columns.remove("status")
        return columns

    # --- deciding ---

    def _decide(self, request, approval, *, approve: bool, reason: str, announce: bool = True) -> str | None:
        """Decide, then say what happened: a repeat from a stale tab says what was done before
        (a warning, never a green success), and what did change goes to Recent actions. Returns
        "decided", "counted" (one approval of several needed), "repeated", or None (refused)."""
        what = f"{approval.tool.name} for run {short(approval.run_id)}"
        try:
            decided = decide_approval(
                approval_id=approval.pk, user=request.user, approve=approve, reason=reason
            )
        except DomainError as exc:
            messages.error(request, f"{what}: {exc.message}")
            return None
        if getattr(decided, "repeated", False):
            messages.warning(request, f"{what}: {approvals_services.first_decision(decided)}")
            return "repeated"  # nothing to correct on the page: back to the inbox, with what happened
        verb = "approved" if approve else "denied"
        said = f": {reason}" if reason else ""
        if getattr(decided, "verdict", None) == approvals_services.Verdict.COUNTED:
            given = approvals_services.approvals_given(decided)
            counted = f"{given} of {decided.required_approvals} approvals"
            self.log_change(request, decided, f"Approved ({counted}){said}")
            messages.success(
                request, f"{what}: your approval counted, {counted}; waiting for another approver"
            )
            return "counted"
        self.log_change(request, decided, f"{verb.capitalize()}{said}")
        if announce:
            messages.success(request, f"{verb}: {what}")
        return "decided"

    def change_view(self, request, object_id, form_url="", extra_context=None):
        """One approval: the call, why it needs approval, the run's conversation, approve/deny."""
        approval = self.get_object(request, unquote(object_id))
        if not self.has_view_permission(request, approval):
            raise PermissionDenied
        form = ReasonForm(request.POST or None, reason_to_approve=approval.tenant.approval_reason_required)
        if request.method == "POST":
            if not self.has_decide_permission(request, approval):
                raise PermissionDenied
            # Only an explicit button decides: a POST without one must never count as a denial.
            approve = "_approve" in request.POST
            if not approve and "_deny" not in request.POST:
                messages.error(request, "choose Approve or Deny")
            elif (
                form.is_valid()
                and form.require_for(approval, approve=approve)
                and self._decide(request, approval, approve=approve, reason=form.cleaned_data["reason"])
            ):
                return redirect(self._inbox_url(request))
        votes = approvals_services.votes(approval)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Approve {approval.tool.name}?",
            "approval": approval,
            "arguments": arguments_html(
                approval.arguments, readable=formatted_arguments(approval.tool, approval.arguments)
            ),
            "summary": call_summary(approval),
            "flags": risk_flags(approval),
            "age": age(approval.created_at),
            "time_left": time_left(approval.expires_at),
            "form": form,
            "inbox_url": self._inbox_url(request),
            "can_decide": approval.status == ApprovalStatus.PENDING and self.has_decide_permission(request),
            "conversation": conversation(approval.run, highlight_seq=approval.step.seq),
            "proposal": proposal_text(approval),
            "effect": effect_meaning(approval.tool),
            "cost_so_far": cost_so_far(approval.run),
            "can_open_run": approval.run_visible,
            "follow_ups": follow_ups(approval),
            "amount": call_amount(approval.tool, approval.arguments),
            "original_arguments": approval.original_arguments
            and arguments_html(
                approval.original_arguments,
                readable=formatted_arguments(approval.tool, approval.original_arguments),
            ),
            "parties": briefing.parties(approval),
            "request_text": briefing.request_text(approval.run),
            "sources": briefing.sources(approval, money=call_money(approval), show=shown),
            "why": briefing.why(approval),
            "votes": votes,
            "asked_at": dateformat.format(approval.created_at.astimezone(approval.tenant.zone), MOMENT),
            "tenant_zone": approval.tenant.zone,
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
        if form.is_bound and form.is_valid() and all(form.require_for(a, approve=approve) for a in approvals):
            outcomes = collections.Counter(
                self._decide(request, a, approve=approve, reason=form.cleaned_data["reason"], announce=False)
                for a in approvals
            )
            # Only what this action decided counts as "approved N": a call decided before (a
            # stale list) or still waiting for a second approver has its own message above.
            if outcomes["decided"]:
                messages.success(
                    request, f"{'approved' if approve else 'denied'} {outcomes['decided']} call(s)"
                )
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
