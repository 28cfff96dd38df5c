"""Pure arithmetic: shard plans and VAE shape rules, no process group."""

import pytest
import torch

from cp_infer import ShardPlan, VideoGeometry, padded_heads


@pytest.mark.parametrize("orig_len", [1, 2, 3, 7, 97, 1000, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plan_covers_every_token_once(orig_len, world):
    plan = ShardPlan(orig_len=orig_len, world=world)
    assert plan.padded_len == plan.local_len * world >= orig_len
    assert plan.num_pad == plan.padded_len - orig_len < world
    assert sum(plan.valid_len(r) for r in range(world)) == orig_len
    x = torch.randn(2, orig_len, 3)
    shards = [plan.shard(x, r) for r in range(world)]
    assert all(s.shape == (2, plan.local_len, 3) for s in shards)
    # Padding is zero and sits only at the end of the concatenated shards.
    padded = torch.cat(shards, dim=1)
    torch.testing.assert_close(plan.trim(padded), x, rtol=0, atol=0)
    assert torch.count_nonzero(padded[:, orig_len:]) == 0
    torch.testing.assert_close(plan.pad(x), padded, rtol=0, atol=0)
    for r in range(world):
        start, stop = plan.token_range(r)
        assert stop - start == plan.valid_len(r)
        assert plan.local_valid_mask(r).sum().item() == plan.valid_len(r)


def test_plan_on_other_dims():
    plan = ShardPlan(orig_len=5, world=2)
    x = torch.randn(3, 4, 5)
    assert plan.shard(x, 1, dim=-1).shape == (3, 4, 3)
    torch.testing.assert_close(plan.shard(x, 0, dim=2), x[..., :3])


def test_plan_errors():
    with pytest.raises(ValueError, match="orig_len=0"):
        ShardPlan(orig_len=0, world=2)
    with pytest.raises(ValueError, match="world=0"):
        ShardPlan(orig_len=3, world=0)
    plan = ShardPlan(orig_len=5, world=2)
    with pytest.raises(ValueError, match="rank=2"):
        plan.shard(torch.zeros(1, 5), 2)
    with pytest.raises(ValueError, match="expects 5"):
        plan.shard(torch.zeros(1, 6), 0)


def test_padded_heads():
    assert padded_heads(32, 4) == 32
    assert padded_heads(4, 3) == 6
    assert padded_heads(2, 4) == 4


def test_latent_shape_ltx():
    g = VideoGeometry()
    s = g.latent_shape(121, 512, 768)
    assert (s.frames, s.height, s.width, s.tokens) == (16, 16, 24, 16 * 16 * 24)
    assert g.video_frames(16) == 121
    assert g.latent_shape(1, 32, 32).tokens == 1


@pytest.mark.parametrize(
    ("frames", "height", "width", "message"),
    [
        (40, 64, 64, "num_frames=40 is not 8k\\+1 .*try 33, 41"),
        (0, 64, 64, "num_frames=0 is not 8k\\+1 .*try 1, 9"),
        (9, 100, 64, "height=100 is not a positive multiple of 32; try 96, 128"),
        (9, 64, 16, "width=16 is not a positive multiple of 32; try 32"),
    ],
)
def test_latent_shape_errors_name_nearest(frames, height, width, message):
    with pytest.raises(ValueError, match=message):
        VideoGeometry().latent_shape(frames, height, width)


def test_min_latent_side_refuses_one_latent_pixel():
    # LTX-2's decoder pads by reflection, which needs two latent pixels: 32 px is one, so 64 is the least.
    geometry = VideoGeometry(min_latent_side=2)
    with pytest.raises(ValueError, match=r"height=32 is not a multiple of 32 of at least 64; try 64"):
        geometry.latent_shape(9, 32, 96)
    assert geometry.latent_shape(9, 64, 96).height == 2
