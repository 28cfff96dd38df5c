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
