"""Each pytest-xdist worker runs on a PostgreSQL cluster and a Redis of its own.

`python -m tests.services --sets N` starts N pairs of throwaway servers and lists them in
THROWAWAY_SETS; this plugin (loaded by `-p` in pytest.ini, so before pytest-django reads the
settings) points worker gwK at pair K mod N. The recovery tests stop, kill and restart their
session's servers: on shared servers they would pull the database from under the tests running on
the other workers. Without xdist or without THROWAWAY_SETS it changes nothing.
"""

from __future__ import annotations

import json
import os

from tests.services import SETS_ENV


def _choose() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    sets = json.loads(os.environ.get(SETS_ENV) or "[]")
    if worker.startswith("gw") and sets:
        os.environ.update(sets[int(worker.removeprefix("gw")) % len(sets)])


_choose()
