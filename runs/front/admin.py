from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from urllib.parse import quote

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ORDER_VAR, ChangeList
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import Http404, JsonResponse
from django.shortcuts import redirect
from django.template.defaultfilters import filesizeformat
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.views.decorators.http import require_POST

from approvals.services import can_approve, can_decide
from artifacts.admin import admin_download
from artifacts.selectors import artifacts_of, get_artifact
from budgets.models import BudgetAccount
from budgets.services import next_local_midnight
from core.api import bounded_count, planner_settings
from core.errors import DomainError, NotFound
from core.ids import short
from core.money import rate_note
from llm.probe import failed_probe
from runs import admission
from runs.controls.admin import PauseAdminMixin
from runs.front.display import run_title, status_label
from runs.front.search import Q_MAX, search
from runs.models import TERMINAL, Run, RunEvent, RunStatus, Step, StepKind, StepStatus
from runs.recovery.resolution import OUTCOMES, resolve_step
from runs.selectors import events_of, steps_of
from runs.services import cancel_run
from tenants.admin_site import (
    DATETIME_FORMAT,
    ReadOnlyAdmin,
    arguments_html,
    duration,
    money,
    money_in_text,
    site,
    tenants_seen,
    time_left,
)
from tools.display import formatted_arguments
from tools.models import EffectClass


def conversation(run: Run, *, highlight_seq: int | None = None) -> list[dict]:
    """The run so far as the model saw it: input, the model's messages and tool results, in order."""
    first = run.input if isinstance(run.input, str) else arguments_html(run.input)
    entries: list[dict] = [{"role": "user", "label": "input", "body": first}]
    for step in steps_of(run):
        if step.kind == StepKind.MODEL:
            result = step.result or {}
            entries.append(
                {
                    "role": "assistant",
                    "seq": step.seq,
                    "label": f"model (step {step.seq})",
                    "body": result.get("text") or "",
                    "status": step.status,
                    "calls": [
                        (call["name"], arguments_html(call.get("arguments")))
                        for call in result.get("tool_calls", [])
                    ],
                }
            )
        else:
            entries.append(
                {
                    "role": "tool",
                    "seq": step.seq,
                    "label": f"{step.tool_name} (step {step.seq})",
                    "body": step.observation or step.error,
                    "status": step.status,
                    "current": step.seq == highlight_seq,
                }
            )
    return entries


# --- the run page as a timeline -------------------------------------------------------------------


def run_marker(run: Run) -> str:
    """Changes whenever anything a person sees on the run page changes: every change of a run
    writes an event (runs/models.py), so the status and the last event's number are enough."""
    last = RunEvent.objects.filter(run=run).order_by("-seq").values_list("seq", flat=True).first()
    return f"{run.status}:{last or 0}"


def usage_of(step: Step) -> dict | None:
    if step.kind not in (StepKind.MODEL, StepKind.SUMMARY) or not step.usage:
        return None
    usage = step.usage
    return {
        "input": usage.get("input_tokens", 0),
        "cached": usage.get("cached_input_tokens", 0),
        "cache_write": usage.get("cache_write_tokens", 0),
        "output": usage.get("output_tokens", 0),
    }


RESULT_LIMIT = 4000  # characters of a tool result on the page; the API has the whole (redacted) result


def result_text(step: Step) -> str:
    """What the tool answered, as stored (secrets already redacted), else what the model was told."""
    if step.kind != StepKind.TOOL:
        return ""
    result = step.result
    if isinstance(result, dict) and set(result) <= {"text", "is_error", "structured"} and "text" in result:
        text = pretty_json_text(str(result["text"]))
    elif result is not None:
        text = json.dumps(result, ensure_ascii=False, indent=2, sort_keys=True)
    else:
        text = step.observation
    return text if len(text) <= RESULT_LIMIT else text[:RESULT_LIMIT] + "…"


def pretty_json_text(text: str) -> str:
    """A tool's text answer that is JSON, indented; any other text as it is."""
    if not text.lstrip().startswith(("{", "[")):
        return text
    try:
        return json.dumps(json.loads(text), ensure_ascii=False, indent=2, sort_keys=True)
    except ValueError:
        return text


def event_row(event: RunEvent, tenant=None) -> dict:
    return {"event": event, "message": money_in_text(event.message, tenant)}


def step_summary(step: Step) -> str:
    """The one line of a step in the compact timeline: what the model said or proposed, what a tool did."""
    if step.kind == StepKind.MODEL:
        result = step.result or {}
        calls = [call.get("name", "?") for call in result.get("tool_calls", [])]
        text = " ".join((result.get("text") or "").split())
        if calls:
            text = f"{text[:80]}{'…' if len(text) > 80 else ''} → calls {', '.join(calls)}".strip(" →")
        return text[:140] or (step.error[:140] if step.error else "")
    if step.kind == StepKind.SUMMARY and step.status == StepStatus.SUCCEEDED:
        text = " ".join(((step.result or {}).get("text") or "").split())
        return f"summary of a fold: {text[:120]}{'…' if len(text) > 120 else ''}"
    return f"· {step.error[:140]}" if step.error and step.status != StepStatus.SUCCEEDED else ""


def flower_url(run: Run) -> str:
    """Flower's task list searched for this run's engine tasks: Flower puts its `name` parameter
    into the search box as `name:<value>`, and `args:<run id>` after it narrows the list to the
    tasks whose arguments carry the run's id (its search joins terms with AND)."""
    if not settings.FLOWER_URL:
        return ""
    return f"{settings.FLOWER_URL}/tasks?name={quote(f'runs.tasks.advance_run args:{run.pk}', safe=':')}"


def sandbox_view(run: Run, step, files: list) -> dict | None:
    """A run_python step on the timeline: its exit, the limit hit, the limits it ran under, what it
    used, and the files in and out with their download links (the code is shown from its arguments)."""
    structured = (step.result or {}).get("structured") if isinstance(step.result, dict) else None
    if not (isinstance(structured, dict) and "exit_code" in structured and "limits" in structured):
        return None
    by_id = {str(a.pk): a for a in files}

    def link(artifact) -> dict:
        return {
            "name": artifact.name,
            "size": artifact.size,
            "url": reverse("admin:runs_run_artifact", args=[run.pk, artifact.pk]),
        }

    limits = structured.get("limits") or {}
    usage = structured.get("usage") or {}
    return {
        "exit_code": structured.get("exit_code"),
        "limit": structured.get("limit"),
        "message": structured.get("message") or "",
        "limits": [
            ("wall", f"{limits['wall_seconds']:g} s") if "wall_seconds" in limits else None,
            ("CPU", f"{limits['cpu_seconds']:g} s") if "cpu_seconds" in limits else None,
            ("cores", f"{limits['cores']:g}") if "cores" in limits else None,
            ("memory", filesizeformat(limits["memory_bytes"])) if "memory_bytes" in limits else None,
            ("processes", str(limits["processes"])) if "processes" in limits else None,
            ("/tmp", filesizeformat(limits["tmp_bytes"])) if "tmp_bytes" in limits else None,
            (
                (
                    "outputs",
                    f"{filesizeformat(limits['output_bytes'])} in {limits.get('output_files', '?')} files",
                )
                if "output_bytes" in limits
                else None
            ),
            ("stdout", filesizeformat(limits["stdout_bytes"])) if "stdout_bytes" in limits else None,
        ],
        "usage": [
            ("CPU", f"{usage.get('cpu_seconds', 0):.3f} s"),
            ("wall", f"{usage.get('wall_seconds', 0):.3f} s"),
            ("peak memory", filesizeformat(usage.get("memory_peak_bytes", 0))),
            ("GiB-seconds", f"{usage.get('gib_seconds', 0):.3f}"),
            (
                "start",
                f"{structured['start_seconds'] * 1000:.0f} ms" if structured.get("start_seconds") else "—",
            ),
            (
                "queue",
                f"{structured['queue_seconds'] * 1000:.0f} ms"
                if structured.get("queue_seconds") is not None
                else "—",
            ),
            ("cost", money(structured.get("cost_micros") or 0, run.tenant)),
        ],
        "inputs": [
            link(by_id[i]) if i in by_id else {"name": i, "size": None, "url": ""}
            for i in structured.get("inputs", [])
        ],
        "outputs": [
            link(by_id[f["artifact_id"]])
            for f in structured.get("files", [])
            if f.get("artifact_id") in by_id
        ],
        "refused": structured.get("files_refused", []),
        "skipped": structured.get("files_skipped", []),
        "stdout": structured.get("stdout", ""),
        "stderr": structured.get("stderr", ""),
    }


def attention(run: Run, rows: list[dict]) -> dict | None:
    """What a person must know first about this run, and do, at the top of its page."""
    now = timezone.now()
    # A lost model call is outcome_unknown too, but no person resolves it: the engine calls the
    # model again and holds the charge. Only tool calls make the page ask for a person, as the
    # desk counts (runs in needs_attention).
    unknown = [
        r for r in rows if r["step"].status == StepStatus.OUTCOME_UNKNOWN and r["step"].kind == StepKind.TOOL
    ]
    if run.status == RunStatus.NEEDS_ATTENTION or unknown:
        for row in unknown:
            last = row["events"][-1]["event"].at if row["events"] else row["step"].dispatched_at
            row["since"] = last
        return {"kind": "needs_attention", "steps": unknown, "error": run.error}
    if run.status == RunStatus.FAILED:
        return {"kind": "failed", "error": run.error, "stop_reason": run.stop_reason}
    models = [r for r in rows if r["step"].kind == StepKind.MODEL]
    if not run.is_terminal and models and models[-1]["step"].status == StepStatus.OUTCOME_UNKNOWN:
        step = models[-1]["step"]
        endpoint = (step.request or {}).get("endpoint") or run.version.model_endpoint.name
        return {"kind": "model_lost", "step": step, "endpoint": endpoint}
    if run.status == RunStatus.WAITING_APPROVAL:
        waiting = [r for r in rows if r["step"].status == StepStatus.AWAITING_APPROVAL]
        return {"kind": "waiting_approval", "steps": waiting}
    if run.status in (RunStatus.WAITING_BUDGET, RunStatus.WAITING_SETTLE):
        until = run.resume_at
        start = admission.expected_start(run, now)
        if start is not None:
            until = start["at"]
        elif until is None and run.status == RunStatus.WAITING_BUDGET:
            until = next_local_midnight(run.tenant, now)
        return {"kind": run.status, "until": until, "in": time_left(until) if until else "", "start": start}
    return None


def with_events(rows: list[dict], events: list[RunEvent], tenant) -> list[dict]:
    """Each step row with the events of that step folded under it."""
    by_step: dict[int, list[dict]] = {}
    for event in events:
        if event.step_seq is not None:
            by_step.setdefault(event.step_seq, []).append(event_row(event, tenant))
    for row in rows:
        row["events"] = by_step.get(row["step"].seq, [])
    return rows


class RunStatusFilter(admin.SimpleListFilter):
    """Statuses in words ("waiting for approval"), not Django's title-cased codes."""

    title = "status"
    parameter_name = "status__exact"

    def lookups(self, request, model_admin):
        return [(value, status_label(value)) for value in RunStatus.values]

    def queryset(self, request, queryset):
        return queryset.filter(status=self.value()) if self.value() else queryset


class FinishedFilter(admin.SimpleListFilter):
    title = "finished"
    parameter_name = "finished"
    WINDOWS = {"hour": dt.timedelta(hours=1), "day": dt.timedelta(days=1), "week": dt.timedelta(days=7)}

    def lookups(self, request, model_admin):
        return [("hour", "in the last hour"), ("day", "in the last day"), ("week", "in the last week")]

    def queryset(self, request, queryset):
        window = self.WINDOWS.get(self.value() or "")
        return queryset.filter(finished_at__gte=timezone.now() - window) if window else queryset


class ResolveForm(forms.Form):
    outcome = forms.ChoiceField(choices=[(o, o) for o in OUTCOMES], widget=forms.RadioSelect)
    reason = forms.CharField(widget=forms.Textarea(attrs={"rows": 2}))
    result = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text="For “succeeded”: what the tool did (shown to the model).",
    )
    override = forms.BooleanField(required=False, label="Retry anyway: I accept the effect may happen twice")


class RankedChangeList(ChangeList):
    """A search that runs.front.search ranked keeps its order (best word matches first), unless a
    column is sorted; a word in many runs has its page read as the API reads it (walking the
    newest runs: core.api.planner_settings)."""

    def get_ordering(self, request, queryset):
        if "search_rank" in queryset.query.annotations and ORDER_VAR not in self.params:
            return ["-search_rank", "-created_at", "-pk"]
        return super().get_ordering(request, queryset)

    def get_results(self, request):
        super().get_results(request)
        page_settings = getattr(request, "run_search_page_settings", None)
        if page_settings:
            with planner_settings(page_settings):
                self.result_list = list(self.result_list)


class BoundedPaginator(Paginator):
    """The run list's count as the API's: exact up to 1,000 matches, PostgreSQL's estimate past
    that (a common word in a million runs is seconds to count; core.api.bounded_count)."""

    @cached_property
    def count(self) -> int:
        return bounded_count(self.object_list)[0]


@admin.register(Run, site=site)
class RunAdmin(PauseAdminMixin, ReadOnlyAdmin):
    """Runs are started through the API; here they are watched, cancelled and unblocked."""

    list_display = ["short_id", "title", "version_number", "status_label", "created", "spent"]
    list_filter = [
        RunStatusFilter,
        ("agent", admin.RelatedOnlyFieldListFilter),
        ("created_by", admin.RelatedOnlyFieldListFilter),
        FinishedFilter,
    ]
    list_select_related = ["agent", "version", "created_by", "budget", "tenant"]
    paginator = BoundedPaginator
    show_full_result_count = False  # "(N total)" would count the tenant's every run
    # The box searches ids, id prefixes, input/metadata values and words (runs/front/search.py),
    # not these fields.
    search_fields = ["id"]
    search_help_text = (
        "A run id or its first characters (a7390f2e), a value of its input or metadata (TXN-1002), "
        'or words of its request and customer (meera sharma, "duplicate charge").'
    )
    date_hierarchy = "created_at"
    actions = ["cancel_selected", "pause_selected", "resume_selected", "add_to_dataset"]

    def changelist_view(self, request, extra_context=None):
        return super().changelist_view(request, {"title": "Runs", **(extra_context or {})})

    def get_search_results(self, request, queryset, search_term):
        found = search(queryset, search_term[:Q_MAX], tenants=tenants_seen(request.user), ranked=True)
        # The changelist orders (clones) the queryset after this: its page settings go by request.
        request.run_search_page_settings = getattr(found, "page_settings", None)
        return found, False

    def get_changelist(self, request, **kwargs):
        return RankedChangeList

    @admin.display(description="run", ordering="created_at")
    def short_id(self, run):
        return short(run.pk)

    @admin.display(description="created", ordering="created_at")
    def created(self, run):
        return date_format(timezone.localtime(run.created_at), DATETIME_FORMAT)

    @admin.display(description="title", ordering="agent__name")
    def title(self, run):
        return run_title(run)

    @admin.display(description="status", ordering="status")
    def status_label(self, run):
        return format_html('<span class="status-badge st-{}">{}</span>', run.status, status_label(run.status))

    @admin.display(description="version", ordering="version__number")
    def version_number(self, run):
        return run.version.number

    @admin.display(description="spent", ordering="budget__spent_micros")
    def spent(self, run):
        budget = getattr(run, "budget", None)
        return money(budget.spent_micros, run.tenant) if budget else "—"

    def has_cancel_permission(self, request, obj=None):
        return request.user.has_perm("runs.change_run")

    def get_urls(self):
        view = self.admin_site.admin_view
        return [
            path("<path:object_id>/cancel/", view(require_POST(self.cancel_view)), name="runs_run_cancel"),
            path("<path:object_id>/watch/", view(self.watch_view), name="runs_run_watch"),
            path(
                "<path:object_id>/artifacts/<uuid:artifact_id>/",
                view(self.artifact_view),
                name="runs_run_artifact",
            ),
            path(
                "<path:object_id>/steps/<int:seq>/resolve/",
                view(require_POST(self.resolve_view)),
                name="runs_run_resolve",
            ),
            *super().get_urls(),
        ]

    def change_view(self, request, object_id, form_url="", extra_context=None):
        run = self.get_object(request, unquote(object_id))
        if not self.has_view_permission(request, run):
            raise PermissionDenied
        events = list(events_of(run))
        steps = with_events(
            [self._step_row(request, step, run.tenant) for step in steps_of(run)], events, run.tenant
        )
        kinds = Counter(row["step"].kind for row in steps)
        files = list(artifacts_of(run).select_related("step"))
        for row in steps:
            row["sandbox"] = sandbox_view(run, row["step"], files)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": run_title(run),
            "run": run,
            "status_label": status_label(run.status),
            "attention": attention(run, steps),
            "budget": self._budget(run),
            "cache": self._cache(run),
            "expected_cost": money(run.expected_cost_micros, run.tenant) if run.expected_cost_micros else "",
            "steps": steps,
            "counts": {"steps": len(steps), "model": kinds[StepKind.MODEL], "tool": kinds[StepKind.TOOL]},
            "step_statuses": sorted({(row["step"].status, row["status_label"]) for row in steps}),
            "run_events": [event_row(e, run.tenant) for e in events if e.step_seq is None],
            "event_count": len(events),
            "can_cancel": not run.is_terminal and self.has_cancel_permission(request, run),
            **self.pause_context(request, run),
            "can_open_version": request.user.has_perm("agents.view_agentversion"),
            "watch_url": reverse("admin:runs_run_watch", args=[run.pk]) if not run.is_terminal else "",
            "marker": run_marker(run),
            "input": arguments_html(run.input) if isinstance(run.input, dict) else run.input,
            "artifacts": files,
            "metadata": arguments_html(run.metadata) if run.metadata else "",
            "flower_url": flower_url(run),
            "rate_note": rate_note(run.tenant),
            "probe_note": failed_probe(run.version.model_endpoint.probe),
        }
        return TemplateResponse(request, "admin/runs/run/detail.html", context)

    def _budget(self, run) -> dict | None:
        account = BudgetAccount.objects.filter(run=run).first()
        if account is None:
            return None
        return {
            name: money(getattr(account, f"{name}_micros"), run.tenant)
            for name in ("limit", "reserved", "spent", "held", "remaining")
        }

    def _cache(self, run) -> dict | None:
        """Input tokens of the run's model calls by how the provider billed them, and the share read
        from its prompt cache (what the context policy and the cache breakpoints are for)."""
        totals = {"uncached": 0, "read": 0, "written": 0}
        for usage in (
            Step.objects.filter(run=run, kind=StepKind.MODEL, usage__isnull=False)
            .order_by()
            .values_list("usage", flat=True)
        ):
            assert usage is not None  # usage__isnull=False
            totals["uncached"] += usage.get("input_tokens", 0)
            totals["read"] += usage.get("cached_input_tokens", 0)
            totals["written"] += usage.get("cache_write_tokens", 0)
        total = sum(totals.values())
        if not total:
            return None
        return {**totals, "total": total, "share": f"{100 * totals['read'] / total:.1f}%"}

    def watch_view(self, request, object_id):
        """A change marker of the run for the page's poller: cheap, and changes with every event."""
        run = self.get_object(request, unquote(object_id))
        if not self.has_view_permission(request, run):
            raise PermissionDenied
        return JsonResponse({"marker": run_marker(run), "status": run.status})

    def artifact_view(self, request, object_id, artifact_id):
        """Download one of the run's files: whoever may open the run's page may read its files."""
        run = self.get_object(request, unquote(object_id))
        if not self.has_view_permission(request, run):
            raise PermissionDenied
        try:
            artifact = get_artifact([run.pk], artifact_id, with_content=True)
        except NotFound:
            raise Http404("no such file in this run") from None
        return admin_download(artifact)

    def _step_row(self, request, step, tenant) -> dict:
        row = {
            "step": step,
            "status_label": status_label(step.status),
            "summary": step_summary(step),
            "cost": money(step.cost_micros, tenant),
            "duration": duration(step.duration_ms),
            "full_arguments": arguments_html(
                step.arguments, readable=formatted_arguments(step.tool, step.arguments)
            )
            if step.kind == StepKind.TOOL
            else "",
            "result": result_text(step),
            "usage": usage_of(step),
        }
        if step.status == StepStatus.AWAITING_APPROVAL and step.tool:
            approval = getattr(step, "approval", None)
            # can_decide: approve_tool, or a member of the group the approval was escalated to.
            if approval is not None and can_decide(request.user, approval):
                row["approval_url"] = reverse("admin:approvals_approval_change", args=[approval.pk])
        if step.status == StepStatus.OUTCOME_UNKNOWN and step.tool and can_approve(request.user, step.tool):
            row["resolve_form"] = ResolveForm(prefix=f"s{step.seq}")
            row["unsafe"] = step.tool.effect_class == EffectClass.UNSAFE
        return row

    def cancel_view(self, request, object_id):
        run = self.get_object(request, unquote(object_id))
        if not self.has_cancel_permission(request, run):
            raise PermissionDenied
        self._cancel(request, run, reason=request.POST.get("reason", ""))
        return redirect(reverse("admin:runs_run_change", args=[run.pk]))

    def _cancel(self, request, run, *, reason: str) -> None:
        try:
            cancel_run(run_id=run.pk, actor=request.user, reason=reason or "cancelled in the admin")
        except DomainError as exc:
            messages.error(request, f"run {short(run.pk)}: {exc.message}")
            return
        messages.success(request, f"run {short(run.pk)}: cancel requested; no new call starts from now on")

    def has_add_to_dataset_permission(self, request, obj=None):
        # A role's permission (tenants/roles.py): supervisors and operators keep datasets.
        return request.user.tenant_id is not None and request.user.has_perm("evals.change_dataset")

    @admin.action(description="Add selected finished runs to a dataset", permissions=["add_to_dataset"])
    def add_to_dataset(self, request, queryset):
        # The dataset's page (evals/admin.py) takes the ids: evaluations are a room above the runs.
        ids = ",".join(str(pk) for pk in queryset.filter(status__in=TERMINAL).values_list("pk", flat=True))
        return redirect(f"{reverse('admin:evals_dataset_add_runs')}?runs={ids}")

    @admin.action(description="Cancel selected runs (give a reason)", permissions=["cancel"])
    def cancel_selected(self, request, queryset):
        reason = request.POST.get("reason", "").strip()
        if not reason:
            messages.error(request, "give a reason in the actions bar")
            return
        for run in queryset.exclude(status__in=TERMINAL):
            self._cancel(request, run, reason=reason)

    def resolve_view(self, request, object_id, seq):
        """Say what happened to a call whose outcome is unknown (needs approve_tool on its tool)."""
        run = self.get_object(request, unquote(object_id))
        if not self.has_view_permission(request, run):
            raise PermissionDenied
        form = ResolveForm(request.POST, prefix=f"s{seq}")
        if not form.is_valid():
            # str(): the stub types an ErrorList's items as stored, but iterating yields their messages
            errors = "; ".join(f"{name}: {' '.join(map(str, errs))}" for name, errs in form.errors.items())
            messages.error(request, f"step {seq} not resolved: {errors}")
        else:
            data = form.cleaned_data
            try:
                resolve_step(
                    run_id=run.pk,
                    seq=seq,
                    user=request.user,
                    outcome=data["outcome"],
                    reason=data["reason"],
                    result=data["result"] if data["outcome"] == "succeeded" else None,
                    override=data["override"],
                )
            except DomainError as exc:
                messages.error(request, f"step {seq} not resolved: {exc.message}")
            else:
                # Recent actions: who said what happened to a call nobody could know the outcome of.
                self.log_change(request, run, f"Resolved step {seq} as {data['outcome']}: {data['reason']}")
                messages.success(request, f"step {seq} resolved as {data['outcome']}")
        return redirect(reverse("admin:runs_run_change", args=[run.pk]))
