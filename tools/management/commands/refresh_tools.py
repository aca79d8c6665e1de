"""Refresh the tool catalogue from the servers: new tools arrive disabled, changed ones quarantined.

python manage.py refresh_tools [--tenant SLUG] [--server NAME]
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from tools.catalog import refresh
from tools.models import ToolServer
from tools.types import ToolFailed, ToolOutcomeUnknown


class Command(BaseCommand):
    help = "Fetch each tool server's tool list and sync it into the tenant's catalogue."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", help="only this tenant (slug)")
        parser.add_argument("--server", help="only servers with this name")

    def handle(self, *args, tenant=None, server=None, **options):
        servers = ToolServer.objects.select_related("tenant").order_by("tenant__slug", "name")
        if tenant:
            servers = servers.filter(tenant__slug=tenant)
        if server:
            servers = servers.filter(name=server)
        if not servers:
            raise CommandError("no tool server matches")
        failed = []
        for item in servers:
            label = f"{item.tenant.slug}/{item.name}"
            try:
                report = refresh(item)
            except (ToolFailed, ToolOutcomeUnknown) as exc:
                # One unreachable server must not stop the others from being refreshed.
                failed.append(label)
                self.stderr.write(f"{label}: not refreshed: {exc}")
                continue
            self.stdout.write(
                f"{label}: "
                + "; ".join(
                    f"{what} {len(names)}"
                    + (f" ({', '.join(names)})" if names and what != "unchanged" else "")
                    for what, names in (
                        ("added", report.added),
                        ("quarantined", report.quarantined),
                        ("unchanged", report.unchanged),
                        ("missing", report.missing),
                    )
                )
            )
        if failed:
            raise CommandError(f"{len(failed)} server(s) not refreshed: {', '.join(failed)}")
