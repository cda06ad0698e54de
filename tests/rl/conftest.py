"""Fixtures of the RL tests shared across modules (run once per xdist worker)."""

import pytest

from tests.helpers.ep2_runs import EP2Runs


@pytest.fixture(scope="session")
def ep2_ray_runs(local_ray, tmp_path_factory):
    """``ep2_ray_runs(*names)``: the named EP = 2 fleet jobs of tests/helpers/ep2_runs.py on the
    worker's Ray cluster, each run once."""
    return EP2Runs(tmp_path_factory.mktemp("ep2"), local_ray.address)
