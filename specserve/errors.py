"""The one exception hierarchy of a request's failures, shared by the CLI, the single-process
engine and the service's ingress. Each class names the gRPC status it maps to (by name: this
module imports no gRPC); ``specserve.grpc_api.status_of`` is the one mapping to status codes,
the CLI maps ``RequestError`` to a usage error (exit 2).
"""

from __future__ import annotations


class ServiceError(Exception):
    """A request failed for a reason the caller is told (``code``: a gRPC status name)."""

    code = "INTERNAL"


class RequestError(ServiceError, ValueError):
    """The request cannot be served as given; the message names the field and what to do."""

    code = "INVALID_ARGUMENT"


class OutOfRange(RequestError):
    """prompt + max_tokens exceed the model's context."""

    code = "OUT_OF_RANGE"


class Overloaded(ServiceError):
    """The service is at its admission limit; retry later or elsewhere."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(ServiceError, ConnectionError):
    """No target replica answered after the retries."""

    code = "UNAVAILABLE"


class ProposerFailed(ServiceError):
    """The drafter failed; the request continues without speculation (never surfaced)."""

    code = "UNAVAILABLE"


class Unauthenticated(ServiceError):
    """No API key, or one the service does not know (public API and data plane)."""

    code = "UNAUTHENTICATED"


class PermissionDenied(ServiceError):
    """The caller is known but may not do this."""

    code = "PERMISSION_DENIED"


class AlreadyExists(ServiceError):
    """A request id the caller already used for a request with other content."""

    code = "ALREADY_EXISTS"


class DeadlineExceeded(ServiceError):
    """The caller's deadline passed; the request was stopped."""

    code = "DEADLINE_EXCEEDED"


class Cancelled(ServiceError):
    """The caller went away or cancelled; the request was stopped."""

    code = "CANCELLED"


class DataLoss(ServiceError):
    """A resumed request regenerated tokens that differ from the ones already delivered
    (determinism broken, e.g. another model revision): never answered as if whole."""

    code = "DATA_LOSS"
