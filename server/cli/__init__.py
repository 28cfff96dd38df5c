"""The ``cp-infer`` command line: ``generate`` one video, run a ``batch`` of prompts, or ``serve`` HTTP.

The parser and the commands are in :mod:`server.cli.command`; ``main`` is imported from it only when called, so
importing a module of this wing (or the ``cp-infer`` entry point) loads nothing else.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """The ``cp-infer`` entry point (see :func:`server.cli.command.main`)."""
    from server.cli.command import main as run

    return run(argv)
