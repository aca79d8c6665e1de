"""Where Django's admin finds the runs app's pages: the run's own (runs/front/admin.py) and the
operators' controls (runs/controls/admin.py)."""

from runs.controls import admin as controls_admin  # noqa: F401 -- registers kill switches and bulk actions
from runs.front import admin as front_admin  # noqa: F401 -- registers the run pages
