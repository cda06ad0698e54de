"""Fixtures shared across the test folders (a module that needs another variant defines its own,
which takes precedence)."""

import pytest


@pytest.fixture(scope="module")
def megatron():
    """A one-rank megatron-core world for the module (gloo; megatron's CPU shim on a CPU-only
    host), with torch's structured-trace logger quiet (it slows CPU tests under log capture)."""
    from megatron_qrl.models.runtime import single_process_megatron
    from tests.helpers.te_quant_fixtures import quiet_torch_trace

    with quiet_torch_trace(), single_process_megatron():
        yield
