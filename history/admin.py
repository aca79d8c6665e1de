"""The history in the admin: legal holds (place through the add form, lift through the change
form with a reason), erasure certificates (read only) and the data subject request form that
makes one, signed checkpoints (platform operators). The services do the work (history/holds.py,
history/erasure.py); a refusal shows on the form with the holds it names."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse

from core.errors import DomainError
from history import erasure, holds
from history.models import Checkpoint, ErasureCertificate, HoldScope, LegalHold, RunTombstone
from tenants.admin_site import ReadOnlyAdmin, TenantScopedAdmin, is_operator, site
from tenants.models import Tenant


class HoldForm(forms.ModelForm):
    lift_reason = forms.CharField(
        required=False, widget=forms.Textarea, help_text="to lift this hold: why (it is lifted on save)"
    )

    class Meta:
        model = LegalHold
        fields = ["tenant", "scope", "run", "subject", "reason"]

    def clean(self):
        data = super().clean() or {}
        if self.instance.pk is None:  # placing: what the service would refuse, said on the form
            if data.get("scope") == HoldScope.RUN and not data.get("run"):
                self.add_error("run", "a run hold needs the run")
            if data.get("scope") == HoldScope.SUBJECT and not (data.get("subject") or "").strip():
                self.add_error("subject", "a subject hold needs the subject's identifier")
            run = data.get("run")
            if run is not None and data.get("tenant") is not None and run.tenant_id != data["tenant"].pk:
                self.add_error("run", "the run is another tenant's")
        return data


@admin.register(LegalHold, site=site)
class LegalHoldAdmin(TenantScopedAdmin):
    form = HoldForm
    list_display = ["__str__", "scope", "placed_by", "placed_at", "lifted_by", "lifted_at"]
    list_filter = ["scope"]
    raw_id_fields = ["run"]

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ["placed_by", "placed_at", "lifted_by", "lifted_at"]
        kept = [
            "tenant",
            "scope",
            "run",
            "subject",
            "reason",
            "placed_by",
            "placed_at",
            "lifted_by",
            "lifted_at",
        ]
        return [*kept, "lift_reason_kept"]

    def get_fields(self, request, obj=None):
        fields = ["tenant", "scope", "run", "subject", "reason"]
        if obj is not None:
            fields += ["placed_by", "placed_at", "lifted_by", "lifted_at"]
            if obj.is_active:
                fields.append("lift_reason")
            else:
                fields.append("lift_reason_kept")
        return fields

    @admin.display(description="lift reason")
    def lift_reason_kept(self, hold):
        return hold.lift_reason

    def has_delete_permission(self, request, obj=None):
        return False  # a hold is lifted, never deleted: its row is the audit

    def save_model(self, request, obj, form, change):
        try:
            if not change:
                placed = holds.place_hold(
                    tenant_id=obj.tenant_id,
                    scope=obj.scope,
                    actor=request.user,
                    reason=obj.reason,
                    run_id=obj.run_id,
                    subject=obj.subject,
                )
                obj.pk = placed.pk
            elif form.cleaned_data.get("lift_reason"):
                holds.lift_hold(hold_id=obj.pk, actor=request.user, reason=form.cleaned_data["lift_reason"])
        except DomainError as exc:
            messages.error(request, exc.message)
            raise PermissionDenied(exc.message) from exc


class SubjectRequestForm(forms.Form):
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.none())
    identifier = forms.CharField(
        max_length=500, help_text="the exact value: a customer id, an email address, an account number"
    )
    request_ref = forms.CharField(max_length=200, label="request reference", help_text="the DSR ticket")
    reason = forms.CharField(required=False, widget=forms.Textarea)


@admin.register(ErasureCertificate, site=site)
class ErasureCertificateAdmin(ReadOnlyAdmin):
    list_display = ["request_ref", "erased_by", "erased_at", "run_count", "counts"]
    FIELDS = (
        "id",
        "tenant",
        "request_ref",
        "identifier_digest",
        "reason",
        "erased_by",
        "erased_at",
        "runs",
        "counts",
    )
    fields = FIELDS
    readonly_fields = FIELDS
    change_list_template = "admin/history/erasurecertificate/change_list.html"

    @admin.display(description="runs")
    def run_count(self, certificate):
        return len(certificate.runs)

    def get_urls(self):
        view = self.admin_site.admin_view(self.subject_request_view)
        return [path("request/", view, name="history_subject_request"), *super().get_urls()]

    def may_erase(self, request) -> bool:
        return request.user.is_superuser or request.user.has_perm("history.add_erasurecertificate")

    def subject_request_view(self, request):
        """The data subject request: erase every run of the tenant carrying the identifier."""
        if not self.may_erase(request):
            raise PermissionDenied
        form = SubjectRequestForm(request.POST or None)
        tenants = (
            Tenant.objects.all()
            if is_operator(request.user)
            else Tenant.objects.filter(pk=request.user.tenant_id)
        )
        form.fields["tenant"].queryset = tenants  # type: ignore[attr-defined]
        if request.method == "POST" and form.is_valid():
            try:
                certificate = erasure.erase_subject(
                    tenant_id=form.cleaned_data["tenant"].pk,
                    identifier=form.cleaned_data["identifier"],
                    request_ref=form.cleaned_data["request_ref"],
                    actor=request.user,
                    reason=form.cleaned_data["reason"],
                )
            except DomainError as exc:
                form.add_error(None, exc.message)
            else:
                messages.success(request, f"Erased the content of {len(certificate.runs)} run(s).")
                return HttpResponseRedirect(
                    reverse("admin:history_erasurecertificate_change", args=[certificate.pk])
                )
        context = {
            **self.admin_site.each_context(request),
            "form": form,
            "title": "Data subject request: erase",
        }
        return TemplateResponse(request, "admin/history/subject_request.html", context)


@admin.register(Checkpoint, site=site)
class CheckpointAdmin(ReadOnlyAdmin):
    list_display = ["number", "at", "size", "root", "kid"]
    FIELDS = ("number", "at", "size", "root", "previous", "kid", "statement", "signature", "public_jwk")
    fields = FIELDS
    readonly_fields = FIELDS

    def get_queryset(self, request):
        return Checkpoint.objects.all() if is_operator(request.user) else Checkpoint.objects.none()


@admin.register(RunTombstone, site=site)
class RunTombstoneAdmin(ReadOnlyAdmin):
    """What remains of a run the skeleton's retention deleted (history/retention.py)."""

    list_display = ["run_id", "agent", "status", "finished_at", "purged_at", "checkpoint"]
    FIELDS = (
        "run_id",
        "tenant",
        "agent",
        "created_by",
        "status",
        "created_at",
        "finished_at",
        "cost_micros",
        "steps",
        "event_seq",
        "checkpoint",
        "period_seconds",
        "purged_at",
    )
    fields = FIELDS
    readonly_fields = FIELDS
