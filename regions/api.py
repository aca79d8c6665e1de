"""The regions' API: the home's escrow endpoints (signed, between regions) and a status for people.

    POST /v1/regions/slices/grant    a region asks for a slice of a tenant's day, or with `user_id`
                                     of that user's day (signed)
    POST /v1/regions/slices/return   a region gives free room of a day (a user's day) back (signed)
    POST /v1/regions/probe           a region asks how much of a day the home has free (signed; no write)
    POST /v1/regions/authority       a region whose copy of the authority is older than the reach asks
                                     the home about calls (user, tool): held? switched off? (signed; no write)
    GET  /v1/regions/status          the signed-in user's tenant in this region (supervisors)

The escrow endpoints are plain Django views: their authentication is the request's signature
over the exact body (regions/signing.py), and their answer is signed over the exact bytes sent,
which DRF's content negotiation would not let us fix before signing. Unsigned, badly signed,
stale or unknown-region requests get 403 and change nothing.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import require_tenant
from core.errors import DomainError, Forbidden
from regions import selectors, services
from regions.models import TenantRegions, here
from regions.signing import ANSWER_SIGNATURE, SIGNATURE, BadSignature, sign_answer, verify_request
from tenants.models import Tenant
from tenants.permissions import may_view_all_runs


def _answer(request: HttpRequest, status: int, body: dict, key: str | None) -> HttpResponse:
    content = json.dumps(body, sort_keys=True).encode()
    response = HttpResponse(content, status=status, content_type="application/json")
    if key:
        response[ANSWER_SIGNATURE] = sign_answer(
            key=key, request_signature=request.headers.get(SIGNATURE, ""), status=status, body=content
        )
    return response


def _error(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message, "fields": {}}}


def _escrow(request: HttpRequest, operation) -> HttpResponse:
    try:
        region = verify_request(
            keys=settings.REGION_KEYS,
            headers=request.headers,
            method="POST",
            path=request.path,
            body=request.body,
        )
    except BadSignature as exc:
        return _answer(request, 403, _error("bad_region_signature", str(exc)), None)
    key = settings.REGION_KEYS[region]
    try:
        body = json.loads(request.body)
        tenant = Tenant.objects.get(slug=body["tenant"])
        config = TenantRegions.of(tenant)
        if config is None or config.home != here() or region not in config.allowed:
            raise Forbidden(
                f"{here()!r} is not the home of {tenant.slug} for region {region!r}", code="not_home"
            )
        if operation == "authority":
            calls, starts = body["calls"], body.get("starts", [])
            if not isinstance(calls, list) or not isinstance(starts, list):
                raise TypeError("calls and starts must be lists")
            return _answer(request, 200, services.decide(tenant=tenant, calls=calls, starts=starts), key)
        day = dt.date.fromisoformat(body["day"])
        if operation is None:
            return _answer(request, 200, services.probe(tenant=tenant, region=region, day=day), key)
        amount = int(body["amount_micros"])
        user_id = None if body.get("user_id") is None else int(body["user_id"])
        answer = operation(
            tenant=tenant,
            region=region,
            day=day,
            request_id=uuid.UUID(body["request_id"]),
            amount=amount,
            user_id=user_id,
        )
        services.report(
            tenant=tenant,
            region=region,
            day=day,
            user_id=user_id,
            spent=int(body.get("spent_micros", 0)),
            reserved=int(body.get("reserved_micros", 0)),
            held=int(body.get("held_micros", 0)),
        )
    except Tenant.DoesNotExist:
        return _answer(request, 404, _error("not_found", "tenant not found"), key)
    except (KeyError, ValueError, TypeError) as exc:
        return _answer(request, 400, _error("invalid", f"bad escrow request: {exc}"), key)
    except DomainError as exc:
        return _answer(request, exc.status, _error(exc.code, exc.message), key)
    return _answer(request, 200, answer, key)


@csrf_exempt
@require_POST
def grant_view(request: HttpRequest) -> HttpResponse:
    return _escrow(
        request,
        lambda *, tenant, region, day, request_id, amount, user_id: services.grant(
            tenant=tenant, region=region, day=day, request_id=request_id, asked_micros=amount, user_id=user_id
        ),
    )


@csrf_exempt
@require_POST
def return_view(request: HttpRequest) -> HttpResponse:
    return _escrow(
        request,
        lambda *, tenant, region, day, request_id, amount, user_id: services.take_back(
            tenant=tenant,
            region=region,
            day=day,
            request_id=request_id,
            amount_micros=amount,
            user_id=user_id,
        ),
    )


@csrf_exempt
@require_POST
def probe_view(request: HttpRequest) -> HttpResponse:
    return _escrow(request, None)


@csrf_exempt
@require_POST
def authority_view(request: HttpRequest) -> HttpResponse:
    return _escrow(request, "authority")


@extend_schema_serializer(component_name="RegionStatus")
class RegionStatusOutput(serializers.Serializer):
    region = serializers.CharField(help_text="this deployment's region")
    home = serializers.CharField(help_text="the tenant's home region")
    allowed = serializers.ListField(child=serializers.CharField())
    is_home = serializers.BooleanField()
    revocation_reach_seconds = serializers.FloatField(allow_null=True)
    day = serializers.CharField(help_text="the tenant's local day (ISO date)")
    authority_age_seconds = serializers.FloatField(
        allow_null=True, help_text="elsewhere: how old this region's copy of the home's authority is"
    )
    day_account = serializers.DictField(
        child=serializers.IntegerField(), help_text="limit, reserved, spent, held of the day here"
    )
    slices = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        help_text="at home: each region's slices per day (user set: of that user's day)",
    )
    link = serializers.DictField(allow_null=True, required=False, help_text="elsewhere: the link to the home")
    pending_requests = serializers.DictField(child=serializers.IntegerField(), required=False)
    parked_runs = serializers.DictField(
        child=serializers.IntegerField(), required=False, help_text="elsewhere: runs parked, by reason"
    )
    user_days = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        help_text="elsewhere: each user's slices of today here (user, username, limit, reserved, spent, held)",
    )


class RegionStatusApi(APIView):
    @extend_schema(
        operation_id="get_region_status",
        summary="Read this region's view of the tenant",
        responses=RegionStatusOutput,
    )
    def get(self, request):
        """This region's view of the tenant: day account, slices (home) or link, pending requests
        and parked runs (elsewhere). Supervisors only (the tenant's view_runs)."""
        require_tenant(request.user)
        tenant = request.user.tenant
        if not may_view_all_runs(request.user):
            raise Forbidden("reading the regions' status needs view_runs on the tenant", code="not_permitted")
        return Response(RegionStatusOutput(selectors.tenant_status(tenant)).data)
