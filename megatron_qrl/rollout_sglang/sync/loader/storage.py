"""The engine's parameter storage as a service: describe it, hand it out, read it back.

Runs inside SGLang's scheduler process, reached like the in-place loader: an
``update_weights_from_tensor`` call whose ``load_format`` is
:data:`~megatron_qrl.sync.protocol.engine_layout.STORAGE` (registered with
``custom_weight_loader``) and whose first tensor is the control message
(:mod:`megatron_qrl.sync.protocol.engine_layout`; a ``write``'s tensors follow it). Four
requests:

* ``export``: :func:`~.live_storage.describe` the live parameters and write ``{"layout",
  "tensors"}`` to ``out`` through SGLang's own ``MultiprocessingSerializer`` (each parameter
  as its CUDA IPC handle), so the trainer writes into them;
* ``fingerprint``: the storage addresses now (:func:`~.live_storage.storage_fingerprint`), to
  see whether SGLang moved a parameter since the handles were taken;
* ``digest``: the fingerprints of the regions the trainer wrote (``names``: packed name ->
  shape), read back from the live tensors, and the storage fingerprint;
* ``write``: the trainer's tensors that came with the request written here instead
  (:mod:`.storage_write`: where the memory saver's parameters cannot be handed out).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch

from megatron_qrl.sync.protocol.engine_layout import ERROR, EngineLayoutError
from megatron_qrl.sync.protocol.inplace import CONTROL, decode_control

from .live_storage import describe, read_digest

__all__ = ["handle", "serve"]


def handle(model: torch.nn.Module, msg: dict,
           items: Sequence[tuple[str, torch.Tensor]] = ()) -> dict:
    """One storage request (module docstring), answered in this process; ``export`` gives the
    tensors themselves (``serve`` turns them into handles); ``items``: the tensors that came
    with a ``write`` request."""
    what = msg["what"]
    if what == "write":  # the trainer's side (the writer, the format registry) loads here
        from .storage_write import write  # only when an engine-side write is asked for

        return write(model, msg, items)
    layout, tensors = describe(model)
    if what == "export":
        return {"layout": layout, "tensors": tensors}
    if what == "fingerprint":
        return {"fingerprint": layout.fingerprint}
    if what == "digest":
        return {"fingerprint": layout.fingerprint,
                "digest": read_digest(layout, tensors, msg["names"])}
    raise ValueError(f"engine storage request {what!r}: expected export, fingerprint, digest "
                     "or write")


def _share(obj: dict) -> bytes:
    """``obj`` serialized as SGLang shares tensors between its processes."""
    from sglang.srt.utils import MultiprocessingSerializer

    try:
        return MultiprocessingSerializer.serialize(obj)
    except RuntimeError as exc:  # e.g. memory the memory saver maps (no IPC handle)
        raise EngineLayoutError(
            f"direct weight sync: the engine's parameters cannot be shared by CUDA IPC ({exc}); "
            "start the engine without its memory saver (--no-qrl-rollout-sglang-release-memory) "
            "or use --qrl-rollout-sglang-sync inplace") from exc


def serve(model: torch.nn.Module, named_tensors) -> None:
    """SGLang custom weight loader: answer the control message's request into its ``out``
    file (``export``: SGLang's ``MultiprocessingSerializer``, whose CUDA tensors travel as IPC
    handles with the device named by UUID; JSON otherwise; temp + rename). A request that
    fails is answered too, as ``{"error": class name, "message": ...}`` in ``out.<pid>.error``:
    an exception raised here would end SGLang's scheduler, and the engine with it."""
    msgs = [decode_control(t) for n, t in named_tensors if n == CONTROL]
    if len(msgs) != 1:
        raise EngineLayoutError(f"engine storage request carries {len(msgs)} control tensors, "
                                "expected 1")
    msg = msgs[0]
    path = f"{msg['out']}.{os.getpid()}"
    try:
        data = _answer(model, msg, [(n, t) for n, t in named_tensors if n != CONTROL])
    except Exception as exc:  # answered to the trainer, which raises it (storage_client)
        data = json.dumps({"error": type(exc).__name__, "message": str(exc)}).encode()
        path += ERROR
    with open(f"{path}.tmp", "wb") as f:
        f.write(data)
    os.replace(f"{path}.tmp", path)


def _answer(model: torch.nn.Module, msg: dict,
            items: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """The bytes of :func:`handle`'s answer to ``msg`` (:func:`serve`)."""
    out = handle(model, msg, items)
    if msg["what"] == "export":
        return _share({"layout": out["layout"].to_json(), "tensors": out["tensors"]})
    return json.dumps(out).encode()
