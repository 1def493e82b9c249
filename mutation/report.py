"""The report of a run: JSON for tools, a table for people."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["summarize", "table", "write"]


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per target: mutants, killed, kill rate, and each survivor."""
    by_target: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_target[record["target"]].append(record)
    summary = {}
    for name, everything in by_target.items():
        # A mutant the tool could not make (killed is None) is listed, not counted.
        items = [r for r in everything if r["killed"] is not None]
        killed = sum(1 for r in items if r["killed"])
        summary[name] = {
            "path": everything[0]["path"],
            "mutants": len(items),
            "not_made": len(everything) - len(items),
            "killed": killed,
            "kill_rate": round(killed / len(items), 4) if items else None,
            "survivors": [r for r in items if r["killed"] is False],
        }
    return summary


def table(summary: dict[str, dict[str, Any]], seconds: dict[str, float]) -> str:
    """A plain-text table: kill rate per target, then each survivor with its diff."""
    lines = [f"{'target':<24} {'mutants':>7} {'killed':>6} {'rate':>7} {'time':>7}"]
    total = killed = 0
    for name, row in summary.items():
        total += row["mutants"]
        killed += row["killed"]
        rate = f"{100 * row['kill_rate']:.1f}%" if row["mutants"] else "-"
        lines.append(
            f"{name:<24} {row['mutants']:>7} {row['killed']:>6} {rate:>7} {seconds[name]:>6.0f}s"
        )
    if total:
        lines.append(
            f"{'all':<24} {total:>7} {killed:>6} {100 * killed / total:>6.1f}% "
            f"{sum(seconds.values()):>6.0f}s"
        )
    for row in summary.values():
        for survivor in row["survivors"]:
            lines.append("")
            lines.append(f"SURVIVED {row['path']}:{survivor['line']} {survivor['description']}")
            lines.append(survivor["diff"].rstrip())
    return "\n".join(lines) + "\n"


def write(out: Path, records: list[dict[str, Any]], seconds: dict[str, float]) -> str:
    """Write ``mutants.json`` and ``mutants.txt`` into *out*; return the table."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(records)
    (out / "mutants.json").write_text(
        json.dumps({"seconds": seconds, "targets": summary, "mutants": records}, indent=1)
    )
    text = table(summary, seconds)
    (out / "mutants.txt").write_text(text)
    return text
