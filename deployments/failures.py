"""The serving system's failures, in its own types: the ones that mean a replica died, stalled or
lost what a request needed (``replica_failed``) are the ones the ingress migrates
(deployments/ingress/migration.py). Nothing here knows a dialect: what a client is told of each
failure is the edge's mapping (deployments/ingress/engine_client.py ``client_error``)."""

from __future__ import annotations

from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import RayServeException


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


class ChannelFailed(Exception):
    """The call carrying a replica's channel failed in transport (deployments/replicas/output_channels.py):
    its requests' outputs cannot be read there, so they move."""


class DecodeDown(Exception):
    """A request waited for a D replica to take its KV while none could answer
    (deployments/pd/decode_watch.py): it moves, to P alone when degradation is on."""


class NoDecodeReplica(Exception):
    """No D replica can answer and the app does not degrade to P-only decoding
    (``pd_degrade_to_prefill`` off): the request ends with a clean 503 at once."""


class NoPrefillReplica(Exception):
    """No P replica can answer and the app does not degrade to D-only serving
    (``pd_degrade_to_decode`` off): the request ends with a clean 503 at once."""



class LateReplacement(Exception):
    """A migrated request's replacement did not answer before the request's deadline
    (deployments/ingress/request_flow.py): a clean 503, never a hang."""


class DeadlineBeforeFirstToken(Exception):
    """The request's timeout passed before its first token (the first-token rule,
    deployments/ingress/request_flow.py ``started``): a 408 before any byte."""


class RateLimited(Exception):
    """A key past one of its per-minute limits (deployments/ingress/rate_limits.py): a 429; the
    message says which limit, ``retry_after`` when the window has room (whole seconds)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RateCounterDown(Exception):
    """The shared per-key rate counter does not answer (deployments/ingress/rate_limits.py): a 503."""

# What Ray and Serve raise when a replica died, is unreachable or lost an object; and a replica
# that did not take its KV in time or stalled mid-stream, which the ingress treats the same way.
REPLICA_FAILURES = (RayError, RayServeException, KVLeaseExpired, ReplicaStalled, ReplicaGone, DecodeDown,
                    ChannelClosed, ChannelFailed)
REPLICA_RETRY_AFTER_S = 1  # Retry-After of a 503 when a replica failed: Serve routes around it, or restarts it


def root_cause(error: BaseException) -> BaseException:
    """The exception a replica raised, without Ray's wrapper around it."""
    return error.cause if isinstance(error, RayTaskError) and error.cause is not None else error


def replica_failed(error: BaseException) -> bool:
    """Whether ``error`` says a replica died, is unreachable or lost an object the request needed
    (deployments/ingress/migration.py moves the request), not that the request itself was refused."""
    return isinstance(root_cause(error), REPLICA_FAILURES)
