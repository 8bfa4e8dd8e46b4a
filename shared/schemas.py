"""Generates docs/schemas/*.json (JSON Schema) from the message models.

python -m trainmover.schemas            # rewrite docs/schemas/
python -m trainmover.schemas --check    # exit 1 when docs/schemas/ is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from trainmover.messages import ALL_MESSAGES, SCHEMA_VERSION

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "docs" / "schemas"


def render() -> dict[str, str]:
    """File name -> JSON Schema text, for every message."""
    out = {}
    for name, model in ALL_MESSAGES.items():
        schema: dict[str, Any] = TypeAdapter(model).json_schema(mode="validation")
        schema = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"trainmover/v{SCHEMA_VERSION}/{name}.json",
            **schema,
        }
        out[f"{name}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def stale(directory: Path = DEFAULT_DIR) -> list[str]:
    """Names of schema files that are missing, different, or no longer generated."""
    wanted = render()
    have = {p.name for p in directory.glob("*.json")} if directory.exists() else set()
    diff = [
        n
        for n, text in wanted.items()
        if not (directory / n).exists() or (directory / n).read_text() != text
    ]
    return sorted(diff + sorted(have - set(wanted)))


def write(directory: Path = DEFAULT_DIR) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    wanted = render()
    for old in directory.glob("*.json"):
        if old.name not in wanted:
            old.unlink()
    for name, text in wanted.items():
        (directory / name).write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainmover.schemas")
    p.add_argument("--check", action="store_true", help="fail when the files are stale")
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args = p.parse_args(argv)
    if args.check:
        bad = stale(args.dir)
        if bad:
            print(
                f"stale JSON Schemas in {args.dir}: {', '.join(bad)}; run `make schemas`",
                file=sys.stderr,
            )
            return 1
        return 0
    write(args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
