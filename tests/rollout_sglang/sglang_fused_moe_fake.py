"""A CPU stand-in for SGLang 0.5.17's ``FusedMoE`` weight loading (tests only).

The methods below are condensed copies of ``sglang/srt/layers/moe/fused_moe_triton/layer.py``
(``weight_loader`` l.899, ``_weight_loader_physical`` l.974, ``_weight_loader_impl`` l.1053,
``_load_w13`` l.604, ``_load_w2`` l.688, ``_load_per_channel_weight_scale`` l.583,
``_load_per_tensor_weight_scale`` l.532, ``_load_single_value`` l.861,
``_map_global_expert_id_to_local_expert_id`` l.889) without the branches the tests never
take (padded loading, GGUF data, fused shared experts, ROCm), and quant methods whose
``create_weights`` register the parameters (shapes, dtypes, attributes) of the SGLang methods
our formats use: ``W8A8Int8MoEMethod``, ``Fp8MoEMethod`` (block and per-tensor),
``ModelOptNvFp4FusedMoEMethod``, compressed-tensors ``CompressedTensorsWNA16MoE``.
Their ``weight_loader`` globals (``_is_hip``, ``get_global_expert_location_metadata``) live in
this module, as they live in layer.py, so :mod:`megatron_qrl.rollout_sglang.sync.loader.expert_batch`
reads them here.
"""

from __future__ import annotations

from functools import cached_property
from types import SimpleNamespace

import torch
from torch import nn

_is_hip = False
_is_cpu = False  # SGLang's CPU build pads; the H200 engine does not
META = None
_WNA16 = ["CompressedTensorsWNA16MarlinMoE", "CompressedTensorsWNA16MoE",
          "CompressedTensorsWNA16TritonMoE"]


def get_global_expert_location_metadata():
    return META


class Metadata:
    """``ExpertLocationMetadata.logical_to_all_physical`` (eplb/expert_location.py l.347)."""

    def __init__(self, num_logical: int, num_physical: int, extra: dict | None = None):
        self.num_logical_experts, self.num_physical, self.extra = num_logical, num_physical, extra

    def logical_to_all_physical(self, layer_id, logical_expert_id, require_global_experts=False):
        if require_global_experts:
            return list(range(logical_expert_id, self.num_physical, self.num_logical_experts))
        return [logical_expert_id] + (self.extra or {}).get(logical_expert_id, [])


class VParam(nn.Parameter):
    """``BasevLLMParameter``: ``weight_loader`` is a property over ``_weight_loader``."""

    def __new__(cls, data, weight_loader):
        p = super().__new__(cls, data, requires_grad=False)
        p._weight_loader = weight_loader
        return p

    @property
    def weight_loader(self):
        return self._weight_loader


def _reg(layer, name, t, attrs):
    p = nn.Parameter(t, requires_grad=False)
    vars(p).update(attrs)
    layer.register_parameter(name, p)


class _Method:
    up_first = False

    def process_weights_after_loading(self, layer):
        pass

    @property
    def load_up_proj_weight_first(self):
        return self.up_first


class W8A8Int8MoEMethod(_Method):
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra):
        i, e = intermediate_size_per_partition, num_experts
        _reg(layer, "w13_weight", torch.empty(e, 2 * i, hidden_size, dtype=torch.int8), extra)
        _reg(layer, "w2_weight", torch.empty(e, hidden_size, i, dtype=torch.int8), extra)
        extra = {**extra, "quant_method": "channel"}
        _reg(layer, "w13_weight_scale", torch.ones(e, 2 * i, 1, dtype=torch.float32), extra)
        _reg(layer, "w2_weight_scale", torch.ones(e, hidden_size, 1, dtype=torch.float32), extra)


class Fp8MoEMethod(_Method):
    def __init__(self, block=None):
        self.block = block

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra):
        i, e, h, f8 = intermediate_size_per_partition, num_experts, hidden_size, torch.float8_e4m3fn
        _reg(layer, "w13_weight", torch.empty(e, 2 * i, h, dtype=f8), extra)
        _reg(layer, "w2_weight", torch.empty(e, h, i, dtype=f8), extra)
        if self.block:
            bn, bk = self.block
            extra = {**extra, "quant_method": "block"}
            _reg(layer, "w13_weight_scale_inv",
                 torch.ones(e, 2 * -(-i // bn), -(-h // bk), dtype=torch.float32), extra)
            _reg(layer, "w2_weight_scale_inv", torch.ones(e, -(-h // bn), -(-i // bk), dtype=torch.float32), extra)
        else:
            extra = {**extra, "quant_method": "tensor"}
            _reg(layer, "w13_weight_scale", torch.ones(e, 2, dtype=torch.float32), extra)
            _reg(layer, "w2_weight_scale", torch.ones(e, dtype=torch.float32), extra)


class ModelOptNvFp4FusedMoEMethod(_Method):
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, weight_loader, **extra):
        i, h, e, g = intermediate_size_per_partition, hidden_size, layer.num_local_experts, 16
        n = 2 if layer.moe_runner_config.is_gated else 1
        for name, shape, dt in (("w13_weight", (e, n * i, h // 2), torch.uint8),
                                ("w2_weight", (e, h, i // 2), torch.uint8),
                                ("w13_weight_scale", (e, n * i, h // g), torch.float8_e4m3fn),
                                ("w2_weight_scale", (e, h, i // g), torch.float8_e4m3fn),
                                ("w13_weight_scale_2", (e, n) if n == 2 else (e,), torch.float32),
                                ("w2_weight_scale_2", (e,), torch.float32),
                                ("w13_input_scale", (layer.num_experts, n), torch.float32),
                                ("w2_input_scale", (layer.num_experts,), torch.float32)):
            p = VParam(torch.empty(shape, dtype=dt), weight_loader)
            if "input_scale" in name:
                p._sglang_require_global_experts = True
            layer.register_parameter(name, p)


class CompressedTensorsWNA16MoE(_Method):
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra):
        i, h, e, g = intermediate_size_per_partition, hidden_size, num_experts, 8
        extra = {**extra, "is_transposed": True, "quant_method": "group"}
        _reg(layer, "w13_weight_packed", torch.empty(e, h // 8, 2 * i, dtype=torch.int32), extra)
        _reg(layer, "w2_weight_packed", torch.empty(e, i // 8, h, dtype=torch.int32), extra)
        _reg(layer, "w13_weight_scale", torch.ones(e, h // g, 2 * i, dtype=params_dtype), extra)
        _reg(layer, "w2_weight_scale", torch.ones(e, i // g, h, dtype=params_dtype), extra)
        _reg(layer, "w2_weight_shape", torch.empty(e, 2), extra)
        _reg(layer, "w13_weight_shape", torch.empty(e, 2), extra)


class CompressedTensorsFusedMoEMethod(_Method):
    def create_weights(self, layer, **kw):
        layer.scheme.create_weights(layer, **kw)


class UnquantizedFusedMoEMethod(_Method):
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra):
        i, e = intermediate_size_per_partition, num_experts
        _reg(layer, "w13_weight", torch.empty(e, 2 * i, hidden_size, dtype=params_dtype), extra)
        _reg(layer, "w2_weight", torch.empty(e, hidden_size, i, dtype=params_dtype), extra)


def _copy(expert_data, shard_dim, loaded_weight):
    """The end of ``_load_w13`` / ``_load_w2``: a smaller loaded weight fills the leading
    slice of a padded buffer."""
    if (loaded_weight.dim() == expert_data.dim() and shard_dim < expert_data.dim()
            and loaded_weight.shape[shard_dim] < expert_data.shape[shard_dim]):
        expert_data = expert_data.narrow(shard_dim, 0, loaded_weight.shape[shard_dim])
    expert_data.copy_(loaded_weight)


class FusedMoE(nn.Module):
    def __init__(self, method, num_experts, hidden_size, intermediate_size, tp=(1, 0),
                 ep=(1, 0), gated=True, quant_name=None, scheme=None, **flags):
        super().__init__()
        self.num_experts, self.hidden_size, self.layer_id = num_experts, hidden_size, 0
        self.moe_tp_size, self.moe_tp_rank = tp
        self.moe_ep_size, self.moe_ep_rank = ep
        self._num_global_routed, self._expert_storage_rank = num_experts, ep[1]
        self._num_local_routed = self.num_local_experts = num_experts // ep[0]
        self._has_fused_shared = False
        self.intermediate_size_per_partition = intermediate_size // tp[0]
        self.use_triton_kernels = self.use_flashinfer_trtllm_moe = False
        self.use_presharded_weights = False
        vars(self).update(flags)
        self.moe_runner_config = SimpleNamespace(is_gated=gated)
        self.quant_config = SimpleNamespace(get_name=lambda: quant_name) if quant_name else None
        self.params_dtype = torch.bfloat16
        if scheme is not None:
            self.scheme = scheme
        self.quant_method = method
        method.create_weights(layer=self, num_experts=self.num_local_experts,
                              hidden_size=hidden_size,
                              intermediate_size_per_partition=self.intermediate_size_per_partition,
                              params_dtype=self.params_dtype, weight_loader=self.weight_loader)

    @cached_property
    def use_padded_loading(self):
        return _is_cpu or self.use_flashinfer_trtllm_moe

    def _map_global_expert_id_to_local_expert_id(self, expert_id):
        start = self._expert_storage_rank * self._num_local_routed
        return expert_id - start if start <= expert_id < start + self._num_local_routed else -1

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id):
        meta = get_global_expert_location_metadata()
        glob = getattr(param, "_sglang_require_global_experts", False)
        if meta is None:
            if not glob:
                expert_id = self._map_global_expert_id_to_local_expert_id(expert_id)
                if expert_id == -1:
                    return
            self._weight_loader_impl(param, loaded_weight, weight_name, shard_id, expert_id)
            return
        for p in meta.logical_to_all_physical(self.layer_id, expert_id, glob):
            self._weight_loader_physical(param, loaded_weight, weight_name, shard_id, p)

    def _weight_loader_physical(self, param, loaded_weight, weight_name, shard_id, expert_id):
        if not getattr(param, "_sglang_require_global_experts", False):
            expert_id = self._map_global_expert_id_to_local_expert_id(expert_id)
            if expert_id < 0 or expert_id >= self.num_local_experts:
                return
        self._weight_loader_impl(param, loaded_weight, weight_name, shard_id, expert_id)

    def _load_gguf_weight(self, param, *args):
        assert not getattr(param, "is_gguf_weight", False)
        return False

    def _maybe_load_fp8_shared_expert_as_fp4(self, *args, **kw):
        return False  # not self._has_fused_shared

    def _weight_loader_impl(self, param, loaded_weight, weight_name, shard_id, expert_id):
        tp_rank = self.moe_tp_rank
        if self._load_gguf_weight(param, loaded_weight, shard_id, expert_id, tp_rank):
            return
        method = self.scheme if hasattr(self, "scheme") else self.quant_method
        cls = type(method).__name__
        if cls in _WNA16 and "zero" not in weight_name:
            loaded_weight = loaded_weight.t().contiguous()
        if self.use_flashinfer_trtllm_moe and cls != "W8A8Int8MoEMethod":
            shard_id = {"w1": "w3", "w3": "w1", "w2": "w2"}[shard_id]
        expert_data = param.data[expert_id]
        shard_dim = {"w1": 0, "w2": 1, "w3": 0}[shard_id]
        if getattr(param, "is_transposed", False) or self.use_triton_kernels:
            shard_dim = int(not shard_dim)
        if "input_scale" in weight_name:
            loaded_weight = loaded_weight.to(param.data.device)
            if (("compressed" in cls.lower() or "w4afp8" in self.quant_config.get_name())
                    and (param.data[expert_id] != 1).any()
                    and ((param.data[expert_id] - loaded_weight).abs() > 1e-5).any()):
                raise ValueError("input_scales of w1 and w3 of a layer must be equal")
            self._load_single_value(param, loaded_weight, expert_id)
            return
        args = (shard_dim, expert_data, shard_id, loaded_weight, tp_rank)
        if "ModelOpt" in cls:
            if "weight_scale_2" in weight_name:
                self._load_per_tensor_weight_scale(shard_id, param, loaded_weight, expert_id)
            elif "weight" in weight_name:
                self._load_model_weight_or_group_weight_scale(*args)
            return
        if "scale" in weight_name:
            qm = getattr(param, "quant_method", None)
            if qm == "channel":
                self._load_per_channel_weight_scale(expert_data, shard_dim, shard_id,
                                                    loaded_weight, tp_rank)
            elif qm in ("group", "block"):
                self._load_model_weight_or_group_weight_scale(*args)
            elif qm == "tensor":
                self._load_per_tensor_weight_scale(shard_id, param, loaded_weight, expert_id)
            return
        if "weight_shape" in weight_name:
            self._load_single_value(param, loaded_weight, expert_id)
        elif "weight" in weight_name:
            self._load_model_weight_or_group_weight_scale(*args)

    def _load_per_tensor_weight_scale(self, shard_id, param, loaded_weight, expert_id):
        if shard_id in ("w1", "w3"):
            if self.moe_runner_config.is_gated:
                param.data[expert_id][0 if shard_id == "w1" else 1] = loaded_weight
            else:
                param.data[expert_id] = loaded_weight
        elif shard_id == "w2":
            param.data[expert_id] = loaded_weight

    def _load_model_weight_or_group_weight_scale(self, shard_dim, expert_data, shard_id,
                                                 loaded_weight, tp_rank):
        load = self._load_w2 if shard_id == "w2" else self._load_w13
        load(expert_data, shard_dim, shard_id, loaded_weight, tp_rank)

    def _load_per_channel_weight_scale(self, expert_data, shard_dim, shard_id, loaded_weight,
                                       tp_rank):
        if shard_id == "w2":
            expert_data.copy_(loaded_weight)
        else:
            self._load_w13(expert_data, shard_dim, shard_id, loaded_weight, tp_rank)

    def _load_w13(self, expert_data, shard_dim, shard_id, loaded_weight, tp_rank):
        assert not self.use_padded_loading
        gated = self.moe_runner_config.is_gated
        shard_size = expert_data.shape[shard_dim] // 2 if gated else expert_data.shape[shard_dim]
        switch = getattr(self.quant_method, "load_up_proj_weight_first", False)
        start = shard_size if gated and ((switch and shard_id == "w1")
                                         or (not switch and shard_id == "w3")) else 0
        if not self.use_presharded_weights:
            if self.use_triton_kernels:
                loaded_weight = loaded_weight.transpose(-2, -1)
            n = loaded_weight.shape[shard_dim] // self.moe_tp_size
            loaded_weight = loaded_weight.narrow(shard_dim, n * tp_rank, n)
        _copy(expert_data.narrow(shard_dim, start, shard_size), shard_dim, loaded_weight)

    def _load_w2(self, expert_data, shard_dim, shard_id, loaded_weight, tp_rank):
        assert not self.use_padded_loading
        if self.quant_config is not None and "modelopt" in self.quant_config.get_name() \
                and (expert_data.dim() != 2 or loaded_weight.dim() != 2):
            raise ValueError("Expected 2D tensors")
        if not self.use_presharded_weights:
            if self.use_triton_kernels:
                loaded_weight = loaded_weight.transpose(-2, -1)
            n = loaded_weight.shape[shard_dim] // self.moe_tp_size
            loaded_weight = loaded_weight.narrow(shard_dim, n * tp_rank, n)
        _copy(expert_data, shard_dim, loaded_weight)

    def _load_single_value(self, param, loaded_weight, expert_id):
        param.data[expert_id] = loaded_weight
