"""Artifacts in the API: list and upload a run's files, read one's description, download it.

Uploads are the raw body (Content-Type: the media type, ?name=the file name), read up to the
tenant's limit per artifact and refused past it before anything is stored.
"""

from __future__ import annotations

from django.http import HttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from agentplatform.api import require_tenant
from artifacts import selectors, services
from artifacts.models import Artifact
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


class ArtifactListApi(APIView):
    @extend_schema(responses=ArtifactOutput(many=True), operation_id="run_artifacts")
    def get(self, request, run_id):
        require_tenant(request.user)
        rows = selectors.artifacts_of(get_run(request.user, run_id)).select_related("step")
        return Response(ArtifactOutput(rows, many=True).data)

    @extend_schema(
        operation_id="run_artifact_upload",
        request={"text/csv": bytes, "application/json": bytes, "text/plain": bytes},
        parameters=[OpenApiParameter("name", str, required=True, description="the file name")],
        responses={201: ArtifactOutput},
    )
    def post(self, request, run_id):
        require_tenant(request.user)
        run = get_run(request.user, run_id)
        media_type = services.media_type_of(request.content_type)
        if media_type is None:
            raise services.ArtifactRefused(
                f"Content-Type must be one of {', '.join(services.UPLOAD_TYPES)}",
                field="content_type",
                status=415,
            )
        limit = services.limits_for(run.tenant).max_artifact_bytes
        content = request._request.read(limit + 1)
        if len(content) > limit:
            raise services.ArtifactRefused(
                f"the file is larger than this tenant's limit per artifact ({limit} bytes)",
                field="file",
                status=413,
            )
        artifact = services.store(
            run=run,
            name=request.query_params.get("name", ""),
            media_type=media_type,
            content=content,
            source=Artifact.Source.UPLOAD,
        )
        return Response(ArtifactOutput(artifact).data, status=status.HTTP_201_CREATED)


class ArtifactDetailApi(APIView):
    @extend_schema(responses=ArtifactOutput, operation_id="artifact")
    def get(self, request, artifact_id):
        require_tenant(request.user)
        return Response(ArtifactOutput(selectors.get_artifact(runs_for(request.user), artifact_id)).data)


class ArtifactContentApi(APIView):
    @extend_schema(responses={200: bytes}, operation_id="artifact_content")
    def get(self, request, artifact_id):
        require_tenant(request.user)
        artifact = selectors.get_artifact(runs_for(request.user), artifact_id, with_content=True)
        response = HttpResponse(bytes(artifact.content), content_type=artifact.media_type)
        response["Content-Disposition"] = f'attachment; filename="{artifact.name}"'
        response["X-Content-Type-Options"] = "nosniff"
        response["ETag"] = f'"{artifact.sha256}"'
        return response
