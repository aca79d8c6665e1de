"""The counters and histograms processes record as they work (docs/operations.md).

prometheus_client decides at import whether values live in this process or in files under
PROMETHEUS_MULTIPROC_DIR (one per process, added up by /metrics): gunicorn workers and Celery
worker processes each record their own, so the variable must be set before they start.
Gauges of what is stored (runs by status, pending approvals, held reservations) are not kept
here: /metrics computes them from the database when scraped (observability/collector.py).
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
ENGINE_ERRORS = Counter(
    "agentplatform_engine_errors",
    "Steps whose engine code raised (a bug, an illegal transition, a constraint), by exception type.",
    ["exception"],
)
SWEEPER_RECOVERIES = Counter(
    "agentplatform_sweeper_recoveries", "What the sweeper found and fixed, by kind.", ["kind"]
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
