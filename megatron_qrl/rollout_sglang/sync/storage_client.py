"""The trainer's handle on the engine's parameter storage (the direct sync's other end).

Runs in the trainer's process. :func:`storage_request` sends one request to the engine's
storage service (:mod:`.loader.storage`, inside SGLang's scheduler: the control tensor of an
``update_weights_from_tensor`` call with ``load_format`` =
:data:`~megatron_qrl.sync.protocol.engine_layout.STORAGE`) and reads its answer back — for
``export`` the layout and the parameters opened from their CUDA IPC handles.
:class:`EngineStorage` keeps what was opened across syncs and asks, before each sync, for the
storage fingerprint only: where SGLang moved a parameter (a re-created tensor after a memory
release / resume, a re-processed module) the handles are taken again.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from megatron_qrl.sync.protocol.checksums import WeightSyncError
from megatron_qrl.sync.protocol.engine_layout import (
    ERROR,
    STORAGE,
    EngineLayout,
    EngineLayoutError,
    HeldTensorError,
)
from megatron_qrl.sync.protocol.inplace import CONTROL, encode_control

__all__ = ["EngineStorage", "storage_request"]


class EngineStorage:
    """The engine's storage as opened here; ``call(msg) -> answer`` reaches the engine."""

    def __init__(self, call: Callable[[dict], dict]):
        self.call = call
        self.layout: EngineLayout | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.taken = 0
        """Times the handles were taken (the first sync, then after every move)."""
        self.derived: dict = {}
        """What callers derived from the tensors (the writer's regions,
        :class:`~.writer.Places`), dropped with the handles."""

    def current(self) -> tuple[EngineLayout, dict[str, torch.Tensor]]:
        """The layout and tensors, re-taken where the engine's fingerprint changed."""
        if self.layout is not None:
            if self.call({"what": "fingerprint"})["fingerprint"] == self.layout.fingerprint:
                return self.layout, self.tensors
        self.layout = self.tensors = None  # the old handles go before the new are opened
        self.derived = {}
        out = self.call({"what": "export"})
        self.layout, self.tensors = out["layout"], out["tensors"]
        self.taken += 1
        return self.layout, self.tensors


def storage_request(request: Callable[[str, object, str], tuple[bool, str]],
                    serialize: Callable[[list], object], device: torch.device, out: str,
                    msg: dict, version: int | None = None,
                    tensors: Sequence[tuple[str, torch.Tensor]] = ()) -> dict:
    """Send ``msg`` to the engine's storage service and read the answer written to ``out``
    (one engine process); ``version`` (with the digest after a trainer-side write, the
    fingerprint after an engine-side one) becomes the engine's weight version and flushes its
    cache; ``tensors`` travel with the request (a ``write``'s, as
    CUDA IPC handles)."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    for old in glob.glob(f"{glob.escape(out)}.*"):
        Path(old).unlink(missing_ok=True)
    ctl = encode_control({**msg, "out": out}).to(device)
    req = UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=serialize([(CONTROL, ctl), *tensors]), load_format=STORAGE,
        flush_cache=version is not None,
        weight_version=str(version) if version is not None else None)
    ok, text = request("update_weights_from_tensor", req, f"storage {msg['what']}")
    files = [f for f in glob.glob(f"{glob.escape(out)}.*") if not f.endswith(".tmp")]
    if not ok or len(files) != 1:
        raise WeightSyncError(f"the engine's storage service did not answer {msg['what']!r} "
                              f"({len(files)} answers, expected 1): {text}")
    data = Path(files[0]).read_bytes()
    Path(files[0]).unlink()
    if files[0].endswith(ERROR):
        _raise_answered(msg["what"], json.loads(data))
    if msg["what"] != "export":
        return json.loads(data)
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    # the engine's processes pickle CUDA tensors with SGLang's reducer (the device named by
    # its uuid); its rebuild function needs the same patch in this process (idempotent)
    monkey_patch_torch_reductions()
    got = MultiprocessingSerializer.deserialize(data)  # the engine we started wrote it
    return {"layout": EngineLayout.from_json(got["layout"]), "tensors": got["tensors"]}


def _raise_answered(what: str, err: dict) -> None:
    """The failure the engine's storage service answered to request ``what``
    (``{"error": class name, "message": ...}``), raised here: an :class:`EngineLayoutError`
    or :class:`HeldTensorError` as itself (the message names the fix; the second, that the
    request can be sent again with every handle), anything else as a
    :class:`WeightSyncError`."""
    for cls in (EngineLayoutError, HeldTensorError):
        if err["error"] == cls.__name__:
            raise cls(err["message"])
    raise WeightSyncError(f"the engine's storage service failed {what!r} ({err['error']}: "
                          f"{err['message']}); see the scheduler log")
