from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from agentplatform.api import paginate, require_tenant
from agentplatform.errors import Conflict, Forbidden
from budgets import selectors, services
from budgets.models import Reservation


class DayOutput(serializers.Serializer):
    day = serializers.DateField()
    limit_micros = serializers.IntegerField()
    reserved_micros = serializers.IntegerField()
    spent_micros = serializers.IntegerField()
    held_micros = serializers.IntegerField()
    overage_micros = serializers.IntegerField()
    remaining_micros = serializers.IntegerField()


class AgentUsageOutput(serializers.Serializer):
    agent = serializers.CharField()
    spent_micros = serializers.IntegerField()
    held_micros = serializers.IntegerField()
    reserved_micros = serializers.IntegerField()
    runs = serializers.IntegerField()


class UsageOutput(serializers.Serializer):
    tenant = serializers.CharField()
    time_zone = serializers.CharField()
    currency_micros_per_unit = serializers.IntegerField()
    days = DayOutput(many=True)
    agents = AgentUsageOutput(many=True)


class ReservationOutput(serializers.ModelSerializer):
    run = serializers.UUIDField(source="run_id", allow_null=True)
    step_seq = serializers.IntegerField(source="step.seq", allow_null=True, default=None)

    class Meta:
        model = Reservation
        fields = ["id", "run", "step_seq", "purpose", "day", "amount_micros", "actual_micros", "status", "overage",
                  "note", "created_at", "closed_at"]


class UsageApi(APIView):
    @extend_schema(parameters=[OpenApiParameter("days", int)], responses=UsageOutput)
    def get(self, request):
        """The tenant's budget days (limit, reserved, spent, held) and a per-agent breakdown."""
        require_tenant(request.user)
        raw = request.query_params.get("days", "30")
        if not raw.isdigit() or not 1 <= int(raw) <= 366:
            raise serializers.ValidationError({"days": ["a whole number from 1 to 366"]})
        tenant = request.user.tenant
        days = int(raw)
        return Response({"tenant": tenant.slug, "time_zone": tenant.time_zone, "currency_micros_per_unit": 1_000_000,
                         "days": DayOutput(selectors.tenant_days(tenant, days=days), many=True).data,
                         "agents": selectors.per_agent(tenant, days=days)})


class ReservationListApi(APIView):
    @extend_schema(parameters=[OpenApiParameter("status", enum=Reservation.Status.values)],
                   responses=ReservationOutput(many=True))
    def get(self, request):
        require_tenant(request.user)
        return paginate(self, request, selectors.reservations_for(request.user, status=request.query_params.get("status"))
                        .order_by("-created_at"), ReservationOutput)


def _require_staff(user) -> None:
    require_tenant(user)
    if not user.is_staff:
        raise Forbidden("only tenant staff may clear holds", code="not_staff")


class ReservationReconcileApi(APIView):
    class InputSerializer(serializers.Serializer):
        actual_micros = serializers.IntegerField(min_value=0)
        note = serializers.CharField()

    @extend_schema(request=InputSerializer, responses=ReservationOutput)
    def post(self, request, reservation_id):
        """Clear a hold with the provider's actual usage for the lost call."""
        _require_staff(request.user)
        reservation = selectors.get_reservation(request.user, reservation_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        if not services.reconcile(reservation.pk, actor=request.user, **data.validated_data):
            raise Conflict(f"reservation is {reservation.status}, not held", code="not_held")
        return Response(ReservationOutput(selectors.get_reservation(request.user, reservation_id)).data)


class ReservationWriteOffApi(APIView):
    class InputSerializer(serializers.Serializer):
        note = serializers.CharField()

    @extend_schema(request=InputSerializer, responses=ReservationOutput)
    def post(self, request, reservation_id):
        """Clear a hold without usage data; nothing is counted as spent and the reason is kept."""
        _require_staff(request.user)
        reservation = selectors.get_reservation(request.user, reservation_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        if not services.write_off(reservation.pk, actor=request.user, **data.validated_data):
            raise Conflict(f"reservation is {reservation.status}, not held", code="not_held")
        return Response(ReservationOutput(selectors.get_reservation(request.user, reservation_id)).data)
