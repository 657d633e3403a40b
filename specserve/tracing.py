"""OpenTelemetry tracing for the router, drafter and target (and W3C trace context helpers).

Configured the standard way, from the environment of each process:

* ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), e.g.
  ``http://collector:4317``: spans go there over OTLP/gRPC through a ``BatchSpanProcessor``
  (``OTEL_BSP_*`` tune it; ``OTEL_EXPORTER_OTLP_HEADERS`` / ``_INSECURE`` / ``_CERTIFICATE``
  ... are read by the exporter itself);
* ``OTEL_TRACES_EXPORTER``: ``otlp`` (default), ``console`` (stdout, for debugging),
  ``none``; ``OTEL_SDK_DISABLED=true`` turns everything off;
* ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (the SDK's own handling; default
  ``parentbased_always_on``: a request traced by its client is traced here too);
* ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``; without a service name each
  component names itself (``specserve-router``, ``specserve-drafter``, ``specserve-target``).

When no exporter is configured, tracing is off: ``tracer()`` returns None and every call
site skips its span work behind that one check, so tracing off costs nothing measurable.

The spans are created with explicit parents (never "current span" attach/detach): the
router's round loop is an async generator whose ``yield`` would break context tokens.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

INSTRUMENTATION = "specserve"
TRACEPARENT = "traceparent"

_tracer: Tracer | None = None  # None: tracing off
_provider: TracerProvider | None = None


def tracer() -> Tracer | None:
    """The process's tracer, or None when tracing is off (the hot-path check)."""
    return _tracer


def provider() -> TracerProvider | None:
    return _provider


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() == "true"


def _resource(service_name: str, replica: str | None):
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    component = service_name.removeprefix("specserve-")
    attrs: dict[str, str] = {"specserve.component": component}
    if replica:
        attrs["specserve.replica"] = replica
    env_attrs = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    named = os.environ.get("OTEL_SERVICE_NAME") or any(
        kv.split("=", 1)[0].strip() == SERVICE_NAME for kv in env_attrs.split(","))
    if not named:  # the standard variables win; else each component names itself
        attrs[SERVICE_NAME] = service_name
    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME over `attrs`.
    return Resource.create(attrs)


def setup_tracing(service_name: str, *, endpoint: str | None = None,
                  replica: str | None = None,
                  exporter: SpanExporter | None = None) -> bool:
    """Configure this process's tracing from the OTEL_* environment; True if it is on.

    ``endpoint`` (an explicit OTLP/gRPC endpoint, e.g. from the app config) overrides the
    environment's. ``exporter`` (tests) is used with a synchronous processor instead.
    Calling it again replaces the previous provider (which is shut down)."""
    exporters = {e.strip().lower()
                 for e in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
    if _env_true("OTEL_SDK_DISABLED") or ("none" in exporters and exporter is None):
        use_provider(None)
        return False
    endpoint = (endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    want_otlp = "otlp" in exporters and bool(endpoint)
    if exporter is None and not want_otlp and "console" not in exporters:
        use_provider(None)
        return False

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    # sampler=None: the SDK reads OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG
    prov = TracerProvider(resource=_resource(service_name, replica))
    if exporter is not None:
        prov.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        if want_otlp:
            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
            if protocol != "grpc":
                log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: specserve exports OTLP over gRPC "
                            "only; using grpc", protocol)
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            prov.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        if "console" in exporters:
            prov.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    use_provider(prov)
    log.info("tracing on: service %s, endpoint %s", service_name, endpoint or "-")
    return True


def use_provider(prov: TracerProvider | None, *, shutdown_previous: bool = True) -> None:
    """Install ``prov`` as this process's tracer provider (None: tracing off). The previous
    provider, if any and different, is shut down (its spans flushed) unless told not to."""
    global _tracer, _provider
    old = _provider
    _provider = prov
    _tracer = prov.get_tracer(INSTRUMENTATION) if prov is not None else None
    if shutdown_previous and old is not None and old is not prov:
        old.shutdown()


def force_flush(timeout_ms: int = 10_000) -> bool:
    return _provider.force_flush(timeout_ms) if _provider is not None else True


# ----------------------------------------------------------------------- W3C context
def _propagator():
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    global _PROPAGATOR
    if _PROPAGATOR is None:
        _PROPAGATOR = TraceContextTextMapPropagator()
    return _PROPAGATOR


_PROPAGATOR = None


def traceparent_of(span: Span | None) -> str:
    """The W3C ``traceparent`` of ``span`` ("" for None or an invalid span): what goes into
    ``ProposeRequest.traceparent`` / ``VerifyRequest.traceparent``."""
    if span is None:
        return ""
    sc = span.get_span_context()
    if not sc.is_valid:
        return ""
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


_TRACEPARENT_V00 = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def context_from_traceparent(traceparent: str, tracestate: str = "") -> Context | None:
    """The remote parent context carried by a ``traceparent`` (None if empty or invalid).
    A plain version-00 value (what the router sends every round) is parsed directly; any
    other (a ``tracestate``, a future version) goes through the W3C propagator."""
    if not traceparent:
        return None
    m = None if tracestate else _TRACEPARENT_V00.fullmatch(traceparent)
    if m is not None:
        from opentelemetry import trace

        trace_id, span_id = int(m[1], 16), int(m[2], 16)
        if not trace_id or not span_id:
            return None
        sc = trace.SpanContext(trace_id, span_id, is_remote=True,
                               trace_flags=trace.TraceFlags(int(m[3], 16)))
        return trace.set_span_in_context(trace.NonRecordingSpan(sc))
    carrier = {TRACEPARENT: traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    ctx = _propagator().extract(carrier)
    from opentelemetry import trace

    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def context_from_metadata(metadata: Iterable[tuple[str, str]] | None) -> Context | None:
    """The client's trace context from gRPC invocation metadata (``traceparent`` key)."""
    if not metadata:
        return None
    parent = state = ""
    for key, value in metadata:
        if key == TRACEPARENT:
            parent = value
        elif key == "tracestate":
            state = value
    return context_from_traceparent(parent, state)


def parent_context(span: Span) -> Context:
    from opentelemetry import trace

    return trace.set_span_in_context(span)
