#!/usr/bin/env python3
"""One SGLang engine in its own process: load a checkpoint dir, greedy-generate, dump JSON.

    python tests/gpu/sglang_engine_worker.py --model-dir DIR --prompts P.json --out R.json

Run by :mod:`sglang_load_check` (one process per format, so a hang or a crash in one engine
cannot take the others down). The result JSON holds ``ok``, ``startup_s``, ``generate_s``,
per prompt ``output_ids`` and ``output_logprobs`` (the engine's log-prob of each generated
token, from ``return_logprob=True``), or ``error`` with the traceback text.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path


def engine_kwargs(model_dir: str, port: int, mem_fraction: float) -> dict:
    """Engine arguments: from disk, no tokenizer, Triton attention, no CUDA graphs, small KV."""
    return dict(
        model_path=model_dir,
        load_format="auto",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        attention_backend="triton",
        sampling_backend="pytorch",
        grammar_backend="none",
        disable_cuda_graph=True,
        mem_fraction_static=mem_fraction,
        # several engines share one GPU: bound the KV pool instead of taking the fraction
        max_total_tokens=8192,
        chunked_prefill_size=4096,
        max_prefill_tokens=4096,
        max_running_requests=8,
        port=port,
        random_seed=0,
        log_level="info",
    )


def run(args: argparse.Namespace) -> dict:
    import sglang

    prompts = json.loads(Path(args.prompts).read_text())
    res: dict = {"ok": False, "model_dir": args.model_dir}
    t0 = time.time()
    eng = sglang.Engine(**engine_kwargs(args.model_dir, args.port, args.mem_fraction))
    res["startup_s"] = round(time.time() - t0, 1)
    try:
        t1 = time.time()
        outs = eng.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": args.max_new, "temperature": 0.0,
                             "ignore_eos": True},
            return_logprob=True,
        )
        res["generate_s"] = round(time.time() - t1, 2)
        res["output_ids"] = [list(o["output_ids"]) for o in outs]
        res["output_logprobs"] = [
            [float(lp) for lp, _tok, _txt in o["meta_info"]["output_token_logprobs"]]
            for o in outs
        ]
        res["logprob_token_ids"] = [
            [int(tok) for _lp, tok, _txt in o["meta_info"]["output_token_logprobs"]]
            for o in outs
        ]
        res["ok"] = True
        # written before shutdown: a hang while shutting down must not lose the result
        Path(args.out).write_text(json.dumps(res))
    finally:
        eng.shutdown()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--mem-fraction", type=float, default=0.45)
    args = p.parse_args()
    try:
        res = run(args)
    except BaseException as exc:  # noqa: BLE001 - report every failure as data
        res = {"ok": False, "model_dir": args.model_dir,
               "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(args.out).write_text(json.dumps(res))
    print("WORKER_DONE", json.dumps({k: res.get(k) for k in ("ok", "startup_s", "error")}),
          flush=True)
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
