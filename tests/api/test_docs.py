"""docs/api.md's examples, run exactly as written against a live server, print what the doc shows.

Every ```sh block runs in one bash process, in the order of the document, with the variables the
doc tells the reader to set; a ```text block right after it is its output (`…` stands for any text
within a line). The run stream's output (its timestamps, and heartbeats where a run waits, cannot
be shown exactly) is checked for its form instead: every event of the run once, in order, then
`end`. The tenant is made by `manage.py apply examples/dispute.yaml`, as the doc says.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from configuration.apply import apply_config
from configuration.loading import load_file
from runs.models import Run
from tests.servers import ROOT

DOC = ROOT / "docs" / "api.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)


def examples(text: str) -> list[tuple[str, str]]:
    """(script, expected output) for every sh block; the output is the text block right after it."""
    blocks = [(m.group(1), m.group(2), m.start(), m.end()) for m in FENCE.finditer(text)]
    found = []
    for i, (lang, body, _, end) in enumerate(blocks):
        if lang != "sh":
            continue
        following = blocks[i + 1] if i + 1 < len(blocks) else None
        if following and following[0] == "text" and not text[end : following[2]].strip():
            found.append((body, following[1]))
        else:
            found.append((body, ""))
    return found


def matches(expected: str, actual: str) -> bool:
    pattern = "[^\n]*".join(re.escape(part) for part in expected.strip("\n").split("…"))
    return re.fullmatch(pattern, actual.strip("\n")) is not None


def stream_ended(printed: str) -> bool:
    """A run stream as the doc shows it: `retry`, events 1..n of the finished run, then `end`."""
    messages = [m for m in printed.strip("\n").split("\n\n") if not m.startswith(": heartbeat")]
    if not messages or messages[0] != "retry: 1000":
        return False
    ids = [int(m.split("\n", 1)[0].removeprefix("id: ")) for m in messages[1:-1]]
    end = messages[-1].split("\n")
    return (
        ids == list(range(1, len(ids) + 1))
        and end[0] == "event: end"
        and json.loads(end[1].removeprefix("data: ")) == {"status": "succeeded", "last_event_id": len(ids)}
    )


def test_the_examples_are_found_with_their_outputs():
    found = examples(DOC.read_text())
    assert len(found) >= 9  # the quick start; later sections (the stream) add theirs
    # Every example shows its output; the stream's is shown, not exactly (stream_ended).
    assert [body for body, output in found if not output] == [
        'curl -N -H "Authorization: Bearer $TOKEN" $BASE/v1/runs/$RUN/stream\n'
    ]
    assert matches('{"id": "…", "n": 1}', '{"id": "3f2c-9", "n": 1}')
    assert not matches('{"id": "…", "n": 1}', '{"id": "3f2c-9", "n": 2}')
    assert not matches("a…", "ab\nc")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_every_example_in_the_api_doc_runs_as_written_and_prints_what_it_shows(
    live_server, bank, workers, monkeypatch, tmp_path
):
    for tool in ("curl", "jq"):
        assert shutil.which(tool), f"{tool} is needed to run docs/api.md (apt-get install {tool})"
    monkeypatch.setenv("BANK_MCP_URL", bank.mcp_url)
    apply_config(load_file(ROOT / "examples" / "dispute.yaml"))
    workers("w1", ready_within=600)  # minutes on a loaded machine

    found = examples(DOC.read_text())
    separator = "@@example-ended@@"
    script = "set -e -o pipefail\n" + "".join(f"{body}\necho {separator}\n" for body, _ in found)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "BASE": live_server.url,
        "API_USER": "asha",
        "API_PASSWORD": "demo-password-asha",
        "SUPERVISOR_USER": "ravi",
        "SUPERVISOR_PASSWORD": "demo-password-ravi",
    }
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    outputs = done.stdout.split(separator + "\n")
    assert done.returncode == 0 and len(outputs) == len(found) + 1, done.stdout[-3000:] + done.stderr[-3000:]
    for (body, expected), actual in zip(found, outputs, strict=False):
        if not expected:
            assert stream_ended(actual), f"example:\n{body}\nprinted:\n{actual}"
            continue
        assert matches(expected, actual), f"example:\n{body}\nshows:\n{expected}\nprinted:\n{actual}"

    # What the doc did, seen from the outside: one refund at the bank, a run that replays, no second run.
    assert Run.objects.count() == 1
    assert len(bank.effects("issue_refund")) == 1
    assert bank.effects("transfer_funds") == []
    assert (tmp_path / "agentplatform_client" / "api" / "runs" / "start_run.py").exists()
