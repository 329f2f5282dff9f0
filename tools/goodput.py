"""Goodput as DistServe defines it: the highest request rate at which at least 90% of requests
meet both a TTFT and a TPOT SLO, over a grid of SLO pairs, from a sweep of offered rates.

A request attains an SLO pair when it completed and its TTFT <= the TTFT SLO and its TPOT <= the
TPOT SLO (a one-token output has no TPOT and is judged on TTFT alone, as vLLM's goodput does). A
request that failed attains nothing: attainment is over every request sent, not only those that
completed, so an app cannot raise its attainment by refusing work.

Goodput of one SLO pair, from the attainment at each swept rate (ascending):
- ``goodput_swept``: the highest swept rate such that it and every lower swept rate attain
  (>= 90%); a dip below 90% ends the search even if a higher rate attains again (noise above
  saturation is not capacity).
- ``goodput_interpolated``: from there, linear interpolation of attainment to the rate where it
  crosses 90% between the last attaining rate and the first that misses.
- ``bound``: "within" when the sweep has a missing rate above an attaining one; "above" when every
  swept rate attains (the goodput is at least the highest rate: sweep further); "below" when even
  the lowest swept rate misses (goodput 0: sweep lower, or the SLO is out of reach).
"""

from __future__ import annotations

from dataclasses import dataclass

from tools.clients import Result

ATTAINMENT_TARGET = 0.9  # DistServe's 90%
DEFAULT_SLO_GRID = "ttft:1000,2000,4000 tpot:30,50,100"  # milliseconds


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float

    @property
    def label(self) -> str:
        return f"TTFT {self.ttft_ms / 1000:g} s, TPOT {self.tpot_ms:g} ms"


def parse_slo_grid(spec: str) -> list[Slo]:
    """'ttft:1000,2000 tpot:30,50' -> every (TTFT, TPOT) pair, TPOT-major: [Slo(1000, 30), Slo(2000, 30), ...]."""
    axes: dict[str, list[float]] = {}
    for item in spec.split():
        name, _, values = item.partition(":")
        if name not in ("ttft", "tpot") or name in axes or not values:
            raise ValueError(f"--slo-grid {item!r}: expected 'ttft:MS,MS,... tpot:MS,MS,...', each axis once")
        try:
            axes[name] = [float(v) for v in values.split(",")]
        except ValueError:
            raise ValueError(f"--slo-grid {item!r}: values are milliseconds, comma-separated") from None
        if any(v <= 0 for v in axes[name]):
            raise ValueError(f"--slo-grid {item!r}: SLOs must be > 0 ms")
    if set(axes) != {"ttft", "tpot"}:
        raise ValueError(f"--slo-grid {spec!r}: needs both a ttft: and a tpot: axis")
    return [Slo(ttft, tpot) for tpot in axes["tpot"] for ttft in axes["ttft"]]


def meets(result: Result, slo: Slo) -> bool:
    """Completed, TTFT <= the TTFT SLO and TPOT <= the TPOT SLO (no TPOT: one output token)."""
    if not result.ok:
        return False
    tpot = result.tpot
    return result.ttft * 1000.0 <= slo.ttft_ms and (tpot is None or tpot * 1000.0 <= slo.tpot_ms)


def attainment(results: list[Result], grid: list[Slo]) -> list[dict]:
    """For each SLO pair, the fraction of ``results`` (every request sent) that met both SLOs."""
    return [{"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms,
             "attainment": sum(meets(r, slo) for r in results) / len(results) if results else 0.0}
            for slo in grid]


def goodput(rates: list[float], attained: list[float], target: float = ATTAINMENT_TARGET) -> dict:
    """One SLO pair's goodput from its attainment at each swept rate (see the module docstring)."""
    points = sorted(zip(rates, attained))
    swept, last = 0.0, None  # last: the (rate, attainment) of the highest attaining rate so far
    for rate, value in points:
        if value < target:
            if last is None:
                return {"goodput_swept": 0.0, "goodput_interpolated": 0.0, "bound": "below"}
            (r0, a0), (r1, a1) = last, (rate, value)
            crossing = r0 + (a0 - target) / (a0 - a1) * (r1 - r0)  # a0 >= target > a1
            return {"goodput_swept": swept, "goodput_interpolated": round(crossing, 3), "bound": "within"}
        swept, last = rate, (rate, value)
    return {"goodput_swept": swept, "goodput_interpolated": swept, "bound": "above"}


def goodput_by_slo(runs: list[dict]) -> list[dict]:
    """Goodput per SLO pair from sweep runs that each carry ``request_rate`` and ``slo_attainment``."""
    rates = [run["request_rate"] for run in runs]
    table = []
    for i, pair in enumerate(runs[0]["slo_attainment"]):
        attained = [run["slo_attainment"][i]["attainment"] for run in runs]
        table.append({"ttft_ms": pair["ttft_ms"], "tpot_ms": pair["tpot_ms"], **goodput(rates, attained)})
    return table


def print_goodput_table(by_app: dict[str, list[dict]], title: str) -> None:
    """Goodput (interpolated, req/s) per SLO pair, one column per app, and each app's ratio to colocated."""
    apps = list(by_app)
    others = [a for a in apps if a != "colocated" and "colocated" in by_app]
    print(f"\n{title}: goodput req/s (interpolated; '>' every swept rate attains, '<' none does)")
    print(f"{'TTFT s':>7}{'TPOT ms':>9}" + "".join(f"{a:>12}" for a in apps) + "".join(f"{a + '/co':>14}" for a in others))
    for i, pair in enumerate(by_app[apps[0]]):
        cells = {a: by_app[a][i] for a in apps}
        shown = "".join(f"{_mark(cells[a]) + format(cells[a]['goodput_interpolated'], '.2f'):>12}" for a in apps)
        co = cells["colocated"]["goodput_interpolated"] if others else 0.0
        ratios = "".join(f"{cells[a]['goodput_interpolated'] / co if co else float('nan'):>14.2f}" for a in others)
        print(f"{pair['ttft_ms'] / 1000:>7g}{pair['tpot_ms']:>9g}{shown}{ratios}")


def _mark(cell: dict) -> str:
    return {"above": ">", "below": "<"}.get(cell["bound"], "")
