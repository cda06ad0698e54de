"""The rlquant study's evaluation: each final policy at the precision it deploys at.

After the RL runs of ``--qrl-compare rlquant`` (:data:`megatron_qrl.rl.compare.RLQUANT_VARIANTS`)
every run's last checkpoint is evaluated greedily on the task's RL prompts (``task``) and on
:data:`EVAL_PROMPTS` held-out problems (``held-out``: same digits, disjoint from the RL
prompts; the tiny CPU model memorises its 512 prompts and barely generalises, so ``task`` is
the column the study reads) in the reference rollout engine, loaded
with the packed tensors the export / weight sync writes for the deployed format
(:data:`DEPLOYMENTS`). The full-precision run is also deployed after post-training
quantization: round-to-nearest, AWQ (w4a16) and SmoothQuant (int8), ModelOpt-calibrated on
:data:`CALIB_PROMPTS` RL prompts (:mod:`megatron_qrl.models.calibrate`). ``rlquant.md``:
task accuracy per deployment (mean ± std over seeds, per seed), the paired difference to the
full-precision policy and the held-out accuracy; ``rlquant.png``: task accuracy as bars
(mean ± std) with the seeds as dots.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from megatron_qrl.config.configs import QrlConfigs
from megatron_qrl.rl.compare import slug
from megatron_qrl.utils.curves import mean_std
from megatron_qrl.utils.io import atomic_write_text
from megatron_qrl.utils.plots import new_figure, save_png

__all__ = ["CALIB_PROMPTS", "DEPLOYMENTS", "EVAL_PROMPTS", "evaluate_seed", "rlquant_after",
           "rlquant_report"]

EVAL_PROMPTS = 512
CALIB_PROMPTS = 64
REFERENCE = "bf16 grpo"
DEPLOYMENTS: tuple[tuple[str, str, str, str], ...] = (
    ("bf16 grpo", "bf16 grpo", "bf16", "none"),
    ("ptq rtn w4a16", "bf16 grpo", "w4a16", "none"),
    ("ptq awq w4a16", "bf16 grpo", "w4a16", "awq"),
    ("ptq rtn int8", "bf16 grpo", "int8", "none"),
    ("ptq smoothquant int8", "bf16 grpo", "int8", "smoothquant"),
    ("qaft int8", "qaft int8", "int8", "none"),
    ("qaft w4a16", "qaft w4a16", "w4a16", "none"),
    ("qlora nf4", "qlora nf4", "bf16", "none"),
)
"""(label, RL variant, deployed format, ``--calibrate`` method). QLoRA deploys as its engine
served it during RL: the dequantized NF4 base with the adapter (merged, BF16)."""


def held_out(configs: QrlConfigs, train: Sequence, n: int = EVAL_PROMPTS) -> list:
    """``n`` addition problems of the task's digits that are not RL prompts (seeded)."""
    from megatron_qrl.data import PromptRecord, addition_problems

    run, task = configs.run, configs.task
    seen = {r.prompt for r in train}
    pool = addition_problems(n + len(seen), 10_000 + run.seed, task.digits_min, task.digits_max)
    out = [PromptRecord(p["prompt"], p["answer"]) for p in pool if p["prompt"] not in seen]
    return out[:n]


def accuracy(hf_config: dict, tensors: Mapping, fmt: str, configs: QrlConfigs, data, records) -> float:
    """Greedy accuracy of ``tensors`` packed as ``fmt`` in the reference engine."""
    from megatron_qrl.quant import get_spec
    from megatron_qrl.rewards.math import score_math
    from megatron_qrl.rollout.base import SamplingParams
    from megatron_qrl.rollout.reference import ReferenceEngine

    tok, ro = data.tokenizer, configs.rollout
    engine = ReferenceEngine(hf_config, fmt, decode=tok.decode)
    engine.update_weights(get_spec(fmt).pack_state_dict(sorted(tensors.items())), version=1)
    bos = [] if tok.bos_id is None else [tok.bos_id]
    out = engine.generate([[*bos, *tok.encode(r.prompt)] for r in records], SamplingParams(
        max_new_tokens=ro.max_new_tokens, temperature=0.0, stop=tuple(ro.stop),
        stop_token_ids=(tok.eos_id,)))
    texts = [tok.decode([i for i in r if i < tok.vocab_size]) for r in out.responses()]
    return sum(score_math(t, r.answer).correct for t, r in zip(texts, records)) / len(records)


def _finished(vdir: Path, configs: QrlConfigs) -> bool:
    from megatron_qrl.utils.metrics import read_metrics

    rl = [r for r in read_metrics(vdir) if r.get("phase") == "rl"]
    return len(rl) >= configs.run.steps


def evaluate_seed(seed_dir: Path, log: Callable[[str], None] = print,
                  n_held_out: int = EVAL_PROMPTS) -> dict[str, dict[str, float]]:
    """``{deployment label: {"task": accuracy, "held_out": accuracy}}`` of one seed's finished
    runs (call inside a one-rank Megatron world); kept in ``<seed_dir>/rlquant_eval.json``,
    whose deployments are not evaluated again."""
    from megatron_qrl.models.calibrate import calibrate_tensors
    from megatron_qrl.rl.driver import prepare_job
    from megatron_qrl.rl.lora_merge import final_hf_tensors

    path = seed_dir / "rlquant_eval.json"
    result: dict[str, dict[str, float]] = json.loads(path.read_text()) if path.is_file() else {}
    finals: dict[str, tuple | None] = {}
    for label, variant, fmt, method in DEPLOYMENTS:
        vdir = seed_dir / slug(variant)
        if label in result or not (vdir / "metrics.jsonl").is_file():
            continue
        if variant not in finals:
            cfg, tensors, configs = final_hf_tensors(vdir)
            data = prepare_job(configs)
            finals[variant] = (cfg, tensors, configs, data, held_out(
                configs, data.records, n_held_out)) if _finished(vdir, configs) else None
        if finals[variant] is None:
            log(f"[rlquant] {vdir}: not finished, not evaluated")
            continue
        cfg, tensors, configs, data, evals = finals[variant]
        if method != "none":
            bos = [] if data.tokenizer.bos_id is None else [data.tokenizer.bos_id]
            calib = [[*bos, *data.tokenizer.encode(r.prompt)]
                     for r in data.records[:CALIB_PROMPTS]]
            tensors = calibrate_tensors(cfg, tensors.items(), method, fmt, calib)
        result[label] = {"task": accuracy(cfg, tensors, fmt, configs, data, data.records),
                         "held_out": accuracy(cfg, tensors, fmt, configs, data, evals)}
        log(f"[rlquant] {seed_dir.name}: {label} ({fmt}, calibrate {method}): accuracy "
            f"{result[label]['task']:.4f} task, {result[label]['held_out']:.4f} held-out")
        atomic_write_text(path, json.dumps(result, indent=1) + "\n")
    return result


Results = Mapping[str, Mapping[str, Mapping[str, float]]]
"""``{seed: {deployment: {"task" | "held_out": accuracy}}}``."""


def _column(by_seed: Results, label: str, key: str, minus: str | None = None) -> list[float]:
    return [r[label][key] - (r[minus][key] if minus else 0.0) for r in by_seed.values()
            if label in r and (minus is None or minus in r)]


def table(by_seed: Results) -> str:
    """Markdown: per deployment the task accuracy (mean ± std, each seed), the paired
    difference to :data:`REFERENCE` and the held-out accuracy (mean ± std over seeds)."""
    seeds = sorted(by_seed, key=str)
    lines = [f"greedy accuracy; task = the RL prompts, held-out = {EVAL_PROMPTS} other problems; "
             f"mean ± std over {len(seeds)} seed(s); paired d = deployment minus "
             f"`{REFERENCE}` (bf16), per seed", "",
             "| deployment | task accuracy | d vs bf16 | " +
             " | ".join(f"seed {s}" for s in seeds) + " | held-out accuracy |",
             "|---" * (len(seeds) + 4) + "|"]
    for label, *_ in DEPLOYMENTS:
        vals = _column(by_seed, label, "task")
        if not vals:
            continue
        (m, sd), (hm, hsd) = mean_std(vals), mean_std(_column(by_seed, label, "held_out"))
        d = _column(by_seed, label, "task", REFERENCE)
        dm, dsd = mean_std(d) if d else (float("nan"), float("nan"))
        cells = [f"{by_seed[s][label]['task']:.4f}" if label in by_seed[s] else "n/a"
                 for s in seeds]
        lines.append(f"| {label} | {m:.4f} ± {sd:.3f} | {dm:+.4f} ± {dsd:.3f} | "
                     + " | ".join(cells) + f" | {hm:.4f} ± {hsd:.3f} |")
    return "\n".join(lines) + "\n"


def write_report(by_seed: Results, out: Path) -> tuple[Path, Path]:
    """``rlquant.md`` (:func:`table`) and ``rlquant.png`` (bars: mean ± std; dots: seeds)."""
    md = atomic_write_text(out / "rlquant.md", table(by_seed))
    labels = [lab for lab, *_ in DEPLOYMENTS if any(lab in v for v in by_seed.values())]
    fig, ax = new_figure(1, 1, figsize=(9, 4))
    for i, lab in enumerate(labels):
        vals = _column(by_seed, lab, "task")
        m, sd = mean_std(vals)
        ax.bar(i, m, yerr=sd, color="tab:blue" if lab.startswith(("bf16", "ptq")) else
               "tab:orange", alpha=0.6, capsize=3)
        ax.plot([i] * len(vals), vals, "k.", markersize=4)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("greedy accuracy (RL prompts)")
    ax.grid(alpha=0.3, axis="y")
    return md, save_png(fig, out / "rlquant.png", dpi=100, bbox_inches="tight")


def rlquant_report(seed_dirs: Sequence[Path], out: Path, log: Callable[[str], None] = print,
                   n_held_out: int = EVAL_PROMPTS) -> tuple[Path, Path]:
    """Evaluate every seed directory (:func:`evaluate_seed`) and write the report in ``out``."""
    by_seed = {Path(d).name.removeprefix("seed"): evaluate_seed(Path(d), log, n_held_out)
               for d in seed_dirs}
    md, png = write_report(by_seed, Path(out))
    log(f"[rlquant] table: {md}\n" + md.read_text())
    return md, png


def rlquant_after(out: Path, seed_dirs: list[Path], log: Callable[[str], None]) -> object:
    """The ``after`` step of the ``rlquant`` variant set (:mod:`megatron_qrl.rl.compare_sets`)."""
    return rlquant_report(seed_dirs, out, log=log)
