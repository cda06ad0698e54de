"""Transport ``disk``: the stream as safetensors in ``sync_dir/v<version>``, loaded with
SGLang's ``update_weights_from_disk`` (which re-runs each layer's post-load processing);
the directory is removed afterwards. One bucket: the whole stream."""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from megatron_qrl.sync.protocol.checksums import WeightSyncError
from megatron_qrl.sync.transport import WeightTransport, register_transport

from ..session import SGLangSession

__all__ = ["DiskTransport"]


@register_transport("sglang", "disk")
class DiskTransport(WeightTransport):
    """Safetensors on disk, then one load request (module docstring)."""

    def __init__(self, session: SGLangSession):
        self.s = session

    def prepare(self, version: int) -> None:
        self.target = Path(self.s.options.sync_dir) / f"v{version}"
        self.version = version

    def produce(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Iterable]:
        yield self.s.sent.passing(stream)  # written as one file set, never held whole

    def send_bucket(self, item: Iterable[tuple[str, torch.Tensor]]) -> int:
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        from ....models.hf_io import copy_side_files, write_safetensors

        shutil.rmtree(self.target, ignore_errors=True)
        self.target.mkdir(parents=True)
        write_safetensors(item, self.target)
        copy_side_files(self.s.model_path, self.target)
        req = UpdateWeightFromDiskReqInput(model_path=str(self.target),
                                           weight_version=str(self.version))
        ok, msg = self.s.call("update_weights_from_disk", req)
        shutil.rmtree(self.target, ignore_errors=True)
        if not ok:
            raise WeightSyncError(f"SGLang failed to load the synced weights: {msg}")
        return 1
