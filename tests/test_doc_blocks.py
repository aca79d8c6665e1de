"""Every shell and Python example in README.md and docs/ is run by a test, or says why it is not.

A block's marker is the HTML comment on the line before its fence (not shown when rendered):

    <!-- run: tests/api/test_docs.py -->          that test runs this block as written
    <!-- not run: <why, and what tests it> -->    a test cannot run it (a model server, a GPU...)

Checked here: every ```sh, ```bash, ```shell, ```console and ```python block has a marker; a `not
run` marker gives its reason; a `run` marker names a test file that exists and reads this
document, and where that test takes its blocks by a rule (docs/api.md's runner, the verification
snippets), the blocks marked are exactly the blocks it takes. The `manage.py` blocks marked for
this file (docs/policies.md's `policy test` and `policy report`) are run here, in-process, against
the example tenant. (YAML blocks:
tests/configuration/test_doc_examples.py.)
"""

from __future__ import annotations

import re
import shlex
from io import StringIO

import pytest
from django.core.management import call_command

from configuration.apply import apply_config
from configuration.loading import load_file
from tests.servers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"sh", "bash", "shell", "console", "python", "py"}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\n", re.M | re.S)
MARKER = re.compile(r"<!-- (run: (?P<test>\S+)|not run: (?P<why>.*?)) -->")
HERE = "tests/test_doc_blocks.py"


def blocks() -> list[dict]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) not in RUNNABLE:
                continue
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.fullmatch(before.strip())
            found.append(
                {
                    "doc": str(path.relative_to(ROOT)),
                    "line": text[: match.start()].count("\n") + 1,
                    "lang": match.group(1),
                    "body": match.group(2),
                    "test": marker and marker.group("test"),
                    "why": marker and marker.group("why"),
                }
            )
    return found


def marked(doc: str, test: str) -> list[str]:
    return [b["body"] for b in blocks() if b["doc"] == doc and b["test"] == test]


def test_every_block_has_a_marker_and_every_marker_holds():
    found = blocks()
    assert len(found) >= 25
    unmarked = [f"{b['doc']}:{b['line']}" for b in found if not (b["test"] or b["why"])]
    assert unmarked == [], "blocks with neither `run:` nor `not run:` on the line before"
    for block in found:
        where = f"{block['doc']}:{block['line']}"
        if block["why"] is not None:
            assert len(block["why"].split()) >= 6, f"{where}: say why it is not run, and what tests it"
            continue
        test = ROOT / block["test"]
        assert test.is_file(), f"{where}: {block['test']} does not exist"
        source = test.read_text()
        name = block["doc"] if block["doc"] == "README.md" else block["doc"].removeprefix("docs/")
        assert name in source, f"{where}: {block['test']} does not read {block['doc']}"


def test_the_runners_take_exactly_the_blocks_marked_for_them():
    from tests.api import test_docs as api_docs
    from tests.authority import test_docs as authority_docs
    from tests.notifications.conftest import documented_code

    api = api_docs.DOC.read_text()
    assert [body for body, _ in api_docs.examples(api)] == marked("docs/api.md", "tests/api/test_docs.py")
    assert [authority_docs.snippet()] == marked("docs/authority.md", "tests/authority/test_docs.py")
    assert [documented_code()] == marked("docs/notifications.md", "tests/notifications/test_signature.py")
    history = (ROOT / "docs" / "history.md").read_text()
    [verifier] = marked("docs/history.md", "tests/history/test_export.py")
    assert history.split("```python verify_bundle\n", 1)[1].split("```", 1)[0] == verifier


@pytest.mark.django_db
def test_the_manage_py_blocks_marked_here_run_as_written(bank, monkeypatch):
    monkeypatch.setenv("BANK_MCP_URL", bank.mcp_url)
    apply_config(load_file(ROOT / "examples" / "dispute.yaml"))
    commands = [
        line for body in (b["body"] for b in blocks() if b["test"] == HERE) for line in body.splitlines()
    ]
    assert len(commands) == 2
    printed = []
    for line in commands:
        argv = shlex.split(line)
        assert argv[:2] == ["python", "manage.py"], line
        out = StringIO()
        call_command(*argv[2:], stdout=out)  # raises CommandError where the command would exit non-zero
        printed.append(out.getvalue())
    assert "policy test(s) passed" in printed[0]
    assert re.match(r"shadow-mode decisions over the last \d+ call\(s\) of acme-bank:", printed[1]), printed[
        1
    ]
