"""Datasets and evaluations in the admin: read-only (services write them), with the one action of
adding finished runs to a dataset (the runs list's "Add selected runs to a dataset" leads here)."""

from __future__ import annotations

import json

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join

from agents.admin import AliasForm
from core.errors import DomainError
from core.ids import short
from core.money import platform_money
from evals import gates, services
from evals.models import Case, CaseResult, Dataset, DatasetVersion, Evaluation
from tenants.admin_site import ReadOnlyAdmin, admin_link, site


def _pre(value) -> str:
    return format_html('<pre class="spec">{}</pre>', json.dumps(value, indent=2, sort_keys=True, default=str))


class CaseInline(admin.StackedInline):
    model = Case
    fields = [
        "name",
        "user",
        "approver",
        "tags",
        "input_json",
        "approvals",
        "checks_json",
        "recordings_json",
        "source_run",
    ]
    readonly_fields = fields  # type: ignore[assignment]  # every field shown is read-only
    extra = 0
    can_delete = False

    @admin.display(description="input")
    def input_json(self, case):
        return _pre(case.input)

    @admin.display(description="checks")
    def checks_json(self, case):
        return _pre(case.checks)

    @admin.display(description="recorded tool results")
    def recordings_json(self, case):
        return _pre(case.recordings)

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class AddRunsForm(forms.Form):
    dataset = forms.SlugField(max_length=100, help_text="an existing dataset, or a new one's name")
    runs = forms.CharField(widget=forms.HiddenInput)


@admin.register(Dataset, site=site)
class DatasetAdmin(ReadOnlyAdmin):
    list_display = ["name", "latest_version", "description", "created_at"]
    fields = ["name", "description", "created_at", "versions_list"]
    readonly_fields = fields  # type: ignore[assignment]  # every field shown is read-only

    @admin.display(description="latest version")
    def latest_version(self, dataset):
        latest = dataset.versions.order_by("-number").first()
        return admin_link(latest, f"v{latest.number} ({latest.cases.count()} cases)") if latest else "—"

    @admin.display(description="versions")
    def versions_list(self, dataset):
        return format_html_join(
            ", ", "{}", ((admin_link(v, f"v{v.number}"),) for v in dataset.versions.order_by("-number"))
        )

    def get_urls(self):
        view = self.admin_site.admin_view
        return [
            path("add-runs/", view(self.add_runs_view), name="evals_dataset_add_runs"),
            *super().get_urls(),
        ]

    def add_runs_view(self, request):
        """Add finished runs (ids from the runs list's action) to a dataset as cases, in one step."""
        if request.user.tenant_id is None or not request.user.has_perm("evals.change_dataset"):
            raise PermissionDenied
        form = AddRunsForm(request.POST or None, initial={"runs": request.GET.get("runs", "")})
        if request.method == "POST" and form.is_valid():
            version = None
            for run_id in [r for r in form.cleaned_data["runs"].split(",") if r]:
                try:
                    version = services.add_run(
                        tenant=request.user.tenant,
                        dataset=form.cleaned_data["dataset"],
                        run_id=run_id,
                        user=request.user,
                    )
                except DomainError as exc:
                    messages.error(request, f"run {short(run_id)}: {exc.message}")
            if version is not None:
                messages.success(request, f"{version}: {version.cases.count()} cases")
                return HttpResponseRedirect(reverse("admin:evals_datasetversion_change", args=[version.pk]))
        context = {
            **self.admin_site.each_context(request),
            "title": "Add runs to a dataset",
            "form": form,
            "runs": [r for r in (form["runs"].value() or "").split(",") if r],
        }
        return TemplateResponse(request, "admin/evals/add_runs.html", context)


@admin.register(DatasetVersion, site=site)
class DatasetVersionAdmin(ReadOnlyAdmin):
    list_display = ["__str__", "dataset", "number", "created_by", "created_at"]
    list_filter = [("dataset", admin.RelatedOnlyFieldListFilter)]
    fields = ["dataset", "number", "content_hash", "created_by", "created_at"]
    readonly_fields = fields  # type: ignore[assignment]  # every field shown is read-only
    inlines = [CaseInline]


class ResultInline(admin.TabularInline):
    model = CaseResult
    fields = [
        "case_name",
        "verdict",
        "checks_table",
        "timeline",
        "cost",
        "steps",
        "latency_ms",
        "uncovered_calls",
    ]
    readonly_fields = fields  # type: ignore[assignment]  # every field shown is read-only
    extra = 0
    can_delete = False

    @admin.display(description="case")
    def case_name(self, result):
        return result.case.name

    @admin.display(description="result")
    def verdict(self, result):
        return "passed" if result.passed else "FAILED"

    @admin.display(description="checks")
    def checks_table(self, result):
        return format_html_join(
            "",
            "<div>{} {}{} <small>{}</small></div>",
            (
                (
                    "✓" if c["passed"] else "✗",
                    c["check"],
                    " (model-graded)" if c.get("graded") else "",
                    c.get("detail", ""),
                )
                for c in result.checks
            ),
        )

    @admin.display(description="run")
    def timeline(self, result):
        return (
            admin_link(result.run, f"{short(result.run_id)} ({result.run_status})") if result.run_id else "—"
        )

    @admin.display(description="cost")
    def cost(self, result):
        return platform_money(result.cost_micros)

    @admin.display(description="uncovered calls")
    def uncovered_calls(self, result):
        return format_html_join("", "<div>{}</div>", ((u,) for u in result.uncovered)) or "—"

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(Evaluation, site=site)
class EvaluationAdmin(ReadOnlyAdmin):
    list_display = [
        "short_id",
        "agent_version",
        "dataset_version",
        "status",
        "pass_rate",
        "compared_with",
        "created_at",
    ]
    list_filter = ["status", ("dataset_version__dataset", admin.RelatedOnlyFieldListFilter)]
    list_select_related = ["agent_version__agent", "dataset_version__dataset", "against__agent_version"]
    fields = [
        "agent_version",
        "dataset_version",
        "status",
        "compared_with",
        "uncovered",
        "budget",
        "totals_table",
        "side_by_side",
        "started_by",
        "created_at",
        "finished_at",
        "error",
    ]
    readonly_fields = fields  # type: ignore[assignment]  # every field shown is read-only
    inlines = [ResultInline]

    @admin.display(description="evaluation", ordering="created_at")
    def short_id(self, evaluation):
        return short(evaluation.pk)

    @admin.display(description="pass rate")
    def pass_rate(self, evaluation):
        rate = evaluation.totals.get("pass_rate")
        return "—" if rate is None else f"{rate:.0%}"

    @admin.display(description="compared with")
    def compared_with(self, evaluation):
        other = evaluation.against
        return admin_link(other, f"v{other.agent_version.number}") if other else "—"

    @admin.display(description="budget")
    def budget(self, evaluation):
        return platform_money(evaluation.budget_micros)

    @admin.display(description="totals")
    def totals_table(self, evaluation):
        return _pre(evaluation.totals)

    @admin.display(description="side by side")
    def side_by_side(self, evaluation):
        if evaluation.against_id is None or evaluation.status != Evaluation.Status.FINISHED:
            return "—"
        table = services.comparison(evaluation)
        mark = {True: "✓", False: "✗", None: "—"}
        rows = []
        for case in table["cases"]:
            rows.append((case["case"], mark[case["passed"]], mark[case["against_passed"]]))
            rows += [
                (f"  {c['check']}", mark[c["passed"]], mark[c["against_passed"]]) for c in case["checks"]
            ]
        head = format_html(
            "<tr><th>case / check</th><th>v{}</th><th>v{}</th></tr>",
            table["version"],
            table["against_version"],
        )
        return format_html(
            "<table>{}{}</table>",
            head,
            format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td></tr>", rows),
        )


# A gated alias moves in the admin only to a version that passed (evals/gates.py); the agents'
# admin sits below the evaluations and leaves its form's gate to be set here.
AliasForm.check_move = staticmethod(gates.require_passing)
