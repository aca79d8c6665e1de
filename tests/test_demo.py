"""The README's first command: the dispute story on the embedded defaults (SQLite, in-process broker).

The rest of the suite runs on PostgreSQL, so this is the test that keeps the engine's SQL, the
budget ledger's portable path and the demo itself working on SQLite. It runs `manage.py demo`
as a user would, in a fresh var directory, with no database or broker configured.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_dispute_demo_runs_end_to_end_on_sqlite_with_no_services(tmp_path):
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"DATABASE_URL", "CELERY_BROKER_URL", "CELERY_QUEUE", "DB_POOL_MAX"}
    }
    env.update(AGENTPLATFORM_VAR_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, "manage.py", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert (tmp_path / "agentplatform.sqlite3").exists()
    assert "bank__transfer_funds         denied" in out, out[-4000:]
    assert "approval requested for bank__issue_refund" in out
    assert "effects applied at the bank: issue_refund 1, send_customer_email 1 (transfer_funds: 0)" in out
    assert "== final status: succeeded" in out
    assert "== budget: limit USD 2.00" in out and "reserved USD 0.00, held USD 0.00" in out
    # Money one way (no "micros", no "$"), no Python dicts, no log lines between the events.
    assert " micros" not in out and not re.search(r"\$\d", out) and "{'" not in out
    story = out[out.index("== asha") : out.index("== steps")]
    assert " WARNING " not in story
    assert "No hostname was supplied" not in out
    # The denied call is logged at WARNING with the run it belongs to.
    log = (tmp_path / "demo.log").read_text()
    assert "WARNING agentplatform.runs call denied: step 6 bank__transfer_funds denied" in log
    assert "== log: " in out and "demo.log" in out
    # The in-process broker polls every 50 ms: the 11 steps take about 2 s, not one second each.
    finished = next(line for line in out.splitlines() if line.rstrip().endswith("==> succeeded"))
    assert float(finished.split("s", 1)[0]) < 9, finished
