"""Results of a benchmark: summaries (median, min, max), values that could not be
measured (null with a reason), progress lines, and the JSON / Markdown / PNG outputs.

Every metric in a result is a number or None; a None always has its reason under
``result["unavailable"]["<dotted.key>"]``, so a reader (and the smoke test) can tell
"not measured, because ..." from a bug.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class NotMeasurable(Exception):
    """A system or variant that cannot run here; the message is the recorded reason."""


def summary(samples: Iterable[float]) -> dict[str, Any]:
    """Median, min, max and the samples themselves (None-free); empty -> Nones."""
    values = [float(v) for v in samples if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0, "samples": []}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "samples": values,
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is not
    positive (a downtime at or below zero has no meaningful ratio)."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


class Result:
    """A benchmark's JSON document under construction."""

    def __init__(self, benchmark: str, **meta: Any):
        self.data: dict[str, Any] = {
            "benchmark": benchmark,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **meta,
            "unavailable": {},
        }

    def set(self, dotted: str, value: Any, reason: str | None = None) -> None:
        """Sets a (possibly nested) key; a None value must come with its reason."""
        *parents, leaf = dotted.split(".")
        node = self.data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        if value is None:
            self.data["unavailable"][dotted] = reason or "not measured"
        else:
            self.data["unavailable"].pop(dotted, None)

    def get(self, dotted: str) -> Any:
        node: Any = self.data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def set_median(self, dotted: str, samples: list[float], reason: str | None = None) -> None:
        """`dotted` = the median of `samples` (None + reason when there are none), and
        `<dotted without _s>_stats` = its min/max/samples."""
        stats = summary(samples)
        self.set(dotted, stats["median"], reason or "no successful sample")
        self.set(dotted.removesuffix("_s") + "_stats", stats)

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        return path


def successes(values: list[Any]) -> list[dict[str, Any]]:
    """The measured rows among `attempt` outcomes (the rest are reason strings)."""
    return [v for v in values if isinstance(v, dict)]


def first_reason(values: list[Any]) -> str | None:
    """Why a measurement has no value: the first reason among `attempt` outcomes."""
    return next((v for v in values if isinstance(v, str)), None)


def attempt(fn: Callable[[], T]) -> T | str:
    """Runs one measurement; a NotMeasurable (or a failure of a peer system) becomes its
    reason string instead of ending the whole benchmark (the progress line shows it)."""
    try:
        return fn()
    except NotMeasurable as exc:
        return str(exc)
    except Exception as exc:  # a peer system failing is a result, not a crash
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        return f"failed: {type(exc).__name__}: {last}"


class Progress:
    """One line per finished item on stderr: [bench i/n, elapsed] what: value."""

    def __init__(self, name: str, total: int, stream: Any = None):
        self.name, self.total, self.done = name, total, 0
        self.started = time.monotonic()
        self.stream = stream or sys.stderr

    def _line(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        print(
            f"[{self.name} {self.done}/{self.total} {elapsed:6.0f}s] {text}",
            file=self.stream,
            flush=True,
        )

    def step(self, text: str) -> None:
        """A measurement finished."""
        self.done += 1
        self._line(text)

    def note(self, text: str) -> None:
        """Something worth seeing while it runs (a phase started, a peer failed)."""
        self._line(text)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A GitHub Markdown table; floats with 3 decimals, None as an em dash."""

    def cell(v: Any) -> str:
        if v is None:
            return "—"
        if isinstance(v, float):
            return f"{v:.3f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def fmt_stats(stats: dict[str, Any] | None) -> str:
    """'median (min–max)' of a summary, for tables."""
    if not stats or stats.get("median") is None:
        return "—"
    return f"{stats['median']:.3f} ({stats['min']:.3f}–{stats['max']:.3f})"


def outputs(json_path: Path) -> tuple[Path, Path]:
    """The Markdown table and the PNG plot written next to a result's JSON."""
    return json_path.with_suffix(".md"), json_path.with_suffix(".png")
