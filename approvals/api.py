from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from approvals import selectors
from approvals import services as approvals
from approvals.models import Approval, ApprovalStatus
from core.api import PAGE_PARAMETERS, paginate, paginated, require_tenant
from core.schema import JsonObjectField, errors
from runs.approval_effects import correct_approval, decide_approval


@extend_schema_serializer(component_name="Approval")
class ApprovalOutput(serializers.ModelSerializer):
    tool = serializers.CharField(source="tool.name")
    run = serializers.UUIDField(source="run_id")
    step_seq = serializers.IntegerField(source="step.seq")
    requested_by = serializers.CharField(source="requested_by.username")
    decided_by = serializers.CharField(source="decided_by.username", allow_null=True, default=None)
    arguments = JsonObjectField(help_text="the exact arguments of the call being approved")
    repeated = serializers.SerializerMethodField(help_text="on a decision: true when it repeats your own")
    escalated_to = serializers.CharField(
        source="escalate_to.name",
        allow_null=True,
        default=None,
        help_text="the group it is escalated to at escalate_at (done: escalated_at), whose members may then decide",
    )
    detail = serializers.SerializerMethodField(
        help_text='on a repeated decision, what happened the first time: "already approved by ravi at ..."'
    )
    policies = serializers.ListField(
        source="policy_ids",
        child=serializers.CharField(),
        help_text="the @id of each Cedar policy that asked for this approval",
    )
    policy_set_version = serializers.IntegerField(
        allow_null=True, help_text="the version of the tenant's policies that decided (null: none)"
    )
    original_arguments = JsonObjectField(
        allow_null=True, help_text="after a correction: the arguments the model proposed (else null)"
    )
    corrected_by = serializers.CharField(source="corrected_by.username", allow_null=True, default=None)
    approvals = serializers.SerializerMethodField(
        help_text="who approved the call it now covers, first first (dual control: required_approvals)"
    )

    def get_approvals(self, approval) -> list[dict]:
        return [
            {"user": vote.user.username, "at": vote.created_at.isoformat(), "reason": vote.reason}
            for vote in approvals.votes(approval)
        ]

    def get_repeated(self, approval) -> bool:
        return getattr(approval, "repeated", False)

    def get_detail(self, approval) -> str | None:
        return approvals.first_decision(approval) if getattr(approval, "repeated", False) else None

    class Meta:
        model = Approval
        fields = [
            "id",
            "status",
            "tool",
            "run",
            "step_seq",
            "arguments",
            "reason",
            "policy",
            "policies",
            "policy_set_version",
            "required_approvals",
            "approvals",
            "digest",
            "requested_by",
            "decided_by",
            "decision_reason",
            "original_arguments",
            "corrected_by",
            "correction_reason",
            "void_reason",
            "created_at",
            "expires_at",
            "decided_at",
            "consumed_at",
            "remind_at",
            "reminded_at",
            "escalate_at",
            "escalated_at",
            "escalated_to",
            "repeated",
            "detail",
        ]


class ApprovalListApi(APIView):
    class FilterSerializer(serializers.Serializer):
        status = serializers.ChoiceField(choices=ApprovalStatus.choices, required=False)
        tool = serializers.CharField(required=False, max_length=200)
        run = serializers.UUIDField(required=False)

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "status", enum=ApprovalStatus.values, description="only approvals in this state"
            ),
            OpenApiParameter("tool", description="only approvals of this tool (<server>__<tool>)"),
            OpenApiParameter("run", OpenApiTypes.UUID, description="only approvals of this run"),
            *PAGE_PARAMETERS,
        ],
        operation_id="list_approvals",
        summary="List approvals",
        responses=paginated(ApprovalOutput, "PaginatedApprovals"),
    )
    def get(self, request):
        """Approvals of tools the caller may approve, oldest first."""
        require_tenant(request.user)
        filters = self.FilterSerializer(data=request.query_params)
        filters.is_valid(raise_exception=True)
        approvals = selectors.approvals_for(request.user, **filters.validated_data)
        return paginate(self, request, approvals, ApprovalOutput)


class ApprovalDetailApi(APIView):
    @extend_schema(operation_id="get_approval", summary="Get an approval", responses=ApprovalOutput)
    def get(self, request, approval_id):
        """One approval: the exact call it is for, who asked, and its decision."""
        require_tenant(request.user)
        return Response(ApprovalOutput(selectors.get_approval(request.user, approval_id)).data)


DECISION_ERRORS = errors(
    {409: "The approval was already decided, voided or consumed, or it expired before this decision"}
)


class _DecisionApi(APIView):
    approve = True

    def decide(self, request, approval_id, serializer_class) -> Response:
        require_tenant(request.user)
        data = serializer_class(data=request.data)
        data.is_valid(raise_exception=True)
        approval = decide_approval(
            approval_id=approval_id,
            user=request.user,
            approve=self.approve,
            reason=data.validated_data["reason"],
        )
        repeated = getattr(approval, "repeated", False)
        approval = Approval.objects.select_related(
            "tool", "requested_by", "decided_by", "step", "tenant"
        ).get(pk=approval.pk)
        setattr(approval, "repeated", repeated)  # noqa: B010 -- read by ApprovalOutput
        return Response(ApprovalOutput(approval).data)


class ApprovalApproveApi(_DecisionApi):
    approve = True

    @extend_schema_serializer(component_name="Approve")
    class InputSerializer(serializers.Serializer):
        reason = serializers.CharField(
            allow_blank=True, required=False, default="", max_length=2000, help_text="kept with the decision"
        )

    @extend_schema(
        operation_id="approve",
        summary="Approve a call",
        request=InputSerializer,
        responses={200: ApprovalOutput, **DECISION_ERRORS},
    )
    def post(self, request, approval_id):
        """Approve one exact call (needs approve_tool on its tool); the run goes on with it.
        The requester may not approve their own request; repeating your own decision answers it again."""
        return self.decide(request, approval_id, self.InputSerializer)


class ApprovalDenyApi(_DecisionApi):
    approve = False

    @extend_schema_serializer(component_name="Deny")
    class InputSerializer(serializers.Serializer):
        reason = serializers.CharField(
            allow_blank=True,
            required=False,
            default="",
            max_length=2000,
            help_text="kept with the decision and told to the model",
        )

    @extend_schema(
        operation_id="deny",
        summary="Deny a call",
        request=InputSerializer,
        responses={200: ApprovalOutput, **DECISION_ERRORS},
    )
    def post(self, request, approval_id):
        """Deny a call (needs approve_tool on its tool); the model is told and may explain or choose
        another path. Repeating your own decision answers it again."""
        return self.decide(request, approval_id, self.InputSerializer)


class ApprovalCorrectApi(APIView):
    @extend_schema_serializer(component_name="Correct")
    class InputSerializer(serializers.Serializer):
        arguments = JsonObjectField(help_text="the corrected call's arguments, in full")
        reason = serializers.CharField(max_length=2000, help_text="why; told to the model")

    @extend_schema(
        operation_id="correct",
        summary="Correct a call and approve the corrected one",
        request=InputSerializer,
        responses={200: ApprovalOutput, **DECISION_ERRORS},
    )
    def post(self, request, approval_id):
        """Change the call's arguments (needs approve_tool): the corrected call is checked again (its
        schema, the requester's grant, the tenant's policies with you as editor), gets its own digest
        and is approved; the model is told what you changed. 403 `correction_refused` if a check fails."""
        require_tenant(request.user)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        approval = correct_approval(
            approval_id=approval_id,
            user=request.user,
            arguments=data.validated_data["arguments"],
            reason=data.validated_data["reason"],
        )
        approval = Approval.objects.select_related("tool", "requested_by", "decided_by", "step").get(
            pk=approval.pk
        )
        return Response(ApprovalOutput(approval).data)
