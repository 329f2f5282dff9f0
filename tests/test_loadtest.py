"""The load tester against a live app: a few seconds of load, every request accounted for."""

import json

import pytest

from tests.serving import openai_apps
from tools.clients import Result
from tools.goodput import Slo, attainment, goodput, goodput_by_slo, parse_slo_grid
from tools.loadgen import Work, arrival_gaps, arrival_offsets
from tools.loadtest import main as loadtest

VLLM_FIELDS = {"completed", "failed", "request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms",
               "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
               "median_ttft_ms", "p90_ttft_ms", "request_goodput", "total_input_tokens", "total_output_tokens",
               "duration", "errors", "per_priority"}


@pytest.fixture(scope="module")
def base_url():
    return f"{openai_apps()}/pd"  # the suite's kept PD app


@pytest.mark.parametrize("endpoint,load", [("infer_token", ["--request-rate", "20", "--sample-replicas", "0.1"]),
                                           ("chat", ["--concurrency", "4"]),
                                           ("completions", ["--request-rate", "30", "--burstiness", "0.5"])])
def test_short_load_accounts_for_every_request(base_url, tmp_path, endpoint, load):
    out = tmp_path / "result.json"
    args = ["--base-url", base_url, "--endpoint", endpoint, "--num-requests", "12", "--duration", "300",
            "--input-len", "16:32", "--output-len", "8", "--priority-mix", "1:0.5,5:0.5", "--seed", "3",
            "--goodput", "ttft:60000", "tpot:60000", "--warmup", "1", "--json", str(out), "--plot",
            str(tmp_path / "plots"), "--quiet", *load]
    loadtest(args)
    result = json.loads(out.read_text())
    assert VLLM_FIELDS <= set(result)
    assert result["completed"] == 12 and result["failed"] == 0 and result["errors"] == {}
    assert result["total_output_tokens"] == 12 * 8  # ignore_eos: every output has its asked length
    assert 0 < result["mean_ttft_ms"] <= result["p99_ttft_ms"] < result["p99_e2el_ms"]
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert set(result["per_priority"]) == {"1", "5"}
    assert sum(r["completed"] for r in result["per_priority"].values()) == 12
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"latency_cdf.png", "ttft_by_priority.png"}
    if "--sample-replicas" in load:  # read during the load, and once as it ends
        last = result["replicas"]["samples"][-1]
        assert last["PrefillServer"] == last["DecodeServer"] == 1 and last["Ingress"] == 1
        assert result["replicas"].get("mean_pd_ratio", 1.0) == 1.0
    else:
        assert "replicas" not in result


def test_sweep_writes_one_run_per_rate_and_its_plot(base_url, tmp_path):
    out = tmp_path / "sweep.json"
    loadtest(["--base-url", base_url, "--num-requests", "6", "--input-len", "16", "--output-len", "4",
              "--sweep", "10,40", "--warmup", "0", "--json", str(out), "--plot", str(tmp_path), "--quiet",
              "--slo-grid", "ttft:1e9,1e-6 tpot:1e9"])  # met and missed by construction, not by timing
    output = json.loads(out.read_text())
    runs = output["sweep"]
    assert [r["request_rate"] for r in runs] == [10.0, 40.0] and all(r["completed"] == 6 for r in runs)
    assert (tmp_path / "sweep.png").stat().st_size > 0
    # 1e9 ms (eleven days) meets every request at every rate; a nanosecond none
    assert [[a["attainment"] for a in r["slo_attainment"]] for r in runs] == [[1.0, 0.0], [1.0, 0.0]]
    assert [(g["goodput_swept"], g["bound"]) for g in output["goodput_by_slo"]] == [(40.0, "above"), (0.0, "below")]
    assert (tmp_path / "slo_attainment.png").stat().st_size > 0


def test_only_loopback_targets_unless_allowed():
    with pytest.raises(SystemExit, match="not a loopback address"):
        loadtest(["--base-url", "http://10.1.2.3:8000", "--num-requests", "1"])


def _result(ttft_s: float, tpot_s: float, tokens: int = 5, status: int = 200) -> Result:
    """A recorded request: TTFT, then ``tokens - 1`` gaps of ``tpot_s``."""
    return Result(Work(0, [1], "", tokens, 5), status=status, ttft=ttft_s, e2el=ttft_s + tpot_s * (tokens - 1),
                  output_tokens=tokens)


def test_attainment_counts_a_request_only_when_it_meets_both_slos():
    results = [_result(0.9, 0.020),  # meets every pair
               _result(1.1, 0.020),  # misses TTFT 1 s
               _result(0.5, 0.040),  # misses TPOT 30 ms
               _result(2.0, 0.010),  # TTFT exactly 2 s: meets 2 s (<=), misses 1 s
               _result(0.2, 0.500, tokens=1),  # one token: no TPOT, judged on TTFT alone
               _result(0.1, 0.010, status=500)]  # failed: attains nothing, still counted
    grid = parse_slo_grid("ttft:1000,2000 tpot:30,50")
    assert grid == [Slo(1000, 30), Slo(2000, 30), Slo(1000, 50), Slo(2000, 50)]
    got = {(a["ttft_ms"], a["tpot_ms"]): a["attainment"] for a in attainment(results, grid)}
    assert got == {(1000, 30): 2 / 6, (2000, 30): 4 / 6, (1000, 50): 3 / 6, (2000, 50): 5 / 6}


def test_goodput_is_the_rate_where_attainment_crosses_90_percent():
    within = goodput([16, 2, 8, 4], [0.2, 1.0, 0.85, 0.95])  # any order
    assert within == {"goodput_swept": 4, "goodput_interpolated": 6.0, "bound": "within"}  # 4 + 0.05 / 0.1 * 4
    dip = goodput([1, 2, 3], [1.0, 0.8, 0.95])  # a miss ends the search: 3 is not its goodput
    assert dip == {"goodput_swept": 1, "goodput_interpolated": 1.5, "bound": "within"}
    assert goodput([2, 4], [1.0, 0.9]) == {"goodput_swept": 4, "goodput_interpolated": 4, "bound": "above"}
    assert goodput([2, 4], [0.89, 0.5]) == {"goodput_swept": 0.0, "goodput_interpolated": 0.0, "bound": "below"}


def test_goodput_by_slo_reads_each_pair_across_the_sweep():
    def run(rate, first, second):
        return {"request_rate": rate, "slo_attainment": [{"ttft_ms": 1000, "tpot_ms": 30, "attainment": first},
                                                         {"ttft_ms": 2000, "tpot_ms": 30, "attainment": second}]}

    table = goodput_by_slo([run(2, 0.95, 1.0), run(4, 0.7, 0.92)])
    assert [(t["ttft_ms"], t["goodput_interpolated"], t["bound"]) for t in table] == \
        [(1000, 2.4, "within"), (2000, 4, "above")]  # 2 + 0.05 / 0.25 * 2


@pytest.mark.parametrize("spec", ["ttft:1000", "ttft:1000 tpot:", "ttft:1000 tpot:0", "ttft:1 ttft:2 tpot:3",
                                  "e2el:5 tpot:3", "ttft:a tpot:3"])
def test_a_bad_slo_grid_is_refused(spec):
    with pytest.raises(SystemExit):
        loadtest(["--slo-grid", spec])


def test_arrival_offsets_add_up_the_gaps_from_the_first_arrival():
    gaps = arrival_gaps(4.0, 0.5, 7)
    first, second = next(gaps), next(gaps)
    assert arrival_offsets(4.0, 0.5, 7, 3) == [0.0, first, first + second]
    assert arrival_offsets(float("inf"), 1.0, 0, 3) == [0.0, 0.0, 0.0]  # all at once
