"""Datasets and evaluations over the API (docs/evaluations.md). Tenant staff write; members read."""

from __future__ import annotations

from django.db import transaction
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import MONEY_MAX_MICROS, require_tenant
from core.errors import Forbidden, NotFound
from core.schema import JsonObjectField
from evals import selectors, services, tasks
from evals.models import CaseResult, DatasetVersion, Evaluation


def _require_editor(user) -> None:
    require_tenant(user)
    if not user.is_staff:
        raise Forbidden("only tenant staff may change datasets and run evaluations", code="not_staff")


@extend_schema_serializer(component_name="EvaluationCase")
class CaseOutput(serializers.Serializer):
    name = serializers.CharField()
    input = serializers.JSONField()
    user = serializers.CharField(source="user.username")
    approver = serializers.CharField(source="approver.username", allow_null=True, default=None)
    recordings = serializers.JSONField()
    approvals = JsonObjectField()
    checks = serializers.JSONField()
    tags = serializers.ListField(child=serializers.CharField())
    source_run = serializers.UUIDField(source="source_run_id", allow_null=True)


@extend_schema_serializer(component_name="DatasetVersion")
class DatasetVersionOutput(serializers.ModelSerializer):
    dataset = serializers.CharField(source="dataset.name")
    cases = serializers.SerializerMethodField()

    class Meta:
        model = DatasetVersion
        fields = ["dataset", "number", "content_hash", "cases", "created_at"]

    def get_cases(self, version) -> list[dict]:
        cases = version.cases.select_related("user", "approver").order_by("id")
        return list(CaseOutput(cases, many=True).data)


class DatasetListApi(APIView):
    @extend_schema_serializer(component_name="SaveDataset")
    class InputSerializer(serializers.Serializer):
        name = serializers.CharField(max_length=100)
        description = serializers.CharField(required=False, allow_blank=True, max_length=2000)
        cases = serializers.ListField(
            child=serializers.JSONField(),
            min_length=1,
            max_length=1000,
            help_text="the cases (docs/evaluations.md); invalid fields are listed by path",
        )

    @extend_schema(
        operation_id="list_datasets", summary="List datasets", responses=DatasetVersionOutput(many=True)
    )
    def get(self, request):
        """The tenant's datasets, each at its latest version."""
        require_tenant(request.user)
        return Response(
            DatasetVersionOutput(selectors.latest_versions(tenant=request.user.tenant), many=True).data
        )

    @extend_schema(
        operation_id="save_dataset",
        summary="Store a dataset's next version",
        request=InputSerializer,
        responses={
            201: OpenApiResponse(DatasetVersionOutput, description="A new version was stored"),
            200: OpenApiResponse(DatasetVersionOutput, description="The cases are the latest version's"),
        },
    )
    def post(self, request):
        """Validate and store the next version of the dataset; its latest cases again return it (200)."""
        _require_editor(request.user)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        version, created = services.save_dataset(
            tenant=request.user.tenant,
            dataset=data.validated_data["name"],
            cases=data.validated_data["cases"],
            description=data.validated_data.get("description", ""),
            user=request.user,
        )
        return Response(
            DatasetVersionOutput(version).data,
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )


class DatasetDetailApi(APIView):
    @extend_schema(operation_id="get_dataset", summary="Get a dataset", responses=DatasetVersionOutput)
    def get(self, request, name: str):
        """The dataset's latest version, or `?version=N`."""
        require_tenant(request.user)
        number = request.query_params.get("version")
        if number is not None and not number.isdigit():
            raise NotFound(f"version {number} of dataset {name}")
        version = services.dataset_version(
            tenant=request.user.tenant, dataset=name, number=int(number or 0) or None
        )
        return Response(DatasetVersionOutput(version).data)


class DatasetAddRunApi(APIView):
    @extend_schema_serializer(component_name="AddRunToDataset")
    class InputSerializer(serializers.Serializer):
        run = serializers.UUIDField(help_text="a finished run of the tenant")
        name = serializers.RegexField(r"^[-a-zA-Z0-9_]{1,100}$", required=False, help_text="the case's name")
        checks = serializers.ListField(
            child=serializers.JSONField(),
            required=False,
            help_text="the case's checks; by default the run's own trajectory (status, calls, approvals, denials)",
        )

    @extend_schema(
        operation_id="add_run_to_dataset",
        summary="Add a finished run to a dataset",
        request=InputSerializer,
        responses={201: DatasetVersionOutput},
    )
    def post(self, request, name: str):
        """The run's input, user, recorded tool results and approvals become a case of the next version."""
        _require_editor(request.user)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        version = services.add_run(
            tenant=request.user.tenant,
            dataset=name,
            run_id=data.validated_data["run"],
            name=data.validated_data.get("name", ""),
            checks=data.validated_data.get("checks"),
            user=request.user,
        )
        return Response(DatasetVersionOutput(version).data, status=status.HTTP_201_CREATED)


@extend_schema_serializer(component_name="CaseResult")
class ResultOutput(serializers.ModelSerializer):
    case = serializers.CharField(source="case.name")
    run = serializers.UUIDField(source="run_id", allow_null=True)
    checks = serializers.JSONField()
    uncovered = serializers.ListField(child=serializers.CharField())

    class Meta:
        model = CaseResult
        fields = [
            "case",
            "run",
            "run_status",
            "passed",
            "checks",
            "uncovered",
            "cost_micros",
            "steps",
            "latency_ms",
            "error",
        ]


@extend_schema_serializer(component_name="Evaluation")
class EvaluationOutput(serializers.ModelSerializer):
    agent = serializers.CharField(source="agent_version.agent.name")
    version = serializers.IntegerField(source="agent_version.number")
    dataset = serializers.CharField(source="dataset_version.dataset.name")
    dataset_version = serializers.IntegerField(source="dataset_version.number")
    against = serializers.UUIDField(source="against_id", allow_null=True)
    totals = JsonObjectField()
    results = ResultOutput(many=True)
    comparison = serializers.SerializerMethodField()

    class Meta:
        model = Evaluation
        fields = [
            "id",
            "agent",
            "version",
            "dataset",
            "dataset_version",
            "against",
            "status",
            "uncovered",
            "budget_micros",
            "totals",
            "results",
            "comparison",
            "error",
            "created_at",
            "finished_at",
        ]

    def get_comparison(self, evaluation) -> dict | None:
        if evaluation.against_id is None or evaluation.status != Evaluation.Status.FINISHED:
            return None
        return services.comparison(evaluation)


class EvaluationListApi(APIView):
    @extend_schema_serializer(component_name="StartEvaluation")
    class InputSerializer(serializers.Serializer):
        agent = serializers.CharField(max_length=100)
        version = serializers.IntegerField(min_value=1, max_value=2**31 - 1)
        dataset = serializers.CharField(max_length=100)
        dataset_version = serializers.IntegerField(min_value=1, max_value=2**31 - 1, required=False)
        against = serializers.IntegerField(
            min_value=1,
            max_value=2**31 - 1,
            required=False,
            help_text="a version to compare with, on the same cases",
        )
        budget_micros = serializers.IntegerField(
            min_value=0,
            max_value=MONEY_MAX_MICROS,
            required=False,
            help_text="what each evaluation's runs may spend (default USD 1.00), apart from the tenant's budget",
        )
        uncovered = serializers.ChoiceField(choices=Evaluation.Uncovered.choices, default="error")

    @extend_schema(
        operation_id="list_evaluations", summary="List evaluations", responses=EvaluationOutput(many=True)
    )
    def get(self, request):
        """The tenant's latest evaluations, newest first."""
        require_tenant(request.user)
        return Response(
            EvaluationOutput(selectors.evaluations_of(tenant=request.user.tenant)[:50], many=True).data
        )

    @extend_schema(
        operation_id="start_evaluation",
        summary="Start an evaluation",
        request=InputSerializer,
        responses={202: EvaluationOutput},
    )
    def post(self, request):
        """Queue an evaluation of a version on a dataset (and of `against` beside it); poll its id."""
        _require_editor(request.user)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        given = data.validated_data
        evaluation = services.start_evaluation(
            user=request.user,
            agent=given["agent"],
            version=given["version"],
            dataset=given["dataset"],
            dataset_number=given.get("dataset_version"),
            against=given.get("against"),
            budget_micros=given.get("budget_micros"),
            uncovered=given["uncovered"],
        )
        transaction.on_commit(lambda: tasks.execute.delay(str(evaluation.pk)))
        return Response(EvaluationOutput(evaluation).data, status=status.HTTP_202_ACCEPTED)


class EvaluationDetailApi(APIView):
    @extend_schema(operation_id="get_evaluation", summary="Get an evaluation", responses=EvaluationOutput)
    def get(self, request, evaluation_id: str):
        """The evaluation, its results per case and check, and the comparison with `against`."""
        require_tenant(request.user)
        return Response(
            EvaluationOutput(
                selectors.get_evaluation(tenant=request.user.tenant, evaluation_id=evaluation_id)
            ).data
        )
