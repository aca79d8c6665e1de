"""run_python: the platform tool that executes model-written Python in the sandbox runner.

A builtin tool (server kind `builtin`, remote name `run_python`) whose call goes to the runner
process (sandbox/runner.py) over loopback HTTP, outside any transaction, with the tool's own
deadline, exactly like an HTTP tool: the engine needs nothing of its own for it. The runner holds
no database, broker or secret; this side does the platform's part: it reads the input artifacts
(of the step's own run only), sends them with the code and the limits, and stores the files the
sandbox left in /out as new artifacts of the step.

Effect class read_only: the sandbox has no network, so a retry after a lost worker only runs the
code again; the step's idempotency key names the execution, and the runner answers a key it has
already run with the result it produced (or joins the execution still running).

Limits and prices are the tool's configuration (Tool.sandbox, from the configuration file's
`sandbox` section), capped per tenant (SandboxCaps). Cost: the reservation is the tool's price,
which configuration sets to what the limits can cost (reservation_micros) and refuses below it;
`cost_of` is what the measured usage costs, which the engine settles at
(runs/engine/tool_step.charge, never more than the reservation).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math

import httpx
from django.conf import settings

from artifacts import services as artifacts
from artifacts.models import Artifact
from observability import metrics
from runs.models import Step
from sandbox.limits import Limits
from tools.models import SandboxCaps
from tools.types import ToolFailed, ToolOutcomeUnknown, ToolResult

NAME = "run_python"
DESCRIPTION = (
    "Run Python 3 code in an isolated sandbox with pandas and numpy; no network. Input artifacts "
    "(by artifact_id) are mounted read-only as /in/<name>; files written to /out become new "
    "artifacts. Print a short summary: only the tail of stdout comes back. Limits: 30 s wall, "
    "20 CPU seconds, 1 GiB memory, 32 MiB of output files."
)
INPUT_SCHEMA = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "description": "the Python program, run as __main__"},
        "artifacts": {
            "type": "array",
            "items": {"type": "string"},
            "description": "artifact ids to mount under /in",
        },
    },
    "required": ["code"],
    "additionalProperties": False,
}
# What the model reads of stdout and stderr (the step's stored result keeps the runner's tails).
MODEL_TAIL = 8 * 1024


# What a tool's configuration may set (tools.Tool.sandbox["limits"]): sandbox.limits.Limits's
# names but open_files, which is the runner's own business. DESIGN.md's defaults where unset.
LIMIT_NAMES = (
    "wall_seconds",
    "cpu_seconds",
    "cores",
    "memory_bytes",
    "processes",
    "tmp_bytes",
    "output_bytes",
    "output_files",
    "stdout_bytes",
)
DEFAULTS = {name: getattr(Limits(), name) for name in LIMIT_NAMES}
# Held below the tool's deadline: the runner's answer and the files must come back within it.
DEADLINE_MARGIN = 2.0


def limits_for(tool) -> dict:
    """The sandbox limits of one call: the tool's configuration over DESIGN.md's defaults, each
    held to the tenant's cap (SandboxCaps), the wall under the tool's deadline, the CPU seconds
    under what the wall and the cores allow."""
    limits = {**DEFAULTS, **(tool.sandbox or {}).get("limits", {})}
    caps = SandboxCaps.objects.filter(tenant_id=tool.tenant_id).values(*LIMIT_NAMES).first() or {}
    for name, cap in caps.items():
        if cap is not None:
            limits[name] = min(limits[name], cap)
    limits["wall_seconds"] = max(1.0, min(limits["wall_seconds"], tool.timeout_seconds - DEADLINE_MARGIN))
    limits["cpu_seconds"] = min(limits["cpu_seconds"], limits["wall_seconds"] * limits["cores"])
    return limits


@dataclasses.dataclass(frozen=True)
class Prices:
    cpu_second_micros: int
    gib_second_micros: int


def prices_for(tool) -> Prices:
    """The tool's prices per CPU second and per GiB-second (its configuration), else the settings'."""
    configured = (tool.sandbox or {}).get("prices", {})
    return Prices(
        configured.get("cpu_second_micros", settings.SANDBOX_PRICE_CPU_SECOND_MICROS),
        configured.get("gib_second_micros", settings.SANDBOX_PRICE_GIB_SECOND_MICROS),
    )


def limit_cost_micros(limits: dict, prices: Prices) -> int:
    """The most a call with these limits can cost: what its reservation (the tool's price) must be."""
    gib_seconds = limits["memory_bytes"] / 2**30 * limits["wall_seconds"]
    return math.ceil(
        limits["cpu_seconds"] * prices.cpu_second_micros + gib_seconds * prices.gib_second_micros
    )


def reservation_micros(tool) -> int:
    return limit_cost_micros(limits_for(tool), prices_for(tool))


def cost_of(usage: dict, prices: Prices) -> int:
    return round(
        usage.get("cpu_seconds", 0) * prices.cpu_second_micros
        + usage.get("gib_seconds", 0) * prices.gib_second_micros
    )


def runner_token() -> str:
    """The runner's shared secret: SANDBOX_RUNNER_TOKEN, else the file the runner made."""
    if settings.SANDBOX_RUNNER_TOKEN:
        return settings.SANDBOX_RUNNER_TOKEN
    try:
        with open(settings.SANDBOX_RUNNER_TOKEN_FILE) as handle:
            return handle.read().strip()
    except OSError:
        # Sent empty: the runner then refuses it (401), and the message below says what to set.
        return ""


def call(step: Step) -> ToolResult:
    if step.tool is None:
        raise ToolFailed("run_python: the step has no tool")
    timeout = step.tool.timeout_seconds
    arguments = step.arguments or {}
    code = arguments.get("code")
    if not isinstance(code, str) or not code.strip():
        raise ToolFailed("run_python needs `code`: the Python program to run")
    ids = arguments.get("artifacts") or []
    if not isinstance(ids, list):
        raise ToolFailed("`artifacts` must be a list of artifact ids")
    try:
        inputs = artifacts.of_run(step.run, ids)
    except artifacts.ArtifactRefused as exc:
        raise ToolFailed(exc.message) from None
    limits = limits_for(step.tool)
    body = {
        "key": step.idempotency_key,
        "tenant": str(step.run.tenant_id),
        "code": code,
        "inputs": [
            {"name": a.name, "content_b64": base64.b64encode(artifacts.content_of(a)).decode()}
            for a in inputs
        ],
        "limits": limits,
        "queue_timeout": max(0.0, timeout - limits["wall_seconds"] - 1.0),
    }
    url = settings.SANDBOX_RUNNER_URL.rstrip("/") + "/v1/executions"
    headers = {"Authorization": f"Bearer {runner_token()}"}
    try:
        response = httpx.post(url, json=body, headers=headers, timeout=httpx.Timeout(timeout, connect=2.0))
    except (httpx.ConnectError, httpx.ConnectTimeout):
        metrics.SANDBOX_EXECUTIONS.labels("unavailable", "").inc()
        raise ToolFailed(f"the sandbox runner at {settings.SANDBOX_RUNNER_URL} is not running") from None
    except httpx.HTTPError as exc:
        # Harmless to repeat (no network inside), and the runner keeps the result under the key.
        metrics.SANDBOX_EXECUTIONS.labels("unknown", "").inc()
        raise ToolOutcomeUnknown(f"sandbox runner: {type(exc).__name__}") from None
    if response.status_code == 401:
        metrics.SANDBOX_EXECUTIONS.labels("unavailable", "").inc()
        raise ToolFailed(
            "the sandbox runner refused the platform's token (SANDBOX_RUNNER_TOKEN or "
            "SANDBOX_RUNNER_TOKEN_FILE must hold the runner's); nothing ran"
        )
    if response.status_code == 503:
        metrics.SANDBOX_EXECUTIONS.labels("busy", "").inc()
        raise ToolFailed(f"the sandbox is busy: {response.json().get('error', '')}; nothing ran")
    if response.status_code >= 400:
        raise ToolFailed(
            f"the sandbox runner refused the call ({response.status_code}): {response.text[:500]}"
        )
    answer = response.json()
    _observe(answer)
    return _result(step, answer, prices_for(step.tool))


def _observe(answer: dict) -> None:
    """Count the execution once: a result the runner replays (a retried step) ran only once."""
    if answer.get("replayed"):
        return
    limit = answer.get("limit") or ""
    outcome = "limit" if limit else ("ok" if answer.get("exit_code") == 0 else "error")
    metrics.SANDBOX_EXECUTIONS.labels(outcome, limit).inc()
    if isinstance(answer.get("start_seconds"), (int, float)):
        metrics.SANDBOX_START_SECONDS.observe(answer["start_seconds"])
    if isinstance(answer.get("queue_seconds"), (int, float)):
        metrics.SANDBOX_QUEUE_SECONDS.observe(answer["queue_seconds"])


def _result(step: Step, answer: dict, prices: Prices) -> ToolResult:
    files, refused = [], []
    for item in answer.get("files", []):
        content = base64.b64decode(item["content_b64"])
        try:
            stored = artifacts.store(
                run=step.run,
                step=step,
                name=item["name"],
                media_type=artifacts.media_type_for_name(item["name"]),
                content=content,
                source=Artifact.Source.SANDBOX,
            )
        except artifacts.ArtifactRefused as exc:
            refused.append({"name": item["name"], "error": exc.message})
            continue
        files.append(artifacts.describe(stored, content))
    usage = answer.get("usage", {})
    summary = {
        "exit_code": answer.get("exit_code"),
        "limit": answer.get("limit"),
        "message": answer.get("message"),
        "stdout": _tail(answer.get("stdout", "")),
        "stderr": _tail(answer.get("stderr", "")),
        "files": files,
        "files_refused": refused,
        "files_skipped": answer.get("skipped_files", []),
        "usage": usage,
        "queue_seconds": answer.get("queue_seconds"),
        "start_seconds": answer.get("start_seconds"),
        "limits": answer.get("limits", {}),
        "cost_micros": cost_of(usage, prices),
        "prices": dataclasses.asdict(prices),
        "inputs": [str(i) for i in (step.arguments or {}).get("artifacts") or []],
    }
    return ToolResult(
        text=json.dumps(summary, ensure_ascii=False),
        structured=summary,
        is_error=answer.get("exit_code") != 0,
        cost_micros=summary["cost_micros"],
    )


def _tail(text: str) -> str:
    if len(text) <= MODEL_TAIL:
        return text
    return f"[{len(text) - MODEL_TAIL} earlier characters cut]\n" + text[-MODEL_TAIL:]


# --- files that tools answer --------------------------------------------------------------------

FILE_TYPES = ("text/csv", "application/csv", "application/vnd.apache.parquet", "application/x-parquet")


def is_file_answer(content_type: str) -> bool:
    """An HTTP tool's answer that is a file (a CSV export), stored as an artifact, not read in."""
    return content_type.split(";")[0].strip().lower() in FILE_TYPES


def file_result(step: Step, content: bytes, content_type: str, disposition: str) -> ToolResult:
    media_type = artifacts.media_type_of(content_type) or "application/octet-stream"
    name = (
        _disposition_name(disposition)
        or f"{step.tool.remote_name if step.tool else 'file'}-{step.seq}{artifacts.UPLOAD_TYPES.get(media_type, '')}"
    )
    try:
        description = _stored_description(step, name, media_type, content)
    except artifacts.ArtifactRefused as exc:
        # The tool did answer: its file was refused, which the model is told (and nothing stored).
        return ToolResult(text=f"the tool returned a file that was not stored: {exc.message}", is_error=True)
    return ToolResult(text=artifacts.describe_text(description), structured={"artifact": description})


def _stored_description(step: Step, name: str, media_type: str, content: bytes) -> dict:
    """A file a tool returned, stored as an artifact of the step: its description for the model.
    Raises ArtifactRefused (the tenant's limits), with nothing stored."""
    stored = artifacts.store(
        run=step.run,
        step=step,
        name=name,
        media_type=media_type,
        content=content,
        source=Artifact.Source.TOOL,
    )
    return artifacts.describe(stored, content)


def with_files(step: Step, result: ToolResult) -> ToolResult:
    """An MCP result's files (embedded resources, resource links read back) stored as artifacts
    of the step; the model's text gets each one's description and id in place of its content.
    A file refused by the tenant's limits is named as refused, and nothing of it is stored."""
    notes, described = [], []
    for i, file in enumerate(result.files):
        media_type = artifacts.media_type_of(file.media_type) or (
            file.media_type.split(";")[0].strip().lower()[:100] or "application/octet-stream"
        )
        name = file.uri.rstrip("/").rsplit("/", 1)[-1].split("?")[0]
        if artifacts.check_name(name) is not None:
            name = f"{step.tool.remote_name if step.tool else 'file'}-{step.seq}-{i + 1}{artifacts.UPLOAD_TYPES.get(media_type, '')}"
        try:
            description = _stored_description(step, name, media_type, file.content)
        except artifacts.ArtifactRefused as exc:
            notes.append(f"the tool returned a file ({file.uri}) that was not stored: {exc.message}")
            continue
        described.append(description)
        notes.append(artifacts.describe_text(description))
    text = "\n\n".join([t for t in (result.text, *notes) if t])
    structured = result.structured if isinstance(result.structured, dict) else {}
    if result.structured is not None and not isinstance(result.structured, dict):
        structured = {"content": result.structured}
    return ToolResult(
        text=text,
        structured={**structured, "files": described} if described else (result.structured),
        is_error=result.is_error,
        cost_micros=result.cost_micros,
    )


def _disposition_name(disposition: str) -> str | None:
    for part in disposition.split(";"):
        key, _, value = part.strip().partition("=")
        if key.lower() == "filename":
            name = value.strip().strip('"')
            return name if artifacts.check_name(name) is None else None
    return None
