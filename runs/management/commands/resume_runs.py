"""`manage.py resume_runs --reason ... [filters] --as USER`: resume every matching paused run, oldest
pause first, rate-limited (runs/controls/pausing.RESUME_PER_SECOND)."""

from __future__ import annotations

from runs.management.commands import pause_runs


class Command(pause_runs.Command):
    help = "Resume every paused run the filters match, oldest pause first, rate-limited; prints how many."
    resume = True
