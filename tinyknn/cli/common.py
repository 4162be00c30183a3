"""What every `tinyknn` subcommand shares: the usage error, counted nouns, JSON output."""

from __future__ import annotations

import json


class UsageError(Exception):
    """A command line that cannot be carried out as given; main() prints it and exits 2."""


def count(n: int, noun: str, plural: str | None = None) -> str:
    """'1 kernel', '2 kernels', '0 kernels'."""
    return f"{n:,} {noun if n == 1 else (plural or noun + 's')}"


def print_json(data) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))
