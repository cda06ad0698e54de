"""A format owns its engine facts: every registered format declares them, a format without is
refused at registration, and the engines read them from the format (no side table keyed by
format name that a new format could be missing from)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_qrl.quant import QuantSpec, get_spec, list_specs, register_spec
from megatron_qrl.quant.engine_facts import EngineFacts, KernelFlags, TERecipe
from megatron_qrl.quant.spec import _REGISTRY


@pytest.fixture
def registry():
    """The registry as it was after the test (a refused format must not stay in it)."""
    before = dict(_REGISTRY)
    yield _REGISTRY
    _REGISTRY.clear()
    _REGISTRY.update(before)


def _probe(name: str, engine: EngineFacts | None) -> type[QuantSpec]:
    """A bf16-like format named ``name``, with ``engine`` facts (None: none declared)."""
    body = {"__annotations__": {"name": "str"}, "name": name}
    if engine is not None:
        body["engine"] = engine
    return dataclasses.dataclass(frozen=True)(type("ProbeSpec", (QuantSpec,), body))


@pytest.mark.parametrize("name", list_specs())
def test_every_registered_format_declares_its_engine_facts(name):
    assert isinstance(get_spec(name).engine, EngineFacts)


def test_a_format_without_engine_facts_is_refused(registry):
    with pytest.raises(ValueError, match=r"format 'probe_fmt' .*declares no engine facts: "
                                         r"set `engine = EngineFacts\("):
        register_spec(_probe("probe_fmt", None))
    assert "probe_fmt" not in list_specs()


def test_a_te_recipe_for_another_format_is_refused(registry):
    recipe = dataclasses.replace(get_spec("fp8").engine.te_recipe)
    facts = EngineFacts(sglang_syncs={}, te_recipe=recipe, moe_kernel=None, lora_experts="merge")
    with pytest.raises(ValueError, match=r"TE recipe is for format 'fp8'; set "
                                         r"TERecipe\(format='probe_fmt'"):
        register_spec(_probe("probe_fmt", facts))


@pytest.mark.parametrize("kwargs, match", [
    ({"sglang_syncs": {"nccl": True}}, r"unknown sync paths \['nccl'\]"),
    ({"lora_experts": "serve"}, r"lora_experts must be one of \['adapter', 'merge'\]"),
])
def test_engine_facts_check_their_values(kwargs, match):
    base = {"sglang_syncs": {"inplace": True}, "te_recipe": None, "moe_kernel": None,
            "lora_experts": "adapter"}
    with pytest.raises(ValueError, match=match):
        EngineFacts(**{**base, **kwargs})


def test_a_new_format_reaches_every_engine_from_its_one_declaration(registry):
    """Registered with its facts only, a format is known to the sync checks, the TE recipe
    lookup, the MoE kernel tuner and the LoRA serving resolver."""
    from megatron_qrl.rollout.lora_serving import expert_path
    from megatron_qrl.rollout_sglang.kernels.moe_tune import make_case
    from megatron_qrl.rollout_sglang.options import check_sync_supported
    from megatron_qrl.te_quant.te_recipes import te_recipe_for

    recipe = TERecipe("probe_fmt", "Float8CurrentScaling", {"fp8": "e4m3"}, (9,), True, "equal")
    facts = EngineFacts(sglang_syncs={"disk": True, "inplace": False}, te_recipe=recipe,
                        moe_kernel=KernelFlags(), lora_experts="merge",
                        lora_merge_from=None)
    register_spec(_probe("probe_fmt", facts))
    assert get_spec("probe_fmt").name == "probe_fmt"
    check_sync_supported("probe_fmt", "disk")
    with pytest.raises(NotImplementedError, match="cannot update 'probe_fmt' weights in place "
                                                  "with sync='inplace'.*probe_fmt/disk"):
        check_sync_supported("probe_fmt", "inplace")
    assert te_recipe_for("probe_fmt", gpu=("H200", 9)) is recipe
    assert expert_path("probe_fmt") == "merge"
    assert make_case("probe_fmt", E=2, N=4, K=8, device="cpu").flags is facts.moe_kernel
