"""Replaying Mooncake-format traces: prompts from hash ids, the schedule, the report, and a replay
against a live app whose engines must see the trace's shared prefixes as prefix-cache hits."""

import json
import os
from pathlib import Path
import shutil
import subprocess
import sys

import httpx
import pytest

from engine.execution.tiny_model import ensure_tiny_model
from tests.serving import openai_apps
from tools.clients import Result
from tools.loadgen import Work
from tools.loadtest import build_result, main as loadtest, parse_args
from tools.make_trace import main as make_trace, multi_turn
from tools.prefix_hits import prefix_counters, prefix_hit_report
from tools.trace import (TraceRecord, block_reuse, block_token_ids, prompt_text, prompt_token_ids, read_trace,
                         send_offsets, trace_rate)

TRACES = Path(__file__).parent / "traces"
# How tests/traces/ was written (docs/loadtest.md): the same command must write the same bytes.
SMALL_TRACE_ARGS = ["--block-size", "32", "--sessions", "4", "--turns", "6", "--system-tokens", "256",
                    "--user-tokens", "16:32", "--output-tokens", "8", "--session-gap-ms", "500", "--think-ms", "3000"]
TOKENS = (3, 800)


def _blocks(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def test_equal_hash_ids_build_equal_blocks_and_different_ids_different_ones():
    a = TraceRecord(0, 4 * 16 + 5, 1, (7, 8, 9, 10, 11))  # four full blocks of 16, the fifth 5 tokens
    b = TraceRecord(0, 3 * 16, 1, (7, 8, 12))
    ids_a, ids_b = prompt_token_ids(a, 16, TOKENS), prompt_token_ids(b, 16, TOKENS)
    assert len(ids_a) == 69 and len(ids_b) == 48
    blocks_a, blocks_b = _blocks(ids_a, 16), _blocks(ids_b, 16)
    assert blocks_a[:2] == blocks_b[:2]  # ids 7, 8 in both
    assert blocks_a[2] != blocks_b[2]  # 9 against 12
    assert len({tuple(block) for block in blocks_a}) == 5
    assert blocks_a[4] == list(block_token_ids(11, 16, TOKENS))[:5]  # the partial last block: its id's first tokens
    assert prompt_token_ids(a, 16, TOKENS, seed=1)[:16] != blocks_a[0]  # another seed, other blocks
    assert all(TOKENS[0] <= t < TOKENS[1] for t in ids_a)


def test_text_prompts_share_exactly_the_words_of_shared_blocks():
    a = TraceRecord(0, 2 * 8 + 3, 1, (1, 2, 3))
    b = TraceRecord(0, 2 * 8, 1, (1, 4))
    words_a, words_b = prompt_text(a, 8).split(" "), prompt_text(b, 8).split(" ")
    assert words_a[0] == words_b[0] == ""  # every word after a space: a block tokenizes alone
    assert len(words_a) - 1 == 19 and len(words_b) - 1 == 16
    assert words_a[1:9] == words_b[1:9] and words_a[9:17] != words_b[9:17]
    assert prompt_text(a, 8).startswith(prompt_text(TraceRecord(0, 8, 1, (1,)), 8))


def test_a_trace_of_another_block_size_is_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 1000, "output_length": 4, "hash_ids": [1, 2]}))
    assert read_trace(path, 512)[0].hash_ids == (1, 2)
    with pytest.raises(ValueError, match=r"t.jsonl:1: 2 hash_ids for input_length 1000; blocks of 64 tokens need 16"):
        read_trace(path, 64)
    path.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 4}))
    with pytest.raises(ValueError, match=r"missing \['hash_ids'\]"):
        read_trace(path, 512)


def test_the_schedule_follows_the_timestamps_divided_by_the_speedup(tmp_path):
    path = tmp_path / "t.jsonl"  # out of order on purpose: the replay goes by timestamp
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 4, "output_length": 2, "hash_ids": [t]}) + "\n"
                            for t in (1000, 0, 4000, 2500)))
    records = read_trace(path, 16)
    assert [r.hash_ids[0] for r in records] == [0, 1000, 2500, 4000]
    assert send_offsets(records, 1.0) == [0.0, 1.0, 2.5, 4.0]
    assert send_offsets(records, 2.0) == [0.0, 0.5, 1.25, 2.0]
    assert trace_rate(records, 2.0) == 4 / 2.0


def test_the_generator_writes_the_recorded_traces_and_their_reuse(tmp_path):
    for mode, name in (("multi-turn", "multi_turn_small.jsonl"), ("no-reuse", "no_reuse_small.jsonl")):
        make_trace([*SMALL_TRACE_ARGS, "--mode", mode, "--out", str(tmp_path / name)])
        assert (tmp_path / name).read_bytes() == (TRACES / name).read_bytes(), name
    multi, none = read_trace(TRACES / "multi_turn_small.jsonl", 32), read_trace(TRACES / "no_reuse_small.jsonl", 32)
    assert block_reuse(multi)["block_reuse"] >= 0.8 and block_reuse(none)["block_reuse"] == 0.0
    assert [(r.timestamp_ms, r.input_length, r.output_length) for r in multi] == \
        [(r.timestamp_ms, r.input_length, r.output_length) for r in none]  # the same load, only the blocks differ


def test_each_turn_extends_its_sessions_last_prompt():
    assert block_reuse(make_trace(["--out", "/dev/null"]))["block_reuse"] >= 0.8  # the defaults: blocks of 512
    records = multi_turn(sessions=3, turns=4, system_tokens=1024, user_tokens=(32, 600), output_tokens=16,
                         session_gap_ms=1, think_ms=1000, block_size=512, seed=0)  # session s at s ms + t s
    first_session = [r for r in records if r.timestamp_ms % 1000 == 0]
    assert len(first_session) == 4
    for before, after in zip(first_session, first_session[1:]):
        full = before.input_length // 512  # the full blocks of the last prompt come back unchanged
        assert after.hash_ids[:full] == before.hash_ids[:full]
        assert set(after.hash_ids[full:]).isdisjoint(before.hash_ids)  # the grown partial block is another
        assert after.input_length > before.input_length + before.output_length  # its answer and a new message
    assert records[0].hash_ids[:2] == records[1].hash_ids[:2] == records[2].hash_ids[:2]  # the system prompt
    assert records[0].hash_ids[2] != records[1].hash_ids[2]  # then each session's own


def test_the_prefix_hit_rate_is_the_difference_of_the_counters():
    before = prefix_counters('pdserve_prefix_cache_queries{deployment="PrefillServer"} 100.0\n'
                             'pdserve_prefix_cache_hits{deployment="PrefillServer"} 40.0\n'
                             'pdserve_prefix_cache_queries{deployment="DecodeServer"} 0.0\n'
                             'pdserve_prefix_cache_hits{deployment="DecodeServer"} 0.0\n'
                             'pdserve_prompt_tokens_computed{deployment="PrefillServer"} 60.0\n')
    after = prefix_counters('pdserve_prefix_cache_queries{deployment="PrefillServer"} 1100.0\n'
                            'pdserve_prefix_cache_hits{deployment="PrefillServer"} 840.0\n'
                            'pdserve_prefix_cache_queries{deployment="DecodeServer"} 1000.0\n'
                            'pdserve_prefix_cache_hits{deployment="DecodeServer"} 0.0\n')
    report = prefix_hit_report(before, after)
    assert report["per_deployment"] == {"PrefillServer": {"queries": 1000, "hits": 800, "hit_rate": 0.8},
                                        "DecodeServer": {"queries": 1000, "hits": 0, "hit_rate": 0.0}}
    assert report["prefix_hit_rate"] == 0.4  # 800 of the 2000 looked up
    assert prefix_hit_report({}, {"Colocated": {"queries": 0.0, "hits": 0.0}})["prefix_hit_rate"] == 0.0


def test_the_report_of_a_recorded_replay(tmp_path):
    """Three recorded requests of a three-record trace: the percentiles, the goodput and the trace's reuse."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 48, "output_length": 5, "hash_ids": [1, 2, 4]},
        {"timestamp": 1000, "input_length": 40, "output_length": 3, "hash_ids": [5, 6, 7]})))
    args = parse_args(["--trace", str(path), "--block-size", "16", "--speedup", "2", "--goodput", "ttft:150",
                       "tpot:25", "--slo-grid", "ttft:150 tpot:25"])
    records = read_trace(path, 16)
    work = [Work(i, [1] * r.input_length, "", r.output_length, 5) for i, r in enumerate(records)]
    results = [Result(work[0], status=200, ttft=0.100, e2el=0.100 + 4 * 0.020, output_tokens=5),
               Result(work[1], status=200, ttft=0.200, e2el=0.200 + 4 * 0.010, output_tokens=5),
               Result(work[2], status=200, ttft=0.050, e2el=0.050 + 2 * 0.030, output_tokens=3)]
    trace = {"requests": 3, **block_reuse(records)}
    result = build_result(args, results, 2.0, trace_rate(records, 2.0), {}, trace)
    assert result["request_rate"] == 3 / 0.5
    assert result["trace"]["block_reuse"] == 2 / 9  # ids 1 and 2 again in the second request
    assert result["median_ttft_ms"] == pytest.approx(100) and result["p90_ttft_ms"] == pytest.approx(180)
    assert result["median_tpot_ms"] == pytest.approx(20) and result["mean_tpot_ms"] == pytest.approx(20)
    assert result["request_goodput"] == pytest.approx(1 / 2.0)  # only the first meets TTFT 150 and TPOT 25
    assert result["slo_attainment"] == [{"ttft_ms": 150, "tpot_ms": 25, "attainment": 1 / 3}]


@pytest.mark.parametrize("argv,message", [
    (["--trace", "t.jsonl", "--request-rate", "4"], "--request-rate cannot be combined"),
    (["--trace", "t.jsonl", "--input-len", "8", "--sweep", "1,2"], "--input-len, --sweep cannot be combined"),
    (["--speedup", "2"], "--trace's options"),
    (["--trace", "t.jsonl", "--speedup", "0"], "--speedup > 0")])
def test_options_a_trace_would_contradict_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def colocated_url():
    return f"{openai_apps()}/co"  # the suite's kept colocated app (tiny-llama)


@pytest.mark.parametrize("endpoint", ["infer_token", "completions"])
def test_a_replayed_multi_turn_trace_hits_the_prefix_cache(colocated_url, tmp_path, endpoint):
    out = tmp_path / "replay.json"
    loadtest(["--base-url", colocated_url, "--endpoint", endpoint, "--trace", str(TRACES / "multi_turn_small.jsonl"),
              "--block-size", "32", "--speedup", "3", "--warmup", "1", "--goodput", "ttft:60000",
              "--json", str(out), "--quiet"])
    result = json.loads(out.read_text())
    assert result["completed"] == 24 and result["failed"] == 0 and result["errors"] == {}
    assert result["total_output_tokens"] == 24 * 8
    assert result["trace"]["requests"] == 24 and result["trace"]["block_reuse"] >= 0.8
    cache = result["prefix_cache"]
    assert cache["per_deployment"]["LLMServer"]["queries"] >= result["total_input_tokens"]
    assert cache["prefix_hit_rate"] > 0.5
    if endpoint == "infer_token":  # token-exact prompts: what the engine looked up is the trace's input
        assert result["total_input_tokens"] == sum(r.input_length for r in read_trace(TRACES / "multi_turn_small.jsonl", 32))


def test_a_trace_without_reuse_gets_no_prefix_hits_from_it(colocated_url, tmp_path):
    out = tmp_path / "replay.json"
    loadtest(["--base-url", colocated_url, "--trace", str(TRACES / "no_reuse_small.jsonl"), "--block-size", "32",
              "--speedup", "8", "--warmup", "0", "--seed", "1", "--json", str(out), "--quiet"])  # seed 1: no block
    result = json.loads(out.read_text())                                         # of the other tests' replays
    assert result["completed"] == 24 and result["trace"]["block_reuse"] == 0.0
    assert result["prefix_cache"]["prefix_hit_rate"] == 0.0


def hub_cache_with_tiny_llama(root: Path) -> Path:
    """A Hugging Face hub cache under ``root`` holding tiny-llama's tokenizer as the repo
    "pdserve/tiny-llama". aiperf 0.13 decodes its prompts in worker processes that force
    HF_HUB_OFFLINE=1, and offline it reads every --tokenizer as a hub id (a local path fails)."""
    revision = "0" * 40
    snapshot = root / "models--pdserve--tiny-llama" / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(ensure_tiny_model() / name, snapshot / name)
    (root / "models--pdserve--tiny-llama" / "refs").mkdir()
    (root / "models--pdserve--tiny-llama" / "refs" / "main").write_text(revision)
    return root


def test_aiperf_replays_the_same_trace_unmodified(colocated_url, tmp_path):
    """aiperf's own Mooncake loader on the same file (its prompts from its tokenizer's text, at the
    trace's timestamps): every request completes, and the engine finds the trace's shared blocks."""
    command = [str(Path(sys.executable).parent / "aiperf"), "profile", "--model", "tiny-llama", "--url", colocated_url,
               "--endpoint-type", "chat", "--streaming", "--input-file", str(TRACES / "multi_turn_small.jsonl"),
               "--custom-dataset-type", "mooncake_trace", "--isl-block-size", "32", "--fixed-schedule",
               "--tokenizer", "pdserve/tiny-llama", "--extra-inputs", "ignore_eos:true",
               "--output-artifact-dir", str(tmp_path / "aiperf"), "--no-auto-plot", "--random-seed", "1"]
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache_with_tiny_llama(tmp_path / "hub")), "HF_HUB_OFFLINE": "1"}
    before = prefix_counters(httpx.get(f"{colocated_url}/metrics", timeout=30).text)
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    after = prefix_counters(httpx.get(f"{colocated_url}/metrics", timeout=30).text)
    report = json.loads((tmp_path / "aiperf" / "profile_export_aiperf.json").read_text())
    assert report["error_summary"] == [] and report["completed_request_count"]["avg"] == 24
    assert report["time_to_first_token"]["count"] == 24
    assert prefix_hit_report(before, after)["prefix_hit_rate"] > 0.5
