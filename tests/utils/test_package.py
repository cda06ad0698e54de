import pytest

from megatron_qrl.utils.optional import MissingDependencyError, available, require


def test_require_names_the_extra_for_a_missing_gpu_library():
    ok, _ = available("sglang")
    if ok:
        pytest.skip("sglang is importable here; the error path cannot be exercised")
    with pytest.raises(MissingDependencyError, match=r"--qrl-rollout-engine sglang.*\.\[gpu\]"):
        require("sglang", "--qrl-rollout-engine sglang")


def test_require_returns_the_module_when_present():
    assert require("json", "reading json").dumps([1]) == "[1]"
