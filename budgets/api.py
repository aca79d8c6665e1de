from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from agentplatform.api import (
    MONEY_MAX_MICROS,
    PAGE_PARAMETERS,
    BudgetSerializer,
    paginate,
    paginated,
    require_tenant,
)
from agentplatform.errors import Conflict, Forbidden
from budgets import selectors, services
from budgets.models import Reservation


class DayOutput(BudgetSerializer):
    """One budget day: the balances every account shows, and its date."""

    day = serializers.DateField()


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
        fields = [
            "id",
            "run",
            "step_seq",
            "purpose",
            "day",
            "amount_micros",
            "actual_micros",
            "status",
            "overage",
            "note",
            "created_at",
            "closed_at",
        ]


class UsageApi(APIView):
    class FilterSerializer(serializers.Serializer):
        days = serializers.IntegerField(min_value=1, max_value=366, required=False, default=30)

    @extend_schema(
        parameters=[
            OpenApiParameter("days", {"type": "integer", "minimum": 1, "maximum": 366, "default": 30})
        ],
        responses=UsageOutput,
    )
    def get(self, request):
        """The tenant's budget days (limit, reserved, spent, held) and a per-agent breakdown."""
        require_tenant(request.user)
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        tenant = request.user.tenant
        days = filters.validated_data["days"]
        return Response(
            {
                "tenant": tenant.slug,
                "time_zone": tenant.time_zone,
                "currency_micros_per_unit": 1_000_000,
                "days": DayOutput(selectors.tenant_days(tenant, days=days), many=True).data,
                "agents": selectors.per_agent(tenant, days=days),
            }
        )


class ReservationListApi(APIView):
    class FilterSerializer(serializers.Serializer):
        status = serializers.ChoiceField(choices=Reservation.Status.choices, required=False)

    @extend_schema(
        parameters=[OpenApiParameter("status", enum=Reservation.Status.values), *PAGE_PARAMETERS],
        responses=paginated(ReservationOutput, "PaginatedReservations"),
    )
    def get(self, request):
        require_tenant(request.user)
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        return paginate(
            self,
            request,
            selectors.reservations_for(request.user, **filters.validated_data).order_by("-created_at"),
            ReservationOutput,
        )


def _require_staff(user) -> None:
    require_tenant(user)
    if not user.is_staff:
        raise Forbidden("only tenant staff may clear holds", code="not_staff")


class ReservationReconcileApi(APIView):
    class InputSerializer(serializers.Serializer):
        actual_micros = serializers.IntegerField(min_value=0, max_value=MONEY_MAX_MICROS)
        note = serializers.CharField(max_length=2000)

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
        note = serializers.CharField(max_length=2000)

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
