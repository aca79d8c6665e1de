from __future__ import annotations

from collections.abc import Callable

from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from agents import selectors, services
from agents.models import AgentDefinition, AgentVersion, Alias
from core.api import require_tenant
from core.errors import DomainError, Forbidden, NotFound
from core.schema import JsonObjectField, JsonObjectInput


@extend_schema_serializer(component_name="AgentVersion")
class VersionOutput(serializers.ModelSerializer):
    agent = serializers.CharField(source="agent.name")
    spec = JsonObjectField(help_text="the validated agent spec (docs/configuration.md)")
    aliases = serializers.SerializerMethodField()

    class Meta:
        model = AgentVersion
        fields = ["agent", "number", "content_hash", "spec", "aliases", "created_at"]

    def get_aliases(self, version) -> list[str]:
        return sorted(a.name for a in version.aliases.all())


@extend_schema_serializer(component_name="Agent")
class AgentOutput(serializers.ModelSerializer):
    aliases = serializers.SerializerMethodField()
    latest_version = serializers.SerializerMethodField()

    class Meta:
        model = AgentDefinition
        fields = ["name", "aliases", "latest_version", "created_at"]

    def get_aliases(self, agent) -> dict[str, int]:
        return {a.name: a.version.number for a in agent.aliases.select_related("version")}

    def get_latest_version(self, agent) -> int | None:
        latest = agent.versions.order_by("-number").first()
        return latest.number if latest else None


@extend_schema_serializer(component_name="Alias")
class AliasOutput(serializers.ModelSerializer):
    agent = serializers.CharField(source="agent.name")
    version = serializers.IntegerField(source="version.number")
    canary = serializers.SerializerMethodField()

    class Meta:
        model = Alias
        fields = ["agent", "name", "version", "canary", "gate", "updated_at"]

    gate = JsonObjectField(help_text="the evaluation its moves need (docs/evaluations.md#gates); {}: none")

    def get_canary(self, alias) -> dict | None:
        if alias.canary_version is None:
            return None
        return {
            "version": alias.canary_version.number,
            "percent": alias.canary_percent,
            "since": alias.canary_since,
            "rules": {**services.CANARY_RULES, **alias.canary_rules},
        }


def _require_editor(user) -> None:
    require_tenant(user)
    if not user.is_staff:
        raise Forbidden("only tenant staff may change agents", code="not_staff")


def _check_length(**names: str) -> None:
    """Names in the path are stored as given; refuse what the columns cannot hold (400, not a 500)."""
    limits: dict[str, int] = {
        "name": AgentDefinition._meta.get_field("name").max_length or 0,
        "alias": Alias._meta.get_field("name").max_length or 0,
    }
    fields = {
        key: [f"at most {limits[key]} characters"] for key, value in names.items() if len(value) > limits[key]
    }
    if fields:
        raise DomainError("the path has invalid names", fields=fields)


class AgentListApi(APIView):
    @extend_schema(operation_id="list_agents", summary="List agents", responses=AgentOutput(many=True))
    def get(self, request):
        """The tenant's agents by name, with their aliases and latest version number."""
        require_tenant(request.user)
        agents = AgentDefinition.objects.filter(tenant_id=request.user.tenant_id).order_by("name")
        return Response(AgentOutput(agents, many=True).data)


class VersionListApi(APIView):
    @extend_schema_serializer(component_name="CreateVersion")
    class InputSerializer(serializers.Serializer):
        spec = JsonObjectInput(help_text="the agent spec (docs/configuration.md); invalid keys are listed")

    @extend_schema(
        operation_id="list_versions", summary="List an agent's versions", responses=VersionOutput(many=True)
    )
    def get(self, request, name: str):
        """Every version of the agent, oldest first, with its spec and the aliases pointing at it."""
        require_tenant(request.user)
        versions = selectors.versions_of(tenant=request.user.tenant, agent=name).prefetch_related("aliases")
        return Response(VersionOutput(versions, many=True).data)

    @extend_schema(
        operation_id="create_version",
        summary="Create an agent version",
        request=InputSerializer,
        responses={
            201: OpenApiResponse(VersionOutput, description="A new version was stored"),
            200: OpenApiResponse(VersionOutput, description="The spec is the latest version's: that version"),
        },
    )
    def post(self, request, name: str):
        """Validate and store a new immutable version. Posting the latest spec again returns it (200)."""
        _require_editor(request.user)
        _check_length(name=name)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        version, created = services.create_version(
            tenant=request.user.tenant, agent=name, spec=data.validated_data["spec"], user=request.user
        )
        return Response(
            VersionOutput(version).data, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK
        )


class VersionDetailApi(APIView):
    @extend_schema(operation_id="get_version", summary="Get an agent version", responses=VersionOutput)
    def get(self, request, name: str, number: int):
        """One immutable version of the agent, with its spec and content hash."""
        require_tenant(request.user)
        version = selectors.versions_of(tenant=request.user.tenant, agent=name).filter(number=number).first()
        if version is None:
            raise NotFound(f"version {number} of agent {name}")
        return Response(VersionOutput(version).data)


class AliasApi(APIView):
    # Set by the URL wiring (agentplatform/urls.py): the gate a move must pass (evals.gates), asked
    # before the alias moves, starts a canary or promotes one; None: no gate is asked.
    check_move: Callable[..., None] | None = None

    @extend_schema_serializer(component_name="MoveAlias")
    class InputSerializer(serializers.Serializer):
        version = serializers.IntegerField(
            min_value=1, max_value=2**31 - 1, help_text="the version number the alias points at from now on"
        )

    @extend_schema(
        operation_id="move_alias",
        summary="Point an alias at a version",
        request=InputSerializer,
        responses=VersionOutput,
    )
    def put(self, request, name: str, alias: str):
        """Point an alias (prod, canary, …) at a version. Running runs keep the version they pinned."""
        _require_editor(request.user)
        _check_length(name=name, alias=alias)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        if self.check_move is not None:
            self.check_move(
                tenant=request.user.tenant, agent=name, alias=alias, version=data.validated_data["version"]
            )
        moved = services.move_alias(
            tenant=request.user.tenant,
            agent=name,
            alias=alias,
            version=data.validated_data["version"],
            user=request.user,
        )
        return Response(VersionOutput(moved.version).data)


class CanaryApi(APIView):
    # Set by the URL wiring (agentplatform/urls.py): the gate a move must pass (evals.gates), asked
    # before the alias moves, starts a canary or promotes one; None: no gate is asked.
    check_move: Callable[..., None] | None = None

    @extend_schema_serializer(component_name="StartCanary")
    class InputSerializer(serializers.Serializer):
        version = serializers.IntegerField(min_value=1, max_value=2**31 - 1, help_text="the canary version")
        percent = serializers.IntegerField(min_value=1, max_value=100, help_text="share of new runs it takes")
        rules = JsonObjectInput(required=False, help_text="rollback thresholds (docs/evaluations.md#canary)")

    @extend_schema(
        operation_id="start_canary",
        summary="Send a share of an alias's runs to a canary",
        request=InputSerializer,
        responses=AliasOutput,
    )
    def put(self, request, name: str, alias: str):
        """From now on `percent` of the alias's new runs take `version`; each run records its arm."""
        _require_editor(request.user)
        _check_length(name=name, alias=alias)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        if self.check_move is not None:
            self.check_move(
                tenant=request.user.tenant, agent=name, alias=alias, version=data.validated_data["version"]
            )
        started = services.start_canary(
            tenant=request.user.tenant,
            agent=name,
            alias=alias,
            user=request.user,
            version=data.validated_data["version"],
            percent=data.validated_data["percent"],
            rules=data.validated_data.get("rules"),
        )
        return Response(AliasOutput(started).data)


class CanaryDecisionApi(APIView):
    # Set by the URL wiring (agentplatform/urls.py): the gate a move must pass (evals.gates), asked
    # before the alias moves, starts a canary or promotes one; None: no gate is asked.
    check_move: Callable[..., None] | None = None

    promote = False

    @extend_schema(request=None, responses=AliasOutput)
    def post(self, request, name: str, alias: str):
        """Promote the canary (it becomes the alias's version) or roll it back (every new run takes
        the alias's version again); runs keep the version they started on."""
        _require_editor(request.user)
        _check_length(name=name, alias=alias)
        if self.promote:
            found = (
                Alias.objects.filter(
                    agent__tenant=request.user.tenant,
                    agent__name=name,
                    name=alias,
                    canary_version__isnull=False,
                )
                .values_list("canary_version__number", flat=True)
                .first()
            )
            if found is not None and self.check_move is not None:
                self.check_move(tenant=request.user.tenant, agent=name, alias=alias, version=found)
        decide = services.promote_canary if self.promote else services.roll_back
        changed = decide(
            tenant=request.user.tenant,
            agent=name,
            alias=alias,
            user=request.user,
            reason=str(request.data.get("reason", ""))[:2000] if hasattr(request.data, "get") else "",
        )
        return Response(AliasOutput(changed).data)


class CanaryPromoteApi(CanaryDecisionApi):
    promote = True

    @extend_schema(
        operation_id="promote_canary",
        summary="Promote an alias's canary",
        request=None,
        responses=AliasOutput,
    )
    def post(self, request, name: str, alias: str):
        return super().post(request, name, alias)


class CanaryRollbackApi(CanaryDecisionApi):
    @extend_schema(
        operation_id="roll_back_canary",
        summary="Roll back an alias's canary",
        request=None,
        responses=AliasOutput,
    )
    def post(self, request, name: str, alias: str):
        return super().post(request, name, alias)


class GateApi(APIView):
    @extend_schema_serializer(component_name="SetGate")
    class InputSerializer(serializers.Serializer):
        gate = JsonObjectInput(help_text="{dataset, min_pass_rate, min_tag_pass_rate}; {} lifts the gate")

    @extend_schema(
        operation_id="set_gate",
        summary="Require a passing evaluation for an alias's moves",
        request=InputSerializer,
        responses=AliasOutput,
    )
    def put(self, request, name: str, alias: str):
        """From now on the alias moves (and starts or promotes a canary) only to a version that passed."""
        _require_editor(request.user)
        _check_length(name=name, alias=alias)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        changed = services.set_gate(
            tenant=request.user.tenant,
            agent=name,
            alias=alias,
            gate=data.validated_data["gate"],
            user=request.user,
        )
        return Response(AliasOutput(changed).data)
