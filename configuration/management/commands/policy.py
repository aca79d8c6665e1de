"""`manage.py policy test FILE | convert FILE | report TENANT [--last N]` (docs/policies.md).

test     the policy tests of FILE's `policies:` section, with its sets validated against the
         schema generated for the tenant as it stands (apply runs the same, then writes)
convert  the Cedar to write for each rule of FILE still in the retired expression language (a
         tool's `approval:`, a version's `approval_overrides`), or why a rule has no exact Cedar
         equivalent (with the nearest stricter policy); apply refuses such a file
report   what the tenant's shadow-mode policy sets would have decided over its last N calls
"""

from __future__ import annotations

from collections import Counter

from django.core.management.base import BaseCommand, CommandError

from approvals import tool_rules
from approvals.migrations import _retired_rules as retired
from approvals.models import ShadowDecision
from approvals.policy_sets import check
from configuration import policies
from configuration.apply import ConfigError, load_file
from configuration.schema import Problems
from tenants.models import Tenant


class Command(BaseCommand):
    help = "Test, convert and report on a tenant's Cedar policies."

    def add_arguments(self, parser) -> None:
        sub = parser.add_subparsers(dest="what", required=True)
        sub.add_parser("test", help="run the file's policy tests").add_argument("file")
        sub.add_parser(
            "convert", help="print the Cedar for the file's rules in the retired expression language"
        ).add_argument("file")
        report = sub.add_parser("report", help="shadow-mode decisions over the last N calls")
        report.add_argument("tenant", help="the tenant's slug")
        report.add_argument("--last", type=int, default=1000)

    def handle(self, *args, what: str, **options) -> None:
        getattr(self, f"_{what}")(**options)

    def _load(self, file: str) -> dict:
        try:
            return load_file(file)
        except ConfigError as exc:
            raise CommandError("; ".join(f"{p}: {m}" if p else m for p, m in exc.errors)) from None

    def _test(self, file: str, **_) -> None:
        data = self._load(file)
        slug = (data.get("tenant") or {}).get("slug")
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            raise CommandError(f"{file}: tenant {slug!r} does not exist yet: apply the file first")
        problems = Problems()
        spec = policies.read(data.get("policies"), data.get("groups"), problems, file)
        if spec is not None and not problems:
            problems.items.extend(check(tenant, spec))
        for path, message in problems.items:
            self.stderr.write(f"{path}: {message}")
        if problems:
            raise CommandError(f"{file}: {len(problems)} problem(s)")
        count = len(spec.tests) if spec else 0
        self.stdout.write(f"{file}: {count} policy test(s) passed")

    def _convert(self, file: str, **_) -> None:
        data = self._load(file)
        refused = 0
        for path, tool, rule, override in _rules(data):
            try:
                tool_rules.check(rule, tool=tool, override=override)
                self.stdout.write(f"// {path} ({tool}): already never, always or Cedar\n")
                continue
            except tool_rules.RuleError as exc:
                problem = str(exc)
            policy_id = tool_rules.rule_id(tool, override=override)
            try:
                text = retired.to_cedar(str(rule), tool=tool, policy_id=policy_id)
            except retired.Unconvertible as exc:
                refused += 1
                self.stderr.write(f"{path} ({tool}): {rule!r} has no exact Cedar equivalent: {exc.advice}")
                continue
            except retired.PolicyError:
                refused += 1
                self.stderr.write(f"{path} ({tool}): {problem}")
                continue
            self.stdout.write(f"// {path} ({tool}): {rule}")
            self.stdout.write(text + "\n")
        if refused:
            raise CommandError(f"{file}: {refused} rule(s) have no exact Cedar equivalent or are not rules")

    def _report(self, tenant: str, last: int, **_) -> None:
        found = Tenant.objects.filter(slug=tenant).first()
        if found is None:
            raise CommandError(f"no tenant {tenant!r}")
        rows = list(
            ShadowDecision.objects.filter(tenant=found)
            .order_by("-created_at")
            .values_list("policy_set", "outcome", "policies")[:last]
        )
        self.stdout.write(f"shadow-mode decisions over the last {len(rows)} call(s) of {tenant}:")
        by_outcome = Counter((s, o) for s, o, _ in rows)
        by_policy = Counter((s, o, p) for s, o, ids in rows for p in ids)
        for (policy_set, outcome), count in sorted(by_outcome.items()):
            self.stdout.write(f"  {policy_set}: {outcome} {count}")
            for (s, o, policy), n in sorted(by_policy.items()):
                if (s, o) == (policy_set, outcome) and outcome != "allow":
                    self.stdout.write(f"    {policy}: {n}")


def _rules(data: dict):
    """(path in the file, tool, rule, is an override) for each approval rule of the file."""
    for i, tool in enumerate(data.get("tools") or []):
        if isinstance(tool, dict) and "approval" in tool:
            yield f"tools[{i}].approval", f"{tool.get('server')}__{tool.get('name')}", tool["approval"], False
    for i, agent in enumerate(data.get("agents") or []):
        versions = agent.get("versions") if isinstance(agent, dict) else None
        for j, spec in enumerate(versions if isinstance(versions, list) else []):
            overrides = spec.get("approval_overrides") if isinstance(spec, dict) else None
            if isinstance(overrides, dict):
                for name, rule in overrides.items():
                    yield f"agents[{i}].versions[{j}].approval_overrides.{name}", str(name), rule, True
