"""The reference rollout engine: a transformers Qwen3 / Qwen3-MoE model on CPU or GPU.

It receives weights exactly as SGLang will — the packed ``(hf_name, tensor)`` stream of
:meth:`QuantSpec.pack_state_dict` — and computes with ``spec.dequantize(spec.unpack(...))``
weights plus SGLang's dynamic activation quantization for W8A8 formats
(:mod:`megatron_qrl.quant.hf_reference`). Generation is batched with a KV cache and
temperature / top-p / top-k sampling, stop token ids and stop strings; it returns the log-prob
of every sampled token under the temperature-scaled distribution it sampled from (the raw
distribution when greedy) and, for MoE models, the experts each router chose per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..quant import get_spec
from ..quant.hf_reference import (
    attach_activation_quant,
    build_hf_model,
    hf_tensor_names,
    load_packed_weights,
)
from .base import GenerationOutput, RolloutEngine, SamplingParams, WeightSyncError, tensor_checksum
from .groups import generate_by_group
from .lora_adapters import AdapterSet
from .sampling import sample_next


class ReferenceEngine(RolloutEngine):
    """A rollout engine built from ``transformers`` that loads QuantSpec-packed weights."""

    def __init__(self, hf_config: dict, spec_name: str, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0,
                 decode: Callable[[list[int]], str] | None = None):
        self.spec = get_spec(spec_name)
        self.model = build_hf_model(hf_config, dtype, device)
        self.device = torch.device(device)
        self.decode = decode
        self._names = hf_tensor_names(self.model)
        self._packed: dict[str, torch.Tensor] = {}
        self._version = -1
        self._routers = [m for n, m in self.model.named_modules() if n.endswith("mlp.gate")]
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        attach_activation_quant(self.model, self.spec)
        self.adapter = AdapterSet()

    # ---- weights ---------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        packed = {name: t.detach().to(self.device, copy=True) for name, t in named_tensors}
        expected = {p for n in self._names for p in self.spec.packed_names(n)}
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        missing = sorted(expected - set(packed) - ({"lm_head.weight"} if tied else set()))
        unknown = sorted(set(packed) - expected)
        if missing or unknown:
            raise WeightSyncError(
                f"weight sync for format {self.spec.name!r} is incomplete: missing {missing[:5]}, "
                f"unexpected {unknown[:5]} (sender and engine disagree on the model or format)")
        names = [n for n in self._names if not (tied and n == "lm_head.weight")]
        # the model must compute with exactly dequantize(unpack(packed)) for every tensor
        differ = load_packed_weights(self.model, self.spec, packed, names)
        if differ:
            raise WeightSyncError(f"engine failed to load {differ[0]!r} (and {len(differ) - 1} "
                                  "more): its weight differs from the dequantized packed tensor")
        self._packed = packed
        self._version = version

    def held_checksums(self) -> dict[str, str]:
        return {name: tensor_checksum(t) for name, t in self._packed.items()}

    # ---- LoRA (rollout/lora_adapters.py; SGLang's load_lora_adapter_from_tensors) ---------
    def load_lora_adapter(self, name: str, tensors: dict, config: dict, version: int) -> None:
        """Serve adapter ``tensors`` (PEFT names, PEFT ``config``) on top of the held base."""
        if self._version < 0:
            raise WeightSyncError("load_lora_adapter() before the first update_weights(): the "
                                  "engine holds no base weights yet")
        self.adapter.install(self.model, name, tensors, config, self.device)
        self._version = version

    def held_lora_checksums(self) -> dict[str, str]:
        return self.adapter.checksums()

    def update_base_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                            version: int) -> None:
        """Replace some unquantized base tensors (AQN's noisy norm gains between adapter syncs)."""
        part = {n: t.detach().to(self.device, copy=True) for n, t in named_tensors}
        bad = [n for n in part if n not in self._packed or self.spec.is_quantized(n)]
        if bad:
            raise WeightSyncError(f"update_base_tensors: {bad[:3]} are not unquantized tensors "
                                  "the engine holds")
        differ = load_packed_weights(self.model, self.spec, part, list(part))
        if differ:
            raise WeightSyncError(f"engine failed to load {differ[0]!r}")
        self._packed.update(part)
        self._version = version

    def update_packed_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                              version: int) -> None:
        """Replace the packed tensors of some weights (every packed tensor of each; LoRA's
        merge path: ``rollout/lora_serving.py``); the rest of the model keeps its weights."""
        part = {n: t.detach().to(self.device, copy=True) for n, t in named_tensors}
        names = [n for n in self._names if any(p in part for p in self.spec.packed_names(n))]
        covered = {p for n in names for p in self.spec.packed_names(n)}
        if covered != set(part) or not names:
            raise WeightSyncError(
                f"update_packed_tensors: {sorted(covered ^ set(part))[:3]} missing or unknown "
                "(send every packed tensor of each weight, names the engine holds)")
        differ = load_packed_weights(self.model, self.spec, part, names)
        if differ:
            raise WeightSyncError(f"engine failed to load {differ[0]!r}")
        self._packed.update(part)
        self._version = version

    def weight_version(self) -> int:
        return self._version

    # ---- generation ------------------------------------------------------------------
    def get_rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        if self._version < 0:
            raise WeightSyncError("generate() before the first update_weights(): the engine "
                                  "holds no weights yet")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate() needs at least one prompt and no empty prompt")
        if sampling.stop and self.decode is None:
            raise ValueError("stop strings need a decode function (ReferenceEngine(decode=...))")
        grouped = generate_by_group(self.generate, prompts, sampling)  # one call per group
        if grouped is not None:
            return grouped
        gen = self.generator if sampling.seed is None else torch.Generator(
            device=self.device).manual_seed(sampling.seed)
        ids, attn = _left_pad(prompts, self.device)
        b, plen = ids.shape
        routed: list[list[torch.Tensor]] = [[] for _ in self._routers]
        hooks = [r.register_forward_hook(_record_into(routed[i], r)) for i, r in enumerate(self._routers)]
        try:
            out_ids, logps, finished, reasons = self._decode_loop(ids, attn, sampling, gen)
        finally:
            for h in hooks:
                h.remove()
        lengths = torch.tensor([len(x) for x in out_ids])
        t = int(lengths.max())
        output = torch.zeros(b, t, dtype=torch.long)
        lp = torch.zeros(b, t)
        for i in range(b):
            output[i, : lengths[i]] = torch.tensor(out_ids[i], dtype=torch.long)
            lp[i, : lengths[i]] = torch.tensor(logps[i])
        mask = torch.arange(t)[None, :] < lengths[:, None]
        experts = _routed_layout(routed, prompts, lengths, plen, b) if self._routers else None
        return GenerationOutput([list(p) for p in prompts], output, lp, mask, reasons,
                                self._version, experts)

    def _decode_loop(self, ids, attn, sampling, gen):
        b = ids.shape[0]
        out_ids: list[list[int]] = [[] for _ in range(b)]
        logps: list[list[float]] = [[] for _ in range(b)]
        reasons = ["length"] * b
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        past, step_ids = None, ids
        stop_ids = set(sampling.stop_token_ids)
        for _ in range(sampling.max_new_tokens):
            pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
            out = self.model(input_ids=step_ids, attention_mask=attn, position_ids=pos,
                             past_key_values=past, use_cache=True)
            past = out.past_key_values
            tok, logp = sample_next(out.logits[:, -1].float(), sampling, gen)
            for i in range(b):
                if done[i]:
                    continue
                out_ids[i].append(int(tok[i]))
                logps[i].append(float(logp[i]))
                if int(tok[i]) in stop_ids or self._hit_stop_string(out_ids[i], sampling.stop):
                    done[i] = True
                    reasons[i] = "stop"
            if bool(done.all()):
                break
            step_ids = tok[:, None]
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        return out_ids, logps, done, reasons

    def _hit_stop_string(self, ids: list[int], stops: tuple[str, ...]) -> bool:
        return bool(stops) and any(self.decode(ids).endswith(s) for s in stops)


def _left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    plen = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), plen, dtype=torch.long, device=device)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, plen - len(p):] = torch.tensor(p, dtype=torch.long)
        attn[i, plen - len(p):] = 1
    return ids, attn


def _record_into(store: list[torch.Tensor], router: torch.nn.Module):
    """Forward hook: keep the top-k expert ids the router chose for this call's tokens."""
    def hook(_module, _inputs, output):
        if isinstance(output, tuple):  # transformers 5: (logits, scores, indices)
            store.append(output[2].detach().cpu())
        else:  # transformers 4: router logits only
            k = router_top_k(router)
            store.append(torch.topk(output.float(), k, dim=-1).indices.cpu())
    return hook


def router_top_k(router: torch.nn.Module) -> int:
    if hasattr(router, "top_k"):
        return int(router.top_k)
    raise ValueError("cannot tell the router's top_k; use transformers >= 5")


def _routed_layout(routed, prompts, lengths, plen, b) -> torch.Tensor:
    """[B, P+T, layers, k] with each sample's prompt+response tokens left-aligned, -1 padded."""
    layers = []
    for calls in routed:
        first = calls[0].view(b, plen, -1)  # prompt forward, left-padded
        steps = [c.view(b, 1, -1) for c in calls[1:]]
        layers.append(torch.cat([first, *steps], dim=1))  # [B, P + steps, k]
    full = torch.stack(layers, dim=2)  # [B, P + steps, L, k]
    t = int(lengths.max())
    out = torch.full((b, plen + t, full.shape[2], full.shape[3]), -1, dtype=torch.long)
    for i, p in enumerate(prompts):
        n_resp = int(lengths[i])
        # the last sampled token is never fed back, so it has no routing; response rows
        # cover tokens fed to the model (all but the final sampled one)
        seq = full[i, plen - len(p): plen + n_resp - 1]
        out[i, : seq.shape[0]] = seq
    return out
