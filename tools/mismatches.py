"""Mismatched P/D pairs, served: each kind of mismatch injected, refused by name, no request hung.

For each mismatch, deploys on loopback a PD app of fp32 tiny-llama (1 P, 1 D) whose D is started
with one thing different from P (deployments/pd/compatibility.py's fields), then measures: how long
after Serve says the app runs `/health` names the mismatch, whether it names the field, which
fields it names, and what ``--requests`` concurrent requests (each with a ``--timeout``) got: all of
them must end within their timeout (answered by P alone, ``pd_degrade_to_prefill``), and D must do
no work for any of them. The app is deleted before the next one.

The mismatches: block size, compute dtype (the KV pool's dtype follows it: this engine has no
separate KV dtype setting, so a KV dtype mismatch is injected through the dtype), tokenizer files
(a copy of tiny-llama with one tokenizer setting changed, same weights and name), model weights (a
copy with every weight scaled, same name and tokenizer), max context, drafts (prompt lookup) and
the LoRA setting (D with a higher rank cap).

    python tools/mismatches.py [--requests 8] [--timeout 30] [--json PATH] [--only TEXT]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
from pathlib import Path
import shutil
import sys
import tempfile
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from ray import serve  # noqa: E402

from deployments.app import pd_app  # noqa: E402
from engine.execution.tiny_model import ensure_tiny_model  # noqa: E402
from tests.serving import deploy, serve_session, wait_until, work_done  # noqa: E402
from tools.faults import timed_infer_token  # noqa: E402

APP = "mismatch"
APP_ARGS = {"torch_threads": 1, "dtype": "float32", "embeddings": False, "pd_local_prefill_tokens": 0}


def tiny_copy(root: Path, kind: str) -> str:
    """A copy of tiny-llama named as the original (so the model's name matches) with either its
    tokenizer's settings or its weights changed."""
    from safetensors.torch import load_file, save_file

    source = ensure_tiny_model()
    target = root / kind / "tiny-llama"
    shutil.copytree(source, target)
    if kind == "tokenizer":
        config = json.loads((target / "tokenizer_config.json").read_text())
        config["model_max_length"] = 12345
        (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    else:
        for path in target.glob("*.safetensors"):
            save_file({name: tensor * 1.01 for name, tensor in load_file(path).items()}, path,
                      metadata={"format": "pt"})
    return str(target)


def mismatches(root: Path) -> dict[str, tuple[dict, str]]:
    """name -> (D's engine settings instead of the app's, the field /health must name)."""
    return {
        "block size": ({"block_size": 32}, "block_size"),
        "dtype (and KV dtype)": ({"dtype": "bfloat16"}, "kv_dtype"),
        "tokenizer": ({"model": tiny_copy(root, "tokenizer")}, "tokenizer_digest"),
        "model weights": ({"model": tiny_copy(root, "weights")}, "weights_digest"),
        "max context": ({"max_model_len": 256}, "max_context"),
        "draft": ({"prompt_lookup": True}, "draft"),
        "LoRA rank cap": ({"max_lora_rank": 32}, "lora"),
    }


def run_row(base: str, name: str, decode_engine: dict, field: str, requests: int, timeout_s: float) -> dict:
    args = {**APP_ARGS, "enable_lora": True} if field == "lora" else APP_ARGS
    deploy({APP: pd_app(args, decode_engine=decode_engine)})
    ready = time.monotonic()
    url = f"{base}/{APP}"
    answers: list[dict] = []

    def named() -> bool:
        answers.append(httpx.get(url + "/health", timeout=30).json())
        return bool(answers[-1].get("incompatible"))

    was_named = wait_until(named, 60, 0.05)
    named_after = round(time.monotonic() - ready, 2)
    incompatible = answers[-1].get("incompatible", [])
    fields = sorted({part.split(":")[0].strip() for line in incompatible
                     for part in line.split("incompatible prefill/decode:", 1)[-1].split(";")})
    before = work_done("DecodeServer", APP)

    def one(i: int) -> tuple[str, float]:
        return timed_infer_token(url, {"input_id": [1, 50 + i, 51, 52], "parameters": {
            "max_new_tokens": 16, "ignore_eos": True, "timeout": int(timeout_s)}}, timeout_s + 30)

    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        results = list(pool.map(one, range(requests)))
    decode_idle = work_done("DecodeServer", APP) == before
    serve.delete(APP)
    return {"mismatch": name, "decode_engine": decode_engine, "named_in_health": was_named,
            "field_named": field in fields, "fields_named": fields, "named_after_ready_s": named_after,
            "sent": requests, "answered_200": sum(o == "200" for o, _ in results),
            "outcomes": sorted({o for o, _ in results}),
            "ended_within_timeout": sum(s <= timeout_s for _, s in results),
            "slowest_s": round(max(s for _, s in results), 2),
            "decode_did_no_work": decode_idle,
            "health_reason": answers[-1].get("reason")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=30.0, help="each request's timeout (s)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", help="run only the rows whose name contains this text")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-mismatch-") as root, serve_session() as base:
        for name, (decode_engine, field) in mismatches(Path(root)).items():
            if args.only is None or args.only in name:
                rows.append(run_row(base, name, decode_engine, field, args.requests, args.timeout))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"requests": args.requests, "timeout_s": args.timeout, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
