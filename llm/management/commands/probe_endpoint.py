"""`manage.py probe_endpoint NAME [--tenant SLUG]`: which settings the endpoint's server needs (llm/probe.py)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from llm.models import ModelEndpoint
from llm.probe import probe


class Command(BaseCommand):
    help = "Try a model endpoint's server with a short, bounded conversation and say what to set."

    def add_arguments(self, parser) -> None:
        parser.add_argument("name", help="the endpoint's name")
        parser.add_argument(
            "--tenant", help="the tenant's slug, when several tenants have an endpoint of that name"
        )

    def handle(self, *args, name: str, tenant: str | None, **options) -> None:
        found = ModelEndpoint.objects.filter(name=name).select_related("secret", "tenant")
        if tenant:
            found = found.filter(tenant__slug=tenant)
        endpoints = list(found)
        if not endpoints:
            raise CommandError(
                f"no model endpoint named {name!r}" + (f" in tenant {tenant!r}" if tenant else "")
            )
        if len(endpoints) > 1:
            slugs = ", ".join(sorted(e.tenant.slug for e in endpoints))
            raise CommandError(f"several tenants have an endpoint named {name!r} ({slugs}): give --tenant")
        endpoint = endpoints[0]
        if endpoint.kind == ModelEndpoint.Kind.SCRIPTED:
            raise CommandError(f"{name} is a scripted endpoint: there is no server to probe")
        result = probe(endpoint)
        self.stdout.write(result.render())
        if not result.ok:
            raise CommandError(f"the probe of {name} failed: change the settings named above and probe again")
