"""Artifacts in the API: list and upload a run's files, read one's description, download it.

Uploads are JSON like every request body (name, media type, base64 content), so they are bounded
by API_MAX_BODY_BYTES first and by the tenant's limits (artifacts/services.py) before anything is
stored.
"""

from __future__ import annotations

import base64
import binascii

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from artifacts import selectors, services
from artifacts.models import Artifact
from core.api import require_tenant
from core.schema import errors
from runs.selectors import get_run, runs_for


class ArtifactOutput(serializers.ModelSerializer):
    step = serializers.IntegerField(source="step.seq", allow_null=True, default=None)
    download = serializers.SerializerMethodField()

    class Meta:
        model = Artifact
        fields = [
            "id",
            "run",
            "step",
            "source",
            "name",
            "media_type",
            "size",
            "sha256",
            "created_at",
            "download",
        ]

    def get_download(self, artifact) -> str:
        return f"/v1/artifacts/{artifact.pk}/content"


class UploadRequest(serializers.Serializer):
    name = serializers.CharField(max_length=200, help_text="the file name, no path")
    media_type = serializers.ChoiceField(choices=sorted(services.UPLOAD_TYPES))
    content_b64 = serializers.CharField(help_text="the file, base64-encoded", trim_whitespace=False)


class ArtifactListApi(APIView):
    @extend_schema(
        operation_id="list_run_artifacts",
        summary="List a run's artifacts",
        responses=ArtifactOutput(many=True),
    )
    def get(self, request, run_id):
        """The files of a run: uploaded with it, returned by its tools, produced by run_python."""
        require_tenant(request.user)
        rows = selectors.artifacts_of(get_run(request.user, run_id)).select_related("step")
        return Response(ArtifactOutput(rows, many=True).data)

    @extend_schema(
        operation_id="upload_run_artifact",
        summary="Upload a file to a run",
        request=UploadRequest,
        responses={
            201: ArtifactOutput,
            **errors({413: "The file is over the tenant's limit per artifact or per run"}),
        },
    )
    def post(self, request, run_id):
        """Store a file (CSV, JSON, text or Parquet) with a run, for its tools and run_python to read.
        Storing the same file again answers the artifact already stored."""
        require_tenant(request.user)
        run = get_run(request.user, run_id)
        data = UploadRequest(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            content = base64.b64decode(data.validated_data["content_b64"], validate=True)
        except binascii.Error:
            raise services.ArtifactRefused("content_b64 is not valid base64", field="content_b64") from None
        artifact = services.store(
            run=run,
            name=data.validated_data["name"],
            media_type=data.validated_data["media_type"],
            content=content,
            source=Artifact.Source.UPLOAD,
        )
        return Response(ArtifactOutput(artifact).data, status=status.HTTP_201_CREATED)


class ArtifactDetailApi(APIView):
    @extend_schema(
        operation_id="get_artifact", summary="Get an artifact's description", responses=ArtifactOutput
    )
    def get(self, request, artifact_id):
        """One artifact: its run, producing step, type, size and sha256 (not its content)."""
        require_tenant(request.user)
        return Response(ArtifactOutput(selectors.get_artifact(runs_for(request.user), artifact_id)).data)


class ArtifactContentApi(APIView):
    @extend_schema(
        operation_id="download_artifact",
        summary="Download an artifact",
        responses={(200, "application/octet-stream"): OpenApiTypes.BINARY},
    )
    def get(self, request, artifact_id):
        """The artifact's bytes, with its media type and file name."""
        require_tenant(request.user)
        artifact = selectors.get_artifact(runs_for(request.user), artifact_id, with_content=True)
        return download(artifact)


def download(artifact: Artifact) -> HttpResponse:
    """The artifact's bytes as a file (the API and both admin pages); 410 when an erasure destroyed
    its key (ContentErased, raised for the API's error handler; the admin shows its message)."""
    response = HttpResponse(services.content_of(artifact), content_type=artifact.media_type)
    response["Content-Disposition"] = f'attachment; filename="{artifact.name}"'
    response["X-Content-Type-Options"] = "nosniff"
    response["ETag"] = f'"{artifact.sha256}"'
    return response
