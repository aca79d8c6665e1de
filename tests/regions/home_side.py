"""The home region's side of the regions tests, run as its own process on the home's database.

    DATABASE_URL=<home> REGION=mumbai python -m tests.regions.home_side COMMAND JSON

    setup {"slug", "daily", "slice", "zone", "regions", "user_daily"?, "user_id"?}  the tenant as the
                                                   home knows it (the same slug; its user with the
                                                   region's id, as replication keeps ids)
    race  {"slug", "runs", "timeout"}              race runs at home until quiet; prints outcomes
    books {"slug", "day"}                          the home's ledger and its check; prints JSON
    publish {}                                     the publication of the authority tables
    beat {"every"}                                 the home's heartbeat, until killed
    people {"tenant_id", "user_id", "slug", "username"}  a tenant and a user with these ids
    policy {"tenant_id", "text"}                   the tenant's one policy set (null: none), as apply
                                                   writes it (the version moved in the same commit);
                                                   prints when it committed (time.time())

Prints one JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import sys


def main(command: str, args: dict) -> dict:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")
    import django

    django.setup()
    import datetime as dt

    from regions.models import RegionDay, SliceMove, TenantRegions
    from regions.selectors import home_books
    from tenants.models import Tenant, User
    from tests import factories
    from tests.regions import race

    if command == "setup":
        tenant = factories.make_tenant(
            args["slug"],
            daily_budget_micros=args["daily"],
            time_zone=args["zone"],
            max_active_runs=200,
            max_starts_per_minute=200,
        )
        if args.get("user_daily") is not None:
            tenant.user_daily_budget_micros = args["user_daily"]
            tenant.save()
        if args.get("user_id") is not None:  # the region's id for the user, as replication would bring it
            asha = User.objects.create_user(
                pk=args["user_id"], username=f"asha-{tenant.slug}", password="pw", tenant=tenant
            )
        else:
            asha = factories.make_user(tenant, f"asha-{tenant.slug}")
        per_call = race.make_racing_agent(tenant, asha, factories)
        TenantRegions.objects.create(
            tenant=tenant, home=args["regions"][0], allowed=args["regions"], slice_micros=args["slice"]
        )
        return {"per_call": per_call}
    if command == "publish":
        from regions import replication

        replication.publish()
        return {"tables": replication.authority_tables()}
    if command == "beat":  # plays the home's beat: the heartbeat every `every` seconds, until killed
        import time

        from regions import services

        while True:
            services.beat()
            time.sleep(args["every"])
    if command == "people":  # the tenant and its user as the home knows them, with the region's ids
        tenant, made = Tenant.objects.get_or_create(
            pk=args["tenant_id"], slug=args["slug"], name=args["slug"]
        )
        if made:
            User.objects.create_user(
                pk=args["user_id"], username=args["username"], password="pw", tenant=tenant
            )
        return {}
    if command == "policy":
        import time

        from django.db import transaction
        from django.db.models import F

        from approvals.models import PolicySet, TenantPolicies

        with transaction.atomic():
            TenantPolicies.objects.get_or_create(tenant_id=args["tenant_id"])
            if args["text"] is None:
                PolicySet.objects.filter(tenant_id=args["tenant_id"]).delete()
            else:
                PolicySet.objects.update_or_create(
                    tenant_id=args["tenant_id"], name="regions-test", defaults={"text": args["text"]}
                )
            TenantPolicies.objects.filter(tenant_id=args["tenant_id"]).update(version=F("version") + 1)
            version = TenantPolicies.objects.get(tenant_id=args["tenant_id"]).version
        return {"committed_at": time.time(), "version": version}
    tenant = Tenant.objects.get(slug=args["slug"])
    if command == "race":
        running = race.Race(
            tenant, User.objects.get(username=f"asha-{tenant.slug}"), runs=args["runs"]
        ).start()
        quiet = running.wait_quiet(timeout=args["timeout"])
        running.stop()
        return {"quiet": quiet, **race.books(tenant)}
    if command == "books":
        day = dt.date.fromisoformat(args["day"])
        return {
            **race.books(tenant),
            "check": home_books(tenant, day),
            "lent": {
                d.region: {
                    "granted": d.granted_micros,
                    "returned": d.returned_micros,
                    "held": d.reported_held_micros,
                }
                for d in RegionDay.objects.filter(tenant=tenant, day=day, user=None)
            },
            "user_lent": {
                f"{d.region}/{d.user_id}": {"granted": d.granted_micros, "returned": d.returned_micros}
                for d in RegionDay.objects.filter(tenant=tenant, day=day, user__isnull=False)
            },
            "moves": list(
                SliceMove.objects.filter(tenant=tenant).values_list(
                    "request_id", "kind", "moved_micros", "day"
                )
            ),
        }
    raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2])), default=str))
