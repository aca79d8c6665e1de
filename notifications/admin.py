"""Webhooks and their deliveries, for operators: a webhook's URL is a destination (like a tool
server's) and its signing secret a credential, so tenant users neither see nor edit them."""

from __future__ import annotations

from django import forms
from django.contrib import admin

from notifications.models import Delivery, DeliveryAttempt, Event, Webhook
from notifications.services import egress_refusal
from tenants.admin_site import OperatorsWrite, ReadOnlyAdmin, TenantScopedAdmin, is_operator, site


class WebhookForm(forms.ModelForm):
    signing_secret = forms.CharField(
        required=False,
        strip=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="Write-only: stored encrypted and never shown again. Leave empty to keep the current value.",
    )
    events = forms.MultipleChoiceField(choices=Event.choices, widget=forms.CheckboxSelectMultiple)

    class Meta:
        model = Webhook
        fields = ["tenant", "name", "url", "events", "enabled"]

    def clean(self):
        cleaned = super().clean() or {}
        if self.instance.pk is None and not cleaned.get("signing_secret"):
            self.add_error("signing_secret", "A new webhook needs a signing secret.")
        tenant, url = cleaned.get("tenant"), cleaned.get("url")
        if tenant is not None and url:
            refusal = egress_refusal(url, tenant.egress_hosts)
            if refusal:
                self.add_error("url", refusal)
        return cleaned


class OperatorOnly:
    def has_module_permission(self, request):
        return is_operator(request.user)

    def has_view_permission(self, request, obj=None):
        return is_operator(request.user)


@admin.register(Webhook, site=site)
class WebhookAdmin(OperatorOnly, OperatorsWrite, TenantScopedAdmin):
    form = WebhookForm
    fields = ["tenant", "name", "url", "signing_secret", "events", "enabled", "created_at", "updated_at"]
    readonly_fields = ["created_at", "updated_at"]
    list_display = ["name", "tenant", "url", "events", "enabled"]
    list_filter = ["enabled"]

    def save_model(self, request, obj, form, change):
        secret = form.cleaned_data.get("signing_secret")
        if secret:
            obj.set_signing_secret(secret)
        if not change:
            obj.save()
            return
        # Only what the form changed, as everywhere in this admin.
        fields = [
            name for name in form.changed_data if name in ("tenant", "name", "url", "events", "enabled")
        ]
        if secret:
            fields.append("signing_ciphertext")
        if fields:
            obj.save(update_fields=[*fields, "updated_at"])


class AttemptInline(admin.TabularInline):
    model = DeliveryAttempt
    FIELDS = ("number", "started_at", "finished_at", "status_code", "error", "retry_at")
    fields = FIELDS
    readonly_fields = FIELDS
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Delivery, site=site)
class DeliveryAdmin(OperatorOnly, ReadOnlyAdmin):
    list_display = [
        "id",
        "webhook",
        "event",
        "subject",
        "status",
        "attempts",
        "next_attempt_at",
        "last_status_code",
    ]
    list_filter = ["status", "event"]
    readonly_fields = [
        "tenant",
        "webhook",
        "event",
        "subject",
        "run_id",
        "approval_id",
        "payload",
        "status",
        "attempts",
        "next_attempt_at",
        "last_status_code",
        "last_error",
        "created_at",
        "delivered_at",
    ]
    inlines = [AttemptInline]
