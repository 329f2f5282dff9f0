"""benchmarks/kv_move_served.py's pure helpers: which streams a scale-down moved (from their traces'
KV bytes), the drained D's resident KV before its first request left, and the streams' timing and
outcome. Model-free, no Ray started."""

from benchmarks.kv_move_served import Stream, moved_streams, outcome, resident_before_move, timing

PROMPT = 128


def test_a_stream_moved_iff_its_last_kv_transfer_carried_more_than_its_prompt():
    per_token = 1024
    traces = {0: {"kv_bytes": PROMPT * per_token}, 1: {"kv_bytes": (PROMPT + 40) * per_token},
              2: {"kv_bytes": PROMPT * per_token}, 3: {"kv_bytes": (PROMPT + 41) * per_token}, 4: {"kv_bytes": None}}
    moved, found_per_token = moved_streams(traces, PROMPT)
    assert moved == {1: (PROMPT + 40) * per_token, 3: (PROMPT + 41) * per_token}
    assert found_per_token == per_token
    assert moved_streams({0: {"kv_bytes": None}}, PROMPT) == ({}, None)


def test_the_resident_kv_is_the_last_reading_before_the_first_request_left():
    readings = [(0.05, 100, 16, 0), (0.10, 101, 16, 0), (0.15, 103, 16, 0), (0.20, 40, 10, 0), (0.25, 0, 0, 0)]
    assert resident_before_move(readings) == (0.15, 103, 16)
    assert resident_before_move([(0.05, 0, 0, 0)]) is None
    assert resident_before_move([]) is None


def test_timing_and_outcome_of_streams():
    steady = Stream(0, text="ab", arrivals=[0.0, 0.1, 0.2, 0.3], tokens=4, finish="length")
    moved = Stream(1, text="ab", arrivals=[0.0, 0.1, 1.1, 1.2], tokens=4, finish="length")
    assert timing([steady, moved], since=0.5) == {"streams": 2, "largest_gap_ms": 1000.0, "median_tpot_ms": 250.0,
                                                  "largest_gap_began_s": -0.4}
    short = Stream(2, text="a", arrivals=[0.0], tokens=1, finish="length")
    failed = Stream(3, error="HTTP 503")
    assert outcome([steady, moved, short, failed], [steady, Stream(1, text="xy"), short, failed], 4) == \
        {"completed": 2, "errored": 1, "lost": 1, "errors": ["HTTP 503"], "identical": 1}
