"""The API's pause and resume (runs/controls/pausing.py does the work): one run, or every run a filter
matches. Platform operators everywhere, a tenant's supervisors for their tenant."""

from __future__ import annotations

import uuid

from django.db.models import Prefetch
from drf_spectacular.utils import PolymorphicProxySerializer, extend_schema, extend_schema_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from core.errors import NotFound
from core.schema import JsonObjectField, errors
from runs import selectors
from runs.controls import cancelling, kill_switches, pausing
from runs.front.api import RunOutput
from runs.models import BulkAction, KillSwitch, KillSwitchChange, Run, RunStatus
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


@extend_schema_serializer(component_name="BulkPreview")
class BulkPreviewOutput(serializers.Serializer):
    kind = serializers.ChoiceField(choices=BulkAction.Kind.choices)
    filters = JsonObjectField(help_text="the filters as they would apply (a supervisor's hold their tenant)")
    count = serializers.IntegerField(help_text="how many runs match now (one action moves 10,000 at most)")
    runs = serializers.ListField(
        child=serializers.UUIDField(), help_text="the first few, in the order they would move"
    )


def _bulk_input(name: str, *, pause: bool) -> type[serializers.Serializer]:
    """Each operation's request body is a component of its own."""
    fields: dict = {
        "reason": serializers.CharField(
            required=False,
            allow_blank=True,
            default="",
            max_length=2000,
            help_text="why; kept with the action and each run's event (required unless preview)",
        ),
        "preview": serializers.BooleanField(
            required=False,
            default=False,
            help_text="true: change nothing, answer how many runs would move and the first few",
        ),
    }
    if pause:
        fields["until"] = serializers.DateTimeField(
            required=False,
            allow_null=True,
            default=None,
            help_text="when the pause ends: the platform resumes them then (null: a person resumes them)",
        )

    def validate(self, data):
        if not data.get("preview") and not data.get("reason", "").strip():
            raise serializers.ValidationError({"reason": ["a reason is required"]})
        return data

    fields["validate"] = validate
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
        if values.pop("preview"):
            filters, count, sample = pausing.preview(actor=request.user, kind=self.kind, filters=values)
            stored = {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in filters.items()}
            body = {"kind": self.kind, "filters": stored, "count": count, "runs": [run.pk for run in sample]}
            return Response(BulkPreviewOutput(body).data)
        if self.kind == BulkAction.Kind.PAUSE:
            action = pausing.pause_matching(actor=request.user, reason=reason, filters=values, until=until)
        elif self.kind == BulkAction.Kind.CANCEL:
            action = cancelling.cancel_matching(actor=request.user, reason=reason, filters=values)
        else:
            action = pausing.resume_matching(actor=request.user, reason=reason, filters=values)
        return Response(BulkOutput(action).data)


ANSWERS = {
    200: PolymorphicProxySerializer(
        component_name="BulkActionOrPreview",
        serializers=[BulkOutput, BulkPreviewOutput],
        resource_type_field_name=None,
    ),
    **errors({403: "Not an operator or the tenant's supervisor"}),
}


class BulkPauseApi(_Bulk):
    kind = BulkAction.Kind.PAUSE
    InputSerializer = _bulk_input("PauseRuns", pause=True)

    @extend_schema(
        operation_id="pause_runs",
        summary="Pause every matching run",
        request=InputSerializer,
        responses=ANSWERS,
    )
    def post(self, request):
        """Pause every live run the filters match, each at its step boundary; answers how many
        (with preview: how many it would, changing nothing)."""
        return self.act(request)


class BulkResumeApi(_Bulk):
    kind = BulkAction.Kind.RESUME
    InputSerializer = _bulk_input("ResumeRuns", pause=False)

    @extend_schema(
        operation_id="resume_runs",
        summary="Resume every matching paused run",
        request=InputSerializer,
        responses=ANSWERS,
    )
    def post(self, request):
        """Resume every paused run the filters match, oldest pause first, 20 a second at most
        (with preview: how many it would, changing nothing)."""
        return self.act(request)


class BulkCancelApi(_Bulk):
    kind = BulkAction.Kind.CANCEL
    InputSerializer = _bulk_input("CancelRuns", pause=False)

    @extend_schema(
        operation_id="cancel_runs",
        summary="Cancel every matching run",
        request=InputSerializer,
        responses=ANSWERS,
    )
    def post(self, request):
        """Cancel every live run the filters match, with a reason (with preview: how many it
        would, changing nothing). No model or tool call of a matched run starts after it answers."""
        return self.act(request)


@extend_schema_serializer(component_name="KillSwitchChange")
class KillSwitchChangeOutput(serializers.ModelSerializer):
    actor = serializers.CharField(source="actor.username", allow_null=True, default=None)

    class Meta:
        model = KillSwitchChange
        fields = ["on", "actor", "reason", "at", "runs_resumed"]


@extend_schema_serializer(component_name="KillSwitch")
class KillSwitchOutput(serializers.ModelSerializer):
    tenant = serializers.CharField(source="tenant.slug")
    changed_by = serializers.CharField(source="changed_by.username", allow_null=True, default=None)
    history = KillSwitchChangeOutput(
        source="changes", many=True, help_text="every flip of the switch, newest first"
    )

    class Meta:
        model = KillSwitch
        fields = [
            "id",
            "scope",
            "tenant",
            "target_name",
            "on",
            "changed_by",
            "reason",
            "changed_at",
            "history",
        ]


def _switches():
    return KillSwitch.objects.select_related("tenant", "changed_by").prefetch_related(
        Prefetch("changes", KillSwitchChange.objects.select_related("actor").order_by("-at", "-pk"))
    )


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
        """The tenant's switches (every tenant's, for platform operators), those on first, each with
        every flip it has had."""
        kill_switches.require_may_flip(request.user, request.user.tenant_id)
        switches = _switches().order_by("-on", "-changed_at")
        if not request.user.is_superuser:
            switches = switches.filter(tenant_id=request.user.tenant_id)
        return Response(KillSwitchOutput(switches, many=True).data)

    @extend_schema(
        operation_id="flip_kill_switch",
        summary="Turn a kill switch on or off",
        request=InputSerializer,
        responses={
            200: KillSwitchOutput,
            **errors(
                {
                    403: "Not a platform operator or the tenant's supervisor (a tenant's operator: "
                    "only its tools' and endpoints' switches)"
                }
            ),
        },
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
        switch = _switches().get(pk=change.switch_id)
        return Response({**KillSwitchOutput(switch).data, "runs_resumed": change.runs_resumed})
