from __future__ import annotations

from django.contrib import admin, messages
from django.utils.html import format_html_join
from django.utils.safestring import mark_safe

from llm import breaker
from llm.models import EndpointCircuit, ModelEndpoint
from llm.probe import probe_lines
from tenants.admin_site import TenantScopedAdmin, is_operator, price, site


@admin.register(ModelEndpoint, site=site)
class ModelEndpointAdmin(TenantScopedAdmin):
    list_display = ["name", "tenant", "kind", "model", "base_url", "input_price", "output_price", "probed"]
    list_filter = ["kind"]
    search_fields = ["name", "model"]
    fieldsets = [
        (None, {"fields": ["tenant", "name", "kind", "model", "base_url", "secret", "timeout_seconds"]}),
        (
            "Prices per million tokens",
            {"fields": ["price_input", "price_cached_input", "price_cache_write", "price_output"]},
        ),
        (
            "Circuit breaker",
            {
                "fields": [
                    "breaker_failures",
                    "breaker_window_seconds",
                    "breaker_open_seconds",
                    "circuit_state",
                ]
            },
        ),
        (
            "Provider quota, shared by every endpoint on this key and model",
            {"fields": list(ModelEndpoint.QUOTA_FIELDS)},
        ),
        (
            "Self-hosted server: settings (configuration file) and the last probe (manage.py probe_endpoint)",
            {"fields": [*ModelEndpoint.SERVER_FIELDS, "last_probe"]},
        ),
        ("Scripted model", {"fields": ["config"], "classes": ["collapse"]}),
    ]

    actions = ["close_circuit"]

    @admin.action(
        description="Close the circuit breaker (the endpoint is known to be back)", permissions=["operate"]
    )
    def close_circuit(self, request, queryset):
        for endpoint in queryset:
            if breaker.close(endpoint):
                messages.success(request, f"{endpoint}: circuit closed; calls go to it again")
            else:
                messages.info(request, f"{endpoint}: circuit was already closed")

    def has_operate_permission(self, request):
        # Whether calls go to an endpoint is the operators' call, like where they go.
        return is_operator(request.user)

    @admin.display(description="circuit now")
    def circuit_state(self, endpoint):
        circuit = EndpointCircuit.objects.filter(endpoint=endpoint).first() if endpoint.pk else None
        if circuit is None or circuit.state == EndpointCircuit.State.CLOSED:
            return "closed"
        return f"{circuit.get_state_display().lower()} until {circuit.until:%Y-%m-%d %H:%M:%S} UTC: {circuit.last_error}"

    @admin.display(description="last probe")
    def last_probe(self, endpoint):
        return (
            format_html_join(mark_safe("<br>"), "{}", ((line,) for line in probe_lines(endpoint.probe)))
            or "never probed: manage.py probe_endpoint " + endpoint.name
        )

    @admin.display(description="probe")
    def probed(self, endpoint):
        if not endpoint.probe:
            return "-"
        return "passed" if endpoint.probe.get("ok") else "FAILED"

    @admin.display(description="input price", ordering="price_input")
    def input_price(self, endpoint):
        return price(endpoint.price_input)

    @admin.display(description="output price", ordering="price_output")
    def output_price(self, endpoint):
        return price(endpoint.price_output)

    def get_readonly_fields(self, request, obj=None):
        # The server settings are the file's (apply): edited there, where they are checked per kind.
        readonly = [
            *super().get_readonly_fields(request, obj),
            "circuit_state",
            "last_probe",
            *ModelEndpoint.SERVER_FIELDS,
        ]
        if not is_operator(request.user):
            # The endpoint's URL and key are configuration (apply, operators): whoever could edit
            # the URL could have the tenant's provider key sent to a host of theirs.
            readonly += ModelEndpoint.DESTINATION_FIELDS
            # The quota is the provider account's, shared with other tenants: raising it here
            # would let this tenant's calls crowd theirs.
            readonly += ModelEndpoint.QUOTA_FIELDS
        return readonly

    def has_add_permission(self, request):
        return is_operator(request.user) and super().has_add_permission(request)
