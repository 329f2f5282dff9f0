"""The load tester against a live app: a few seconds of load, every request accounted for."""

import json

import pytest

from benchmarks.loadtest import main as loadtest
from tests.serving import openai_apps

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
              "--sweep", "10,40", "--warmup", "0", "--json", str(out), "--plot", str(tmp_path), "--quiet"])
    runs = json.loads(out.read_text())["sweep"]
    assert [r["request_rate"] for r in runs] == [10.0, 40.0] and all(r["completed"] == 6 for r in runs)
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_only_loopback_targets_unless_allowed():
    with pytest.raises(SystemExit, match="not a loopback address"):
        loadtest(["--base-url", "http://10.1.2.3:8000", "--num-requests", "1"])
