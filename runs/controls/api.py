"""The API's pause and resume (runs/controls/pausing.py does the work): one run, or every run a filter
matches. Platform operators everywhere, a tenant's supervisors for their tenant."""

from __future__ import annotations

import uuid

from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import NotFound
from core.schema import JsonObjectField, errors
from runs import selectors
from runs.controls import kill_switches, pausing
from runs.front.api import RunOutput
from runs.models import BulkAction, KillSwitch, Run, RunStatus
from tenants.models import Tenant


def _run(user, run_id) -> Run:
    """The run as the caller may act on it: a platform operator's from any tenant."""
    if user.is_superuser:
        try:
            return Run.objects.select_related("agent", "version", "created_by", "budget").get(
                pk=uuid.UUID(str(run_id))
            )
        except (Run.DoesNotExist, ValueError):
            raise NotFound("run") from None
    if user.tenant_id is None:
        raise NotFound("run")
    return selectors.get_run(user, run_id)


class RunPauseApi(APIView):
    @extend_schema_serializer(component_name="PauseRun")
    class InputSerializer(serializers.Serializer):
        reason = serializers.CharField(
            max_length=2000, help_text="why; shown with the run and in its timeline"
        )
        until = serializers.DateTimeField(
            required=False,
            allow_null=True,
            default=None,
            help_text="when the pause ends: the platform resumes the run then (null: a person resumes it)",
        )

    @extend_schema(
        operation_id="pause_run",
        summary="Pause a run",
        request=InputSerializer,
        responses={
            200: RunOutput,
            **errors(
                {
                    403: "Not an operator or the tenant's supervisor",
                    409: "The run has ended or is being cancelled",
                }
            ),
        },
    )
    def post(self, request, run_id):
        """Pause the run at its next step boundary: a call in flight is recorded first (the run
        shows pause_requested until then), then nothing is dispatched until it is resumed."""
        run = _run(request.user, run_id)
        pausing.require_may_pause(request.user, run.tenant_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        pausing.pause_run(run_id=run.pk, actor=request.user, **data.validated_data)
        return Response(RunOutput(_run(request.user, run.pk)).data)


class RunResumeApi(APIView):
    @extend_schema_serializer(component_name="ResumeRun")
    class InputSerializer(serializers.Serializer):
        reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)

    @extend_schema(
        operation_id="resume_run",
        summary="Resume a paused run",
        request=InputSerializer,
        responses={
            200: RunOutput,
            **errors({403: "Not an operator or the tenant's supervisor", 409: "The run is not paused"}),
        },
    )
    def post(self, request, run_id):
        """Resume a paused run where it stopped (a pause not yet taken is withdrawn)."""
        run = _run(request.user, run_id)
        pausing.require_may_pause(request.user, run.tenant_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        pausing.resume_run(run_id=run.pk, actor=request.user, **data.validated_data)
        return Response(RunOutput(_run(request.user, run.pk)).data)


class BulkFilters(serializers.Serializer):
    tenant = serializers.SlugField(
        required=False, help_text="a tenant's slug (platform operators; a supervisor's own)"
    )
    agent = serializers.SlugField(max_length=100, required=False, help_text="the agent's name")
    version = serializers.IntegerField(
        required=False, min_value=1, max_value=2**31 - 1, help_text="one version of agent"
    )
    tool = serializers.CharField(
        max_length=200, required=False, help_text="runs whose next or pending call is to this tool"
    )
    endpoint = serializers.CharField(
        max_length=100, required=False, help_text="runs whose version calls this model endpoint"
    )
    created_by = serializers.CharField(max_length=150, required=False, help_text="a username")
    status = serializers.ChoiceField(choices=RunStatus.choices, required=False)
    created_before = serializers.DateTimeField(required=False)


@extend_schema_serializer(component_name="BulkAction")
class BulkOutput(serializers.ModelSerializer):
    actor = serializers.CharField(source="actor.username", allow_null=True, default=None)
    filters = JsonObjectField(help_text="the filters as applied (a supervisor's hold their tenant)")

    class Meta:
        model = BulkAction
        fields = ["id", "kind", "actor", "reason", "filters", "count", "at"]


def _bulk_input(name: str, *, pause: bool) -> type[serializers.Serializer]:
    """Each operation's request body is a component of its own."""
    fields: dict = {
        "reason": serializers.CharField(
            max_length=2000, help_text="why; kept with the action and each run's event"
        )
    }
    if pause:
        fields["until"] = serializers.DateTimeField(
            required=False,
            allow_null=True,
            default=None,
            help_text="when the pause ends: the platform resumes them then (null: a person resumes them)",
        )
    return extend_schema_serializer(component_name=name)(type(name, (BulkFilters,), fields))


class _Bulk(APIView):
    kind = ""
    InputSerializer: type[serializers.Serializer]

    def act(self, request):
        pausing.require_may_pause(request.user, request.user.tenant_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        reason, until = values.pop("reason"), values.pop("until", None)
        if self.kind == BulkAction.Kind.PAUSE:
            action = pausing.pause_matching(actor=request.user, reason=reason, filters=values, until=until)
        else:
            action = pausing.resume_matching(actor=request.user, reason=reason, filters=values)
        return Response(BulkOutput(action).data)


class BulkPauseApi(_Bulk):
    kind = BulkAction.Kind.PAUSE
    InputSerializer = _bulk_input("PauseRuns", pause=True)

    @extend_schema(
        operation_id="pause_runs",
        summary="Pause every matching run",
        request=InputSerializer,
        responses={200: BulkOutput, **errors({403: "Not an operator or the tenant's supervisor"})},
    )
    def post(self, request):
        """Pause every live run the filters match, each at its step boundary; answers how many."""
        return self.act(request)


class BulkResumeApi(_Bulk):
    kind = BulkAction.Kind.RESUME
    InputSerializer = _bulk_input("ResumeRuns", pause=False)

    @extend_schema(
        operation_id="resume_runs",
        summary="Resume every matching paused run",
        request=InputSerializer,
        responses={200: BulkOutput, **errors({403: "Not an operator or the tenant's supervisor"})},
    )
    def post(self, request):
        """Resume every paused run the filters match, oldest pause first, 20 a second at most."""
        return self.act(request)


@extend_schema_serializer(component_name="KillSwitch")
class KillSwitchOutput(serializers.ModelSerializer):
    tenant = serializers.CharField(source="tenant.slug")
    changed_by = serializers.CharField(source="changed_by.username", allow_null=True, default=None)

    class Meta:
        model = KillSwitch
        fields = ["id", "scope", "tenant", "target_name", "on", "changed_by", "reason", "changed_at"]


class KillSwitchApi(APIView):
    @extend_schema_serializer(component_name="FlipKillSwitch")
    class InputSerializer(serializers.Serializer):
        scope = serializers.ChoiceField(choices=KillSwitch.Scope.choices)
        target = serializers.CharField(
            max_length=200, help_text="the tenant's slug, or the agent's, tool's or endpoint's name"
        )
        on = serializers.BooleanField(help_text="true: kill; false: lift, and resume what the switch paused")
        reason = serializers.CharField(max_length=2000)
        tenant = serializers.SlugField(required=False, help_text="platform operators: the target's tenant")

    @extend_schema(
        operation_id="list_kill_switches", summary="List kill switches", responses=KillSwitchOutput(many=True)
    )
    def get(self, request):
        """The switches the caller may flip, those on first."""
        pausing.require_may_pause(request.user, request.user.tenant_id)
        switches = KillSwitch.objects.select_related("tenant", "changed_by").order_by("-on", "-changed_at")
        if not request.user.is_superuser:
            switches = switches.filter(tenant_id=request.user.tenant_id)
        return Response(KillSwitchOutput(switches, many=True).data)

    @extend_schema(
        operation_id="flip_kill_switch",
        summary="Turn a kill switch on or off",
        request=InputSerializer,
        responses={200: KillSwitchOutput, **errors({403: "Not an operator or the tenant's supervisor"})},
    )
    def post(self, request):
        """On: a killed tenant or agent starts no run, a killed tool or endpoint is never called (its
        runs pause at their next call). Off: the runs it paused resume, oldest first, rate-limited."""
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        slug = values.pop("tenant", None)
        if request.user.is_superuser and slug:
            tenant = Tenant.objects.filter(slug=slug).first()
        else:
            tenant = Tenant.objects.filter(pk=request.user.tenant_id).first()
        if tenant is None:
            raise NotFound("tenant")
        change = kill_switches.flip(actor=request.user, tenant=tenant, **values)
        switch = KillSwitch.objects.select_related("tenant", "changed_by").get(pk=change.switch_id)
        return Response({**KillSwitchOutput(switch).data, "runs_resumed": change.runs_resumed})
