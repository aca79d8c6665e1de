"""Run every benchmark in turn (each creates and drops its own database) and print their tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    failed = 0
    for script in ("engine.py", "gateway.py", "budget.py", "quotas.py"):
        print(f"\n===== bench/{script} =====", flush=True)
        failed |= subprocess.call([sys.executable, str(HERE / script)], cwd=HERE.parent)
    sys.exit(failed)
