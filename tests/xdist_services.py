"""Each pytest-xdist worker runs on a PostgreSQL cluster and a Redis of its own.

`python -m tests.services --sets N` starts N pairs of throwaway servers and lists them in
THROWAWAY_SETS; this plugin (loaded by `-p` in pytest.ini, so before pytest-django reads the
settings) points worker gwK at pair K. The recovery tests stop, kill and restart their session's
servers: on shared servers they would pull the database from under the tests running on the other
workers, so more workers than pairs is refused rather than shared. Without xdist or without
THROWAWAY_SETS it changes nothing.
"""

from __future__ import annotations

import json
import os

from tests.services import SETS_ENV


def _choose() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    sets = json.loads(os.environ.get(SETS_ENV) or "[]")
    if not (worker.startswith("gw") and sets):
        return
    index = int(worker.removeprefix("gw"))
    if index >= len(sets):
        raise RuntimeError(
            f"pytest-xdist worker {worker} has no servers of its own: {len(sets)} pairs were started "
            f"(python -m tests.services --sets N with N at least the -n of pytest)"
        )
    os.environ.update(sets[index])


_choose()
