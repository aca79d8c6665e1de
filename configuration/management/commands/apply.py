"""`manage.py apply FILE.yaml [--dry-run]`: create or update a tenant from a file (docs/configuration.md)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from configuration.apply import ConfigError, apply_config, load_file


class Command(BaseCommand):
    help = "Create or update one tenant from a YAML file, all or nothing."

    def add_arguments(self, parser) -> None:
        parser.add_argument("file", help="the tenant's YAML configuration")
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="validate and report what would change, without writing anything",
        )

    def handle(self, *args, file: str, dry_run: bool, **options) -> None:
        try:
            report = apply_config(load_file(file), dry_run=dry_run)
        except ConfigError as exc:
            for path, message in exc.errors:
                self.stderr.write(f"{path}: {message}" if path else message)
            raise CommandError(f"{file}: {len(exc.errors)} error(s); nothing was applied") from None
        self.stdout.write(report.render())
