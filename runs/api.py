from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from agentplatform.api import ID_MAX, PAGE_PARAMETERS, BudgetSerializer, paginate, paginated, require_tenant
from agentplatform.errors import Forbidden
from runs import lifecycle, selectors
from runs.models import Run, RunEvent, RunStatus, Step
from runs.recovery import resolution
from tenants.auth import RunStartThrottle


class RunOutput(serializers.ModelSerializer):
    agent = serializers.CharField(source="agent.name")
    version = serializers.IntegerField(source="version.number")
    created_by = serializers.CharField(source="created_by.username")
    budget = BudgetSerializer(allow_null=True)

    class Meta:
        model = Run
        fields = [
            "id",
            "agent",
            "version",
            "status",
            "stop_reason",
            "error",
            "final_output",
            "input",
            "metadata",
            "limits",
            "created_by",
            "cancel_requested",
            "step_count",
            "tool_call_count",
            "model_call_count",
            "budget",
            "expected_cost_micros",
            "admitted_at",
            "created_at",
            "started_at",
            "finished_at",
            "deadline_at",
            "resume_at",
        ]


class StepOutput(serializers.ModelSerializer):
    tool = serializers.CharField(source="tool_name")
    duration_ms = serializers.IntegerField(allow_null=True)

    class Meta:
        model = Step
        fields = [
            "seq",
            "kind",
            "status",
            "tool",
            "parent_seq",
            "arguments",
            "idempotency_key",
            "request",
            "result",
            "observation",
            "error",
            "usage",
            "cost_micros",
            "reserved_micros",
            "attempts",
            "replayed_from_seq",
            "created_at",
            "started_at",
            "dispatched_at",
            "finished_at",
            "duration_ms",
            "resolved_at",
            "resolution",
        ]


class EventOutput(serializers.ModelSerializer):
    # The event's number within its run (1, 2, 3, ...), not a platform-wide sequence whose gaps
    # would show other tenants' activity.
    id = serializers.IntegerField(source="seq", help_text="the event's number within its run (same as seq)")
    actor = serializers.CharField(source="actor.username", allow_null=True, default=None)

    class Meta:
        model = RunEvent
        fields = ["id", "seq", "at", "kind", "step_seq", "actor", "message", "data"]


class RunListApi(APIView):
    throttle_classes = [RunStartThrottle]

    class InputSerializer(serializers.Serializer):
        agent = serializers.SlugField(max_length=100)
        alias = serializers.SlugField(max_length=50, required=False)
        version = serializers.IntegerField(required=False, min_value=1, max_value=2**31 - 1)
        input = serializers.JSONField()
        metadata = serializers.DictField(required=False, default=dict)
        wait = serializers.BooleanField(
            required=False,
            default=True,
            help_text="If the tenant's day cannot carry this run now, wait in waiting_budget (true, the default) "
            "or answer 429 with Retry-After (false).",
        )

        def validate(self, attrs):
            if "alias" in attrs and "version" in attrs:
                raise serializers.ValidationError({"version": ["give alias or version, not both"]})
            return attrs

    class FilterSerializer(serializers.Serializer):
        status = serializers.ChoiceField(choices=RunStatus.choices, required=False)
        agent = serializers.CharField(max_length=100, required=False)
        created_by = serializers.CharField(max_length=150, required=False)

    @extend_schema(
        parameters=[
            OpenApiParameter("status", enum=RunStatus.values),
            OpenApiParameter("agent"),
            OpenApiParameter("created_by"),
            *PAGE_PARAMETERS,
        ],
        responses=paginated(RunOutput, "PaginatedRuns"),
    )
    def get(self, request):
        require_tenant(request.user)
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        return paginate(self, request, selectors.runs_for(request.user, **filters.validated_data), RunOutput)

    @extend_schema(
        request=InputSerializer,
        responses={201: RunOutput, 200: RunOutput},
        parameters=[OpenApiParameter("Idempotency-Key", location=OpenApiParameter.HEADER)],
    )
    def post(self, request):
        """Start a run as the caller. The same Idempotency-Key and body replay the same run (200).

        A run the tenant's day budget cannot carry yet (runs/admission.py) is created in
        waiting_budget and started in order of arrival, or refused with 429 if `wait` is false.
        """
        require_tenant(request.user)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        key = request.headers.get("Idempotency-Key") or None
        if key is not None and len(key) > 200:
            raise serializers.ValidationError({"Idempotency-Key": ["at most 200 characters"]})
        run, created = lifecycle.start_run(user=request.user, idempotency_key=key, **data.validated_data)
        run = selectors.get_run(request.user, run.pk)
        return Response(
            RunOutput(run).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK
        )


class RunDetailApi(APIView):
    @extend_schema(responses=RunOutput)
    def get(self, request, run_id):
        require_tenant(request.user)
        return Response(RunOutput(selectors.get_run(request.user, run_id)).data)


class RunStepsApi(APIView):
    @extend_schema(responses=StepOutput(many=True))
    def get(self, request, run_id):
        require_tenant(request.user)
        run = selectors.get_run(request.user, run_id)
        return Response(StepOutput(selectors.steps_of(run), many=True).data)


class RunEventsApi(APIView):
    class FilterSerializer(serializers.Serializer):
        after = serializers.IntegerField(min_value=0, max_value=ID_MAX, required=False)

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "after",
                {"type": "integer", "minimum": 0, "maximum": ID_MAX},
                description="only events with a larger id (seq) in this run",
            )
        ],
        responses=EventOutput(many=True),
    )
    def get(self, request, run_id):
        require_tenant(request.user)
        run = selectors.get_run(request.user, run_id)
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        return Response(
            EventOutput(selectors.events_of(run, after=filters.validated_data.get("after")), many=True).data
        )


class RunCancelApi(APIView):
    class InputSerializer(serializers.Serializer):
        reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)

    @extend_schema(request=InputSerializer, responses=RunOutput)
    def post(self, request, run_id):
        """Cancel a run. No model or tool call starts after this answers."""
        require_tenant(request.user)
        run = selectors.get_run(request.user, run_id)
        if run.created_by_id != request.user.pk and not request.user.is_staff:
            raise Forbidden("only the run's creator or tenant staff may cancel it", code="not_run_owner")
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        lifecycle.cancel_run(run_id=run.pk, actor=request.user, reason=data.validated_data["reason"])
        return Response(RunOutput(selectors.get_run(request.user, run_id)).data)


class StepResolveApi(APIView):
    class InputSerializer(serializers.Serializer):
        outcome = serializers.ChoiceField(choices=resolution.OUTCOMES)
        reason = serializers.CharField(max_length=2000)
        result = serializers.JSONField(required=False, default=None)
        override = serializers.BooleanField(required=False, default=False)

    @extend_schema(request=InputSerializer, responses=StepOutput)
    def post(self, request, run_id, seq: int):
        """Resolve a tool step whose outcome is unknown (needs approve_tool on the tool)."""
        require_tenant(request.user)
        run = selectors.get_run(request.user, run_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        step = resolution.resolve_step(run_id=run.pk, seq=seq, user=request.user, **data.validated_data)
        return Response(StepOutput(step).data)
