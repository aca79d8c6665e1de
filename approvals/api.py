from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from agentplatform.api import PAGE_PARAMETERS, paginate, paginated, require_tenant
from approvals import selectors
from approvals.models import Approval, ApprovalStatus
from runs.lifecycle import decide_approval


class ApprovalOutput(serializers.ModelSerializer):
    tool = serializers.CharField(source="tool.name")
    run = serializers.UUIDField(source="run_id")
    step_seq = serializers.IntegerField(source="step.seq")
    requested_by = serializers.CharField(source="requested_by.username")
    decided_by = serializers.CharField(source="decided_by.username", allow_null=True, default=None)

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
            "digest",
            "requested_by",
            "decided_by",
            "decision_reason",
            "void_reason",
            "created_at",
            "expires_at",
            "decided_at",
            "consumed_at",
        ]


class ApprovalListApi(APIView):
    class FilterSerializer(serializers.Serializer):
        status = serializers.ChoiceField(choices=ApprovalStatus.choices, required=False)
        tool = serializers.CharField(required=False, max_length=200)
        run = serializers.UUIDField(required=False)

    @extend_schema(
        parameters=[
            OpenApiParameter("status", enum=ApprovalStatus.values),
            OpenApiParameter("tool"),
            OpenApiParameter("run", OpenApiTypes.UUID),
            *PAGE_PARAMETERS,
        ],
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
    @extend_schema(responses=ApprovalOutput)
    def get(self, request, approval_id):
        require_tenant(request.user)
        return Response(ApprovalOutput(selectors.get_approval(request.user, approval_id)).data)


class _DecisionApi(APIView):
    approve = True

    class InputSerializer(serializers.Serializer):
        reason = serializers.CharField(allow_blank=True, required=False, default="", max_length=2000)

    @extend_schema(request=InputSerializer, responses=ApprovalOutput)
    def post(self, request, approval_id):
        require_tenant(request.user)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        approval = decide_approval(
            approval_id=approval_id,
            user=request.user,
            approve=self.approve,
            reason=data.validated_data["reason"],
        )
        approval = Approval.objects.select_related("tool", "requested_by", "decided_by", "step").get(
            pk=approval.pk
        )
        return Response(ApprovalOutput(approval).data)


class ApprovalApproveApi(_DecisionApi):
    """Approve one exact call. The requester may not approve their own request."""

    approve = True


class ApprovalDenyApi(_DecisionApi):
    """Deny a call; the model is told and may explain or choose another path."""

    approve = False
