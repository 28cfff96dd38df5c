"""``cp_infer.devices``: the device's defaults and a GPU per rank, as pure functions of what the rank sees (#42)."""

from __future__ import annotations

import pytest
import torch

from cp_infer.devices import DeviceError, apply_device_defaults, cuda_ordinal, device_defaults, resolve_dtype

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0"}


@pytest.mark.parametrize("device", ["cuda", "cuda:3", torch.device("cuda", 1)])
def test_cuda_defaults_are_bf16_and_tf32(device):
    assert device_defaults(device).dtype == "bf16" and device_defaults(device).tf32
    assert resolve_dtype("auto", device) == "bf16"


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_cpu_defaults_are_unchanged(device):
    assert device_defaults(device).dtype == "fp32" and not device_defaults(device).tf32
    assert resolve_dtype("auto", device) == "fp32"


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_explicit_dtype_is_kept(dtype, device):
    assert resolve_dtype(dtype, device) == dtype


def test_the_cpu_leaves_the_float32_precision_alone():
    before = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    assert not apply_device_defaults("cpu").tf32
    assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == before


def test_cuda_turns_tf32_on(monkeypatch):
    # The flags are process-wide: set them back whatever happens.
    monkeypatch.setattr(torch.backends.cuda.matmul, "fp32_precision", torch.backends.cuda.matmul.fp32_precision)
    monkeypatch.setattr(torch.backends.cudnn.conv, "fp32_precision", torch.backends.cudnn.conv.fp32_precision)
    apply_device_defaults("cuda")
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"


@pytest.mark.parametrize("ranks,visible", [(1, 1), (4, 4), (4, 8), (8, 8)])
def test_torchrun_ranks_take_their_local_rank(ranks, visible):
    for local_rank in range(ranks):
        assert cuda_ordinal(local_rank=local_rank, local_world_size=ranks, visible=visible, env=TORCHRUN) == local_rank


@pytest.mark.parametrize("local_rank", [0, 1, 2])
def test_more_ranks_than_gpus_is_refused_on_every_rank(local_rank):
    # Today's cuda:LOCAL_RANK % device_count put ranks 0 and 2 on one device, which NCCL refuses.
    with pytest.raises(DeviceError, match=r"3 ranks on this node and 2 visible CUDA device\(s\).*at most 2 ranks "
                                          r"per node \(--nproc / torchrun --nproc_per_node 2\)"):
        cuda_ordinal(local_rank=local_rank, local_world_size=3, visible=2, env=TORCHRUN)


def test_one_visible_gpu_under_torchrun_is_shared_and_refused():
    # CUDA_VISIBLE_DEVICES=0 for the whole torchrun: every rank sees the same one device.
    env = {**TORCHRUN, "CUDA_VISIBLE_DEVICES": "0"}
    with pytest.raises(DeviceError, match=r"2 ranks on this node and 1 visible CUDA device\(s\) "
                                          r"\(CUDA_VISIBLE_DEVICES='0'\)"):
        cuda_ordinal(local_rank=1, local_world_size=2, visible=1, env=env)


@pytest.mark.parametrize("local_rank", [0, 1, 7])
def test_a_per_rank_visible_device_is_device_0(local_rank):
    # srun --gpus-per-task=1: each rank started alone, seeing its own GPU only (today: cuda:LOCAL_RANK, invalid).
    env = {"CUDA_VISIBLE_DEVICES": str(local_rank), "SLURM_LOCALID": str(local_rank), "LOCAL_RANK": str(local_rank)}
    assert cuda_ordinal(local_rank=local_rank, local_world_size=None, visible=1, env=env) == 0
    assert cuda_ordinal(local_rank=local_rank, local_world_size=8, visible=1, env=env) == 0


def test_ranks_started_alone_seeing_every_gpu_take_their_local_rank():
    assert cuda_ordinal(local_rank=3, local_world_size=None, visible=8, env={"LOCAL_RANK": "3"}) == 3
    with pytest.raises(DeviceError, match="4 ranks on this node and 2 visible"):
        cuda_ordinal(local_rank=3, local_world_size=None, visible=2, env={"LOCAL_RANK": "3",
                                                                            "CUDA_VISIBLE_DEVICES": "0,1"})


def test_no_visible_device_names_the_variable():
    with pytest.raises(DeviceError, match=r"rank 0 sees no CUDA device \(CUDA_VISIBLE_DEVICES=''\); unset "
                                          "CUDA_VISIBLE_DEVICES.*--device cpu"):
        cuda_ordinal(local_rank=0, local_world_size=1, visible=0, env={"CUDA_VISIBLE_DEVICES": ""})


def test_each_rank_picks_its_checked_ordinal(monkeypatch):
    """``init_parallel``'s device: the checked ordinal, not ``LOCAL_RANK % device_count``."""
    from cp_infer.state import ParallelConfig, _pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _pick_device(ParallelConfig(), 1) == torch.device("cuda", 1)
    assert _pick_device(ParallelConfig(device="cuda"), 1) == torch.device("cuda", 1)
    assert _pick_device(ParallelConfig(device="cpu"), 1) == torch.device("cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    for device in (None, "cuda"):
        with pytest.raises(DeviceError, match="3 ranks on this node and 2 visible"):
            _pick_device(ParallelConfig(device=device), 2)
    # Started alone with a per-rank CUDA_VISIBLE_DEVICES (today: cuda:5, an invalid ordinal).
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _pick_device(ParallelConfig(device="cuda"), 5) == torch.device("cuda", 0)
