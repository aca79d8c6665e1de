"""Acting on a copy of the home's authority, away from home (DESIGN.md section 9, docs/regions.md).

    stale_authority(tenant_id)   None, or why this region may not act on its copy now
    pause_for_stale_authority()  with the run locked, before a tool call (and an approval's use):
                                 park it as `paused`, reason named; regions' keeper resumes it

People, groups, grants, policies and kill switches are written at the tenant's home and reach
this region by logical replication with the home's heartbeat (regions/replication.py). Read the
watermark before the authority it vouches for: every commit at home older than the heartbeat
read is then visible to the reads that follow in this transaction.
"""

from __future__ import annotations

from django.utils import timezone

from regions.models import TenantRegions, authority_age, here
from runs.engine.decisions import AUTHORITY_STALE, authority_turn
from runs.models import Run, RunStatus
from runs.transitions import transition_run


def stale_authority(tenant_id) -> str | None:
    if not here():  # a deployment without regions: nothing read
        return None
    config = TenantRegions.objects.filter(tenant_id=tenant_id).first()
    if config is None:
        return None
    return authority_turn(
        home_here=config.home == here(),
        age_seconds=authority_age(config),
        reach_seconds=config.revocation_reach_seconds,
    )


def pause_for_stale_authority(run: Run, why: str) -> None:
    transition_run(
        run,
        RunStatus.PAUSED,
        message=f"paused: {why}",
        pause_requested=False,
        paused_at=timezone.now(),
        pause_reason=AUTHORITY_STALE,
        paused_until=None,
        paused_by=None,
        paused_by_switch=None,
        event_data={"region_reason": AUTHORITY_STALE},
    )
