"""Whether Ray Serve is draining this replica (scale-down, a redeploy, a replica replaced).

Ray Serve 2.60 tells a replica's code nothing before the drain ends: ``Replica.
_perform_graceful_shutdown`` sets ``_shutting_down``, waits until no call is ongoing (at most
``graceful_shutdown_timeout_s``), and only then runs the user's ``__del__``. The controller has
already stopped routing new calls to the replica by then. So the one signal is that internal
flag, read here and nowhere else; tests/test_kv_moves.py reads Ray's source and fails if Ray
renames it or stops setting it before the drain's wait.

A D replica that sees it moves its running requests to other D replicas (deployments/replicas/servers.py).
"""

from __future__ import annotations

import ray


def serve_draining() -> bool:
    """True once Serve has begun to shut this replica down; False outside a Serve replica."""
    worker = ray._private.worker.global_worker
    replica_actor = worker.actors.get(worker.actor_id)  # this process's actor instance: Serve's ReplicaActor
    replica = getattr(replica_actor, "_replica_impl", None)
    return bool(getattr(replica, "_shutting_down", False))
