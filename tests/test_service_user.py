"""scripts/serve.sh runs the web, worker, beat and Flower processes unprivileged when started as root
(scripts/service_user.sh), and refuses root in production when it cannot drop it.

As far as this machine allows: the platform's Python lives under /root here, so no other user can
run it. The drop itself is shown with a stand-in Python (/bin/true passes the check); the refusal
with the real one. Needs root, as serve.sh's drop does; `nobody` is the unprivileged user (it
exists everywhere, so no user is created).
"""

from __future__ import annotations

import os
import pwd
import subprocess

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
        timeout=60,
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


def test_production_refuses_root_when_the_service_user_cannot_run_the_platform():
    python = str(ROOT / ".venv" / "bin" / "python")
    probe = serve_user("service_user_problem", PY=python, SERVE_USER="nobody")
    if not probe.stdout.strip():
        pytest.skip("nobody can run this checkout's Python here: the refusal needs a machine where it cannot")

    refused = serve_user("choose_service_user production", PY=python, SERVE_USER="nobody")
    assert refused.returncode == 2
    assert "refusing to run the platform as root in production: nobody cannot run" in refused.stderr

    accepted = serve_user(
        'choose_service_user production; echo "prefix=${#service_prefix[@]}"',
        PY=python,
        SERVE_USER="nobody",
        SERVE_AS_ROOT="1",
    )
    assert accepted.returncode == 0 and accepted.stdout.strip() == "prefix=0"
    assert (
        "WARNING: the web, worker, beat and Flower processes run as root (SERVE_AS_ROOT=1)" in accepted.stderr
    )

    development = serve_user("choose_service_user development", PY=python, SERVE_USER="nobody")
    assert development.returncode == 0 and "WARNING: running as root (development mode)" in development.stderr


def test_a_missing_service_user_is_named_with_how_to_create_it():
    done = serve_user("service_user_problem", PY="/bin/true", SERVE_USER="no-such-user-40")

    assert done.stdout.startswith("no user no-such-user-40 (useradd --system --no-create-home")
