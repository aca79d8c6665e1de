"""Artifacts in the admin: listed per run, downloadable by whoever may read the run."""

from __future__ import annotations

from django.contrib import admin
from django.http import Http404, HttpResponse
from django.urls import path, reverse
from django.utils.html import format_html

from artifacts.api import download
from artifacts.models import Artifact
from artifacts.services import ContentAltered, ContentErased
from tenants.admin_site import ReadOnlyAdmin, site


@admin.register(Artifact, site=site)
class ArtifactAdmin(ReadOnlyAdmin):
    list_display = ["name", "run", "step", "source", "media_type", "size", "created_at", "download"]
    list_filter = ["source", "media_type"]
    search_fields = ["sha256", "=run__id"]  # the name is sealed at rest: the database cannot search it
    FIELDS = ("name", "run", "step", "source", "media_type", "size", "sha256", "created_at", "download")
    fields = FIELDS
    readonly_fields = FIELDS

    def get_queryset(self, request):
        # scoped like runs (tenant, and the creator without view_runs); the content stays unread
        return super().get_queryset(request).defer("content").select_related("run", "step")

    @admin.display(description="download")
    def download(self, artifact):
        return format_html(
            '<a href="{}">download</a>', reverse("admin:artifact_download", args=[artifact.pk])
        )

    def get_urls(self):
        view = self.admin_site.admin_view(self.download_view)
        return [path("<uuid:artifact_id>/download/", view, name="artifact_download"), *super().get_urls()]

    def download_view(self, request, artifact_id):
        artifact = self.get_queryset(request).defer(None).filter(pk=artifact_id).first()
        if artifact is None or not self.has_view_permission(request, artifact):
            raise Http404("no artifact with this id")
        return admin_download(artifact)


def admin_download(artifact: Artifact) -> HttpResponse:
    try:
        return download(artifact)
    except (ContentErased, ContentAltered) as exc:
        return HttpResponse(exc.message, status=exc.status, content_type="text/plain")
