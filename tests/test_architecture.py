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


def test_at_most_eight_arrows_run_back_up_the_ladder_and_each_says_why():
    sys.path.insert(0, str(ROOT / "scripts"))
    import imports  # scripts/ is not a package: the graph module is read from its folder

    found = imports.back_up()
    assert set(found) <= set(imports.BACK_UP), sorted(set(found) - set(imports.BACK_UP))
    assert len(imports.BACK_UP) <= 8
    assert all(reason.strip() for reason in imports.BACK_UP.values())
    # The ground floor imports no app, and the project package on top is imported by none.
    assert not [arrow for arrow in found if arrow[0] == "core"]
    edges, _, _ = imports.graph()
    assert not [
        (mod, target)
        for mod, targets in edges.items()
        for target in targets
        if target.split(".")[0] == "agentplatform" and mod.split(".")[0] != "agentplatform"
    ]
