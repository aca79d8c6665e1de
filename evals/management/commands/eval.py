"""`manage.py eval AGENT:VERSION DATASET [--against VERSION] --as USER`: evaluate a version on a
dataset (and another beside it), here and now, and print the results side by side.

Exit status 1 when the version does not pass every case (a pipeline can gate on it).
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from core.errors import DomainError
from core.money import platform_money
from evals import services
from tenants.models import User


class Command(BaseCommand):
    help = "Evaluate an agent version on a dataset (against another version); prints each case's checks."

    def add_arguments(self, parser):
        parser.add_argument("version", help="AGENT:VERSION, e.g. dispute-agent:3")
        parser.add_argument(
            "dataset", help="the dataset's name (its latest version unless --dataset-version)"
        )
        parser.add_argument("--against", type=int, help="another version of the agent, on the same cases")
        parser.add_argument("--dataset-version", type=int)
        parser.add_argument("--as", dest="actor", required=True, help="the tenant staff member running it")
        parser.add_argument("--budget", type=float, help="what each evaluation may spend (platform currency)")
        parser.add_argument("--uncovered", choices=["error", "nearest"], default="error")

    def handle(self, *args, **options):
        agent, _, number = options["version"].rpartition(":")
        if not agent or not number.isdigit():
            raise CommandError("VERSION is AGENT:NUMBER, e.g. dispute-agent:3")
        actor = User.objects.filter(username=options["actor"]).select_related("tenant").first()
        if actor is None or actor.tenant_id is None:
            raise CommandError(f"no tenant user {options['actor']}")
        budget = options.get("budget")
        try:
            evaluation = services.start_evaluation(
                user=actor,
                agent=agent,
                version=int(number),
                dataset=options["dataset"],
                dataset_number=options.get("dataset_version"),
                against=options.get("against"),
                budget_micros=None if budget is None else int(round(budget * 1_000_000)),
                uncovered=options["uncovered"],
            )
            done = services.execute(evaluation.pk)
        except DomainError as exc:
            raise CommandError(f"{exc.message} {exc.fields or ''}".strip()) from None
        if done is None:
            raise CommandError("another worker is running this evaluation")
        self.stdout.write(render(done))
        if done.totals.get("pass_rate") != 1.0:
            raise SystemExit(1)


def _mark(passed) -> str:
    return "—" if passed is None else ("pass" if passed else "FAIL")


def render(evaluation) -> str:
    table = services.comparison(evaluation)
    two = table["against_version"] is not None
    head = f"v{table['version']}" + (f"   v{table['against_version']}" if two else "")
    lines = [f"== evaluation {evaluation.pk}: {evaluation.agent_version} on {evaluation.dataset_version}"]
    lines.append(f"{'case / check':<60} {head}")
    for row in table["cases"]:
        lines.append(
            f"{row['case']:<60} {_mark(row['passed']):<6}"
            + (f"{_mark(row['against_passed'])}" if two else "")
        )
        for check in row["checks"]:
            lines.append(
                f"    {check['check'][:56]:<56} {_mark(check['passed']):<6}"
                + (f"{_mark(check['against_passed'])}" if two else "")
            )
    for label, totals in (
        ("v" + str(table["version"]), table["totals"]),
        ("v" + str(table["against_version"]), table["against_totals"]),
    ):
        if not totals:
            continue
        lines.append(
            f"== {label}: {totals['cases_passed']}/{totals['cases']} cases passed ({totals['pass_rate']:.0%}), "
            f"checks {totals['checks_passed']}/{totals['checks']}, graded {totals['graded_passed']}/{totals['graded_checks']}, "
            f"cost {platform_money(totals['cost_micros'])}, {totals['steps']} steps, "
            f"mean latency {totals['mean_latency_ms']} ms, uncovered calls {totals['uncovered_calls']}"
        )
    return "\n".join(lines)
