"""OpenTelemetry spans for run steps, after the GenAI semantic conventions.

Off unless an OTLP endpoint is configured (OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; the exporter reads the standard OTEL_* variables itself):
with no provider set, the API hands out non-recording spans that cost almost nothing.

A run's steps run in many tasks, on many workers, hours apart, so no span can stay open for the
whole run. Each step's span is instead a child of the run's own trace: trace id = the run id
(its 128 bits, so a trace search by run id finds every step), parent span id = derived from it.
That parent is never exported; backends show the steps under a missing root.
"""

from __future__ import annotations

import os
import uuid

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

TRACER_NAME = "agentplatform"


def configure() -> bool:
    """Export spans by OTLP/HTTP when an endpoint is configured; return whether it is."""
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    ):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; the default name
    # applies only when neither names the service.
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "agentplatform"})
    provider = TracerProvider(resource=resource)
    # Batching keeps the export off the step's path; the SDK flushes it at exit and after a fork.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def run_context(run_id) -> otel_context.Context:
    """The context whose current span is the run's (virtual) root span."""
    value = uuid.UUID(str(run_id)).int
    parent = SpanContext(
        trace_id=value,
        span_id=(value & 0xFFFF_FFFF_FFFF_FFFF) or 1,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    return trace.set_span_in_context(NonRecordingSpan(parent))
