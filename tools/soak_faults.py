"""The soak's faults: the kill matrix's list (tools/faults.py) plus a stopped P and a stuck engine
step, each injected for real and proven, with the seconds until the role was whole again (the time
to detect a stall is read from the clients' streams: tools/soak.py).

Each fault returns a dict: ``kind``, ``at`` (monotonic seconds), ``proof``, ``proven``,
``recovered_s`` (the role back to its replica count), ``until`` (the fault's window ends).
"""

from __future__ import annotations

import random
import signal
import time

import psutil

from tests.serving import call_replica, replica_process, replicas, sigkill, wait_until

STOP_S = 8.0  # how long a SIGSTOPped replica stays stopped: past stall_timeout_s, under the kv lease's 3 moves
HANG_S = 45.0  # a stuck step's bound: Serve replaces the replica long before (step_timeout_s + health checks)
RECOVERY_BOUND_S = 180.0
DISCONNECTS = 6  # clients of a disconnect burst, each leaving after two events


def roles(app_kind: str) -> tuple[str, ...]:
    return ("PrefillServer", "DecodeServer") if app_kind == "pd" else ("LLMServer",)


def kinds(app_kind: str) -> list[str]:
    """Fault kinds for the app: what its roles allow (P's faults only in PD)."""
    engine = "DecodeServer" if app_kind == "pd" else "LLMServer"
    out = [f"SIGKILL {engine}", f"SIGSTOP {engine}", f"stuck step {engine}", "clients disconnect"]
    if app_kind == "pd":
        out += ["SIGKILL PrefillServer", "SIGSTOP PrefillServer"]
    return out


class FaultInjector:
    """Injects one fault of a kind, on ``app`` (a Serve app name) served at ``url``. ``disconnect``:
    called with a count, sends that many streams whose clients leave mid-stream (the load's client)."""

    def __init__(self, url: str, app: str, app_kind: str, rng: random.Random, disconnect=None) -> None:
        self.url, self.app, self.app_kind, self.rng, self.disconnect = url, app, app_kind, rng, disconnect
        self.full = {role: len(replicas(role, app)) for role in roles(app_kind)}

    def inject(self, kind: str) -> dict:
        verb, _, role = kind.partition(" ")
        started = time.monotonic()
        fault = {"kind": kind, "at": started, "proven": False, "recovered_s": None}
        if kind == "clients disconnect":
            left = self.disconnect(DISCONNECTS)
            fault.update(proof=f"{left} of {DISCONNECTS} clients left mid-stream", proven=left > 0)
        elif verb == "SIGKILL":
            self._kill(role, fault)
        elif verb == "SIGSTOP":
            self._stop(role, fault)
        else:
            self._stuck_step(kind.rsplit(" ", 1)[1], fault)
        if verb in ("SIGKILL", "stuck"):
            role = role.split()[-1]
            # Serve's status still counts a killed replica RUNNING until its controller notices: wait for that first
            wait_until(lambda: self._running(role) < self.full[role], 30, 0.2)
            whole = wait_until(lambda: self._running(role) >= self.full[role], RECOVERY_BOUND_S, 0.5)
            fault["recovered_s"] = round(time.monotonic() - started, 2) if whole else None
        fault["until"] = time.monotonic()
        return fault

    def _running(self, role: str) -> int:
        """The role's replicas Serve says are RUNNING (a replacement is registered long before it serves)."""
        from ray import serve

        return serve.status().applications[self.app].deployments[role].replica_states.get("RUNNING", 0)

    def _victim(self, role: str) -> str:
        """The replica serving the most streams now (ties: at random), so that the fault hits requests."""
        names = sorted(replicas(role, self.app))
        streams = {}
        for name in names:
            try:
                streams[name] = call_replica(name, "holdings")["streams"]
            except Exception:  # not answering (stopped, being replaced): not a victim
                pass
        if not streams:
            return self.rng.choice(names)
        most = max(streams.values())
        return self.rng.choice([n for n in streams if streams[n] == most])

    def _kill(self, role: str, fault: dict) -> None:
        name = self._victim(role)
        process = replica_process(name)
        sigkill(process)  # waits until the process is gone
        gone = wait_until(lambda: name not in replicas(role, self.app), 60, 0.2)
        fault.update(proof=f"pid {process.pid} gone, replica {name.rsplit('#', 1)[-1]} "
                           f"{'gone from' if gone else 'still in'} Ray's registry", proven=not process.is_running())

    def _stop(self, role: str, fault: dict) -> None:
        process = replica_process(self._victim(role))
        process.send_signal(signal.SIGSTOP)  # no /metrics while it is stopped: the ingress would ask it
        try:
            stopped = wait_until(lambda: process.status() == psutil.STATUS_STOPPED, 10, 0.01)
            fault.update(proof=f"pid {process.pid} {process.status()} for {STOP_S:g} s, then SIGCONT", proven=stopped)
            time.sleep(max(0.0, fault["at"] + STOP_S - time.monotonic()))
        finally:
            process.send_signal(signal.SIGCONT)

    def _stuck_step(self, role: str, fault: dict) -> None:
        name = self._victim(role)
        call_replica(name, "hang_next_step", HANG_S)
        replaced = wait_until(lambda: name not in replicas(role, self.app), HANG_S, 0.2)
        fault.update(proof=f"replica {name.rsplit('#', 1)[-1]}'s step hung; "
                           f"{'Serve stopped it' if replaced else 'not replaced'} "
                           f"{time.monotonic() - fault['at']:.1f} s after", proven=replaced)
