"""The subcommand parser every command module builds from its own docstring."""
from __future__ import annotations

import argparse


def documented_parser(subparsers, name: str, help: str, doc: str, *, more: str = "",
                      examples: str | None = None) -> argparse.ArgumentParser:
    """`name`'s parser: its description is the first paragraph of the module docstring `doc`
    after its "`autopart NAME ...`: " (and `more`), its epilog the docstring's lines starting
    with `examples` (default "    autopart NAME")."""
    prefix = examples or f"    autopart {name}"
    return subparsers.add_parser(
        name, help=help, description=doc.split("\n\n")[0].split(": ", 1)[1] + more,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n" + "\n".join(line for line in doc.splitlines()
                                         if line.startswith(prefix)))
