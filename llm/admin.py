from __future__ import annotations

from django.contrib import admin

from agentplatform.admin_site import TenantScopedAdmin, site
from llm.models import ModelEndpoint


@admin.register(ModelEndpoint, site=site)
class ModelEndpointAdmin(TenantScopedAdmin):
    list_display = ["name", "tenant", "kind", "model", "base_url", "price_input", "price_output"]
    list_filter = ["kind"]
    search_fields = ["name", "model"]
    fieldsets = [
        (None, {"fields": ["tenant", "name", "kind", "model", "base_url", "secret", "timeout_seconds"]}),
        ("Prices per million tokens", {"fields": ["price_input", "price_cached_input", "price_cache_write",
                                                  "price_output"]}),
        ("Scripted model", {"fields": ["config"], "classes": ["collapse"]}),
    ]
