"""A minimal rollout engine for the driver tests (NOT product code).

A transformers Qwen3(-MoE) model whose weights come from the packed stream through
``spec.unpack`` / ``spec.dequantize`` (quant.hf_reference), activation fake-quant for W8A8,
and batched ancestral sampling (no KV cache) seeded by ``SamplingParams.seed``.
"""

from __future__ import annotations

import torch

from megatron_qrl.quant import get_spec
from megatron_qrl.quant.hf_reference import (
    attach_activation_quant,
    hf_tensor_names,
    load_packed_weights,
)
from megatron_qrl.rollout.base import GenerationOutput, RolloutEngine, tensor_checksum
from megatron_qrl.rollout.capacity import EngineCapacity


class TinyEngine(RolloutEngine):
    def __init__(self, hf_config: dict, spec_name: str, seed: int = 0) -> None:
        import transformers

        arch = hf_config["architectures"][0]
        cfg_cls = transformers.Qwen3MoeConfig if "Moe" in arch else transformers.Qwen3Config
        model_cls = getattr(transformers, arch)
        kwargs = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
        torch.manual_seed(seed)
        self.model = model_cls(cfg_cls(**kwargs)).eval()
        self.spec = get_spec(spec_name)
        attach_activation_quant(self.model, self.spec)
        self.names = hf_tensor_names(self.model)
        self.held: dict[str, str] = {}
        self.version = -1
        self._routed: list[torch.Tensor] = []
        gates = [m for n, m in self.model.named_modules() if n.endswith("mlp.gate")]
        for gate in gates:
            gate.register_forward_hook(lambda _m, _a, out: self._routed.append(out[2]))

    def update_weights(self, named_tensors, version: int) -> None:
        packed = {}
        for name, t in named_tensors:
            packed[name] = t.clone()
            self.held[name] = tensor_checksum(t)
        load_packed_weights(self.model, self.spec, packed, self.names)
        self.version = version

    def held_checksums(self) -> dict[str, str]:
        return dict(self.held)

    def weight_version(self) -> int:
        return self.version

    @torch.no_grad()
    def generate(self, prompts, sampling) -> GenerationOutput:
        """Batched: left-padded prompts, attention mask and explicit positions, no KV cache."""
        gen = torch.Generator().manual_seed(int(sampling.seed or 0))
        b, t_max = len(prompts), sampling.max_new_tokens
        width = max(len(p) for p in prompts)
        ids = torch.zeros(b, width, dtype=torch.long)
        att = torch.zeros(b, width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            att[i, width - len(p):] = 1
        out_ids = torch.zeros(b, t_max, dtype=torch.long)
        lps = torch.zeros(b, t_max)
        mask = torch.zeros(b, t_max, dtype=torch.bool)
        alive = torch.ones(b, dtype=torch.bool)
        stops = torch.tensor(sampling.stop_token_ids or (-1,))
        for t in range(t_max):
            pos = (att.cumsum(-1) - 1).clamp_min(0)
            self._routed = []
            logits = self.model(input_ids=ids, attention_mask=att, position_ids=pos).logits
            logp = torch.log_softmax(logits[:, -1].float() / sampling.temperature, -1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            out_ids[:, t] = torch.where(alive, tok, 0)
            lps[:, t] = torch.where(alive, logp.gather(-1, tok[:, None]).squeeze(-1), 0.0)
            mask[:, t] = alive
            ids = torch.cat([ids, tok[:, None]], -1)
            att = torch.cat([att, alive.long()[:, None]], -1)
            alive = alive & ~torch.isin(tok, stops)
            if not alive.any():
                break
        routed = self._routed_experts(b, width, [len(p) for p in prompts], t_max)
        reasons = ["length" if mask[i, -1] and not torch.isin(out_ids[i, -1], stops) else "stop"
                   for i in range(b)]
        return GenerationOutput([list(p) for p in prompts], out_ids, lps, mask, reasons,
                                self.version, routed)

    def _routed_experts(self, b, width, plens, t_max):
        """[B, P + T, layers, top_k] of the last forward, rows re-aligned to start at 0."""
        if not self._routed:
            return None
        ids = torch.stack(self._routed, dim=1)  # [B * S, layers, k]
        ids = ids.reshape(b, -1, *ids.shape[1:])
        out = torch.full((b, max(plens) + t_max, *ids.shape[2:]), -1, dtype=torch.long)
        for i, plen in enumerate(plens):
            row = ids[i, width - plen:]
            out[i, : row.shape[0]] = row
        return out


def tiny_engine_factory(rollout_cfg, hf_config, seed):
    return TinyEngine(hf_config, rollout_cfg.format, seed)


class PooledEngine(TinyEngine):
    """:class:`TinyEngine` with an SGLang engine's limits: 3 requests at once, a 10,000-token
    KV pool."""

    def capacity(self) -> EngineCapacity:
        return EngineCapacity(max_running_requests=3, kv_pool_tokens=10_000)


def pooled_engine(spec) -> PooledEngine:
    """An engine actor's builder (``rollout.ray_actor.EngineActor``) of a :class:`PooledEngine`."""
    return PooledEngine(spec.hf_config, spec.format, spec.seed)
