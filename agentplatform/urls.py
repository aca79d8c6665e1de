from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from agentplatform import desk
from agents import api as agents_api
from approvals import api as approvals_api
from artifacts import api as artifacts_api
from authority import api as authority_api
from budgets import api as budgets_api
from connections import api as connections_api
from core import errors
from evals import api as evals_api
from evals import gates
from history import api as history_api
from regions import api as regions_api
from runs.controls import api as pause_api
from runs.front import api as runs_api
from runs.front.stream import RunStreamApi
from tenants import api as tenants_api
from tenants.admin_site import site as admin_site  # tenant-scoped, not Django's default site

v1 = [
    path("auth/token", tenants_api.TokenApi.as_view()),
    path("auth/token/refresh", tenants_api.TokenRefreshApi.as_view()),
    path("agents", agents_api.AgentListApi.as_view()),
    path("agents/<slug:name>/versions", agents_api.VersionListApi.as_view()),
    path("agents/<slug:name>/versions/<int:number>", agents_api.VersionDetailApi.as_view()),
    path(
        "agents/<slug:name>/aliases/<slug:alias>",
        agents_api.AliasApi.as_view(check_move=gates.require_passing),
    ),
    path(
        "agents/<slug:name>/aliases/<slug:alias>/canary",
        agents_api.CanaryApi.as_view(check_move=gates.require_passing),
    ),
    path("agents/<slug:name>/aliases/<slug:alias>/gate", agents_api.GateApi.as_view()),
    path(
        "agents/<slug:name>/aliases/<slug:alias>/canary/promote",
        agents_api.CanaryPromoteApi.as_view(check_move=gates.require_passing),
    ),
    path("agents/<slug:name>/aliases/<slug:alias>/canary/rollback", agents_api.CanaryRollbackApi.as_view()),
    path("datasets", evals_api.DatasetListApi.as_view()),
    path("datasets/<slug:name>", evals_api.DatasetDetailApi.as_view()),
    path("datasets/<slug:name>/runs", evals_api.DatasetAddRunApi.as_view()),
    path("evaluations", evals_api.EvaluationListApi.as_view()),
    path("evaluations/<str:evaluation_id>", evals_api.EvaluationDetailApi.as_view()),
    path("runs", runs_api.RunListApi.as_view()),
    path("runs/pause", pause_api.BulkPauseApi.as_view()),
    path("kill-switches", pause_api.KillSwitchApi.as_view()),
    path("runs/resume", pause_api.BulkResumeApi.as_view()),
    path("runs/cancel", pause_api.BulkCancelApi.as_view()),
    path("runs/<str:run_id>", runs_api.RunDetailApi.as_view()),
    path("runs/<str:run_id>/steps", runs_api.RunStepsApi.as_view()),
    path("runs/<str:run_id>/events", runs_api.RunEventsApi.as_view()),
    path("runs/<str:run_id>/stream", RunStreamApi.as_view()),
    path("runs/<str:run_id>/cancel", runs_api.RunCancelApi.as_view()),
    path("runs/<str:run_id>/pause", pause_api.RunPauseApi.as_view()),
    path("runs/<str:run_id>/resume", pause_api.RunResumeApi.as_view()),
    path("runs/<str:run_id>/artifacts", artifacts_api.ArtifactListApi.as_view()),
    path("artifacts/<str:artifact_id>", artifacts_api.ArtifactDetailApi.as_view()),
    path("history/holds", history_api.HoldListApi.as_view()),
    path("history/holds/<str:hold_id>/lift", history_api.HoldLiftApi.as_view()),
    path("history/erasures", history_api.ErasureListApi.as_view()),
    path("history/erasures/<str:certificate_id>", history_api.ErasureDetailApi.as_view()),
    path("history/export", history_api.ExportApi.as_view()),
    path("artifacts/<str:artifact_id>/content", artifacts_api.ArtifactContentApi.as_view()),
    path("runs/<str:run_id>/steps/<int:seq>/resolve", runs_api.StepResolveApi.as_view()),
    path("approvals", approvals_api.ApprovalListApi.as_view()),
    path("approvals/<str:approval_id>", approvals_api.ApprovalDetailApi.as_view()),
    path("approvals/<str:approval_id>/approve", approvals_api.ApprovalApproveApi.as_view()),
    path("approvals/<str:approval_id>/deny", approvals_api.ApprovalDenyApi.as_view()),
    path("approvals/<str:approval_id>/correct", approvals_api.ApprovalCorrectApi.as_view()),
    path("usage", budgets_api.UsageApi.as_view()),
    path("reservations", budgets_api.ReservationListApi.as_view()),
    path("reservations/<str:reservation_id>/reconcile", budgets_api.ReservationReconcileApi.as_view()),
    path("reservations/<str:reservation_id>/write-off", budgets_api.ReservationWriteOffApi.as_view()),
    path("regions/slices/grant", regions_api.grant_view),
    path("regions/slices/return", regions_api.return_view),
    path("regions/probe", regions_api.probe_view),
    path("regions/authority", regions_api.authority_view),
    path("regions/status", regions_api.RegionStatusApi.as_view()),
    path("connections", connections_api.ConnectionListApi.as_view()),
    path("connections/callback", connections_api.ConnectionCallbackApi.as_view()),
    path("connections/<int:connection_id>", connections_api.ConnectionDetailApi.as_view()),
    path("schema", SpectacularAPIView.as_view(), name="schema"),
    # The page's init script is a URL of its own (?script), not inline: the CSP allows no inline script.
    path("docs", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="docs"),
    re_path(r"", errors.unmatched_route),  # last: anything else under /v1/ is a JSON 404
]

urlpatterns = [
    path(".well-known/jwks.json", authority_api.jwks, name="jwks"),
    # The index is the supervisors' desk, which reads rooms the admin site sits below.
    path("admin/", admin_site.admin_view(desk.index), name="admin-desk"),
    path("admin/", admin_site.urls),
    path("v1/", include(v1)),
]

handler400 = "core.errors.bad_request"
handler403 = "core.errors.permission_denied"
handler404 = "core.errors.page_not_found"
handler500 = "core.errors.server_error"
