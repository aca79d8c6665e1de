"""Logical replication of authority between a home and its regions (regions/replication.py).

manage.py regions_replication publish                 at the home (wal_level = logical)
manage.py regions_replication subscribe "CONNINFO"    in a region, CONNINFO reaching the home
manage.py regions_replication unsubscribe             in a region
manage.py regions_replication lag                     in a region: the copy's age in seconds
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from regions import replication


class Command(BaseCommand):
    help = "Publish the authority tables (home), or subscribe to them (another region)."

    def add_arguments(self, parser):
        parser.add_argument("action", choices=["publish", "subscribe", "unsubscribe", "lag"])
        parser.add_argument("conninfo", nargs="?", default="")
        parser.add_argument(
            "--no-copy", action="store_true", help="subscribe without copying the rows the home has now"
        )

    def handle(self, *args, action: str, conninfo: str, no_copy: bool, **options):
        if action == "publish":
            replication.publish()
            self.stdout.write(f"published: {', '.join(replication.authority_tables())}")
        elif action == "subscribe":
            if not conninfo:
                raise CommandError("subscribe needs the home's connection string")
            replication.subscribe(conninfo, copy_data=not no_copy)
            self.stdout.write(f"subscribed to {replication.PUBLICATION}")
        elif action == "unsubscribe":
            replication.unsubscribe()
            self.stdout.write("unsubscribed (drop the slot at the home: pg_drop_replication_slot)")
        else:
            lag = replication.lag_seconds()
            self.stdout.write("no heartbeat yet" if lag is None else f"{lag:.3f}")
