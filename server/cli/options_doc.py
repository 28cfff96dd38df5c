"""The option tables of ``docs/options.md``, generated from the models' declarations (``cp_infer.options``).

``python -m server.cli.options_doc`` rewrites each table of docs/options.md between its markers
(``<!-- options:FAMILY -->`` ... ``<!-- /options:FAMILY -->``); ``--check`` exits 1 if one is stale, and a test runs
that check, so the docs cannot drift from the declarations.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from cp_infer.options import ModelOptions, Option
from models.families import family_names

__all__ = ["DOC", "FAMILIES", "options_table", "render_tables"]

# The families whose tables the docs show: every one of the table (``models.families``), at 48 blocks (a real-size
# model's depth: the range of block-index options); a family whose options depend on its folder shows its default
# folder's (``models.registry.model_options``).
FAMILIES = family_names()
DOC = Path(__file__).resolve().parents[2] / "docs" / "options.md"
"""The page that holds the tables."""


def _options(family: str) -> ModelOptions:
    from models.registry import model_options

    return model_options(family, layers=48)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(option: Option) -> str:
    if option.default is None:
        return "unset"
    if isinstance(option.default, tuple):
        return "[" + ", ".join(map(str, option.default)) + "]"
    return f"`{option.default!r}`" if isinstance(option.default, str) else f"`{option.default}`"


def options_table(options: ModelOptions) -> str:
    """A markdown table: the request name (HTTP field, batch key), the CLI flags, the accepted values (a limit named
    where the deployment caps it), the default and the help."""
    rows = ["| option (HTTP, batch) | CLI | accepts | default | |", "|---|---|---|---|---|"]
    for o in options:
        names = ", ".join(f"`{n}`" for n in (o.name, *o.aliases))
        flags = ", ".join(f"`{f}`" for f in dict.fromkeys((o.flag, *o.flags)))
        accepts = o.describe() + (f" ({o.limit_note()})" if o.limit else "")
        rows.append(f"| {names} | {flags} | {_cell(accepts)} | {_default(o)} | {_cell(o.help)} |")
    return "\n".join(rows)


def render_tables(text: str) -> str:
    """``text`` with every options table regenerated; a ``ValueError`` if a family's markers are missing."""
    for family in FAMILIES:
        name = re.escape(family)
        pattern = re.compile(rf"(<!-- options:{name} -->\n)(?:.*?\n)?(<!-- /options:{name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"no <!-- options:{family} --> ... <!-- /options:{family} --> markers; add the pair "
                             "where the table goes")
        table = options_table(_options(family))
        text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.cli.options_doc", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the tables are stale; write nothing")
    parser.add_argument("--doc", type=Path, default=DOC, help="the page to rewrite (default docs/options.md)")
    args = parser.parse_args(argv)
    text = args.doc.read_text(encoding="utf-8")
    try:
        rendered = render_tables(text)
    except ValueError as exc:
        print(f"{args.doc}: {exc}", file=sys.stderr)
        return 1
    if args.check:
        if rendered != text:
            print(f"{args.doc}: the option tables are stale; run python -m server.cli.options_doc", file=sys.stderr)
            return 1
        return 0
    if rendered != text:
        args.doc.write_text(rendered, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
