"""PNG plots of load-test runs: latency CDFs, TTFT by priority, rate sweeps and SLO attainment."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def write_plots(directory: Path, runs: list[dict]) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = [_latency_cdfs(directory, runs[-1]), _ttft_by_priority(directory, runs[-1])]
    if len(runs) > 1:
        written.append(_sweep(directory, runs))
    if len(runs) > 1 and "slo_attainment" in runs[0]:
        written.append(slo_attainment_plot(directory / "slo_attainment.png", {"this app": runs}, "SLO attainment"))
    return written


def slo_attainment_plot(path: Path, runs_by_app: dict[str, list[dict]], title: str) -> Path:
    """One panel per (TTFT, TPOT) SLO pair (TTFT down the rows, TPOT across the columns): the share
    of requests meeting both against the offered rate, one line per app, and the 90% line goodput
    is read at. ``runs_by_app``: each app's sweep runs, each with request_rate and slo_attainment."""
    pairs = [(a["ttft_ms"], a["tpot_ms"]) for a in next(iter(runs_by_app.values()))[0]["slo_attainment"]]
    ttfts, tpots = sorted({t for t, _ in pairs}), sorted({t for _, t in pairs})
    fig, axes = plt.subplots(len(ttfts), len(tpots), figsize=(4 * len(tpots), 3 * len(ttfts)), squeeze=False,
                             sharex=True, sharey=True)
    for i, (ttft, tpot) in enumerate(pairs):
        ax = axes[ttfts.index(ttft)][tpots.index(tpot)]
        for app, runs in runs_by_app.items():
            ax.plot([r["request_rate"] for r in runs], [r["slo_attainment"][i]["attainment"] for r in runs], "o-",
                    label=app, markersize=3)
        ax.axhline(0.9, color="grey", linestyle="--", linewidth=0.8)
        ax.set(title=f"TTFT {ttft / 1000:g} s, TPOT {tpot:g} ms", ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("offered rate (req/s)")
    for row in axes:
        row[0].set_ylabel("SLO attainment")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def _latency_cdfs(directory: Path, run: dict) -> Path:
    done = [r for r in run["_results"] if r.ok]
    series = {"TTFT": [r.ttft for r in done], "TPOT": [r.tpot for r in done if r.tpot is not None],
              "ITL": [g for r in done for g in r.itl], "E2E": [r.e2el for r in done]}
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, (name, values) in zip(axes, series.items()):
        values = np.sort(np.asarray(values) * 1000.0)
        if len(values):
            ax.plot(values, np.arange(1, len(values) + 1) / len(values))
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests" if name == "TTFT" else None)
        ax.grid(alpha=0.3)
    return _save(fig, directory / "latency_cdf.png")


def _ttft_by_priority(directory: Path, run: dict) -> Path:
    done = [r for r in run["_results"] if r.ok]
    priorities = sorted({r.work.priority for r in done})
    fig, ax = plt.subplots(figsize=(6, 4))
    if priorities:
        ax.boxplot([[r.ttft * 1000.0 for r in done if r.work.priority == p] for p in priorities],
                   tick_labels=[str(p) for p in priorities])
    ax.set(title="TTFT by priority (1 is served first)", xlabel="priority", ylabel="TTFT (ms)")
    ax.grid(alpha=0.3)
    return _save(fig, directory / "ttft_by_priority.png")


def _sweep(directory: Path, runs: list[dict]) -> Path:
    rates = [r["request_rate"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(rates, [r["request_throughput"] for r in runs], "o-", label="throughput")
    if "request_goodput" in runs[0]:
        axes[0].plot(rates, [r["request_goodput"] for r in runs], "s-", label="goodput")
    axes[0].set(title="requests/s", xlabel="offered rate (req/s)")
    axes[0].legend()
    for ax, metric in ((axes[1], "ttft"), (axes[2], "tpot")):
        ax.plot(rates, [r[f"p99_{metric}_ms"] for r in runs], "o-")
        ax.set(title=f"p99 {metric.upper()} (ms)", xlabel="offered rate (req/s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    return _save(fig, directory / "sweep.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
