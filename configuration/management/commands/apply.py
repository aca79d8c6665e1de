"""`manage.py apply FILE.yaml [--dry-run] [--probe]`: create or update a tenant from a file
(docs/configuration.md); with --probe, then try each model endpoint of the file (llm/probe.py)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from configuration.apply import ConfigError, apply_config, load_file
from llm.models import ModelEndpoint
from llm.probe import probe as probe_endpoint


class Command(BaseCommand):
    help = "Create or update one tenant from a YAML file, all or nothing."

    def add_arguments(self, parser) -> None:
        parser.add_argument("file", help="the tenant's YAML configuration")
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="validate and report what would change, without writing anything",
        )
        parser.add_argument(
            "--probe",
            action="store_true",
            help="after applying, probe each openai or anthropic endpoint of the file (manage.py probe_endpoint)",
        )

    def handle(self, *args, file: str, dry_run: bool, probe: bool = False, **options) -> None:
        try:
            data = load_file(file)
            report = apply_config(data, dry_run=dry_run)
        except ConfigError as exc:
            for path, message in exc.errors:
                self.stderr.write(f"{path}: {message}" if path else message)
            raise CommandError(f"{file}: {len(exc.errors)} error(s); nothing was applied") from None
        self.stdout.write(report.render())
        if probe and not dry_run:
            self._probe(report.tenant, data)

    def _probe(self, tenant: str, data) -> None:
        # After the commit: the probe calls the servers, and no transaction waits on them.
        names = [e.get("name") for e in data.get("model_endpoints") or [] if isinstance(e, dict)]
        failed = []
        for endpoint in (
            ModelEndpoint.objects.filter(tenant__slug=tenant, name__in=names)
            .exclude(kind=ModelEndpoint.Kind.SCRIPTED)
            .select_related("secret")
            .order_by("name")
        ):
            result = probe_endpoint(endpoint)
            self.stdout.write(result.render())
            if not result.ok:
                failed.append(endpoint.name)
        if failed:
            raise CommandError(
                f"applied, but the probe of {', '.join(failed)} failed: see the settings named above"
            )
