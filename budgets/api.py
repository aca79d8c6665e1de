from __future__ import annotations

from decimal import Decimal

from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from budgets import selectors, services
from budgets.models import Reservation
from core.api import (
    MONEY_MAX_MICROS,
    PAGE_PARAMETERS,
    BudgetSerializer,
    paginate,
    paginated,
    require_tenant,
)
from core.errors import Conflict, Forbidden
from core.money import PLATFORM_CURRENCY
from core.schema import errors


@extend_schema_serializer(component_name="UsageDay")
class DayOutput(BudgetSerializer):
    """One budget day: the balances every account shows, and its date."""

    day = serializers.DateField()
    over_limit = serializers.SerializerMethodField(
        help_text="true when reserved + spent + held pass the limit: remaining_micros is then negative, "
        "by how much the day went over"
    )

    def get_over_limit(self, account) -> bool:
        return account.remaining_micros < 0


@extend_schema_serializer(component_name="AgentUsage")
class AgentUsageOutput(serializers.Serializer):
    agent = serializers.CharField()
    spent_micros = serializers.IntegerField()
    held_micros = serializers.IntegerField()
    reserved_micros = serializers.IntegerField()
    runs = serializers.IntegerField()


@extend_schema_serializer(component_name="Usage")
class UsageOutput(serializers.Serializer):
    tenant = serializers.CharField()
    time_zone = serializers.CharField()
    currency = serializers.CharField(help_text="the currency every *_micros amount is in (ISO 4217)")
    currency_micros_per_unit = serializers.IntegerField()
    display_currency = serializers.CharField(
        help_text="the currency the tenant's people read (tenant.currency)"
    )
    exchange_rate = serializers.DecimalField(
        max_digits=18,
        decimal_places=6,
        coerce_to_string=True,
        help_text="fixed, from the configuration: display_currency units per one currency unit",
    )
    days = DayOutput(many=True)
    agents = AgentUsageOutput(many=True)


@extend_schema_serializer(component_name="Reservation")
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
            OpenApiParameter(
                "days",
                {"type": "integer", "minimum": 1, "maximum": 366, "default": 30},
                description="how many days back from today (the tenant's time zone)",
            )
        ],
        operation_id="get_usage",
        summary="Read usage and budget",
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
                "currency": PLATFORM_CURRENCY,
                "currency_micros_per_unit": 1_000_000,
                "display_currency": tenant.currency,
                "exchange_rate": f"{Decimal(tenant.exchange_rate):.6f}",
                "days": DayOutput(selectors.tenant_days(tenant, days=days), many=True).data,
                "agents": selectors.per_agent(tenant, days=days),
            }
        )


class ReservationListApi(APIView):
    class FilterSerializer(serializers.Serializer):
        status = serializers.ChoiceField(choices=Reservation.Status.choices, required=False)

    @extend_schema(
        operation_id="list_reservations",
        summary="List budget reservations",
        parameters=[
            OpenApiParameter(
                "status", enum=Reservation.Status.values, description="only reservations in this state"
            ),
            *PAGE_PARAMETERS,
        ],
        responses=paginated(ReservationOutput, "PaginatedReservations"),
    )
    def get(self, request):
        """The budget reservations of the runs the caller may see, newest first; `held` ones wait for a
        person to reconcile or write them off."""
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


HOLD_ERRORS = errors({409: "The reservation is not held"})


class ReservationReconcileApi(APIView):
    @extend_schema_serializer(component_name="ReconcileReservation")
    class InputSerializer(serializers.Serializer):
        actual_micros = serializers.IntegerField(
            min_value=0, max_value=MONEY_MAX_MICROS, help_text="what the provider billed for the lost call"
        )
        note = serializers.CharField(max_length=2000, help_text="why, and where the figure comes from")

    @extend_schema(
        operation_id="reconcile_reservation",
        summary="Reconcile a held reservation",
        request=InputSerializer,
        responses={200: ReservationOutput, **HOLD_ERRORS},
    )
    def post(self, request, reservation_id):
        """Clear a hold with the provider's actual usage for the lost call (tenant staff)."""
        _require_staff(request.user)
        reservation = selectors.get_reservation(request.user, reservation_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        if not services.reconcile(reservation.pk, actor=request.user, **data.validated_data):
            raise Conflict(f"reservation is {reservation.status}, not held", code="not_held")
        return Response(ReservationOutput(selectors.get_reservation(request.user, reservation_id)).data)


class ReservationWriteOffApi(APIView):
    @extend_schema_serializer(component_name="WriteOffReservation")
    class InputSerializer(serializers.Serializer):
        note = serializers.CharField(max_length=2000, help_text="why; kept with the reservation")

    @extend_schema(
        operation_id="write_off_reservation",
        summary="Write off a held reservation",
        request=InputSerializer,
        responses={200: ReservationOutput, **HOLD_ERRORS},
    )
    def post(self, request, reservation_id):
        """Clear a hold without usage data (tenant staff); nothing is counted as spent and the reason
        is kept."""
        _require_staff(request.user)
        reservation = selectors.get_reservation(request.user, reservation_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        if not services.write_off(reservation.pk, actor=request.user, **data.validated_data):
            raise Conflict(f"reservation is {reservation.status}, not held", code="not_held")
        return Response(ReservationOutput(selectors.get_reservation(request.user, reservation_id)).data)
