"""The commands refuse, with exit code 2 and the fix, a group whose ranks would not each have a GPU (#42); CUDA is
faked (``torch.cuda.is_available`` / ``device_count``) in this process, which is where the check runs, before any
rank starts."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)


def test_check_device_counts_the_ranks_it_launches(two_gpus):
    from server.cli.common import UsageError, check_device
    from server.group.runtime import RuntimeConfig

    for nproc in (1, 2):
        check_device(RuntimeConfig(), nproc=nproc)
        check_device(RuntimeConfig(device="cuda"), nproc=nproc)
    check_device(RuntimeConfig(device="cpu"), nproc=8)
    with pytest.raises(UsageError, match=r"3 ranks on this node and 2 visible CUDA device\(s\).*--nproc"):
        check_device(RuntimeConfig(), nproc=3)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_more_ranks_than_gpus_is_exit_code_2(two_gpus, capsys, tmp_path, command):
    from server.cli import main

    flags = (["--port", "8123", "--data-dir", str(tmp_path)] if command == "serve"
             else ["--prompt", "a cat", "--out", str(tmp_path / "v.mp4")])
    code = main([command, *flags, "--nproc", "4"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "4 ranks on this node and 2 visible CUDA device(s)" in err and "--nproc_per_node 2" in err


def test_dtype_is_auto_by_default_and_resolved_on_the_device():
    """``--dtype`` reaches the runtime as ``auto`` unless given (``start_runtime`` resolves it on the rank's device with
    ``cp_infer.devices.resolve_dtype``, tested in ``tests/cp_infer/test_devices.py``)."""
    from server.cli.command import build_parser
    from server.cli.common import runtime_config_from_args
    from server.group.runtime import RuntimeConfig

    def parsed(*flags: str) -> str:
        args = build_parser().parse_args(["generate", "--prompt", "a cat", "--out", "x.mp4", *flags])
        return runtime_config_from_args(args).dtype

    assert parsed() == RuntimeConfig().dtype == "auto"
    assert parsed("--dtype", "bf16") == "bf16"
    with pytest.raises(ValueError, match="dtype='fp64' is not supported"):
        RuntimeConfig(dtype="fp64")
