"""Rollout -> trainer batch packing (closed form) and step seeding."""

import pytest
import torch

from megatron_qrl.rl.batch import pack_samples, split_batch
from megatron_qrl.rl.steps import sample_indices, step_seed


def test_pack_samples_closed_form():
    b = pack_samples([[1, 5, 6], [1, 7]], [[8, 2], [9, 10, 2]],
                     [torch.tensor([-0.1, -0.2]), torch.tensor([-0.3, -0.4, -0.5])], pad_id=0)
    assert b["tokens"].tolist() == [[1, 5, 6, 8, 2], [1, 7, 9, 10, 2]]
    assert b["labels"].tolist() == [[5, 6, 8, 2, 0], [7, 9, 10, 2, 0]]
    assert b["loss_mask"].tolist() == [[False, False, True, True, False],
                                       [False, True, True, True, False]]
    assert torch.allclose(b["rollout_log_probs"],
                          torch.tensor([[0, 0, -0.1, -0.2, 0], [0, -0.3, -0.4, -0.5, 0]]))
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 2


def test_pack_samples_routed_experts_padded():
    re = torch.arange(2 * 3 * 1 * 2).reshape(2, 3, 1, 2)
    b = pack_samples([[1, 4], [1, 4]], [[5, 2], [6]], None, routed_experts=re)
    assert b["routed_experts"].shape == (2, 4, 1, 2)
    assert b["routed_experts"][:, :3].tolist() == re.tolist()
    assert (b["routed_experts"][:, 3] == -1).all()


def test_split_batch_and_errors():
    b = pack_samples([[1]] * 4, [[3]] * 4)
    parts = split_batch(b, 2)
    assert len(parts) == 2 and parts[1]["tokens"].shape == (2, 2)
    with pytest.raises(ValueError, match="--qrl-micro-batch-size"):
        split_batch(b, 3)
    with pytest.raises(ValueError, match="empty"):
        pack_samples([[]], [[3]])


def test_step_sampling_is_stateless():
    assert sample_indices(100, 8, 3, 17) == sample_indices(100, 8, 3, 17)
    assert sample_indices(100, 8, 3, 17) != sample_indices(100, 8, 3, 18)
    assert len(set(sample_indices(10, 10, 0, 0))) == 10
    assert step_seed(1, 2, 3) != step_seed(1, 3, 2)
