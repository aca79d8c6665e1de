"""The counters and histograms processes record as they work (docs/operations.md).

prometheus_client decides at import whether values live in this process or in files under
PROMETHEUS_MULTIPROC_DIR (one per process, added up by /metrics): gunicorn workers and Celery
worker processes each record their own, so the variable must be set before they start.
Gauges of what is stored (runs by status, pending approvals, held reservations) are not kept
here: /metrics computes them from the database when scraped (agentplatform/gauges.py).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

# Calls last from milliseconds (scripted, cached) to minutes (slow tools, long completions).
CALL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

RUN_TRANSITIONS = Counter(
    "agentplatform_run_transitions",
    "Runs entering a status (reason: the stop reason, if any).",
    ["tenant", "status", "reason"],
)
STEPS = Counter(
    "agentplatform_steps",
    "Steps reaching an outcome, by kind, tool and outcome (the step status).",
    ["kind", "tool", "outcome"],
)
STEP_SECONDS = Histogram(
    "agentplatform_step_call_seconds",
    "Duration of a step's model or tool call, by kind and outcome.",
    ["kind", "outcome"],
    buckets=CALL_BUCKETS,
)
MODEL_TOKENS = Counter(
    "agentplatform_model_tokens",
    "Model tokens reported by providers, by tenant, model and type "
    "(input: uncached input; cached_input; cache_write; output).",
    ["tenant", "model", "type"],
)
SPEND = Counter(
    "agentplatform_spend_micros",
    "Settled cost in micro-units of the budget currency, by tenant and kind.",
    ["tenant", "kind"],
)
SWEEPS = Counter("agentplatform_sweeps", "Sweeper passes completed.")
CANARY_ROLLBACKS = Counter(
    "agentplatform_canary_rollbacks",
    "Canaries the platform rolled back because they did worse than the stable version (evals/canary.py).",
    ["tenant", "agent", "alias"],
)
ENGINE_ERRORS = Counter(
    "agentplatform_engine_errors",
    "Steps whose engine code raised (a bug, an illegal transition, a constraint), by exception type.",
    ["exception"],
)
SWEEPER_RECOVERIES = Counter(
    "agentplatform_sweeper_recoveries", "What the sweeper found and fixed, by kind.", ["kind"]
)
MODEL_FALLBACKS = Counter(
    "agentplatform_model_fallbacks",
    "Model calls sent to another endpoint of the version's chain than the run's previous call "
    "(reason: the failure class that moved it, circuit_open, or moved_back).",
    ["tenant", "from_endpoint", "to_endpoint", "reason"],
)
MODEL_ENDPOINT_CALLS = Counter(
    "agentplatform_model_endpoint_calls",
    "Model calls per endpoint, by outcome (answered, or the failure class).",
    ["tenant", "endpoint", "outcome"],
)
MODEL_ENDPOINT_SPEND = Counter(
    "agentplatform_model_endpoint_spend_micros",
    "Settled model cost per endpoint, in micro-units of the budget currency.",
    ["tenant", "endpoint"],
)
CIRCUIT_TRANSITIONS = Counter(
    "agentplatform_circuit_transitions",
    "Circuit breakers of model endpoints entering a state (open, half_open, closed).",
    ["tenant", "endpoint", "state"],
)
CIRCUIT_REFUSED = Counter(
    "agentplatform_circuit_refused_calls",
    "Model calls not sent because the endpoint's circuit was open (moved to a fallback or waited).",
    ["tenant", "endpoint"],
)
# run_python (tools/run_python.py), recorded by the worker that called the sandbox runner.
SANDBOX_EXECUTIONS = Counter(
    "agentplatform_sandbox_executions",
    "run_python executions by outcome (ok, error: the code's own non-zero exit, limit, busy: no "
    "slot came free, unavailable: no runner, unknown: the answer was lost) and limit hit.",
    ["outcome", "limit"],
)
# Sandbox starts take tens of milliseconds; a queue wait for a slot up to the tool's deadline.
SANDBOX_BUCKETS = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30)
SANDBOX_START_SECONDS = Histogram(
    "agentplatform_sandbox_start_seconds",
    "From the runner taking a slot to the sandboxed interpreter about to run the code.",
    buckets=SANDBOX_BUCKETS,
)
SANDBOX_QUEUE_SECONDS = Histogram(
    "agentplatform_sandbox_queue_seconds",
    "Time an execution waited in the runner for a slot (its tenant's share or any free one).",
    buckets=SANDBOX_BUCKETS,
)

# Model endpoint quotas (llm/quotas.py). Wait times are short (a quota's spacing) to minutes (a
# provider's Retry-After).
QUOTA_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
QUOTA_ADMITTED = Counter(
    "agentplatform_quota_admitted",
    "Model calls the shared endpoint quota let through, by endpoint and tenant.",
    ["endpoint", "tenant"],
)
QUOTA_WAITS = Counter(
    "agentplatform_quota_waits",
    "Model calls told to wait by the shared endpoint quota, by endpoint, tenant and what held them "
    "(requests, tokens, fair_share, retry_after).",
    ["endpoint", "tenant", "limit"],
)
QUOTA_WAIT_SECONDS = Histogram(
    "agentplatform_quota_wait_seconds",
    "Waits the shared endpoint quota gave, by what held the call.",
    ["limit"],
    buckets=QUOTA_BUCKETS,
)
QUOTA_THROTTLES = Counter(
    "agentplatform_quota_throttles",
    "Provider answers with Retry-After that paused every caller of the endpoint's account.",
    ["endpoint"],
)
QUOTA_UNAVAILABLE = Counter(
    "agentplatform_quota_unavailable",
    "Quota checks that could not reach Redis: the call went ahead unlimited.",
)
