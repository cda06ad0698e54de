#!/usr/bin/env python3
"""One JSON record per RL step from a slime run's log, and the step table docs/SLIME.md shows.

    python bench/slime_log.py bench/results/slime_baseline_<commit>.log ... \
        --out bench/results/slime_<commit>.jsonl

slime logs each step as Python dict literals: the rollout manager's ``perf N: {...}`` (rollout
time, decode throughput, response lengths), the trainer's ``rollout N: {...}`` (rewards, the
rollout's log-probs), ``step N: {...}`` (the loss terms, slime's
``train/train_rollout_logprob_abs_diff``, our ``kl_behav_prox_k3`` and ``qrl_error_*`` with
the plugin) and the trainer's ``perf N: {...}`` (train, weight update, sleep / wake-up and step
times, slime's TFLOP/s). This joins them by step. The variant and commit come from the first
line ``bench/slime.sh`` writes (``# nvidia-h200 DATE, commit C: QRL=.. LOSS=.., SGLang ..``).
The table leaves out step 0 from its means (the first step carries start-up work: compile,
CUDA graphs, the first wake-up).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import statistics
import sys
from pathlib import Path

# "(RolloutManager pid=5057) [date] rollout_metrics.py:268 - perf 0: {...}"
_LINE = re.compile(r"\((?P<actor>\w+) pid=\d+\).*? - (?P<kind>perf|rollout|step) (?P<n>\d+): "
                   r"(?P<body>\{.*\})\s*$")
_HEAD = re.compile(r"^# (?P<machine>\S+) (?P<date>\S+), commit (?P<commit>\w+): "
                   r"QRL=(?P<qrl>\d) LOSS=(?P<loss>\w+).*?(?P<sglang>SGLang \S+)")
# what a row keeps: (record key, source, slime's key)
FIELDS = (
    ("rollout_s", "rollout_perf", "perf/rollout_time"),
    ("decode_tok_s", "rollout_perf", "perf/tokens_per_gpu_per_sec"),
    ("response_len", "rollout_perf", "rollout/response_len/mean"),
    ("raw_reward", "rollout", "rollout/raw_reward"),
    ("train_s", "train_perf", "perf/train_time"),
    ("log_probs_s", "train_perf", "perf/log_probs_time"),
    ("actor_train_s", "train_perf", "perf/actor_train_time"),
    ("update_weights_s", "train_perf", "perf/update_weights_time"),
    ("sleep_s", "train_perf", "perf/sleep_time"),
    ("wake_up_s", "train_perf", "perf/wake_up_time"),
    ("step_s", "train_perf", "perf/step_time"),
    ("train_tflops", "train_perf", "perf/actor_train_tflops"),
    ("logprob_abs_diff", "step", "train/train_rollout_logprob_abs_diff"),
    # the same |log pi_train - log pi_rollout| token mean, as megatron_qrl's custom loss logs it
    # (slime's own key is computed only by its built-in loss)
    ("logprob_abs_diff", "step", "train/logp_abs_diff_mean"),
    ("kl_behav_prox_k3", "step", "train/kl_behav_prox_k3"),
    ("pg_loss", "step", "train/pg_loss"),
    ("entropy", "step", "train/entropy_loss"),
    ("grad_norm", "step", "train/grad_norm"),
)
TABLE = ("rollout_s", "train_s", "log_probs_s", "actor_train_s", "update_weights_s", "sleep_s", "wake_up_s", "step_s",
         "train_tflops", "logprob_abs_diff", "kl_behav_prox_k3")


def parse(text: str) -> tuple[dict, list[dict]]:
    """(the header's fields, one dict per step joining its four slime records)."""
    lines = text.splitlines()
    head = _HEAD.match(lines[0]) if lines else None
    if head is None:
        raise ValueError("the log's first line is not bench/slime.sh's header "
                         "('# MACHINE DATE, commit C: QRL=.. LOSS=.., SGLang ..'): run it "
                         "through `bash bench/h200.sh run slime-run`")
    info = head.groupdict()
    steps: dict[int, dict[str, dict]] = {}
    for line in lines:
        m = _LINE.search(line)
        if m is None:
            continue
        kind = m["kind"]
        if kind == "perf":  # the rollout manager's and the trainer's share the name
            kind = "rollout_perf" if m["actor"] == "RolloutManager" else "train_perf"
        steps.setdefault(int(m["n"]), {})[kind] = ast.literal_eval(m["body"])
    rows = []
    for n in sorted(steps):
        rec = steps[n]
        row = {"step": n}
        for key, source, slime_key in FIELDS:
            value = rec.get(source, {}).get(slime_key)
            if value is not None:
                row[key] = float(value)
        qrl = {k.removeprefix("train/"): float(v) for k, v in rec.get("step", {}).items()
               if k.startswith("train/qrl_")}
        rows.append({**row, **qrl})
    return info, rows


def records(path: Path) -> list[dict]:
    info, rows = parse(path.read_text(errors="replace"))
    variant = f"qrl_{info['loss']}" if info["qrl"] == "1" else "baseline"
    return [{"commit": info["commit"], "date": info["date"], "machine": info["machine"],
             "variant": variant, "sglang": info["sglang"].split()[1], "log": path.name, **r}
            for r in rows]


def table(recs: list[dict]) -> str:
    """Markdown: per variant, the mean over the steps after the first, and the step count."""
    out = ["| variant | steps | " + " | ".join(TABLE) + " |",
           "|---|---|" + "---|" * len(TABLE)]
    for variant in dict.fromkeys(r["variant"] for r in recs):
        rows = [r for r in recs if r["variant"] == variant]
        later = [r for r in rows if r["step"] > 0] or rows
        cells = []
        for key in TABLE:
            vals = [r[key] for r in later if key in r]
            cells.append(f"{statistics.mean(vals):.4g}" if vals else "")
        out.append(f"| {variant} | {len(rows)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", type=Path, help="logs of `bench/h200.sh run slime-run`")
    ap.add_argument("--out", type=Path, help="JSON lines, one per step (temp file + rename)")
    args = ap.parse_args(argv)
    recs = []
    for path in args.logs:
        try:
            found = records(path)
        except (OSError, ValueError) as e:
            print(f"bench/slime_log.py: {path}: {e}", file=sys.stderr)
            return 2
        if not found:
            print(f"bench/slime_log.py: {path}: no step records (the run stopped before its "
                  "first step; read the log's last error)", file=sys.stderr)
            return 2
        recs += found
    if args.out:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
        os.replace(tmp, args.out)
    print(table(recs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
