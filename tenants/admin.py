from __future__ import annotations

from django import forms
from django.contrib import admin
from django.contrib.auth.admin import GroupAdmin as DjangoGroupAdmin
from django.contrib.auth.admin import UserAdmin as DjangoUserAdmin
from django.contrib.auth.forms import UserChangeForm, UserCreationForm
from django.contrib.auth.models import Group
from django.urls import reverse
from django.utils.html import format_html

from tenants.admin_site import TenantScopedAdmin, is_operator, money, site
from tenants.models import Secret, Tenant, TenantGroup, User
from tenants.tokens import revoke_all


@admin.register(Tenant, site=site)
class TenantAdmin(TenantScopedAdmin):
    list_display = ["slug", "name", "time_zone", "daily_budget", "usage_link"]
    search_fields = ["slug", "name"]

    @admin.display(description="daily budget")
    def daily_budget(self, tenant):
        return money(tenant.daily_budget_micros, tenant)

    @admin.display(description="usage")
    def usage_link(self, tenant):
        return format_html('<a href="{}">last 30 days</a>', reverse("admin:budgets_usage", args=[tenant.pk]))

    def has_add_permission(self, request):
        return is_operator(request.user) and super().has_add_permission(request)

    def has_delete_permission(self, request, obj=None):
        return is_operator(request.user) and super().has_delete_permission(request, obj)

    def get_readonly_fields(self, request, obj=None):
        readonly = list(super().get_readonly_fields(request, obj))
        if not is_operator(request.user):
            # Its share of quotas other tenants wait for too: a tenant does not set its own.
            readonly.append("quota_weight")
        return readonly


class TenantUserCreationForm(UserCreationForm):
    class Meta(UserCreationForm.Meta):
        model = User
        fields = ("username", "tenant")


class TenantUserChangeForm(UserChangeForm):
    class Meta(UserChangeForm.Meta):
        model = User


@admin.register(User, site=site)
class UserAdmin(TenantScopedAdmin, DjangoUserAdmin):
    form = TenantUserChangeForm
    add_form = TenantUserCreationForm
    list_display = ["username", "tenant", "email", "is_staff", "is_active"]
    list_filter = ["is_staff", "is_active", ("groups", admin.RelatedOnlyFieldListFilter)]
    fieldsets = [
        (None, {"fields": ["username", "password", "tenant"]}),
        ("Personal info", {"fields": ["first_name", "last_name", "email"]}),
        ("Permissions", {"fields": ["is_active", "is_staff", "is_superuser", "groups", "user_permissions"]}),
        ("Important dates", {"fields": ["last_login", "date_joined"]}),
    ]
    add_fieldsets = [
        (None, {"classes": ["wide"], "fields": ["username", "tenant", "password1", "password2"]})
    ]

    def get_form(self, request, obj=None, **kwargs):  # type: ignore[override]  # UserAdmin's signature
        form = super().get_form(request, obj, **kwargs)
        if not is_operator(request.user) and "tenant" in form.base_fields:
            # Only operators have no tenant; a tenant admin's users always belong to the tenant.
            form.base_fields["tenant"].required = True
        return form

    def get_queryset(self, request):
        users = super().get_queryset(request)
        # A tenant admin who could edit a superuser (e.g. reset their password) would become one.
        return users if request.user.is_superuser else users.filter(is_superuser=False)

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        if change and "is_active" in form.changed_data and not obj.is_active:
            # A deactivated user's tokens end now, so reactivating them later revives none.
            revoke_all(user=obj)

    def get_readonly_fields(self, request, obj=None):
        readonly = list(super().get_readonly_fields(request, obj))
        if not request.user.is_superuser:
            # Global permissions reach across tenants; only operators hand them out.
            readonly += ["is_superuser", "user_permissions"]
        return readonly


class TenantGroupInline(admin.StackedInline):
    model = TenantGroup
    max_num = 1
    can_delete = False


@admin.register(Group, site=site)
class GroupAdmin(TenantScopedAdmin, DjangoGroupAdmin):  # type: ignore[misc]  # stubs: GroupAdmin's override is narrower
    """Tenant users see their groups (and manage membership on the user page); operators edit them:
    a group's permissions are global and would reach other tenants."""

    inlines = [TenantGroupInline]
    list_display = ["name", "tenant"]

    @admin.display(description="tenant")
    def tenant(self, group):
        link = getattr(group, "tenant_link", None)
        return link.tenant if link else "—"

    def has_add_permission(self, request):
        return request.user.is_superuser

    def has_change_permission(self, request, obj=None):
        return request.user.is_superuser

    def has_delete_permission(self, request, obj=None):
        return request.user.is_superuser


class SecretForm(forms.ModelForm):
    value = forms.CharField(
        required=False,
        strip=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="Write-only: stored encrypted and never shown again. Leave empty to keep the current value.",
    )

    class Meta:
        model = Secret
        fields = ["tenant", "name"]

    def clean(self):
        cleaned = super().clean() or {}
        if self.instance.pk is None and not cleaned.get("value"):
            self.add_error("value", "A new secret needs a value.")
        return cleaned


@admin.register(Secret, site=site)
class SecretAdmin(TenantScopedAdmin):
    form = SecretForm
    fields = ["tenant", "name", "value", "updated_at"]
    readonly_fields = ["updated_at"]
    list_display = ["name", "tenant", "updated_at"]
    search_fields = ["name"]

    def save_model(self, request, obj, form, change):
        value = form.cleaned_data.get("value")
        if value:
            obj.set_value(value)
        if not change:
            obj.save()
            return
        fields = [name for name in form.changed_data if name in ("tenant", "name")]
        if value:
            fields += ["ciphertext"]
        if fields:
            obj.save(update_fields=fields + ["updated_at"])
