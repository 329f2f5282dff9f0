"""What a client is told of a failure (``client_error``): a status it can act on and a message
with nothing of Ray's in it; the cause goes to the server log. The failures that mean a replica
died, stalled or lost what a request needed (``replica_failed``) are the ones the ingress
migrates (deployments/ingress/migration.py)."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.responses import JSONResponse
from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import RayServeException

from dialects.errors import APIError, from_value_error


class KVLeaseExpired(Exception):
    """No D replica took a request within its KV's lease (deployments/pd/backends.py PDBackend)."""


class ReplicaStalled(Exception):
    """The replica serving a stream gave no sign of life for too long (deployments/replicas/liveness.py)."""


class ReplicaGone(Exception):
    """A call pinned to a replica reached another one: that replica died or left (deployments/replicas/servers.py)."""


class PrefixLost(ReplicaGone):
    """A call pinned to the D replica that holds the request's prefix reached another one."""


class ChannelClosed(Exception):
    """The ingress closed the channel a request's outputs came on (deployments/replicas/output_channels.py)."""


class DecodeDown(Exception):
    """A request waited for a D replica to take its KV while none could answer
    (deployments/pd/decode_watch.py): it moves, to P alone when degradation is on."""


class NoDecodeReplica(Exception):
    """No D replica can answer and the app does not degrade to P-only decoding
    (``pd_degrade_to_prefill`` off): the request ends with a clean 503 at once."""


class NoPrefillReplica(Exception):
    """No P replica can answer and the app does not degrade to D-only serving
    (``pd_degrade_to_decode`` off): the request ends with a clean 503 at once."""


# What Ray and Serve raise when a replica died, is unreachable or lost an object; and a replica
# that did not take its KV in time or stalled mid-stream, which the ingress treats the same way.
REPLICA_FAILURES = (RayError, RayServeException, KVLeaseExpired, ReplicaStalled, ReplicaGone, DecodeDown,
                    ChannelClosed)
REPLICA_RETRY_AFTER_S = 1  # Retry-After of a 503 when a replica failed: Serve routes around it, or restarts it
logger = logging.getLogger("ray.serve")


def root_cause(error: BaseException) -> BaseException:
    """The exception a replica raised, without Ray's wrapper around it."""
    return error.cause if isinstance(error, RayTaskError) and error.cause is not None else error


def replica_failed(error: BaseException) -> bool:
    """Whether ``error`` says a replica died, is unreachable or lost an object the request needed
    (deployments/ingress/migration.py moves the request), not that the request itself was refused."""
    return isinstance(root_cause(error), REPLICA_FAILURES)


def client_error(error: BaseException) -> APIError:
    """What the client is told of ``error``; anything but a request error is logged with its cause
    (Serve's log lines carry the request id). Ray's text (exception names, pids, node addresses,
    tracebacks) never reaches a client."""
    cause = root_cause(error)
    if isinstance(cause, APIError):
        return cause
    if isinstance(cause, ValueError):  # the engines' checks of a request: "<field>: <rule>"
        return from_value_error(cause)
    logger.warning("request failed: %s: %s", type(cause).__name__, cause)
    if isinstance(cause, NoDecodeReplica):
        return APIError(503, "no decode replica is available; retry it", code="no_decode_replica",
                        retry_after=REPLICA_RETRY_AFTER_S)
    if isinstance(cause, NoPrefillReplica):
        return APIError(503, "no prefill replica is available; retry it", code="no_prefill_replica",
                        retry_after=REPLICA_RETRY_AFTER_S)
    if isinstance(cause, REPLICA_FAILURES):
        return APIError(503, "a replica serving this request failed or is unavailable; retry it",
                        code="replica_unavailable", retry_after=REPLICA_RETRY_AFTER_S)
    if isinstance(cause, TimeoutError):
        return APIError(504, "the engines did not answer in time; retry it", code="engine_timeout")
    return APIError(500, "the server failed while serving this request; its log has the cause under the "
                         "request's x-request-id", code="internal_error")


async def on_unexpected_error(_: Request, error: Exception) -> JSONResponse:
    """Any other exception out of a route, in OpenAI's shape with nothing of Ray's in it."""
    return client_error(error).response()
