"""Kept only for tests/gpu/test_te_spec.py, which imports ``tests.test_te_quant_fixtures``
(the GPU files stay as they are): the fixtures live in tests/helpers/te_quant_fixtures.py."""

from tests.helpers.te_quant_fixtures import grads_as_hf, hf_state, ids, tiny_hf

__all__ = ["grads_as_hf", "hf_state", "ids", "tiny_hf"]
