"""The SGLang rollout engine behind :class:`~megatron_qrl.rollout.base.RolloutEngine`.

In-process ``sglang.Engine`` started on an HF directory exported for the spec
(``tools/export_quantized.py``), so its layers are built for the low-bit format. Weight
sync takes the same packed stream as every engine:
- ``sync="inplace"`` (default for formats that quantize weights): buckets of packed tensors
  through ``update_weights_from_tensor`` with ``load_format`` = our registered loader
  (:mod:`.inplace`), which rebuilds each quantized layer's checkpoint parameters, re-runs
  its post-load processing (Marlin repacking, transposes) and copies the result into the
  live tensors, so CUDA graphs stay valid;
- ``sync="tensor"``: the same buckets through SGLang's plain ``model.load_weights`` (bf16,
  and formats whose loaded layout equals the checkpoint's);
- ``sync="distributed"``: the engine runs on other GPUs (``base_gpu_id``) and every bucket
  is broadcast from the trainer's GPU over a weight-update group (:mod:`.distributed`:
  SGLang's ``update_weights_from_distributed`` for bf16, our in-place loader for quantized
  formats);
- ``sync="disk"``: the stream is written as safetensors to ``sync_dir`` and loaded with
  ``update_weights_from_disk``, which re-runs each layer's post-load processing.
After every sync the engine's ``weight_version`` must equal the version sent, or the run
stops (:class:`WeightSyncError`). Requires a CUDA GPU and SGLang; imports fail with a
message naming the ``[gpu]`` extra.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..quant import get_spec
from ..rollout.base import (
    Checksums,
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    WeightSyncError,
)
from ..rollout.broadcast import flatten
from ..rollout.supervisor import EngineDiedError
from ..utils.optional import require
from . import crash, expert_stack
from .inplace import CONTROL, FLAT, LOADER, RECV, StreamTracker, encode_control
from .moe_configs import config_dir_for_engine
from .prefetch import ahead, timed
from .sync_policy import SYNC_MODES, check_sync_supported, default_sync, sync_options

FEATURE = "--qrl-rollout-engine sglang"

def packed_suffixes(spec) -> tuple[str, ...]:
    """The tensor suffixes ``spec`` packs a quantized linear into (``weight``,
    ``weight_scale``, ...), read off :meth:`QuantSpec.packed_names`."""
    probe = "model.layers.0.self_attn.o_proj.weight"
    if not spec.is_quantized(probe):
        return ()
    mod = probe.rpartition(".")[0]
    return tuple(n[len(mod) + 1:] for n in spec.packed_names(probe))


def engine_args_for(spec_name: str, is_moe: bool) -> dict:
    """Engine arguments that work on the H200 recipe (shared/gpu/sglang-h200) for a format."""
    args = {
        "skip_tokenizer_init": True,
        "grammar_backend": "none",
        "sampling_backend": "pytorch",
        "attention_backend": "triton",
        "mem_fraction_static": 0.5,
        "enable_return_routed_experts": is_moe,
    }
    if get_spec(spec_name).quantizes_weights:
        # capture fewer decode graphs for quantized kernels (graph capture 107 s -> 8 s measured)
        args["cuda_graph_bs_decode"] = [1, 8, 32, 64, 128, 192, 256]
    return args


class SGLangEngine(RolloutEngine):
    """``sglang.Engine`` in this process, fed QuantSpec-packed weights."""

    checksums_of_sent_stream = True  # held_checksums: what update_weights was handed

    def __init__(self, model_path: str | Path, spec_name: str, *, sync: str | None = None,
                 sync_dir: str | Path | None = None, bucket_bytes: int = 512 * 2**20,
                 trainer_device: str | torch.device | None = None, group_backend: str = "nccl",
                 flatten_buckets: bool | None = None, prefetch_buckets: int | None = None,
                 direct_expert_loads: bool | None = None, stack_experts: bool | None = None,
                 **engine_kwargs):
        sync = default_sync(spec_name) if sync is None else sync
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
        if sync == "disk" and sync_dir is None:
            raise ValueError("sync='disk' needs sync_dir (a fast local directory, e.g. /dev/shm)")
        check_sync_supported(spec_name, sync)
        self.trainer_device = torch.device(trainer_device or (
            f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"))
        if sync == "distributed":
            _check_distributed_layout(self.trainer_device, group_backend, engine_kwargs)
        self.group_backend = group_backend
        (self.flatten_buckets, self.prefetch_buckets, self.direct_expert_loads,
         self.stack_experts) = sync_options(sync, flatten_buckets, prefetch_buckets,
                                            direct_expert_loads, stack_experts)
        """In-place buckets carry each layer's experts of one kind as one stacked tensor
        (:mod:`.expert_stack`; needs ``direct_expert_loads``; default on in place with
        direct loads: 30B-A3B fp8 on the H200, engine share of a sync 4.3 s -> 1.3 s,
        bit-identical engine state in every format, docs/BENCHMARKS.md)."""
        """In-place loads put expert tensors straight into their FusedMoE parameters
        (:mod:`.expert_loads`; default on in place; ``direct_expert_loads=False`` turns the
        stacked wire off too; bench variants name it: ``FMT:inplace+direct``)."""
        """Buckets prepared ahead in a thread while the engine loads one (``tensor`` and
        ``inplace`` syncs; 0: one after the other; default 1 in place, measured in
        docs/BENCHMARKS.md, 0 otherwise; bench variant ``FMT:inplace+prefetch``)."""
        """In-place buckets as one flat buffer each (one CUDA-IPC handle per bucket instead
        of one per tensor; default on in place; bench/weight_sync.py variant
        ``FMT:inplace+flat``)."""
        self._group = None
        sglang = require("sglang", FEATURE)
        self.spec = get_spec(spec_name)
        self.model_path = Path(model_path)
        cfg = _read_config(self.model_path)
        self.is_moe = "num_experts" in cfg or "num_local_experts" in cfg
        self.num_layers = int(cfg["num_hidden_layers"])
        self.top_k = int(cfg.get("num_experts_per_tok", 0))
        self.sync, self.sync_dir, self.bucket_bytes = sync, sync_dir, bucket_bytes
        args = engine_args_for(spec_name, self.is_moe)
        if engine_kwargs.get("disable_cuda_graph"):
            args.pop("cuda_graph_bs_decode", None)
        if sync in ("inplace", "distributed"):
            args["custom_weight_loader"] = [LOADER]
        args |= engine_kwargs
        moe_dir = config_dir_for_engine()  # shipped tuned fused-MoE configs (tools/tune_fused_moe.py)
        if moe_dir is not None:
            os.environ["SGLANG_MOE_CONFIG_DIR"] = moe_dir  # read by the scheduler processes
        self.returns_experts = bool(self.is_moe and args.get("enable_return_routed_experts"))
        """MoE engines return routed experts unless started with
        ``enable_return_routed_experts=False`` (then ``routed_experts`` is None)."""
        # a crashed child must fail the engine call, not kill this process (.crash)
        args.setdefault("custom_sigquit_handler", crash.on_child_crash)
        crash.mark_alive()
        with crash.engine_call():
            self.engine = sglang.Engine(model_path=str(self.model_path), **args)
        self.crash_handler = crash.install(self.engine)
        """True when SGLang's process-killing SIGQUIT handlers were replaced (main thread)."""
        self._sent: dict[str, str] = {}
        self._version = -1
        self.fingerprint_rows = True
        """With ``stack_experts``: the experts' fingerprints are taken as rows of each stack
        (False: one by one before stacking, the order before 2026-11-29, kept so
        ``bench/weight_sync.py`` can time both side by side; the fingerprints are equal)."""
        self.last_sync: dict = {}
        """Where the last :meth:`update_weights` went: ``buckets`` sent, wall ``seconds``;
        tensor / in-place syncs add ``request_s`` (waiting on the engine's load requests),
        ``produce_s`` (preparing buckets — in the prefetch thread when ``prefetch_buckets`` —
        of which ``stream_s`` waited on the incoming packed stream (packing),
        ``fingerprint_s`` took the copies to the device and the fingerprints, ``flatten_s``
        built flat buckets), ``wait_s`` (this thread waiting for a prepared bucket: the
        preparation not hidden behind the engine), ``serialize_s`` (CUDA-IPC handles) and
        ``finish_s`` (version check and fingerprints fetched at the end)."""

    # ---- weights ---------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        sent = Checksums()  # fingerprints fetched once at the end (no sync per tensor)
        t0 = time.perf_counter()
        self.last_sync = {"buckets": 0, "seconds": 0.0}
        with crash.engine_call():
            if self.sync in ("tensor", "inplace"):
                self._sync_tensor(named_tensors, version, sent)
            elif self.sync == "distributed":
                self._sync_distributed(named_tensors, version, sent)
            else:
                self._sync_disk(named_tensors, version, sent)
            t1 = time.perf_counter()
            got = self.engine.get_server_info().get("weight_version")
        if str(got) != str(version):
            raise WeightSyncError(f"SGLang reports weight_version {got!r} after sending version "
                                  f"{version}; the engine did not apply the update")
        self._sent, self._version = sent.result(), version
        t2 = time.perf_counter()
        self.last_sync["finish_s"] = t2 - t1
        self.last_sync["seconds"] = t2 - t0

    def _sync_tensor(self, stream, version, sent) -> None:
        """Buckets of ~``bucket_bytes`` through ``update_weights_from_tensor``; in-place mode
        adds the control tensor saying which modules are complete (:mod:`.inplace`). With
        ``prefetch_buckets`` the next buckets are prepared while the engine loads one."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        tracker = (StreamTracker(packed_suffixes(self.spec),
                                 direct_experts=self.direct_expert_loads)
                   if self.sync == "inplace" else None)
        device = self.trainer_device  # colocated: the engine maps the trainer's tensors (IPC)
        init = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        lap = self.last_sync
        buckets = timed(ahead(timed(self._buckets(stream, sent, tracker, device, lap), lap,
                                    "produce_s"), self.prefetch_buckets, init), lap, "wait_s")
        lap.setdefault("serialize_s", 0.0)
        for items, first, last in buckets:
            t0 = time.perf_counter()
            payload = self.engine._serialize_tensors_per_rank(items, None)
            lap["serialize_s"] += time.perf_counter() - t0
            req = UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=payload, load_format=LOADER if tracker else None,
                flush_cache=last, weight_version=str(version) if last else None)
            ok, msg = self._checked("update_weights_from_tensor", req, first)
            if not ok:
                raise WeightSyncError(f"SGLang rejected a weight bucket ({first} ...): {msg}")
            self.last_sync["buckets"] += 1

    def _buckets(self, stream, sent, tracker, device, lap: dict | None = None
                 ) -> Iterator[tuple[list, str, bool]]:
        """``(tensors of one request, its first name, last)`` per bucket of ``stream``.
        Fingerprints are of the stream's own (per-expert) tensors; with ``stack_experts`` the
        wire carries each layer's experts stacked per kind (:mod:`.expert_stack`), stacked
        before fingerprinting: the per-expert fingerprints are then taken as rows of the
        stack, a few kernels per stack instead of a device copy and a queue entry per expert
        (equal bit for bit: :func:`~megatron_qrl.rollout.base.checksum_rows`)."""
        lap = {} if lap is None else lap  # produce_s's parts go there
        wire = timed(stream, lap, "stream_s")
        stack = tracker and self.stack_experts
        rows = getattr(self, "fingerprint_rows", True)
        if stack and rows:
            wire = expert_stack.stack_experts(wire)
        wire = self._fingerprinted(wire, sent, device, lap)
        if stack and not rows:
            wire = expert_stack.stack_experts(wire)
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, t in wire:
            if tracker:
                tracker.add(name)
                if not self.flatten_buckets:  # a flat bucket's meta keeps the real dtype
                    t = tracker.send_as(name, t)
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= self.bucket_bytes:
                yield self._request_items(bucket, tracker, device, last=False, lap=lap)
                bucket, size = [], 0
        # empty when the previous bucket filled exactly at the end of the stream: it still
        # carries the version (and, in place, the final control tensor)
        yield self._request_items(bucket, tracker, device, last=True, lap=lap)

    @staticmethod
    def _fingerprinted(stream, sent, device, lap: dict) -> Iterator[tuple[str, torch.Tensor]]:
        lap.setdefault("fingerprint_s", 0.0)
        for name, t in stream:
            t0 = time.perf_counter()
            t = t.detach().to(device, non_blocking=True).contiguous()
            if expert_stack.parse_stacked(name) is None:
                sent.add(name, t)
            else:  # the experts' own names and fingerprints, from the rows of the stack
                if t.dim() == 0:
                    expert_stack.expert_views(name, t)  # raises, naming the tensor
                sent.add_rows(expert_stack.expert_names(name, t.shape[0]), t)
            lap["fingerprint_s"] += time.perf_counter() - t0
            yield name, t

    def _request_items(self, bucket, tracker, device, last: bool, lap: dict
                       ) -> tuple[list, str, bool]:
        items = bucket
        if tracker and self.flatten_buckets and bucket:
            t0 = time.perf_counter()
            flat, meta = flatten(bucket)
            items = [(RECV, encode_control({"meta": meta}).to(device)), (FLAT, flat)]
            lap["flatten_s"] = lap.get("flatten_s", 0.0) + time.perf_counter() - t0
        if tracker:
            items = items + [(CONTROL, tracker.control(final=last).to(device))]
        return items, bucket[0][0] if bucket else "end of sync", last

    def weight_group(self):
        """The weight-update group of ``sync="distributed"`` (created on first use)."""
        if self._group is None:
            from .distributed import open_group

            tp = int(self.engine.server_args.tp_size)
            self._group = open_group(
                lambda host, port, world, name: self.engine.init_weights_update_group(
                    host, port, 1, world, name, backend=self.group_backend),
                tp, self.trainer_device, backend=self.group_backend)
        return self._group

    def _sync_distributed(self, stream, version, sent) -> None:
        """Buckets broadcast from the trainer's device (:mod:`.distributed`)."""
        from sglang.srt.managers.io_struct import (
            UpdateWeightsFromDistributedReqInput,
            UpdateWeightsFromTensorReqInput,
        )

        from .distributed import flat_buckets, run_alongside, send_bucket

        group = self.weight_group()
        quantized = self.spec.quantizes_weights
        tracker = StreamTracker(packed_suffixes(self.spec)) if quantized else None

        for names, flat, meta, last in flat_buckets(sent.passing(stream), self.bucket_bytes,
                                                    self.trainer_device):
            wv = str(version) if last else None
            if tracker:
                for n in names:
                    tracker.add(n)
                small = [(RECV, encode_control({"group": group.name, "meta": meta}).cuda()),
                         (CONTROL, tracker.control(final=last).cuda())]
                req = UpdateWeightsFromTensorReqInput(
                    serialized_named_tensors=self.engine._serialize_tensors_per_rank(small, None),
                    load_format=LOADER, flush_cache=last, weight_version=wv)
            else:
                req = UpdateWeightsFromDistributedReqInput(
                    names=names, dtypes=[d for _, d, _ in meta], shapes=[s for _, _, s in meta],
                    group_name=group.name, flush_cache=last, weight_version=wv,
                    load_format="flattened_bucket")
            send = ("update_weights_from_tensor" if tracker
                    else "update_weights_from_distributed")
            ok, msg = run_alongside(partial(self._checked, send, req, names[0]),
                                    partial(send_bucket, flat, group))
            if not ok:
                raise WeightSyncError(f"SGLang rejected a broadcast weight bucket ({names[0]} ...): {msg}")
            self.last_sync["buckets"] += 1

    def _checked(self, send: str, req, first: str) -> tuple[bool, str]:
        """``(ok, message)`` of weight request ``req`` sent by the tokenizer manager's ``send``
        method (``update_weights_from_tensor`` / ``..._distributed``); a dead engine is an
        :class:`EngineDiedError` naming the bucket's ``first`` tensor."""
        t0 = time.perf_counter()
        try:
            coro = getattr(self.engine.tokenizer_manager, send)(req, None)
            return tuple(self.engine.loop.run_until_complete(coro)[:2])
        except Exception as exc:
            if not self._alive():
                raise EngineDiedError(f"SGLang died loading a weight bucket ({first} ...; see "
                                      f"the scheduler log): {exc}") from exc
            raise
        finally:  # the engine's share of the sync (the rest: packing, fingerprints, buckets)
            self.last_sync["request_s"] = self.last_sync.get("request_s", 0.0) + (
                time.perf_counter() - t0)

    def _sync_disk(self, stream, version, sent) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        from ..models.hf_io import copy_side_files, write_safetensors

        target = Path(self.sync_dir) / f"v{version}"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)

        write_safetensors(sent.passing(stream), target)
        copy_side_files(self.model_path, target)
        req = UpdateWeightFromDiskReqInput(model_path=str(target), weight_version=str(version))
        ok, msg = self.engine.loop.run_until_complete(
            self.engine.tokenizer_manager.update_weights_from_disk(req, None))[:2]
        shutil.rmtree(target, ignore_errors=True)
        if not ok:
            raise WeightSyncError(f"SGLang failed to load the synced weights: {msg}")

    def held_checksums(self) -> dict[str, str]:
        """Checksums of the tensors SGLang acknowledged in the last sync (it holds them in its
        own post-processed layout, which cannot be fingerprinted against the packed form)."""
        return dict(self._sent)

    def weight_version(self) -> int:
        return self._version

    # ---- generation ------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        if self._version < 0:
            raise WeightSyncError("generate() before the first update_weights()")
        params = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                  "top_p": sampling.top_p, "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                  "stop_token_ids": list(sampling.stop_token_ids), "stop": list(sampling.stop)}
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        try:
            with crash.engine_call():
                outs = self.engine.generate(input_ids=[list(p) for p in prompts],
                                            sampling_params=params, return_logprob=True,
                                            return_routed_experts=self.returns_experts)
        except Exception as exc:
            if not self._alive():
                raise EngineDiedError(f"an SGLang engine process exited: {exc}") from exc
            raise
        return self._to_output(prompts, outs)

    def _alive(self) -> bool:
        """True while every scheduler / detokenizer child process still runs."""
        import psutil

        return all(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in self.engine.get_all_child_pids())

    def _to_output(self, prompts, outs) -> GenerationOutput:
        b = len(outs)
        resp = [list(o["output_ids"]) for o in outs]
        t = max(len(r) for r in resp)
        ids = torch.zeros(b, t, dtype=torch.long)
        lp = torch.zeros(b, t)
        for i, o in enumerate(outs):
            n = len(resp[i])
            ids[i, :n] = torch.tensor(resp[i], dtype=torch.long)
            lp[i, :n] = torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]][:n])
        mask = torch.arange(t)[None] < torch.tensor([len(r) for r in resp])[:, None]
        reasons = [o["meta_info"]["finish_reason"]["type"] for o in outs]
        experts = None
        if self.returns_experts:
            experts = torch.full((b, max(map(len, prompts)) + t, self.num_layers, self.top_k), -1)
            for i, o in enumerate(outs):
                flat = np.frombuffer(base64.b64decode(o["meta_info"]["routed_experts"]), np.int32)
                rows = torch.from_numpy(flat.copy()).view(-1, self.num_layers, self.top_k)
                experts[i, : rows.shape[0]] = rows.long()
        return GenerationOutput([list(p) for p in prompts], ids, lp, mask, reasons,
                                self._version, experts)

    def release_memory(self) -> None:
        with crash.engine_call():
            self.engine.release_memory_occupation()

    def resume_memory(self) -> None:
        with crash.engine_call():
            self.engine.resume_memory_occupation()

    def shutdown(self) -> None:
        if self._group is not None:  # a process group left at exit aborts the interpreter
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group(self._group.pg)
            self._group = None
        self.engine.shutdown()


def _check_distributed_layout(trainer: torch.device, backend: str, engine_kwargs: dict) -> None:
    """``sync="distributed"`` broadcasts between processes on different GPUs (NCCL cannot
    put two ranks of a group on one GPU)."""
    if backend == "nccl" and trainer.type != "cuda":
        raise ValueError(f"sync='distributed' with group_backend='nccl' needs the trainer's "
                         f"weights on a CUDA device, got trainer_device={trainer}")
    first = int(engine_kwargs.get("base_gpu_id", 0))
    tp = int(engine_kwargs.get("tp_size", 1))
    if backend == "nccl" and trainer.index is not None and first <= trainer.index < first + tp:
        raise ValueError(
            f"sync='distributed': the engine's GPUs {list(range(first, first + tp))} "
            f"(base_gpu_id={first}, tp_size={tp}) include the trainer's {trainer}; start the "
            "engine on other GPUs (base_gpu_id) or use sync='inplace' / 'tensor' (colocated)")


def _read_config(path: Path) -> dict:
    import json

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: start the SGLang engine on a directory "
                                "written by tools/export_quantized.py")
    return json.loads(cfg_file.read_text())
