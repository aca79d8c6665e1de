"""Write a signed export of run history (history/export.py) to a zip file."""

from __future__ import annotations

import uuid

from django.core.management.base import BaseCommand, CommandError
from django.utils.dateparse import parse_datetime

from history import export
from runs.models import Run
from tenants.models import Tenant


class Command(BaseCommand):
    help = "Write a signed export (records.jsonl, manifest.json, manifest.sig, jwks.json) of one run or a tenant's date range"

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True, help="the tenant's slug")
        parser.add_argument("--run", help="one run's id")
        parser.add_argument("--from", dest="start", help="runs created at or after (ISO time)")
        parser.add_argument("--to", dest="end", help="runs created before (ISO time)")
        parser.add_argument("--out", required=True, help="the zip file to write")

    def handle(self, *args, tenant, run=None, start=None, end=None, out, **options):
        tenant_id = Tenant.objects.filter(slug=tenant).values_list("pk", flat=True).first()
        if tenant_id is None:
            raise CommandError(f"no tenant {tenant}")
        if run:
            if not Run.objects.filter(pk=run, tenant_id=tenant_id).exists():
                raise CommandError(f"no run {run} in {tenant}")
            run_ids, scope = [uuid.UUID(run)], {"run": run}
        else:
            first, last = parse_datetime(start or ""), parse_datetime(end or "")
            if first is None or last is None or first >= last:
                raise CommandError("give --run, or --from and --to (ISO times, from before to)")
            run_ids = export.runs_between(tenant_id, first, last)
            if len(run_ids) > export.MAX_RUNS:
                raise CommandError(f"more than {export.MAX_RUNS} runs: export a shorter range")
            scope = {"from": first.isoformat(), "to": last.isoformat()}
        with open(out, "wb") as handle:
            handle.write(export.build_bundle(tenant_id=tenant_id, run_ids=run_ids, scope=scope))
        self.stdout.write(f"{out}: {len(run_ids)} run(s)")
