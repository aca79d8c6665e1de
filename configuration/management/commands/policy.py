"""`manage.py policy test FILE | convert FILE | report TENANT [--last N]` (docs/policies.md).

test     the policy tests of FILE's `policies:` section, with its sets validated against the
         schema generated for the tenant as it stands (apply runs the same, then writes)
convert  the Cedar policy each `approval:` rule of FILE's tools is evaluated as (or why a
         rule has none)
report   what the tenant's shadow-mode policy sets would have decided over its last N calls
"""

from __future__ import annotations

from collections import Counter

from django.core.management.base import BaseCommand, CommandError

from approvals.models import ShadowDecision
from approvals.policy import PolicyError, Unconvertible, to_cedar
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
        sub.add_parser("convert", help="print the Cedar of the file's approval: rules").add_argument("file")
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
        for i, tool in enumerate(data.get("tools") or []):
            rule = str(tool.get("approval", "never"))
            name = f"{tool.get('server')}__{tool.get('name')}"
            try:
                text = to_cedar(rule, tool=name, policy_id=f"{name}.approval")
            except Unconvertible as exc:
                refused += 1
                self.stderr.write(f"tools[{i}] {name}: {rule!r} has no exact Cedar equivalent: {exc.advice}")
                continue
            except PolicyError as exc:
                refused += 1
                self.stderr.write(f"tools[{i}] {name}: {rule!r} does not parse: {exc}")
                continue
            self.stdout.write(f"// tools[{i}] {name}: approval: {rule}")
            self.stdout.write((text or "// never: no policy") + "\n")
        if refused:
            raise CommandError(f"{file}: {refused} rule(s) cannot be converted")

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
