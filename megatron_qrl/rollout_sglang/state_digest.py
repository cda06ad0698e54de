"""The bits an engine holds after each in-place sync, opt-in: for comparing load paths.

Set ``QRL_INPLACE_DIGEST=/path/file.jsonl`` in the environment the SGLang engine starts in (its
scheduler processes inherit it). After the final bucket of every in-place sync the loader then
appends one JSON line ``{"pid", "digest": {name: fingerprint}}``: the
:func:`~megatron_qrl.rollout.base.tensor_checksum` (dtype, shape, two wrapping sums of the raw
bits) of every parameter and buffer of the model, and of the tensor attributes of each
post-processed module's quant method and scheme (Marlin workspaces, processed scales).

Two syncs of the same weights through different load paths (SGLang's per-tensor
``FusedMoE.weight_loader`` and :mod:`.expert_batch`'s batched copies) must leave equal
digests. Unlike comparing generated tokens, this does not assume the engine's kernels are
deterministic: on the H200 (2026-11-29) the nvfp4 engine's greedy agreement with the
reference was 0.953 in one run and 0.969 in the next for the same weights and prompts (the
other formats repeated to the digit), and its batched-vs-per-tensor token check failed; the
digest tells a wrong load from a non-deterministic kernel. Costs one pass over the weights
per sync: leave it unset outside tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..rollout.base import Checksums
from .module_state import needs_reload

DIGEST_ENV = "QRL_INPLACE_DIGEST"


def model_digest(model: torch.nn.Module) -> dict[str, str]:
    """``name -> fingerprint`` of the model's kernel state (see the module doc); attributes
    of a module's quant method are named ``module:quant_method.attr`` (or ``:scheme.``)."""
    sums = Checksums()
    for name, t in model.named_parameters():
        sums.add(name, t)
    for name, t in model.named_buffers():
        sums.add(name, t)
    for mname, module in model.named_modules():
        if not needs_reload(module):
            continue
        for owner in ("quant_method", "scheme"):
            obj = getattr(module, owner, None)
            for attr, t in sorted(vars(obj).items()) if obj is not None else ():
                if isinstance(t, torch.Tensor):
                    sums.add(f"{mname}:{owner}.{attr}", t)
    return sums.result()


def write_digest(model: torch.nn.Module, final: bool) -> None:
    """Append the model's digest to ``$QRL_INPLACE_DIGEST`` after a sync's final bucket."""
    path = os.environ.get(DIGEST_ENV)
    if not path or not final:
        return
    rec = {"pid": os.getpid(), "digest": model_digest(model)}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def read_digests(path: str | Path) -> list[dict[str, str]]:
    """The digests of a file, one per sync, in file order (one engine process)."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line)["digest"] for line in p.read_text().splitlines() if line.strip()]


def digest_diff(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """Names whose fingerprints differ, or that only one digest has, sorted."""
    return sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))
