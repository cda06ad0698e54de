"""The SGLang rollout engine behind :class:`~megatron_qrl.rollout.base.RolloutEngine`.

In-process ``sglang.Engine`` started on an HF directory for the spec (exported by
``tools/export_quantized.py``, or config-only with placeholder weights: :mod:`.launch`), so
its layers are built for the low-bit format. This module holds the engine's lifecycle and
generation; the weight sync lives in :mod:`.sync`, split where the process splits. Each
sync path (``SGLangOptions.sync``, resolved per format by :meth:`~.options.SGLangOptions.
resolve`: ``inplace``, ``tensor``, ``distributed``, ``disk``) is one transport of
:mod:`.sync.transports`, handed a typed :class:`~.sync.session.SGLangSession` by
:meth:`SGLangEngine.transport`; its module docstring says how it works.

Verification: after every sync the engine's ``weight_version`` must equal the version sent.
Where our loader runs (in place, and quantized distributed syncs), each scheduler process
also fingerprints what it received (and the parameters it holds in the received layout) and
the transport's ``verify`` compares that receipt with the fingerprints of the stream it was
handed, raising :class:`WeightSyncError` naming the tensor (``SGLangOptions.receipt``, on by
default). SGLang's own loaders (``tensor``, ``disk``, bf16 ``distributed``) return no
receipt: there only the version is checked. Requires a CUDA GPU and SGLang; imports fail
with a message naming the ``[gpu]`` extra.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..quant import get_spec
from ..rollout.base import (
    Checksums,
    EngineCapacity,
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    WeightSyncError,
)
from ..rollout.groups import group_seed
from ..rollout.sampling import row_seeds
from ..rollout.supervisor import EngineDiedError
from ..sync.protocol.engine_layout import STORAGE
from ..sync.protocol.inplace import LOADER
from ..sync.transport import WeightTransport, transport_class
from ..utils.devices import gpu_capability as _capability
from ..utils.optional import require
from . import crash
from .attention import choose_attention, fa3_kernel
from .kernels.moe_configs import config_dir_for_engine
from .options import SGLangOptions
from .sync import transports as _transports  # noqa: F401  (registers the sync paths)
from .sync.session import SGLangSession
from .sync.transports.direct import check_placement

FEATURE = "--qrl-rollout-engine sglang"
UNSEEDED_WARNING = (
    "SGLang engine: sampling seeds are ignored without --qrl-rollout-sglang-deterministic "
    "(SGLang's enable_deterministic_inference): samples depend on the engine, its history and "
    "the batch, so rollouts change with the number of engines and after a restart (the sampled "
    "distribution is unaffected)")
"""Logged once per engine on its first seeded sampling without ``deterministic``."""

log = logging.getLogger(__name__)


def engine_args_for(spec_name: str, is_moe: bool) -> dict:
    """Engine arguments that work on the H200 recipe (shared/gpu/sglang-h200) for a format."""
    args = {
        "skip_tokenizer_init": True,
        "grammar_backend": "none",
        "sampling_backend": "pytorch",
        "attention_backend": "triton",  # the engine's choice replaces it (rollout_sglang.attention)
        "mem_fraction_static": 0.5,
        "enable_return_routed_experts": is_moe,
    }
    if get_spec(spec_name).quantizes_weights:
        # capture fewer decode graphs for quantized kernels (graph capture 107 s -> 8 s measured)
        args["cuda_graph_bs_decode"] = [1, 8, 32, 64, 128, 192, 256]
    return args


class SGLangEngine(RolloutEngine):
    """``sglang.Engine`` in this process, fed QuantSpec-packed weights.

    ``options``: :class:`SGLangOptions` (resolved for ``spec_name`` here: the sync path and
    its speed options); ``bucket_bytes``: bytes per weight request; ``trainer_device``: where
    the trainer's tensors are (default: the current CUDA device); ``group_backend``: the
    weight-update group's of a distributed sync; ``engine_kwargs``: ``sglang.Engine``
    arguments (they win over :func:`engine_args_for` and the options)."""

    verifies_own_update = True
    _capacity: EngineCapacity | None = None
    _warned_unseeded = False
    """Whether :data:`UNSEEDED_WARNING` was logged by this engine (once per engine)."""

    @property
    def stacked_experts(self) -> bool:
        """The in-place sync with ``stack_experts`` takes expert stacks (RolloutEngine)."""
        return self.options.sync == "direct" or (self.options.sync == "inplace"
                                                 and bool(self.options.stack_experts))

    @property
    def quantizes_into(self) -> bool:
        """The direct sync quantizes the weights into the engine's tensors (RolloutEngine)."""
        return self.options.sync == "direct"

    @property
    def reshares_stream(self) -> bool:
        """The direct sync under the memory saver sends the stream's tensors to the engine's
        scheduler by CUDA IPC (RolloutEngine)."""
        return self.options.sync == "direct" and self.options.release_memory

    @property
    def holds_stream_tensors(self) -> bool:
        """The engine-side direct write keeps the trainer's tensors (RolloutEngine)."""
        return self.reshares_stream and self.options.hold_trainer_tensors

    def __init__(self, model_path: str | Path, spec_name: str,
                 options: SGLangOptions | None = None, *, bucket_bytes: int = 512 * 2**20,
                 trainer_device: str | torch.device | None = None, group_backend: str = "nccl",
                 **engine_kwargs):
        misplaced = sorted(set(engine_kwargs) & {f.name for f in dataclasses.fields(SGLangOptions)})
        if misplaced:
            raise TypeError(f"SGLangEngine: {misplaced[0]}= is an SGLangOptions field; pass "
                            f"options=SGLangOptions({misplaced[0]}=...)")
        self.options = (options if options is not None else SGLangOptions()).resolve(spec_name)
        self.trainer_device = torch.device(trainer_device or (
            f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"))
        self.group_backend, self.bucket_bytes = group_backend, bucket_bytes
        placement = {"tp_size": 1} | self._placement() | engine_kwargs
        self.processes = int(placement["tp_size"])
        """Scheduler processes (TP ranks): each loads every bucket and writes a receipt."""
        if self.options.sync == "direct":
            check_placement(self.trainer_device, placement)
        if self.options.sync == "distributed":
            _check_distributed_layout(self.trainer_device, group_backend,
                                      int(placement.get("base_gpu_id", 0)), self.processes)
        self._group = None
        sglang = require("sglang", FEATURE)
        self.spec = get_spec(spec_name)
        self.model_path = Path(model_path)
        cfg = _read_config(self.model_path)
        self.is_moe = "num_experts" in cfg or "num_local_experts" in cfg
        self.num_layers = int(cfg["num_hidden_layers"])
        self.top_k = int(cfg.get("num_experts_per_tok", 0))
        args = engine_args_for(spec_name, self.is_moe) | self._placement() \
            | self.options.engine_kwargs
        self.attention = choose_attention(self.options.attention_backend, self.options.kv_cache,
                                          _capability(args.get("base_gpu_id", 0)), fa3_kernel())
        """The attention backend SGLang runs and why (rollout_sglang.attention)."""
        args["attention_backend"] = self.attention.backend
        if self.options.release_memory:  # release_memory_occupation frees memory only so
            args["enable_memory_saver"] = True
        if engine_kwargs.get("disable_cuda_graph"):
            args.pop("cuda_graph_bs_decode", None)
        if self.uses_loader or self.options.sync == "direct":
            args["custom_weight_loader"] = [LOADER, STORAGE]
        args |= engine_kwargs
        moe_dir = config_dir_for_engine()  # shipped tuned fused-MoE configs (kernels/)
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
        self._reset_sync_state()

    def _placement(self) -> dict:
        """``base_gpu_id`` from the options, where the engine is placed away from GPU 0."""
        o = self.options
        return {"base_gpu_id": o.base_gpu} if o.base_gpu or o.sync == "distributed" else {}

    def _reset_sync_state(self) -> None:
        self._transport_state: dict = {}
        """What a transport keeps across syncs (the direct sync's opened storage)."""
        self._sent: dict[str, str] = {}
        self._received: dict[str, str] | None = None
        self._version = -1
        self._receipts: str | None = None
        self.last_sync: dict = {}
        """Where the last :meth:`update_weights` went: ``buckets`` sent, wall ``seconds``,
        ``verified`` (``receipt``: the engine's fingerprints of what it received were
        compared; ``version``: only the weight version); tensor / in-place syncs add
        ``request_s`` (waiting on the engine's load requests), ``produce_s`` (preparing
        buckets — in the prefetch thread when ``prefetch_buckets`` — of which ``stream_s``
        waited on the incoming packed stream, ``fingerprint_s`` took the copies to the
        device and the fingerprints, ``flatten_s`` built flat buckets), ``wait_s`` (this
        thread waiting for a prepared bucket), ``serialize_s`` (CUDA-IPC handles) and
        ``finish_s`` (version check, fingerprints and the receipts at the end); direct syncs
        add ``storage_s``, ``write_s`` (of which ``stream_s`` waited on the stream),
        ``digest_s``, ``handles_taken``, ``quantized`` and ``copied``; written by the engine
        (its memory saver on) ``engine_writes``, ``buckets`` requests, ``loader_s`` (their
        time in the engine's writer: the rest of ``request_s`` is SGLang's way there and the
        handles opened) split by phase into ``loader_<phase>_s``
        (``loader.storage_write.PHASES``) and ``held_refs`` (tensors sent by name)."""

    @property
    def uses_loader(self) -> bool:
        """Whether syncs go through our loader (:mod:`.sync.loader`), which returns receipts."""
        s = self.options.sync
        return s == "inplace" or (s == "distributed" and self.spec.quantizes_weights)

    # ---- weights ---------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        sent = Checksums()  # fingerprints fetched once at the end (no sync per tensor)
        receipt = (self._receipt_prefix(version) if self.uses_loader and self.options.receipt
                   else None)
        t0 = time.perf_counter()
        self.last_sync = {"buckets": 0, "seconds": 0.0}
        with crash.engine_call():
            transport = self.transport(sent, receipt)
            transport.send(named_tensors, version)
            t1 = time.perf_counter()
            got = self.engine.get_server_info().get("weight_version")
        if str(got) != str(version):
            raise WeightSyncError(f"SGLang reports weight_version {got!r} after sending version "
                                  f"{version}; the engine did not apply the update")
        self._sent, self._version = sent.result(), version
        self._received = transport.verify(self._sent)
        self.last_sync["verified"] = ("digest" if self.options.sync == "direct"
                                      else "receipt" if receipt else "version")
        t2 = time.perf_counter()
        self.last_sync["finish_s"] = t2 - t1
        self.last_sync["seconds"] = t2 - t0

    def transport(self, sent: Checksums, receipt: str | None) -> WeightTransport:
        """``options.sync``'s transport for one sync (fingerprints to ``sent``, receipts to ``receipt``)."""
        session = SGLangSession(
            self.options, self.spec, self.trainer_device, self.bucket_bytes, self.processes,
            self.model_path, sent, receipt, self.last_sync,
            serialize=lambda items: self.engine._serialize_tensors_per_rank(items, None),
            request=self.request, call=self._call, weight_group=self.weight_group,
            storage=self._storage_call, state=self._transport_state)
        return transport_class("sglang", self.options.sync, "--qrl-rollout-sglang-sync")(session)

    def _receipt_prefix(self, version: int) -> str:
        """Where this sync's receipts go (a sync that failed left its own: removed)."""
        if self._receipts is None:
            self._receipts = tempfile.mkdtemp(prefix="qrl-sglang-receipts-")
        for old in Path(self._receipts).glob("*"):
            old.unlink(missing_ok=True)
        return str(Path(self._receipts) / f"v{version}")

    def request(self, send: str, req, first: str) -> tuple[bool, str]:
        """``(ok, message)`` of weight request ``req`` sent by the tokenizer manager's ``send``
        method (``update_weights_from_tensor`` / ``..._distributed``); a dead engine is an
        :class:`EngineDiedError` naming the bucket's ``first`` tensor."""
        t0 = time.perf_counter()
        try:
            return self._call(send, req)
        except Exception as exc:
            if not self._alive():
                raise EngineDiedError(f"SGLang died loading a weight bucket ({first} ...; see "
                                      f"the scheduler log): {exc}") from exc
            raise
        finally:  # the engine's share of the sync (the rest: packing, fingerprints, buckets)
            self.last_sync["request_s"] = self.last_sync.get("request_s", 0.0) + (
                time.perf_counter() - t0)

    def _call(self, method: str, req) -> tuple[bool, str]:
        """``(ok, message)`` of the tokenizer manager's ``method(req)``."""
        coro = getattr(self.engine.tokenizer_manager, method)(req, None)
        return tuple(self.engine.loop.run_until_complete(coro)[:2])

    def _storage_call(self, msg: dict, tensors: Sequence[tuple[str, torch.Tensor]] = ()
                      ) -> dict:
        """One request to the engine's storage service (``sync="direct"``), ``tensors`` with
        it."""
        from .sync.storage_client import storage_request

        msg = dict(msg)
        version = msg.pop("version", None)
        if self._receipts is None:
            self._receipts = tempfile.mkdtemp(prefix="qrl-sglang-receipts-")
        return storage_request(self.request,
                               lambda items: self.engine._serialize_tensors_per_rank(items, None),
                               self.trainer_device, str(Path(self._receipts) / "storage"), msg,
                               version, tensors)

    def weight_group(self):
        """The weight-update group of ``sync="distributed"`` (created on first use)."""
        if self._group is None:
            from .sync.distributed import open_group

            self._group = open_group(
                lambda host, port, world, name: self.engine.init_weights_update_group(
                    host, port, 1, world, name, backend=self.group_backend),
                self.processes, self.trainer_device, backend=self.group_backend)
        return self._group

    def held_checksums(self) -> dict[str, str]:
        """Fingerprints of the last sync as the engine's scheduler took them of what it
        received (checked in :meth:`update_weights`; ``last_sync["verified"] == "receipt"``).
        SGLang's own loaders (tensor / disk / bf16 distributed syncs) return no receipt: then
        these are :meth:`sent_checksums`, the stream this process was handed."""
        return dict(self._received if self._received is not None else self._sent)

    def sent_checksums(self) -> dict[str, str]:
        """Fingerprints of the stream the last :meth:`update_weights` was handed (taken in
        this process, before the transport)."""
        return dict(self._sent)

    def weight_version(self) -> int:
        return self._version

    # ---- generation ------------------------------------------------------------------
    def capacity(self) -> EngineCapacity | None:
        """The KV pool and batch limit SGLang settled on at start (read once)."""
        if self._capacity is None:
            from .server_info import capacity_from_server_info

            self._capacity = capacity_from_server_info(self.engine.get_server_info())
        return self._capacity

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        if self._version < 0:
            raise WeightSyncError("generate() before the first update_weights()")
        params = self._sampling_params(len(prompts), sampling)
        try:
            with crash.engine_call():
                outs = self.engine.generate(input_ids=[list(p) for p in prompts],
                                            sampling_params=params, return_logprob=True,
                                            return_routed_experts=self.returns_experts,
                                            **self._request_kwargs(len(prompts)))
        except Exception as exc:
            if not self._alive():
                raise EngineDiedError(f"an SGLang engine process exited: {exc}") from exc
            raise
        return self._to_output(prompts, outs)

    def _sampling_params(self, n: int, sampling: SamplingParams) -> dict | list[dict]:
        """SGLang's sampling parameters for ``n`` prompts. A seeded sampling (temperature > 0,
        ``sampling.seed`` set) on a deterministic engine gives every row its own
        ``sampling_seed`` (:func:`~megatron_qrl.rollout.sampling.row_seeds` of the call's
        seed, or of each prompt group's seed with ``sampling.group_size``: SGLang hashes
        (seed, position) into the noise, so the rows of a prompt group would be equal under
        one seed); on an engine without ``deterministic`` SGLang ignores ``sampling_seed``:
        none is sent and a warning says so once per engine."""
        params = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                  "top_p": sampling.top_p, "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                  "stop_token_ids": list(sampling.stop_token_ids), "stop": list(sampling.stop)}
        if sampling.seed is None or sampling.temperature == 0:
            return params
        if self.options.deterministic:
            return [params | {"sampling_seed": s} for s in _row_seeds(sampling, n)]
        if not self._warned_unseeded:
            self._warned_unseeded = True
            log.warning(UNSEEDED_WARNING)
        return params

    def _request_kwargs(self, n: int) -> dict:
        """Extra ``sglang.Engine.generate`` arguments for ``n`` prompts (the LoRA engine names
        its adapter here)."""
        return {}

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
        if self._receipts is not None:
            shutil.rmtree(self._receipts, ignore_errors=True)
        self._transport_state.clear()  # the direct sync's opened engine memory goes first
        self.engine.shutdown()


def _check_distributed_layout(trainer: torch.device, backend: str, first: int, tp: int) -> None:
    """``sync="distributed"`` broadcasts between processes on different GPUs (NCCL cannot
    put two ranks of a group on one GPU)."""
    if backend == "nccl" and trainer.type != "cuda":
        raise ValueError(f"sync='distributed' with group_backend='nccl' needs the trainer's "
                         f"weights on a CUDA device, got trainer_device={trainer}")
    if backend == "nccl" and trainer.index is not None and first <= trainer.index < first + tp:
        raise ValueError(
            f"sync='distributed': the engine's GPUs {list(range(first, first + tp))} "
            f"(base_gpu_id={first}, tp_size={tp}) include the trainer's {trainer}; start the "
            "engine on other GPUs (base_gpu_id) or use sync='inplace' / 'tensor' (colocated)")


def _read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: start the SGLang engine on a directory "
                                "written by tools/export_quantized.py")
    return json.loads(cfg_file.read_text())


def _row_seeds(sampling: SamplingParams, n: int) -> list[int]:
    """The ``sampling_seed`` of each of ``n`` rows: per prompt group (``group_size``) the
    rows of :func:`~megatron_qrl.rollout.groups.group_seed`, as the fleet sends one group
    per call, else the rows of ``sampling.seed``."""
    g = sampling.group_size
    if not g:
        return row_seeds(sampling.seed, n)
    if n % g:
        raise ValueError(f"generate: {n} prompts are not whole prompt groups of {g} "
                         "(SamplingParams.group_size)")
    return [s for k in range(n // g) for s in row_seeds(group_seed(sampling.seed, k), g)]
