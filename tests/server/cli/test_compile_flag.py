"""``--compile`` on ``generate`` and ``batch`` reaches the runtime config (off by default); what it does to the model
is tested in ``tests/models/test_compile.py``."""

import pytest

from server.cli import command as cli


@pytest.mark.parametrize("command", [["generate", "--prompt", "a fox", "--out", "x.mp4"],
                                     ["batch", "prompts.jsonl", "--out-dir", "videos"]])
def test_compile_flag_reaches_runtime_config(command):
    from server.cli.common import runtime_config_from_args
    from server.group.runtime import RuntimeConfig

    def compiled(*flags: str) -> bool:
        return runtime_config_from_args(cli.build_parser().parse_args([*command, *flags])).compile_blocks

    assert compiled() is RuntimeConfig().compile_blocks is False
    assert compiled("--compile") is True


@pytest.mark.parametrize("command", [["generate", "--prompt", "a fox", "--out", "x.mp4"],
                                     ["batch", "prompts.jsonl", "--out-dir", "videos"]])
def test_max_lora_rank_reaches_runtime_config(command):
    """The adapter slots' rank under ``--compile`` (``models.common.lora_slots``); a rank below 1 names the flag."""
    from models.common.lora_slots import DEFAULT_MAX_LORA_RANK
    from server.cli.common import runtime_config_from_args
    from server.group.runtime import RuntimeConfig

    def rank(*flags: str) -> int:
        return runtime_config_from_args(cli.build_parser().parse_args([*command, *flags])).max_lora_rank

    assert rank() == RuntimeConfig().max_lora_rank == DEFAULT_MAX_LORA_RANK
    assert rank("--compile", "--max-lora-rank", "16") == 16
    with pytest.raises(ValueError, match="--max-lora-rank"):
        RuntimeConfig(max_lora_rank=0)
