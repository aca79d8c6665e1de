"""scripts/serve.sh runs the web, worker, beat and Flower processes unprivileged when started as root
(scripts/service_user.sh), and refuses root in production when it cannot drop it.

The platform's Python may live where no other user can run it (under /root, as here): serve then
builds the service user a tree of hard links to it (scripts/service_python.py), and the real
interpreter runs the platform as that user from there. The capabilities are shown with a stand-in
Python (/bin/true passes the check). Needs root, as serve.sh's drop does; `nobody` is the
unprivileged user (it exists everywhere, so no user is created). tests/test_production_shape.py
runs the whole stack this way.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.servers import ROOT

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="serve.sh drops privileges only when root")


def serve_user(script: str, **env: str) -> subprocess.CompletedProcess:
    """`script` in bash after sourcing scripts/service_user.sh, from the checkout."""
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail; . scripts/service_user.sh; {script}"],
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=600,  # builds the service user's Python tree the first time; slow on a loaded machine
    )


def others_reach(path: Path) -> bool:
    """Whether a user other than the owner can walk down to `path` (every directory above it o+x)."""
    return all(parent.stat().st_mode & 0o001 for parent in (path, *path.parents))


@pytest.mark.skipif(
    not others_reach(ROOT),
    reason="a checkout under a 0700 directory (mktemp -d): the service user cannot reach it, the "
    "hard-linked tree's case (the next test)",
)
def test_started_as_root_the_services_run_as_the_service_user_with_no_capabilities():
    done = serve_user(
        'choose_service_user production; as=("${service_prefix[@]}");'
        ' "${as[@]}" sh -c "id -u; id -G; grep -E \\"^(CapEff|CapBnd|NoNewPrivs)\\" /proc/self/status"',
        PY="/bin/true",
        SERVE_USER="nobody",
    )

    assert done.returncode == 0, done.stderr
    uid, groups, *status = done.stdout.split("\n")
    assert uid == "65534" and groups.split() == [str(pwd.getpwnam("nobody").pw_gid)]
    assert dict(line.split(":\t") for line in status if line) == {
        "CapEff": "0000000000000000",
        "CapBnd": "0000000000000000",
        "NoNewPrivs": "1",
    }


PYTHON = str(ROOT / ".venv" / "bin" / "python")


@pytest.fixture
def reachable():
    """A var directory the service user can reach (pytest's tmp_path is under a root-only 0700)."""
    path = Path(tempfile.mkdtemp(prefix="service-user-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_service_user_that_cannot_run_the_python_where_it_is_runs_it_from_hard_links(reachable):
    done = serve_user(
        'choose_service_user production; as=("${service_prefix[@]}");'
        ' cd "$SERVICE_DIR" && "${as[@]}" "$SERVICE_PY" -c'
        ' "import os, sys, agentplatform; print(os.getuid(), sys.prefix, agentplatform.__file__)"',
        PY=PYTHON,
        SERVE_USER="nobody",
        AGENTPLATFORM_VAR_DIR=str(reachable),
    )
    assert done.returncode == 0, done.stderr
    uid, prefix, module = done.stdout.split()
    assert int(uid) == pwd.getpwnam("nobody").pw_uid
    built = reachable / "service-python"
    assert prefix == str(built / "venv")
    linked = built / "base" / "bin" / os.path.basename(os.path.realpath(PYTHON))
    assert os.path.samefile(linked, os.path.realpath(PYTHON))  # a hard link: the same file, not a copy
    assert module.startswith(str(ROOT)) or module.startswith(str(built / "app"))
    # The tree is reused while the interpreter and the packages are unchanged.
    stamp = (built / "stamp").stat().st_mtime_ns
    again = serve_user(
        "choose_service_user production", PY=PYTHON, SERVE_USER="nobody", AGENTPLATFORM_VAR_DIR=str(reachable)
    )
    assert again.returncode == 0 and (built / "stamp").stat().st_mtime_ns == stamp


def test_production_refuses_root_when_the_service_user_cannot_run_the_platform():
    unreachable = "/root/service-python-40"  # /root is 0700: nobody cannot reach what is built there
    probe = serve_user("service_user_problem", PY=PYTHON, SERVE_USER="nobody")
    if not probe.stdout.strip():
        pytest.skip("nobody can run this checkout's Python here: the refusal needs a machine where it cannot")

    refused = serve_user(
        "choose_service_user production", PY=PYTHON, SERVE_USER="nobody", SERVICE_PYTHON_DIR=unreachable
    )
    assert refused.returncode == 2
    assert "refusing to run the platform as root in production: nobody cannot run" in refused.stderr
    assert f"SERVICE_PYTHON_DIR ({unreachable}) and its parents must be reachable by nobody" in refused.stderr

    accepted = serve_user(
        'choose_service_user production; echo "prefix=${#service_prefix[@]}"',
        PY=PYTHON,
        SERVE_USER="nobody",
        SERVE_AS_ROOT="1",
        SERVICE_PYTHON_DIR=unreachable,
    )
    assert accepted.returncode == 0 and accepted.stdout.strip() == "prefix=0"
    assert (
        "WARNING: the web, worker, beat and Flower processes run as root (SERVE_AS_ROOT=1)" in accepted.stderr
    )

    development = serve_user(
        "choose_service_user development", PY=PYTHON, SERVE_USER="nobody", SERVICE_PYTHON_DIR=unreachable
    )
    shutil.rmtree(unreachable, ignore_errors=True)
    assert development.returncode == 0 and "WARNING: running as root (development mode)" in development.stderr


def test_a_missing_service_user_is_named_with_how_to_create_it():
    done = serve_user("service_user_problem", PY="/bin/true", SERVE_USER="no-such-user-40")

    assert done.stdout.startswith("no user no-such-user-40 (useradd --system --no-create-home")


def test_caches_and_tools_databases_written_in_the_checkout_do_not_rebuild_the_tree(tmp_path):
    """Hypothesis writes its examples into .hypothesis/ while tests run, and a process may write
    bytecode: neither is code, so the tree built for the service user stays (once, a test saw it
    rebuilt between two starts because another test wrote there meanwhile)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("service_python", ROOT / "scripts" / "service_python.py")
    service_python = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(service_python)
    app = tmp_path / "app"
    (app / "runs" / "__pycache__").mkdir(parents=True)  # made once, by the first import
    (app / "runs" / "engine.py").write_text("x = 1\n")
    before = service_python.stamp(app)

    time.sleep(0.01)  # a later mtime for whatever is written next
    (app / ".hypothesis" / "examples").mkdir(parents=True)
    (app / ".hypothesis" / "examples" / "a1").write_bytes(b"example")
    (app / "runs" / "__pycache__" / "engine.cpython-311.pyc").write_bytes(b"bytecode")
    assert service_python.stamp(app) == before

    (app / "runs" / "engine.py").write_text("x = 2\n")
    assert service_python.stamp(app) != before  # code edited: rebuilt
