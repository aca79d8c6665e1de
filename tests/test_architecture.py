"""The house has no circle: no module imports itself back, no app imports an app above it, and every
import inside a function says why next to it (scripts/imports.py prints the graph)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_graph_has_no_circle_and_no_unexplained_function_level_import():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "imports.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout
