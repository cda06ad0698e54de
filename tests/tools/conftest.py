"""Fixtures of the tools/ tests."""

from pathlib import Path

import pytest

from tests.helpers.tiny_hf import make_tiny_hf


@pytest.fixture(scope="module")
def dense_hf(tmp_path_factory) -> Path:
    """A tiny dense HF Qwen3 checkpoint, one per test module."""
    return make_tiny_hf(tmp_path_factory.mktemp("dense") / "hf", "dense")
