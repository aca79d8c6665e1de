"""The admin for supervisors and operators: one site, every page scoped to the user's tenant.

Staff users with a tenant see and change only their tenant's rows (another tenant's object URL
answers 404); superusers without a tenant (platform operators) see everything. Django's default
`admin.site` is not used because the apps that register on it (auth groups, API tokens) would
list every tenant's rows.

Admin code only displays and forwards: writes go through the apps' services.

This module is the admin's ground: every app's `admin` registers on `site` and builds on its base
classes, and it imports no app above `tenants`. The supervisors' desk on the index page reads
approvals, runs and budgets, so it sits on the top floor (agentplatform/desk.py, wired in
agentplatform/urls.py over the index URL).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from decimal import Decimal
from functools import update_wrapper

from django import forms
from django.apps import apps
from django.contrib import admin
from django.db.models import BooleanField, Exists, Value
from django.http import Http404
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.timesince import timesince, timeuntil
from guardian.admin import GroupManage, GuardedModelAdmin, UserManage

from core.money import PLATFORM_CURRENCY
from core.money import money as tenant_money
from tenants.models import TenantGroup, User
from tenants.permissions import may_view_all_runs

# The lookup from each model to its tenant's id; None marks platform-wide reference data. A model
# missing here shows no rows to tenant users: tenant data must not leak because someone forgot
# to declare how to scope it.
TENANT_PATHS = {
    "artifacts.artifact": "tenant",
    "runs.killswitch": "tenant",
    "runs.bulkaction": "tenant",
    "tenants.tenant": "pk",
    "tenants.user": "tenant",
    "tenants.secret": "tenant",
    "tenants.tenantgroup": "tenant",
    "auth.group": "tenant_link__tenant",
    "auth.permission": None,
    "agents.agentdefinition": "tenant",
    "agents.agentversion": "agent__tenant",
    "agents.alias": "agent__tenant",
    "llm.modelendpoint": "tenant",
    "tools.toolserver": "tenant",
    "tools.tool": "tenant",
    "runs.run": "tenant",
    "runs.step": "run__tenant",
    "runs.runevent": "run__tenant",
    "approvals.approval": "tenant",
    "budgets.budgetaccount": "tenant",
    "budgets.reservation": "tenant",
    "budgets.ledgerentry": "reservation__tenant",
    # authority.signingkey is platform-wide: operators only (not listed).
    "authority.delegation": "server__tenant",
    "authority.identityprovider": "tenant",
    "authority.exchangedtoken": "tenant",
    "connections.connection": "tenant",
    "connections.protectedserver": "tenant",
    "history.legalhold": "tenant",
    "history.erasurecertificate": "tenant",
    "history.runtombstone": "tenant",
    "evals.dataset": "tenant",
    "evals.datasetversion": "dataset__tenant",
    "evals.case": "version__dataset__tenant",
    "evals.evaluation": "tenant",
    "evals.caseresult": "evaluation__tenant",
    # history.checkpoint is platform-wide: operators only (not listed).
}


# Runs and what belongs to them are readable by their creator, and by holders of the tenant's
# view_runs (DESIGN.md section 7): the lookup from each such model to the run's creator.
RUN_CREATOR_PATHS = {
    "runs.run": "created_by",
    "runs.step": "run__created_by",
    "runs.runevent": "run__created_by",
    "artifacts.artifact": "run__created_by",
}


def is_operator(user) -> bool:
    return user.is_superuser and user.tenant_id is None


def scope(queryset, user):
    """The rows of `queryset` that `user` may see in the admin."""
    label = queryset.model._meta.label_lower
    if is_operator(user) or (label in TENANT_PATHS and TENANT_PATHS[label] is None):
        return queryset
    path = TENANT_PATHS.get(label)
    if user.tenant_id is None or path is None:
        return queryset.none()
    queryset = queryset.filter(**{path: user.tenant_id})
    if label in RUN_CREATOR_PATHS and not may_view_all_runs(user):
        queryset = queryset.filter(**{RUN_CREATOR_PATHS[label]: user.pk})
    return queryset


def tenants_seen(user) -> list:
    """The ids of the tenants whose rows `user` may see in the admin: every one for an operator."""
    if is_operator(user):
        return list(apps.get_model("tenants", "Tenant").objects.values_list("pk", flat=True))
    return [user.tenant_id] if user.tenant_id is not None else []


def run_visible(user, run_id) -> Exists | Value:
    """An annotation: whether `user` may open the page of the run `run_id` (an OuterRef or a value);
    a link to a run the user cannot open is shown as plain text."""
    if not user.has_perm("runs.view_run"):
        return Value(False, output_field=BooleanField())
    return Exists(scope(apps.get_model("runs", "Run").objects.filter(pk=run_id), user))


class TenantScopedAdmin(admin.ModelAdmin):
    """Rows, foreign-key choices and object URLs limited to the user's tenant.

    Changes save only the fields the form changed, so an admin edit does not overwrite what a
    worker or a service wrote meanwhile. Foreign-key list filters must be
    RelatedOnlyFieldListFilter: the plain one lists every tenant's rows.
    """

    def get_queryset(self, request):
        return scope(super().get_queryset(request), request.user)

    def get_object(self, request, object_id, from_field=None):
        # Django redirects to the index for a missing object; another tenant's row must be a 404.
        obj = super().get_object(request, object_id, from_field)
        if obj is None:
            raise Http404(f"no {self.opts.verbose_name} with this id")
        return obj

    def formfield_for_dbfield(self, db_field, request, **kwargs):
        field = super().formfield_for_dbfield(db_field, request, **kwargs)
        if field is not None and db_field.name.endswith("_micros"):
            # Stored and edited in micro-units; say which, next to the amount everyone else reads.
            field.label = f"{field.label} (millionths of {CURRENCY})"
            field.help_text = f"1000000 = {CURRENCY} 1.00. {field.help_text}".strip()
        return field

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        field = super().formfield_for_foreignkey(db_field, request, **kwargs)
        if field is not None and hasattr(field, "queryset"):
            field.queryset = scope(field.queryset, request.user)
        return field

    def formfield_for_manytomany(self, db_field, request, **kwargs):
        field = super().formfield_for_manytomany(db_field, request, **kwargs)
        if field is not None and hasattr(field, "queryset"):
            field.queryset = scope(field.queryset, request.user)
        return field

    def get_changeform_initial_data(self, request):
        # The tenant stays a form field (choices: the user's tenant only) so that uniqueness per
        # tenant is validated by the form instead of failing in the database.
        initial = super().get_changeform_initial_data(request)
        if request.user.tenant_id and any(f.name == "tenant" for f in self.opts.concrete_fields):
            initial.setdefault("tenant", request.user.tenant_id)
        return initial

    def save_model(self, request, obj, form, change):
        if not change:
            obj.save()
            return
        concrete = {f.name for f in self.opts.concrete_fields}
        changed = [name for name in form.changed_data if name in concrete]
        if changed:
            stamps = [f.name for f in self.opts.concrete_fields if getattr(f, "auto_now", False)]
            obj.save(update_fields=changed + stamps)


class TenantGuardedAdmin(TenantScopedAdmin, GuardedModelAdmin):  # type: ignore[misc]  # guardian's template attribute is untyped
    """Object-permission pages (django-guardian's "Object permissions") that stay in the tenant:
    users and groups of another tenant can be neither picked nor opened there."""

    # Guardian's grant pages look users and groups up platform-wide; keep them in the tenant.
    def get_obj_perms_user_select_form(self, request):
        tenant_id = request.user.tenant_id

        class TenantUserManage(UserManage):
            def clean_user(self):
                user = super().clean_user()
                if tenant_id and user.tenant_id != tenant_id:
                    raise forms.ValidationError(self.fields["user"].error_messages["does_not_exist"])
                return user

        return TenantUserManage

    def get_obj_perms_group_select_form(self, request):
        tenant_id = request.user.tenant_id

        class TenantGroupManage(GroupManage):
            def clean_group(self):
                group = super().clean_group()
                if tenant_id and not TenantGroup.objects.filter(group=group, tenant_id=tenant_id).exists():
                    raise forms.ValidationError(self.fields["group"].error_messages["does_not_exist"])
                return group

        return TenantGroupManage

    def obj_perms_manage_user_view(self, request, object_pk, user_id):
        obj = get_object_or_404(self.get_queryset(request), pk=object_pk)
        get_object_or_404(User, pk=user_id, tenant_id=obj.tenant_id)
        return super().obj_perms_manage_user_view(request, object_pk, user_id)

    def obj_perms_manage_group_view(self, request, object_pk, group_id):
        obj = get_object_or_404(self.get_queryset(request), pk=object_pk)
        if not TenantGroup.objects.filter(tenant_id=obj.tenant_id, group_id=group_id).exists():
            raise Http404("no such group in this tenant")
        return super().obj_perms_manage_group_view(request, object_pk, group_id)


class OperatorsWrite:
    """Rows that platform operators add, change and delete, and a tenant's staff at most read (a
    tenant's ceilings, its webhooks): put before the ModelAdmin class it narrows."""

    def has_add_permission(self, request, obj=None):
        return is_operator(request.user)

    def has_change_permission(self, request, obj=None):
        return is_operator(request.user)

    def has_delete_permission(self, request, obj=None):
        return is_operator(request.user)


class ReadOnlyAdmin(TenantScopedAdmin):
    """Rows are written by services (and their custom admin actions), never by the admin's forms."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


def status_filter(choices, *, default: str, field: str = "status"):
    """A status list filter that starts on `default` (e.g. pending) and offers "all"."""

    class StatusFilter(admin.SimpleListFilter):
        title = field
        parameter_name = field

        def lookups(self, request, model_admin):
            return [*choices, ("all", "All")]

        def queryset(self, request, queryset):
            value = self.value() or default
            return queryset if value == "all" else queryset.filter(**{field: value})

        def choices(self, changelist):
            current = self.value() or default
            for value, label in self.lookup_choices:
                yield {
                    "selected": current == value,
                    "display": label,
                    "query_string": changelist.get_query_string({self.parameter_name: value}),
                }

    return StatusFilter


# --- display helpers ---------------------------------------------------------------------------

# Argument names with one of these words carry money: supervisors must not miss them.
MONEY_WORDS = {"amount", "amounts", "currency", "price", "total", "fee", "fees"}


def is_money(key) -> bool:
    """`amount`, `refund_amount`, `totalPrice` yes; `feedback` no."""
    words = re.findall(r"[a-z]+", re.sub(r"([A-Z])", r"_\1", str(key)).lower())
    return any(word in MONEY_WORDS for word in words)


def _value_text(value, limit: int | None) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)
    if limit and len(text) > limit:
        return text[:limit] + "…"
    return text


def arguments_html(arguments, *, limit: int | None = None, readable: dict | None = None) -> SafeString:
    """Tool-call arguments as `key: value` lines, money values in bold (formatted in their currency
    where the tool says which arguments are money: `readable` is tools.display.formatted_arguments)."""
    if not isinstance(arguments, dict):
        return format_html('<div class="arguments"><code>{}</code></div>', _value_text(arguments, limit))
    if not arguments:
        return format_html('<div class="arguments quiet">{}</div>', "(no arguments)")
    readable = readable or {}
    rows = []
    for key, value in arguments.items():
        text, is_amount = readable.get(key, (None, False))
        text = _value_text(value, limit) if text is None or not is_amount else text
        if is_amount or is_money(key):
            text = format_html('<strong class="amount">{}</strong>', text)
        rows.append((key, text))
    return format_html(
        '<div class="arguments">{}</div>',
        format_html_join("", '<div><span class="arg-key">{}</span>: {}</div>', rows),
    )


# Budgets, prices and costs are kept in micro-units of the platform currency and shown in the
# tenant's (core/money.py); every admin page shows them through `money` so one amount reads the
# same everywhere.
CURRENCY = PLATFORM_CURRENCY


def money(micros: int | None, tenant=None) -> str:
    """Micro-units as the tenant reads them (`INR 1.19`); without a tenant `USD 0.0021`: at least 2
    decimals, at most 6, never rounded."""
    return tenant_money(micros, tenant)


def price(per_million: Decimal | None) -> str:
    """A model price (currency units per million tokens) in the same unit as `money`."""
    if per_million is None:
        return "—"
    return f"{money(int(Decimal(per_million) * 1_000_000))} / M tokens"


_MICROS_IN_TEXT = re.compile(r"\b(\d+) micros\b")


# Budget events say "reserved 18240, settled 2469, run remaining 1997531 micros": every amount of
# such a message is in micros, not only the one the word follows.
_AMOUNT_IN_BUDGET_TEXT = re.compile(
    r"\b(reserved|settled|spent|held|remaining|cost|refunded) (\d+)\b(?! micros)"
)


def money_in_text(text: str, tenant=None) -> str:
    """Event messages written by the engine say `cost 1188 micros`; people read `cost USD 0.001188`."""
    text = text or ""
    if " micros" in text:
        text = _AMOUNT_IN_BUDGET_TEXT.sub(lambda m: f"{m.group(1)} {money(int(m.group(2)), tenant)}", text)
    return _MICROS_IN_TEXT.sub(lambda match: money(int(match.group(1)), tenant), text)


# The one date format of the admin's pages (templates use the same: "j M Y, H:i"): 14 Jan 2025, 09:30.
DATETIME_FORMAT = "j M Y, H:i"


def age(since: dt.datetime | None) -> str:
    return timesince(since, timezone.now(), depth=2) if since else "—"


def time_left(until: dt.datetime | None) -> str:
    if until is None:
        return "—"
    if until <= timezone.now():
        return "expired"
    return timeuntil(until, timezone.now(), depth=2)


def duration(ms: int | None) -> str:
    if ms is None:
        return "—"
    return f"{ms} ms" if ms < 1000 else f"{ms / 1000:.1f} s"


def admin_link(obj, text=None) -> SafeString:
    url = reverse(f"admin:{obj._meta.app_label}_{obj._meta.model_name}_change", args=[obj.pk])
    return format_html('<a href="{}">{}</a>', url, text if text is not None else obj)


# --- the site ----------------------------------------------------------------------------------


class PlatformAdminSite(admin.AdminSite):
    site_header = "Agent platform"
    site_title = "Agent platform admin"
    index_title = "Supervision and operations"
    index_template = "admin/platform/index.html"
    site_url = None  # the platform has no public site to link to
    # The inbox and the run timeline need the width; the top bar and breadcrumbs lead everywhere.
    enable_nav_sidebar = False

    def admin_view(self, view, cacheable=False):
        """Every admin page renders its times in the time zone of the user's tenant."""

        def in_tenant_zone(request, *args, **kwargs):
            with timezone.override(tenant_zone(request.user)):
                response = view(request, *args, **kwargs)
                # Template responses render after the view returns: render them inside the zone.
                if hasattr(response, "render") and not response.is_rendered:
                    response.render()
            return response

        return super().admin_view(update_wrapper(in_tenant_zone, view), cacheable)

    def each_context(self, request):
        context = super().each_context(request)
        user = getattr(request, "user", None)
        if user is not None and user.is_active and user.is_staff:
            context["platform_nav"] = self.links(request)
            context["platform_counts"] = self.control_counts(request)
            context["time_zone"] = timezone.get_current_timezone_name()
            tenant = getattr(user, "tenant", None)
            context["currency"] = tenant.currency if tenant is not None else CURRENCY
        return context

    def links(self, request) -> list[tuple[str, str]]:
        """The top bar: only the pages this user can open."""
        user, links = request.user, []
        if self.registry_admin("approvals.approval").has_view_permission(request):
            links.append(("Inbox", reverse("admin:approvals_approval_changelist")))
        if self.registry_admin("runs.run").has_view_permission(request):
            links.append(("Runs", reverse("admin:runs_run_changelist")))
        if user.tenant_id and self.registry_admin("tenants.tenant").has_view_permission(request):
            links.append(("Usage", reverse("admin:budgets_usage", args=[user.tenant_id])))
        return links

    def control_counts(self, request) -> list[tuple[str, int, str]]:
        """The top bar's operator counts, for whoever may pause runs or flip switches: paused runs
        and kill switches on, each linking to its list (the desk breaks them down)."""
        counts = []
        if self.registry_admin("runs.bulkaction").has_view_permission(request):
            runs = self.registry_admin("runs.run")
            paused = runs.get_queryset(request).filter(status="paused").order_by()
            url = reverse("admin:runs_run_changelist") + "?status__exact=paused"
            counts.append(("paused runs", paused.count(), url))
        switches = self.registry_admin("runs.killswitch")
        if switches.has_view_permission(request):
            on = switches.get_queryset(request).filter(on=True).order_by()
            url = reverse("admin:runs_killswitch_changelist") + "?on__exact=1"
            counts.append(("kill switches on", on.count(), url))
        return counts

    def registry_admin(self, label: str):
        return next(a for m, a in self._registry.items() if m._meta.label_lower == label)


def tenant_zone(user) -> dt.tzinfo:
    """The zone of the user's tenant; operators (no tenant) see the server's zone."""
    tenant = getattr(user, "tenant", None) if getattr(user, "is_authenticated", False) else None
    return tenant.zone if tenant is not None else timezone.get_default_timezone()


site = PlatformAdminSite(name="admin")
