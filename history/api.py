"""The history's API: legal holds (place, lift, list), data subject erasure and signed exports
(history/holds.py, history/erasure.py, history/export.py do the work). Platform operators name the tenant; a tenant's people act on
their own tenant and need the model permission (history.add_legalhold, history.add_erasurecertificate,
history.export_history)."""

from __future__ import annotations

import uuid

from django.http import HttpResponse
from django.utils.dateparse import parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import DomainError, Forbidden, NotFound
from core.schema import errors
from history import erasure, export, holds
from history.models import ErasureCertificate, HoldScope, LegalHold
from runs.models import Run
from tenants.models import Tenant


def acting_tenant(user, slug: str | None, perm: str) -> int:
    """The tenant the caller acts for, or refuse: an operator names it, anyone else acts on their own."""
    if user.is_superuser and user.tenant_id is None:
        if not slug:
            raise DomainError("a platform operator names the tenant", code="tenant_required")
        tenant_id = Tenant.objects.filter(slug=slug).values_list("pk", flat=True).first()
        if tenant_id is None:
            raise DomainError(f"no tenant {slug}", code="unknown_tenant")
        return tenant_id
    if user.tenant_id is None or (slug and slug != user.tenant.slug):
        raise Forbidden("you act for your own tenant only", code="not_permitted")
    if not (user.is_superuser or (user.is_staff and user.has_perm(perm))):
        raise Forbidden(f"this needs the {perm} permission", code="not_permitted")
    return user.tenant_id


class HoldOutput(serializers.ModelSerializer):
    placed_by = serializers.CharField(source="placed_by.username")
    lifted_by = serializers.CharField(source="lifted_by.username", allow_null=True, default=None)

    class Meta:
        model = LegalHold
        fields = [
            "id",
            "scope",
            "run",
            "subject",
            "reason",
            "placed_by",
            "placed_at",
            "lifted_by",
            "lifted_at",
            "lift_reason",
        ]


class CertificateOutput(serializers.ModelSerializer):
    erased_by = serializers.CharField(source="erased_by.username")

    class Meta:
        model = ErasureCertificate
        fields = [
            "id",
            "request_ref",
            "identifier_digest",
            "reason",
            "erased_by",
            "erased_at",
            "runs",
            "counts",
        ]


class HoldListApi(APIView):
    @extend_schema_serializer(component_name="PlaceHold")
    class InputSerializer(serializers.Serializer):
        tenant = serializers.SlugField(required=False, help_text="platform operators: the tenant's slug")
        scope = serializers.ChoiceField(choices=HoldScope.choices)
        run = serializers.UUIDField(
            required=False, allow_null=True, default=None, help_text="scope run: the run"
        )
        subject = serializers.CharField(
            required=False,
            allow_blank=True,
            default="",
            max_length=500,
            help_text="scope subject: the exact identifier",
        )
        reason = serializers.CharField(max_length=2000, help_text="the matter or case the hold is for")

    @extend_schema(
        operation_id="list_holds", summary="List legal holds", responses={200: HoldOutput(many=True)}
    )
    def get(self, request):
        """The tenant's legal holds, active and lifted, newest first."""
        tenant_id = acting_tenant(request.user, request.query_params.get("tenant"), "history.view_legalhold")
        rows = LegalHold.objects.filter(tenant_id=tenant_id).select_related("placed_by", "lifted_by")
        return Response(HoldOutput(rows, many=True).data)

    @extend_schema(
        operation_id="place_hold",
        summary="Place a legal hold",
        request=InputSerializer,
        responses={201: HoldOutput},
    )
    def post(self, request):
        """Place a hold on a run, the tenant, or a data subject: retention's purge skips what it
        covers and erasure refuses it, until it is lifted."""
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        tenant_id = acting_tenant(request.user, v.get("tenant"), "history.add_legalhold")
        hold = holds.place_hold(
            tenant_id=tenant_id,
            scope=v["scope"],
            actor=request.user,
            reason=v["reason"],
            run_id=v["run"],
            subject=v["subject"],
        )
        return Response(HoldOutput(hold).data, status=201)


class HoldLiftApi(APIView):
    @extend_schema_serializer(component_name="LiftHold")
    class InputSerializer(serializers.Serializer):
        reason = serializers.CharField(max_length=2000)

    @extend_schema(
        operation_id="lift_hold",
        summary="Lift a legal hold",
        request=InputSerializer,
        responses={200: HoldOutput, **errors({404: "No such hold", 409: "The hold was already lifted"})},
    )
    def post(self, request, hold_id):
        """Lift the hold (once; who, when and why are kept with it)."""
        hold = LegalHold.objects.filter(pk=hold_id).first() if _uuid(hold_id) else None
        if hold is None:
            raise NotFound("hold")
        acting_tenant(
            request.user,
            hold.tenant.slug if request.user.tenant_id is None else None,
            "history.change_legalhold",
        )
        if request.user.tenant_id not in (None, hold.tenant_id):
            raise NotFound("hold")
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        lifted = holds.lift_hold(hold_id=hold.pk, actor=request.user, reason=data.validated_data["reason"])
        return Response(HoldOutput(lifted).data)


class ErasureListApi(APIView):
    @extend_schema_serializer(component_name="EraseSubject")
    class InputSerializer(serializers.Serializer):
        tenant = serializers.SlugField(required=False, help_text="platform operators: the tenant's slug")
        identifier = serializers.CharField(
            max_length=500, help_text="the exact value to erase: a customer id, an email, an account number"
        )
        request_ref = serializers.CharField(
            max_length=200,
            help_text="your reference for the request: a retry with it gets the same certificate",
        )
        reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)

    @extend_schema(
        operation_id="erase_subject",
        summary="Erase a data subject's content",
        request=InputSerializer,
        responses={
            201: CertificateOutput,
            **errors(
                {409: "A legal hold covers a run carrying the identifier (named), or such a run is live"}
            ),
        },
    )
    def post(self, request):
        """Erase the content of every run of the tenant carrying the identifier, keeping the
        skeleton; answer the erasure certificate."""
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        tenant_id = acting_tenant(request.user, v.get("tenant"), "history.add_erasurecertificate")
        certificate = erasure.erase_subject(
            tenant_id=tenant_id,
            identifier=v["identifier"],
            request_ref=v["request_ref"],
            actor=request.user,
            reason=v["reason"],
        )
        return Response(CertificateOutput(certificate).data, status=201)


class ErasureDetailApi(APIView):
    @extend_schema(
        operation_id="get_erasure",
        summary="An erasure certificate",
        responses={200: CertificateOutput, **errors({404: "No such certificate"})},
    )
    def get(self, request, certificate_id):
        """What one request erased, when, by whom."""
        certificate = (
            ErasureCertificate.objects.filter(pk=certificate_id).first() if _uuid(certificate_id) else None
        )
        if certificate is None or request.user.tenant_id not in (None, certificate.tenant_id):
            raise NotFound("certificate")
        acting_tenant(
            request.user,
            certificate.tenant.slug if request.user.tenant_id is None else None,
            "history.view_erasurecertificate",
        )
        return Response(CertificateOutput(certificate).data)


def _uuid(text: str) -> bool:
    try:
        uuid.UUID(str(text))
    except ValueError:
        return False
    return True


class ExportApi(APIView):
    @extend_schema(
        operation_id="export_history",
        summary="A signed export of run history",
        parameters=[
            OpenApiParameter("tenant", str, description="platform operators: the tenant's slug"),
            OpenApiParameter("run", str, description="one run's id"),
            OpenApiParameter("from", OpenApiTypes.DATETIME, description="runs created at or after"),
            OpenApiParameter("to", OpenApiTypes.DATETIME, description="runs created before"),
        ],
        responses={
            # A zip's bytes; octet-stream, which generated clients read as a file.
            (200, "application/octet-stream"): OpenApiTypes.BINARY,
            **errors({404: "No such run", 422: "Neither a run nor a range, or a range of too many runs"}),
        },
    )
    def get(self, request):
        """A zip an auditor verifies offline (docs/history.md): records.jsonl (skeleton, the content
        still kept, approvals with their policies, identity events, costs, the chain and the latest
        signed checkpoint with each run's audit path), manifest.json, manifest.sig, jwks.json."""
        params = request.query_params
        tenant_id = acting_tenant(request.user, params.get("tenant"), "history.export_history")
        if params.get("run"):
            run_id = params["run"]
            if not _uuid(run_id) or not Run.objects.filter(pk=run_id, tenant_id=tenant_id).exists():
                raise NotFound("run")
            run_ids, scope = [uuid.UUID(run_id)], {"run": run_id}
        else:
            start, end = parse_datetime(params.get("from") or ""), parse_datetime(params.get("to") or "")
            if start is None or end is None or start >= end:
                raise DomainError(
                    "give run=ID, or from and to (times, from before to)", code="invalid_range", status=422
                )
            run_ids = export.runs_between(tenant_id, start, end)
            if len(run_ids) > export.MAX_RUNS:
                raise DomainError(
                    f"more than {export.MAX_RUNS} runs: export a shorter range", code="too_many", status=422
                )
            scope = {"from": start.isoformat(), "to": end.isoformat()}
        bundle = export.build_bundle(tenant_id=tenant_id, run_ids=run_ids, scope=scope)
        response = HttpResponse(bundle, content_type="application/octet-stream")
        response["Content-Disposition"] = 'attachment; filename="history-export.zip"'
        return response
