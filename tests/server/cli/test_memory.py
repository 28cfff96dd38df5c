"""``cp-infer memory`` (the plan of where each rank's weights go, from configs alone) and the ``--weights`` /
``--offload`` flags of ``generate``, ``batch``, ``serve`` and ``memory``.

The tiny model's plan is checked against its own safetensors headers (shapes read from the files, not from the meta
build the plan uses): FSDP2's rows of each parameter on rank 0, byte for byte. The committed real-size LTX-2 configs
(``bench/configs/ltx2/``, no weights) give the released parameter counts.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import pytest

from cp_infer.placement import format_bytes, shard_rows
from server.cli import command as cli

REPO = Path(__file__).resolve().parents[3]
LTX2 = REPO / "bench" / "configs" / "ltx2"
HELIOS = REPO / "bench" / "configs" / "helios"
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}


def _memory(capsys, *flags: str) -> dict[str, list[str]]:
    """``cp-infer memory`` with ``flags``: its component rows by name, and the whole output under ``""``."""
    assert cli.main(["memory", *flags]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isalpha() and "  " in line}
    rows[""] = [out]
    return rows


def _header_shard_bytes(path: Path, world: int) -> int:
    """Rank 0's bytes of every tensor in a safetensors file over ``world`` ranks, from its header alone."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    total = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape, size = entry["shape"], _ITEMSIZE[entry["dtype"]]
        start, stop = shard_rows(shape[0], world, 0) if shape else (0, 1)
        total += (stop - start) * math.prod(shape[1:]) * size
    return total


def test_the_tiny_models_plan_is_its_files_shards(capsys):
    from models.ltx_video.default import ensure_default_model

    folder = ensure_default_model()
    for world in (2, 3):
        rows = _memory(capsys, "--nproc", str(world), "--weights", "sharded")
        assert "weights sharded" in rows[""][0]
        for name, file in (("transformer", "transformer/diffusion_pytorch_model.safetensors"),
                           ("text_encoder", "text_encoder/model.safetensors")):
            expected = format_bytes(_header_shard_bytes(folder / file, world))
            assert " ".join(rows[name][4:6]) == expected, (name, world, rows[name])
            assert rows[name][-2:] == [f"1/{world}", "shard"], rows[name]
        assert rows["vae"][-1] == "replicated" and rows["vae"][2:4] == rows["vae"][4:6]
    offloaded = _memory(capsys, "--nproc", "2", "--weights", "replicated", "--offload", "vae,transformer_blocks")
    assert offloaded["vae"][4:6] == ["0", "B"] and offloaded["vae"][6:8] == offloaded["vae"][2:4]
    assert " ".join(offloaded["vae"]).endswith("replicated, on the CPU")
    assert "on the CPU" in " ".join(offloaded["transformer"])
    assert "on the CPU" not in " ".join(offloaded["text_encoder"])


def test_ltx2_at_its_released_size(capsys):
    """The committed configs-only folder: the 18.9B transformer and Gemma 3 12B, 64 GiB replicated in bf16; on
    8 x 24 GiB ``auto`` shards and it fits, on 8 x 80 GiB it replicates."""
    assert not [p for p in LTX2.rglob("*") if p.suffix in (".safetensors", ".bin")], "configs only"
    small = _memory(capsys, "--model", str(LTX2), "--nproc", "8", "--dtype", "bf16", "--device-memory", "24")
    assert small["transformer"][1] == "18.88B" and small["text_encoder"][1] == "12.19B"
    assert small["total"][1] == "34.32B" and " ".join(small["total"][2:4]) == "63.93 GiB"
    text = small[""][0]
    assert "weights auto -> sharded" in text and "on 24 GiB per GPU: fits" in text
    big = _memory(capsys, "--model", str(LTX2), "--nproc", "8", "--dtype", "bf16", "--device-memory", "80")
    assert "weights auto -> replicated" in big[""][0]
    peak = re.search(r"([\d.]+) GiB at the peak", text)
    assert peak and float(peak.group(1)) < 24 * 0.8


def test_helios_at_its_released_size(capsys):
    """The committed configs-only Helios folder: the 14.3B transformer and UMT5-XXL's 5.7B encoder, the VAE float32
    (HeliosPipeline's example keeps it there, so it stays whole on every rank); on 8 x 24 GiB ``auto`` shards."""
    assert not [p for p in HELIOS.rglob("*") if p.suffix in (".safetensors", ".bin")], "configs only"
    rows = _memory(capsys, "--model", str(HELIOS), "--nproc", "8", "--dtype", "bf16", "--device-memory", "24")
    assert rows["transformer"][1] == "14.31B" and rows["text_encoder"][1] == "5.68B"
    assert rows["vae"][-1] == "replicated" and " ".join(rows["vae"][2:4]) == "484.06 MiB"
    assert "weights auto -> sharded" in rows[""][0] and "on 24 GiB per GPU: fits" in rows[""][0]


@pytest.mark.parametrize("command", ["generate", "batch", "serve", "memory"])
def test_an_unknown_offload_component_is_exit_2_naming_the_valid_ones(command, capsys, tmp_path):
    argv = {"generate": ["generate", "--prompt", "x", "--out", str(tmp_path / "x.mp4")],
            "batch": ["batch", str(tmp_path / "p.jsonl"), "--out-dir", str(tmp_path)],
            "serve": ["serve"], "memory": ["memory"]}[command]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--offload", "vae,text_encoders"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--offload text_encoders" in err and "text_encoder, vae, transformer_blocks" in err, err


def test_the_flags_reach_the_runtime_config():
    from server.cli.common import runtime_config_from_args
    from server.group.runtime import RuntimeConfig

    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--out", "x.mp4", "--weights", "sharded",
                                          "--offload", "transformer_blocks,text_encoder"])
    config = runtime_config_from_args(args)
    assert (config.weights, config.offload) == ("sharded", ("text_encoder", "transformer_blocks"))
    assert (RuntimeConfig().weights, RuntimeConfig().offload) == ("auto", ())
    with pytest.raises(ValueError, match="--weights 'all'"):
        RuntimeConfig(weights="all")
    with pytest.raises(ValueError, match="valid: text_encoder, vae, transformer_blocks"):
        RuntimeConfig(offload=("unet",))
    # adapters load into sharded weights too (tests/models/test_lora_sharded.py)
    assert RuntimeConfig(weights="sharded", lora_dir=str(REPO / "bench")).weights == "sharded"


def test_memory_knows_the_ring_axis(capsys):
    """A ring of 2 Ulysses groups of 2: the replica group is all 4 ranks, and the sharded weights are quarters; a
    ring that does not divide the ranks is exit 2 naming the ring degrees that do."""
    rows = _memory(capsys, "--nproc", "4", "--ring-degree", "2", "--weights", "sharded")
    assert "4 rank(s) (guidance 1 x ring 2 x Ulysses 2)" in rows[""][0], rows[""][0]
    assert rows["transformer"][-2:] == ["1/4", "shard"], rows["transformer"]
    assert cli.main(["memory", "--nproc", "4", "--ring-degree", "3"]) == 2
    assert "--ring-degree must divide the 4 ranks: one of [2, 4]" in capsys.readouterr().err
