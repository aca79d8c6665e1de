"""Regions in the admin: where each tenant runs (operators edit), and per region the slices
(home: what each region holds), the link to the home, the requests in flight (elsewhere)."""

from __future__ import annotations

from django.contrib import admin

from regions.models import HomeLink, RegionDay, SliceRequest, TenantRegions
from tenants.admin_site import OperatorsWrite, ReadOnlyAdmin, TenantScopedAdmin, site


@admin.register(TenantRegions, site=site)
class TenantRegionsAdmin(OperatorsWrite, TenantScopedAdmin):
    list_display = ("tenant", "home", "allowed", "slice_micros", "revocation_reach_seconds")


@admin.register(RegionDay, site=site)
class RegionDayAdmin(ReadOnlyAdmin):
    """Home side: each region's slices of a day, or of one user's day (outstanding counts as
    spent here until returned)."""

    list_display = (
        "tenant",
        "region",
        "day",
        "user",
        "granted_micros",
        "returned_micros",
        "outstanding",
        "reported_spent_micros",
        "reported_held_micros",
        "reported_at",
    )
    list_filter = ("region", "day")

    @admin.display(description="outstanding (micros)")
    def outstanding(self, obj: RegionDay) -> int:
        return obj.outstanding_micros


@admin.register(HomeLink, site=site)
class HomeLinkAdmin(ReadOnlyAdmin):
    """Region side: the link to the tenant's home, as the slice keeper last found it."""

    list_display = ("tenant", "state", "since", "last_ok_at", "home_free_micros", "refill_ms", "last_error")


@admin.register(SliceRequest, site=site)
class SliceRequestAdmin(ReadOnlyAdmin):
    """Region side: grants and returns asked of the home; pending ones are sent again, same id."""

    list_display = (
        "created_at",
        "tenant",
        "day",
        "user",
        "kind",
        "asked_micros",
        "moved_micros",
        "home_free_micros",
        "status",
        "attempts",
    )
    list_filter = ("status", "kind")
