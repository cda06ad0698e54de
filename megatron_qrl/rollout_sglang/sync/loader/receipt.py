"""The engine's receipt of one in-place sync: fingerprints of what this scheduler process
RECEIVED, and of what it HOLDS where SGLang keeps the checkpoint layout.

Runs inside SGLang's scheduler (called by :func:`~.packed.load_packed`). The sender names a
path prefix in the control message (``"receipt"``); from the first bucket of a sync on, every
received wire tensor — after the flat buffer is viewed and 1-byte floats re-viewed, before
anything is loaded — is fingerprinted on its device (:class:`~megatron_qrl.sync.protocol.checksums.Checksums`;
a stack's experts as rows, under their per-expert names, as the sender takes them). After
the final bucket, parameters SGLang keeps exactly as received (same name, shape and dtype, in
a module without post-load processing: norms, unsharded embeddings at TP 1) are
fingerprinted again as held, and ``<prefix>.<pid>.json`` is written (temp + rename):
``{"pid", "received": {name: fingerprint}, "held": {name: fingerprint}}``. The trainer's
engine reads and compares it (:func:`megatron_qrl.rollout_sglang.sync.sender.check_receipts`).
"""

from __future__ import annotations

import json
import os

import torch

from megatron_qrl.sync.protocol.checksums import Checksums
from megatron_qrl.sync.protocol.inplace import expert_names, expert_views, parse_stacked
from megatron_qrl.sync.protocol.wire import dtype_name

from .module_state import needs_reload

__all__ = ["RECEIPT_ATTR", "note_received", "write_receipt"]

RECEIPT_ATTR = "_qrl_receipt"
"""Model attribute holding the current sync's :class:`Checksums` between buckets."""


def note_received(model: torch.nn.Module, msg: dict,
                  weights: list[tuple[str, torch.Tensor]]) -> None:
    """Fingerprint this bucket's received tensors (no-op unless the sender asked for a
    receipt); a sync's first bucket starts a new receipt."""
    if not msg.get("receipt"):
        return
    state = vars(model)
    if msg["begin"] or RECEIPT_ATTR not in state:
        state[RECEIPT_ATTR] = Checksums()
    sums: Checksums = state[RECEIPT_ATTR]
    for name, t in weights:
        if (t.storage_offset() * t.element_size()) % 4:  # a view of a flat bucket's bytes
            t = t.clone()  # the fingerprints read 32-bit words
        if parse_stacked(name) is None:
            sums.add(name, t)
        else:
            sums.add_rows(expert_names(name, len(expert_views(name, t))), t)
    sums.flush()  # nothing of this bucket is held past the request


def held_verbatim(model: torch.nn.Module, received: dict[str, str]) -> dict[str, str]:
    """Fingerprints of the parameters SGLang holds in the received layout: a received name
    that is a parameter of the model, of the received shape and dtype, in a module that is
    not post-processed."""
    modules = dict(model.named_modules())
    sums = Checksums()
    for name, p in model.named_parameters():
        want = received.get(name)
        if want is None or needs_reload(modules.get(name.rpartition(".")[0])):
            continue
        if want.startswith(f"{dtype_name(p.dtype)}{list(p.shape)}:"):  # format_checksum's
            sums.add(name, p.detach())
    return sums.result()


def write_receipt(model: torch.nn.Module, msg: dict) -> None:
    """After a sync's final bucket: write ``<receipt>.<pid>.json`` (module docstring)."""
    if not (msg.get("receipt") and msg["final"]):
        return
    sums = vars(model).pop(RECEIPT_ATTR, None) or Checksums()
    received = sums.result()
    rec = {"pid": os.getpid(), "received": received, "held": held_verbatim(model, received)}
    path = f"{msg['receipt']}.{os.getpid()}.json"
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, path)
