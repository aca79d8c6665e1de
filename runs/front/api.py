from __future__ import annotations

import base64
import binascii
import json

from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    extend_schema_serializer,
)
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from agents import output as output_contract
from agents.spec import spec_for
from artifacts import selectors as artifact_selectors
from artifacts import services as artifacts
from core.api import ID_MAX, PAGE_PARAMETERS, BudgetSerializer, paginate, paginated, require_tenant
from core.errors import Forbidden, NotFound
from core.parsers import BoundedMultiPartParser, StrictJSONParser
from core.schema import JsonObjectField, JsonObjectInput, errors
from runs import admission, selectors, services
from runs.front import search
from runs.models import Run, RunEvent, RunStatus, Step
from runs.recovery import resolution
from tenants.auth import RunStartThrottle


class ExpectedStart(serializers.Serializer):
    when = serializers.ChoiceField(
        choices=["next_admission_pass", "as_admitted_runs_finish", "next_local_midnight"]
    )
    at = serializers.DateTimeField(allow_null=True)
    runs_ahead = serializers.IntegerField()


@extend_schema_serializer(component_name="Run")
class RunOutput(serializers.ModelSerializer):
    agent = serializers.CharField(source="agent.name")
    version = serializers.IntegerField(source="version.number")
    created_by = serializers.CharField(source="created_by.username")
    paused_by = serializers.CharField(
        source="paused_by.username",
        allow_null=True,
        default=None,
        help_text="who paused it (or set the kill switch that did), while paused or pause_requested",
    )
    paused_by_switch = serializers.IntegerField(
        source="paused_by_switch_id",
        allow_null=True,
        help_text="the kill switch that paused it (GET /v1/kill-switches); turning it off resumes the run",
    )
    budget = BudgetSerializer(allow_null=True)
    input = JsonObjectField(help_text="what the run was started with")
    metadata = JsonObjectField(help_text="the caller's own labels, stored as given")
    limits = JsonObjectField(help_text="the limits in force: the version's, capped by the tenant's")
    output = serializers.SerializerMethodField(
        help_text="a succeeded run whose version declares output_schema: its final answer, parsed (it "
        "validated against the schema); null otherwise, and final_output holds the text"
    )
    expected_start = serializers.SerializerMethodField(
        help_text="for a run waiting to be admitted (waiting_budget, admitted_at null): when it is expected "
        "to start. `when` is next_admission_pass (within the sweeper's period), as_admitted_runs_finish "
        "(budget remains; the tenant's admitted runs must finish first) or next_local_midnight (today's "
        "budget is spent); `at` is a time or null; `runs_ahead` counts the waiting runs before it"
    )

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
            "output",
            "input",
            "metadata",
            "limits",
            "created_by",
            "cancel_requested",
            "pause_requested",
            "paused_by",
            "paused_by_switch",
            "paused_at",
            "pause_reason",
            "paused_until",
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
            "expected_start",
        ]

    @extend_schema_field(serializers.JSONField(allow_null=True))
    def get_output(self, run):
        if run.status != RunStatus.SUCCEEDED or spec_for(run.version).output is None:
            return None
        return output_contract.parse(run.final_output)[0]

    @extend_schema_field(ExpectedStart(allow_null=True))
    def get_expected_start(self, run) -> dict | None:
        return admission.expected_start(run)


@extend_schema_serializer(component_name="Step")
class StepOutput(serializers.ModelSerializer):
    tool = serializers.CharField(source="tool_name")
    duration_ms = serializers.IntegerField(allow_null=True)
    usage = JsonObjectField(allow_null=True, help_text="a model step's tokens (input, output, cached)")
    endpoint = serializers.SerializerMethodField(
        help_text="a model step: the endpoint it went to (the primary or a fallback), whose prices it was charged at"
    )
    error_class = serializers.CharField(
        help_text="a failed model step: rate_limited, server_error, timeout, context_too_long or refused"
    )

    class Meta:
        model = Step
        fields = [
            "seq",
            "kind",
            "status",
            "tool",
            "endpoint",
            "error_class",
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

    def get_endpoint(self, step) -> str:
        # The name as it was when the call was made (kept in the step's request), without a query.
        return (step.request or {}).get("endpoint", "") if step.kind in ("model", "summary") else ""


@extend_schema_serializer(component_name="Event")
class EventOutput(serializers.ModelSerializer):
    # The event's number within its run (1, 2, 3, ...), not a platform-wide sequence whose gaps
    # would show other tenants' activity.
    id = serializers.IntegerField(source="seq", help_text="the event's number within its run (same as seq)")
    actor = serializers.CharField(source="actor.username", allow_null=True, default=None)
    data = JsonObjectField(source="details", help_text="the event's details, by kind")  # type: ignore[assignment]  # stubs: DRF's metaclass takes declared fields off the class

    class Meta:
        model = RunEvent
        fields = ["id", "seq", "at", "kind", "step_seq", "actor", "message", "data"]


class FileInput(serializers.Serializer):
    """One file of a start request: its content, or an artifact of a run you may read (copied)."""

    name = serializers.CharField(
        max_length=200, required=False, help_text="the file name, no path (a copy keeps its own by default)"
    )
    media_type = serializers.ChoiceField(choices=sorted(artifacts.UPLOAD_TYPES), required=False)
    content_b64 = serializers.CharField(
        required=False, trim_whitespace=False, help_text="the file, base64-encoded"
    )
    artifact_id = serializers.UUIDField(
        required=False, help_text="instead of content: copy this artifact (of a run you may read)"
    )

    def validate(self, attrs):
        if ("content_b64" in attrs) == ("artifact_id" in attrs):
            raise serializers.ValidationError({"content_b64": ["give content_b64 or artifact_id, not both"]})
        if "content_b64" in attrs:
            for field in ("name", "media_type"):
                if field not in attrs:
                    raise serializers.ValidationError({field: ["required with content_b64"]})
        return attrs


MAX_START_FILES = 200


def _given(user, items: list[dict]) -> list[artifacts.Given]:
    """The files of a start request as the service takes them; a bad one is a 400 on its field."""
    given = []
    for i, item in enumerate(items):
        if "upload" in item:
            upload = item["upload"]
            media_type = artifacts.media_type_of(upload.content_type or "") or (upload.content_type or "")
            given.append(
                artifacts.Given(name=upload.name or "", media_type=media_type, content=upload.read())
            )
        elif "artifact_id" in item:
            try:
                found = artifact_selectors.get_artifact(
                    selectors.runs_for(user), item["artifact_id"], with_content=True
                )
            except NotFound:
                raise artifacts.ArtifactRefused(
                    f"no artifact {item['artifact_id']} of a run you may read",
                    field=f"files[{i}].artifact_id",
                ) from None
            given.append(
                artifacts.Given(
                    name=item.get("name") or found.name,
                    media_type=found.media_type,
                    content=artifacts.content_of(found),
                    copied_from=found.pk,
                )
            )
        else:
            try:
                content = base64.b64decode(item["content_b64"], validate=True)
            except binascii.Error:
                raise artifacts.ArtifactRefused("not valid base64", field=f"files[{i}].content_b64") from None
            given.append(artifacts.Given(name=item["name"], media_type=item["media_type"], content=content))
    return given


def _multipart_start(request) -> tuple[dict, list[dict]]:
    """A multipart start request as the JSON one: `input` and `metadata` are JSON text fields,
    each file part named `files` is one file (its part's name and type), and each `artifact_ids`
    field copies one artifact."""
    data: dict = {}
    for field in ("agent", "alias", "version", "wait"):
        if field in request.data:
            data[field] = request.data[field]
    for field in ("input", "metadata"):
        if field in request.data:
            try:
                data[field] = json.loads(request.data[field])
            except ValueError:
                raise serializers.ValidationError({field: ["must be JSON text (an object)"]}) from None
    files: list[dict] = [{"upload": upload} for upload in request.FILES.getlist("files")]
    unknown = sorted(set(request.FILES) - {"files"})
    if unknown:
        raise serializers.ValidationError({unknown[0]: ["file parts must be named `files`"]})
    for raw in request.data.getlist("artifact_ids"):
        reference = FileInput(data={"artifact_id": raw})
        if not reference.is_valid():
            raise serializers.ValidationError({"artifact_ids": [f"{raw!r} is not an artifact id"]})
        files.append(dict(reference.validated_data))
    return data, files


class RunListApi(APIView):
    throttle_classes = [RunStartThrottle]
    parser_classes = [StrictJSONParser, BoundedMultiPartParser]

    @extend_schema_serializer(component_name="StartRun")
    class InputSerializer(serializers.Serializer):
        agent = serializers.SlugField(max_length=100, help_text="the agent's name")
        alias = serializers.SlugField(
            max_length=50,
            required=False,
            help_text="run the version this alias points at (prod, canary, ...)",
        )
        version = serializers.IntegerField(
            required=False,
            min_value=1,
            max_value=2**31 - 1,
            help_text="run this version; with neither alias nor version, the latest",
        )
        input = JsonObjectInput(
            help_text="the task, as a JSON object; the agent's spec reads it ($input.<key>)"
        )
        metadata = JsonObjectInput(
            required=False, default=dict, help_text="your own labels (ticket id, ...), stored as given"
        )
        wait = serializers.BooleanField(
            required=False,
            default=True,
            help_text="If the tenant's day cannot carry this run now, wait in waiting_budget (true, the default) "
            "or answer 429 with Retry-After (false).",
        )
        files = FileInput(
            many=True,
            required=False,
            max_length=MAX_START_FILES,  # type: ignore[call-arg]  # stubs: many=True passes it to the ListSerializer
            help_text="files the run starts with (CSV, JSON, text, Parquet), stored as its artifacts with "
            "the run or not at all; the model is shown each one's description and id. Also as "
            "multipart/form-data: `files` parts, `artifact_ids` fields, `input` and `metadata` as JSON text",
        )

        def validate(self, attrs):
            if "alias" in attrs and "version" in attrs:
                raise serializers.ValidationError({"version": ["give alias or version, not both"]})
            return attrs

    class FilterSerializer(serializers.Serializer):
        status = serializers.ChoiceField(choices=RunStatus.choices, required=False)
        agent = serializers.CharField(max_length=100, required=False)
        created_by = serializers.CharField(max_length=150, required=False)
        q = serializers.CharField(max_length=search.Q_MAX, required=False, trim_whitespace=True)
        created_after = serializers.DateTimeField(required=False)
        created_before = serializers.DateTimeField(required=False)

    @extend_schema(
        operation_id="list_runs",
        summary="List runs",
        parameters=[
            OpenApiParameter("status", enum=RunStatus.values, description="only runs in this state"),
            OpenApiParameter("agent", description="only runs of this agent (its name)"),
            OpenApiParameter("created_by", description="only runs started by this username"),
            OpenApiParameter(
                "q",
                {"type": "string", "maxLength": search.Q_MAX},
                description="a run id or id prefix (4+ hex digits), a value found anywhere in the "
                "input or metadata, matched exactly (TXN-1002, 12499), or words of its strings (the "
                'request, the customer\'s name: `meera sharma`, `"duplicate charge"`, `-refund`), '
                "best matches first",
            ),
            OpenApiParameter(
                "created_after", {"type": "string", "format": "date-time"}, description="created at or after"
            ),
            OpenApiParameter(
                "created_before", {"type": "string", "format": "date-time"}, description="created before"
            ),
            *PAGE_PARAMETERS,
        ],
        responses=paginated(RunOutput, "PaginatedRuns", bounded=True),
    )
    def get(self, request):
        """The runs the caller may see (their own; all of the tenant's with view_runs), newest first."""
        require_tenant(request.user)
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        data = dict(filters.validated_data)
        q, after, before = (
            data.pop("q", ""),
            data.pop("created_after", None),
            data.pop("created_before", None),
        )
        runs = search.created_between(selectors.runs_for(request.user, **data), after=after, before=before)
        return paginate(
            self,
            request,
            search.search(runs, q, tenants=[request.user.tenant_id], ranked=True),
            RunOutput,
            bounded=True,
        )

    @extend_schema(
        operation_id="start_run",
        summary="Start a run",
        request=InputSerializer,
        responses={
            201: OpenApiResponse(RunOutput, description="The run was created"),
            200: OpenApiResponse(
                RunOutput, description="Replayed: this Idempotency-Key already started this run"
            ),
            **errors(
                {
                    404: "No such agent, alias or version",
                    409: "A request with this Idempotency-Key is still in progress; retry it",
                    422: "This Idempotency-Key was used with a different body, or a run of this version is "
                    "expected to cost more than the tenant's whole daily budget (expected_cost_exceeds_daily_budget)",
                    429: "Start rate or active-run quota reached, or (with wait: false) no budget today",
                }
            ),
        },
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                {"type": "string", "maxLength": 200},
                location=OpenApiParameter.HEADER,
                description="the same key and body (per user) answer the same run with 200, never a second run",
            )
        ],
    )
    def post(self, request):
        """Start a run as the caller. The same Idempotency-Key and body replay the same run (200).

        A run the tenant's day budget cannot carry yet (runs/admission.py) is created in
        waiting_budget and started in order of arrival, or refused with 429 if `wait` is false.
        """
        require_tenant(request.user)
        if request.content_type.startswith("multipart/"):
            fields, items = _multipart_start(request)
            if len(items) > MAX_START_FILES:
                raise serializers.ValidationError({"files": [f"at most {MAX_START_FILES} files"]})
            data = self.InputSerializer(data=fields)
        else:
            data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = dict(data.validated_data)
        if not request.content_type.startswith("multipart/"):
            items = [dict(item) for item in values.get("files", [])]
        values["files"] = _given(request.user, items)
        key = request.headers.get("Idempotency-Key") or None
        if key is not None and len(key) > 200:
            raise serializers.ValidationError({"Idempotency-Key": ["at most 200 characters"]})
        run, created = services.start_run(user=request.user, idempotency_key=key, **values)
        run = selectors.get_run(request.user, run.pk)
        return Response(
            RunOutput(run).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK
        )


class RunDetailApi(APIView):
    @extend_schema(operation_id="get_run", summary="Get a run", responses=RunOutput)
    def get(self, request, run_id):
        """One run: its state, counters, budget and, once it ended, its final output or error.

        Poll it to follow a run (or read its events with `after`)."""
        require_tenant(request.user)
        return Response(RunOutput(selectors.get_run(request.user, run_id)).data)


class RunStepsApi(APIView):
    @extend_schema(
        operation_id="list_run_steps", summary="List a run's steps", responses=StepOutput(many=True)
    )
    def get(self, request, run_id):
        """Every model and tool step of the run in order, with arguments, redacted results, usage and cost."""
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
        operation_id="list_run_events",
        summary="List a run's events",
        responses=EventOutput(many=True),
    )
    def get(self, request, run_id):
        """The run's events in order; pass the last id you saw as `after` to read only newer ones."""
        require_tenant(request.user)
        run = selectors.get_run(request.user, run_id)
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        return Response(
            EventOutput(selectors.events_of(run, after=filters.validated_data.get("after")), many=True).data
        )


class RunCancelApi(APIView):
    @extend_schema_serializer(component_name="CancelRun")
    class InputSerializer(serializers.Serializer):
        reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)

    @extend_schema(
        operation_id="cancel_run",
        summary="Cancel a run",
        request=InputSerializer,
        responses={200: RunOutput, **errors({409: "The run has already ended"})},
    )
    def post(self, request, run_id):
        """Cancel a run (its creator or tenant staff). No model or tool call starts after this answers."""
        require_tenant(request.user)
        run = selectors.get_run(request.user, run_id)
        if run.created_by_id != request.user.pk and not request.user.is_staff:
            raise Forbidden("only the run's creator or tenant staff may cancel it", code="not_run_owner")
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        services.cancel_run(run_id=run.pk, actor=request.user, reason=data.validated_data["reason"])
        return Response(RunOutput(selectors.get_run(request.user, run_id)).data)


class StepResolveApi(APIView):
    @extend_schema_serializer(component_name="ResolveStep")
    class InputSerializer(serializers.Serializer):
        outcome = serializers.ChoiceField(
            choices=resolution.OUTCOMES,
            help_text="succeeded or failed: what the provider says happened; retry: call it again",
        )
        reason = serializers.CharField(max_length=2000, help_text="why; kept with the step")
        result = serializers.JSONField(
            required=False, default=None, help_text="what the tool did, if it happened (any JSON)"
        )
        override = serializers.BooleanField(
            required=False, default=False, help_text="retry an unsafe tool anyway (it may act twice)"
        )

    @extend_schema(
        operation_id="resolve_step",
        summary="Resolve an unknown tool outcome",
        request=InputSerializer,
        responses={200: StepOutput, **errors({409: "The step's outcome is not unknown (anymore)"})},
    )
    def post(self, request, run_id, seq: int):
        """Say what became of a tool call whose outcome is unknown (needs approve_tool on the tool)."""
        require_tenant(request.user)
        run = selectors.get_run(request.user, run_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        step = resolution.resolve_step(run_id=run.pk, seq=seq, user=request.user, **data.validated_data)
        return Response(StepOutput(step).data)
