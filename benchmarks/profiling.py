"""``python -m benchmarks --profile``: where the time goes on the hot paths.

cProfile (deterministic, in this process) wraps:

* one companion pass releasing N due tasks on each path (handoff, generic on
  Redis, generic on RabbitMQ), with the store's Redis-side script time beside
  it (SLOWLOG), so Python time and Redis time can be told apart;
* N ``apply_delayed`` calls and N ``apply_async(countdown=)`` calls;
* bulk parking with ``apply_delayed_many`` and inside ``celery_zdelay.batch``.

py-spy (sampling, another process; only samples holding the GIL, i.e. Python
CPU, not waits), when installed, records the real
``celery zdelay`` process during the steady 1,000 due/s run.

cProfile slows Python code down (roughly 1.5-2x), so its rates are not
benchmark figures; the shares are what matter. Writes
``results/<timestamp>-profile.txt`` (readable) and ``-profile.json``.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import celery_zdelay

from .common import PARK_CHUNK, Sizes
from .infra import Resources
from .proj import make_app

TOP = 18


def run_profile(sizes: Sizes, out_dir: Path) -> str:
    from .release import MODES, is_rabbit, release_rate

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir.mkdir(parents=True, exist_ok=True)
    sections: dict[str, Any] = {}

    for mode in MODES:
        n = sizes.release_rabbit_n if is_rabbit(mode) else sizes.release_n
        profiler = cProfile.Profile()
        try:
            result = release_rate(mode, n, profiler=profiler)[0]
        except Exception as exc:
            sections[f"release {mode}"] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        sections[f"release {mode}"] = {
            "n": n,
            "wall_s": result["seconds"],
            "redis_scripts": result.get("redis_script_calls"),
            **summarize(profiler),
        }

    for name, fn in (
        ("apply_delayed per call", _calls_delayed),
        ("apply_async per call", _calls_plain),
        ("bulk parking, apply_delayed_many", _bulk_many),
        ("bulk parking", _bulk),
    ):
        profiler = cProfile.Profile()
        n = sizes.bulk_n if name.startswith("bulk") else sizes.call_n * sizes.call_rounds
        wall = fn(n, profiler)
        sections[name] = {"n": n, "wall_s": round(wall, 3), **summarize(profiler)}

    sections["companion at steady load (py-spy)"] = _spy_companion(sizes)

    json_path = out_dir / f"{stamp}-profile.json"
    json_path.write_text(json.dumps(sections, indent=1) + "\n")
    text = render(sections)
    text_path = out_dir / f"{stamp}-profile.txt"
    text_path.write_text(text)
    return text + f"\nwrote {text_path} and {json_path}\n"


def _producer_app(res: Resources) -> Any:
    server = res.redis()
    url = f"{server.url}/0"
    app = make_app(broker=url, store=url)
    res.callback(app.close)
    noop = app.tasks["bench.noop"]
    for seq in range(200):  # connections and scripts loaded before profiling
        noop.apply_delayed((seq, 0), countdown=3600)
        noop.apply_async((seq, 0), countdown=3600)
    return noop


def _calls_delayed(n: int, profiler: cProfile.Profile) -> float:
    with Resources() as res:
        noop = _producer_app(res)
        profiler.enable()
        started = time.perf_counter()
        for seq in range(n):
            noop.apply_delayed((seq, 0), countdown=3600)
        wall = time.perf_counter() - started
        profiler.disable()
    return wall


def _calls_plain(n: int, profiler: cProfile.Profile) -> float:
    with Resources() as res:
        noop = _producer_app(res)
        profiler.enable()
        started = time.perf_counter()
        for seq in range(n):
            noop.apply_async((seq, 0), countdown=3600)
        wall = time.perf_counter() - started
        profiler.disable()
    return wall


def _bulk_many(n: int, profiler: cProfile.Profile) -> float:
    with Resources() as res:
        noop = _producer_app(res)
        noop.apply_delayed_many([(0, 0)], countdown=3600)
        profiler.enable()
        started = time.perf_counter()
        for chunk in range(0, n, PARK_CHUNK):
            calls = [(seq, 0) for seq in range(chunk, min(chunk + PARK_CHUNK, n))]
            noop.apply_delayed_many(calls, countdown=3600)
        wall = time.perf_counter() - started
        profiler.disable()
    return wall


def _bulk(n: int, profiler: cProfile.Profile) -> float:
    with Resources() as res:
        noop = _producer_app(res)
        app = noop._get_app()
        profiler.enable()
        started = time.perf_counter()
        for chunk in range(0, n, PARK_CHUNK):
            with celery_zdelay.batch(app):
                for seq in range(chunk, min(chunk + PARK_CHUNK, n)):
                    noop.apply_delayed((seq, 0), countdown=3600)
        wall = time.perf_counter() - started
        profiler.disable()
    return wall


def _spy_companion(sizes: Sizes) -> dict[str, Any]:
    """py-spy the companion process while it releases 1,000 due/s."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return {"error": "py-spy is not installed (pip install py-spy)"}
    from .lateness import run_lateness

    raw = Path(tempfile.mkstemp(prefix="zbench-spy-", suffix=".txt")[1])
    spies: list[subprocess.Popen[bytes]] = []

    def start(pid: int, seconds: float) -> None:
        spies.append(
            subprocess.Popen(
                [
                    *(spy, "record", "-p", str(pid), "-d", str(max(1, round(seconds)))),
                    *("-r", "500", "-f", "raw", "-o", str(raw), "--nonblocking", "--gil"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        )

    try:
        result = run_lateness(sizes, on_start=start)
        for process in spies:
            _, err = process.communicate(timeout=60)
            if process.returncode:
                return {"error": f"py-spy failed: {err.decode(errors='replace')[-500:]}"}
        return {
            "lateness_ms": result["observed_ms"],
            **summarize_folded(raw.read_text()),
        }
    finally:
        for process in spies:
            if process.poll() is None:
                process.kill()
                process.wait()
        raw.unlink(missing_ok=True)


# -- summaries ---------------------------------------------------------------------------


def _where(file: str, line: int, name: str) -> str:
    # Paths relative to site-packages or the checkout: "celery_zdelay/store/store.py".
    for marker in ("site-packages/", "/celery_zdelay/", "/benchmarks/"):
        if marker in file:
            rest = file.split(marker, 1)[1]
            file = rest if marker == "site-packages/" else marker[1:] + rest
            break
    if file.startswith("~") or file == "<built-in>":
        return name
    return f"{file}:{line}:{name}"


def summarize(profiler: cProfile.Profile) -> dict[str, Any]:
    """Return the top functions by own time and by cumulative time."""
    stats = pstats.Stats(profiler)
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = [
        (_where(*key), tt, ct, nc)
        for key, (_, nc, tt, ct, _callers) in stats.stats.items()  # type: ignore[attr-defined]
    ]

    def table(index: int) -> list[dict[str, Any]]:
        ordered = sorted(rows, key=lambda row: row[index], reverse=True)[:TOP]
        return [
            {
                "function": where,
                "calls": nc,
                "own_s": round(tt, 4),
                "own_pct": round(100 * tt / total, 1) if total else 0,
                "cum_s": round(ct, 4),
                "cum_pct": round(100 * ct / total, 1) if total else 0,
            }
            for where, tt, ct, nc in ordered
        ]

    return {"profiled_s": round(total, 3), "by_own_time": table(1), "by_cumulative": table(2)}


def summarize_folded(text: str) -> dict[str, Any]:
    """Summarize py-spy raw (folded) stacks: own and inclusive share per frame."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f and not f.startswith("thread (")]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count

    def table(counter: Counter[str]) -> list[dict[str, Any]]:
        return [
            {"function": frame, "samples": count, "pct": round(100 * count / total, 1)}
            for frame, count in counter.most_common(TOP)
        ]

    return {"samples": total, "by_own_time": table(own), "by_inclusive": table(inclusive)}


def render(sections: dict[str, Any]) -> str:
    lines = []
    for title, section in sections.items():
        lines.append(f"== {title} ==")
        if "error" in section:
            lines.append(f"  error: {section['error']}")
            lines.append("")
            continue
        header = {k: v for k, v in section.items() if not isinstance(v, (list, dict))}
        lines.append("  " + ", ".join(f"{k}={v}" for k, v in header.items()))
        if section.get("redis_scripts"):
            for script, s in section["redis_scripts"].items():
                lines.append(
                    f"  Redis: {script}.lua {s['calls']} calls, {s['total_ms']} ms server time "
                    f"(mean {s['mean_ms']} ms, max {s['max_ms']} ms)"
                )
        if section.get("lateness_ms"):
            q = section["lateness_ms"]
            lines.append(f"  lateness p50 {q['p50']} ms, p99 {q['p99']} ms (under py-spy)")
        for key in ("by_own_time", "by_cumulative", "by_inclusive"):
            if key not in section:
                continue
            lines.append(f"  -- {key.replace('_', ' ')} --")
            for row in section[key]:
                if "samples" in row:
                    lines.append(f"  {row['pct']:5.1f}%  {row['function']}")
                else:
                    value = row["own_pct"] if key == "by_own_time" else row["cum_pct"]
                    lines.append(f"  {value:5.1f}%  {row['calls']:>8}  {row['function']}")
        lines.append("")
    return "\n".join(lines)
