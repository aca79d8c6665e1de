"""`manage.py pause_runs --reason ... [--tenant acme --agent refunder --tool refund ...] --as USER`:
pause every matching run at its step boundary, audited like the API's (runs/controls/pausing.py)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.utils.dateparse import parse_datetime

from core.errors import DomainError
from runs.controls import pausing
from tenants.models import User


class Command(BaseCommand):
    help = "Pause every run the filters match, at its step boundary; prints how many."
    resume = False

    def add_arguments(self, parser):
        parser.add_argument("--reason", required=True, help="why; kept with the action and each run's event")
        parser.add_argument(
            "--as", dest="actor", required=True, help="the operator or supervisor acting (username)"
        )
        for name in ("tenant", "agent", "tool", "endpoint", "created_by", "status"):
            parser.add_argument(f"--{name.replace('_', '-')}", dest=name)
        parser.add_argument("--agent-version", dest="version", type=int, help="one version of --agent")
        parser.add_argument("--created-before", dest="created_before", help="ISO 8601 with a time zone")
        if not self.resume:
            parser.add_argument("--until", help="until when it is meant to stay paused (ISO 8601)")

    def handle(self, *args, **options):
        actor = User.objects.filter(username=options["actor"]).first()
        if actor is None:
            raise CommandError(f"no user {options['actor']}")
        filters = {name: options.get(name) for name in pausing.FILTERS}
        for name in ("created_before", "until"):
            if options.get(name):
                when = parse_datetime(options[name])
                if when is None or when.tzinfo is None:
                    raise CommandError(f"--{name.replace('_', '-')}: an ISO 8601 time with its zone")
                options[name] = when
        filters["created_before"] = options.get("created_before")
        try:
            if self.resume:
                action = pausing.resume_matching(actor=actor, reason=options["reason"], filters=filters)
            else:
                action = pausing.pause_matching(
                    actor=actor, reason=options["reason"], filters=filters, until=options.get("until")
                )
        except DomainError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"{action.kind}: {action.count} runs (bulk action {action.pk})")
