"""Usage per tenant (a server-rendered chart) and the holds operators reconcile or write off."""

from __future__ import annotations

import datetime as dt

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.exceptions import PermissionDenied
from django.db.models import OuterRef
from django.http import Http404
from django.template.response import TemplateResponse
from django.urls import path

from budgets import selectors, services
from budgets.models import LedgerEntry, Reservation
from core.errors import DomainError
from core.ids import short
from core.money import rate_note
from runs.models import Run
from tenants.admin_site import ReadOnlyAdmin, admin_link, money, run_visible, site, status_filter

DAYS = 30
# SVG geometry in user units; the chart scales with the page width.
WIDTH, HEIGHT = 760, 260
LEFT, RIGHT, TOP, BOTTOM = 80, 10, 12, 36


def remaining_text(micros: int, tenant) -> str:
    """What is left of a day, or by how much it went over: never a bare negative balance."""
    return money(micros, tenant) if micros >= 0 else f"over the limit by {money(-micros, tenant)}"


def usage_chart(accounts, *, today: dt.date, days: int = DAYS, tenant=None) -> dict:
    """Bars of spent with held stacked on top, and the day's limit as a step line; days without
    an account (nothing was reserved) are empty slots."""
    by_day = {account.day: account for account in accounts}
    peak = max([a.limit_micros for a in accounts] + [a.spent_micros + a.held_micros for a in accounts] + [1])
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / days

    def y(micros: int) -> float:
        return round(TOP + plot_h - micros / peak * plot_h, 1)

    def height(micros: int) -> float:
        # A charge far below the limit would round to nothing; keep it visible.
        return max(round(micros / peak * plot_h, 1), 1.0) if micros else 0.0

    bars, limit_path, previous = [], [], False
    for i in range(days):
        day = today - dt.timedelta(days=days - 1 - i)
        account = by_day.get(day)
        spent = account.spent_micros if account else 0
        held = account.held_micros if account else 0
        x = LEFT + i * slot
        spent_h, held_h = height(spent), height(held)
        bars.append(
            {
                "x": round(x + slot * 0.15, 1),
                "width": round(slot * 0.7, 1),
                "spent_y": round(y(0) - spent_h, 1),
                "spent_h": spent_h,
                "held_y": round(y(0) - spent_h - held_h, 1),
                "held_h": held_h,
                "label_x": round(x + slot / 2, 1),
                "label": day.strftime("%d %b") if i % 5 == 4 or i == 0 else "",
                "title": f"{day:%d %b %Y}: spent {money(spent, tenant)}, held {money(held, tenant)}, limit "
                f"{money(account.limit_micros, tenant) if account else '—'}",
            }
        )
        if account:
            limit_y = y(account.limit_micros)
            limit_path.append(
                f"{'L' if previous else 'M'}{round(x, 1)},{limit_y} L{round(x + slot, 1)},{limit_y}"
            )
        previous = account is not None
    ticks = [{"y": y(v), "label": money(v, tenant)} for v in (0, peak // 2, peak)]
    return {
        "width": WIDTH,
        "height": HEIGHT,
        "left": LEFT,
        "right": WIDTH - RIGHT,
        "bottom": y(0),
        "bars": bars,
        "limit_path": " ".join(limit_path),
        "ticks": ticks,
        "days": days,
    }


def usage_page(model_admin, request, tenant):
    accounts = selectors.tenant_days(tenant, days=DAYS)
    top_runs = list(selectors.top_runs(tenant, days=DAYS))
    visible = set(
        Run.objects.filter(pk__in=[r.pk for r in top_runs])
        .filter(run_visible(request.user, OuterRef("pk")))
        .values_list("pk", flat=True)
    )
    context = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.opts,
        "title": f"Usage of {tenant.name}, last {DAYS} days",
        "tenant": tenant,
        "chart": usage_chart(accounts, today=services.local_day(tenant), tenant=tenant),
        "rate_note": rate_note(tenant),
        "days": [
            {
                "day": a.day,
                "limit": money(a.limit_micros, tenant),
                "reserved": money(a.reserved_micros, tenant),
                "spent": money(a.spent_micros, tenant),
                "held": money(a.held_micros, tenant),
                "remaining": remaining_text(a.remaining_micros, tenant),
            }
            for a in reversed(accounts)
        ],
        "agents": [
            {
                **row,
                "spent": money(row["spent_micros"], tenant),
                "held": money(row["held_micros"], tenant),
                "reserved": money(row["reserved_micros"], tenant),
            }
            for row in selectors.per_agent(tenant, days=DAYS)
        ],
        "top_runs": [
            {
                "run": run,
                "link": admin_link(run, short(run.pk)) if run.pk in visible else short(run.pk),
                "spent": money(run.budget.spent_micros, tenant),
                "held": money(run.budget.held_micros, tenant),
            }
            for run in top_runs
        ],
    }
    return TemplateResponse(request, "admin/budgets/usage.html", context)


class LedgerInline(admin.TabularInline):
    model = LedgerEntry
    fields = ["at", "kind", "amount_micros", "actor", "note"]
    readonly_fields = fields  # type: ignore[assignment]  # every field shown is read-only (stubs: fieldsets' type)
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


class NoteForm(forms.Form):
    note = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}), help_text="Why: kept in the ledger for audit."
    )


def reconcile_form(reservations, data=None) -> forms.Form:
    """A note plus, per reservation, the actual charge the provider reported (in micros)."""
    fields = {
        f"actual_{r.pk}": forms.IntegerField(min_value=0, label=f"actual micros for {short(r.pk)}")
        for r in reservations
    }
    return type("ReconcileForm", (NoteForm,), fields)(data)


@admin.register(Reservation, site=site)
class ReservationAdmin(ReadOnlyAdmin):
    """Held reservations are possible charges of lost calls; people clear them with a reason."""

    list_display = [
        "short_id",
        "run_link",
        "step_seq",
        "purpose",
        "day",
        "amount",
        "actual",
        "status",
        "note",
        "created_at",
    ]
    list_filter = [status_filter(Reservation.Status.choices, default=Reservation.Status.HELD), "purpose"]
    list_select_related = ["run", "step"]
    ordering = ["-created_at"]
    inlines = [LedgerInline]
    actions = ["reconcile_selected", "write_off_selected"]

    def get_urls(self):
        return [
            # A tenant's usage of the last days: the budgets' page, linked from the tenant's row and
            # the top bar (named here so the tenants' admin, below budgets, needs no import of it).
            path(
                "usage/<path:tenant_id>/", self.admin_site.admin_view(self.usage_view), name="budgets_usage"
            ),
            *super().get_urls(),
        ]

    def usage_view(self, request, tenant_id):
        tenants = site.registry_admin("tenants.tenant")  # the platform's site, where this admin is registered
        tenant = tenants.get_object(request, tenant_id)
        if tenant is None:
            raise Http404
        if not tenants.has_view_permission(request, tenant):
            raise PermissionDenied
        return usage_page(tenants, request, tenant)

    @admin.display(description="reservation")
    def short_id(self, reservation):
        return short(reservation.pk)

    def get_queryset(self, request):
        return (
            super().get_queryset(request).annotate(run_visible=run_visible(request.user, OuterRef("run_id")))
        )

    @admin.display(description="run")
    def run_link(self, reservation):
        if not reservation.run:
            return "—"
        label = short(reservation.run_id)
        return admin_link(reservation.run, label) if getattr(reservation, "run_visible", False) else label

    @admin.display(description="step")
    def step_seq(self, reservation):
        return reservation.step.seq if reservation.step else "—"

    @admin.display(description="amount", ordering="amount_micros")
    def amount(self, reservation):
        return money(reservation.amount_micros)

    @admin.display(description="actual")
    def actual(self, reservation):
        return money(reservation.actual_micros)

    def has_settle_permission(self, request, obj=None):
        return request.user.has_perm("budgets.change_reservation")

    @admin.action(
        description="Reconcile selected holds with the provider's actual charge…", permissions=["settle"]
    )
    def reconcile_selected(self, request, queryset):
        held = list(queryset.filter(status=Reservation.Status.HELD))
        form = reconcile_form(held, request.POST if "confirm" in request.POST else None)
        if form.is_bound and form.is_valid():
            note = form.cleaned_data["note"]
            return self._close_each(
                request,
                held,
                "reconciled",
                lambda r: services.reconcile(
                    r.pk, actual_micros=form.cleaned_data[f"actual_{r.pk}"], actor=request.user, note=note
                ),
            )
        return self._confirm(request, "reconcile_selected", "Reconcile holds", held, form, with_actual=True)

    @admin.action(description="Write off selected holds (nothing counted as spent)…", permissions=["settle"])
    def write_off_selected(self, request, queryset):
        held = list(queryset.filter(status=Reservation.Status.HELD))
        form = NoteForm(request.POST if "confirm" in request.POST else None)
        if form.is_bound and form.is_valid():
            note = form.cleaned_data["note"]
            return self._close_each(
                request,
                held,
                "written off",
                lambda r: services.write_off(r.pk, actor=request.user, note=note),
            )
        return self._confirm(request, "write_off_selected", "Write off holds", held, form)

    def _close_each(self, request, reservations, verb: str, close) -> None:
        done = 0
        for reservation in reservations:
            try:
                closed = close(reservation)
            except DomainError as exc:
                messages.error(request, f"{short(reservation.pk)}: {exc.message}")
                continue
            if closed:
                done += 1
            else:
                messages.warning(request, f"{short(reservation.pk)} was no longer held")
        messages.success(request, f"{verb} {done} hold(s)")

    def _confirm(self, request, action: str, title: str, held, form, *, with_actual: bool = False):
        if not held:
            messages.warning(request, "none of the selected reservations is held")
            return None
        rows = [
            {
                "reservation": r,
                "amount": money(r.amount_micros),
                "actual": form[f"actual_{r.pk}"] if with_actual else None,
            }
            for r in held
        ]
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "rows": rows,
            "form": form,
            "action": action,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "with_actual": with_actual,
        }
        return TemplateResponse(request, "admin/budgets/reservation/close_selected.html", context)
