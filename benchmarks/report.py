"""Turn a results JSON into the target verdicts, a console table, docs and a plot.

Everything here reads only the JSON a run wrote, so the docs can be
regenerated from any run (``python -m benchmarks --render-docs FILE``)
without measuring again.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS_PAGE = ROOT / "docs" / "performance.rst"
DOCS_PLOT = ROOT / "docs" / "_static" / "lateness.png"


@dataclass(frozen=True)
class Verdict:
    """One row of the summary: a target, what was measured, and whether it is met."""

    target_id: str
    what: str
    measured: str
    comparison: str
    target: str
    #: "met", "missed", or "not measured".
    status: str
    #: How far from the target, e.g. "1.9x better" or "4.0x short".
    margin: str
    #: Set when the run was smaller than the target's own size (quick mode).
    note: str = ""

    def as_dict(self) -> dict[str, str]:
        return dict(self.__dict__)


# -- formatting ------------------------------------------------------------------------


def fmt_int(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def fmt_ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _ratio_margin(measured: float, target: float, *, higher_is_better: bool) -> tuple[bool, str]:
    """Return whether *measured* meets *target*, and by how much, as a factor."""
    if measured <= 0 or target <= 0:
        met = (measured >= target) if higher_is_better else (measured <= target)
        return met, ""
    if higher_is_better:
        factor = measured / target
        return factor >= 1, (
            f"{factor:.2f}x the target" if factor >= 1 else f"{1 / factor:.2f}x short"
        )
    factor = target / measured
    return factor >= 1, (
        f"{factor:.2f}x under the limit" if factor >= 1 else f"{1 / factor:.2f}x over the limit"
    )


def _get(results: dict[str, Any], *path: str) -> Any:
    node: Any = results
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


# -- verdicts --------------------------------------------------------------------------


def verdicts(run: dict[str, Any]) -> list[Verdict]:
    """Judge each of DESIGN §7's targets P1-P8 from a run's results."""
    results = run.get("results", {})
    rows: list[Verdict] = []
    for build in _VERDICTS:
        rows.extend(build(results))
    return rows


def _missing(target_id: str, what: str, target: str, why: str = "not run") -> Verdict:
    return Verdict(target_id, what, "n/a", "", target, "not measured", why)


def _release_verdicts(results: dict[str, Any]) -> list[Verdict]:
    release = results.get("release") or {}
    e2e = results.get("end_to_end") or {}
    native = []
    for label in ("solo", "prefork-2"):
        rate = _get(e2e, f"native-{label}", "rate")
        if rate is not None:
            native.append(f"native ETA {label}: {fmt_int(rate)}/s")
    comparison = "; ".join(native) + (" (end to end, see below)" if native else "")
    rows = []
    specs = [
        ("P1", "handoff", "release rate, atomic handoff (broker = store's Redis db)", 50_000),
        ("P2", "generic-redis", "release rate, generic path, Redis broker", 10_000),
        ("P2", "generic-rabbitmq", "release rate, generic path, RabbitMQ + confirms", 5_000),
    ]
    for target_id, mode, what, target in specs:
        entry = release.get(mode)
        target_text = f"≥ {target:,}/s"
        if not entry or "rate" not in entry:
            reason = (entry or {}).get("error", "not run")
            rows.append(_missing(target_id, what, target_text, reason))
            continue
        met, margin = _ratio_margin(entry["rate"], target, higher_is_better=True)
        runs = entry.get("runs") or [entry["rate"]]
        measured = f"{fmt_int(entry['rate'])}/s"
        if len(runs) > 1:
            measured += f" (median of {len(runs)})"
        rows.append(
            Verdict(
                target_id,
                what,
                measured,
                comparison if mode == "handoff" else _confirm_cost(release, mode),
                target_text,
                "met" if met else "missed",
                margin,
                f"N={entry['n']:,}",
            )
        )
    return rows


def _confirm_cost(release: dict[str, Any], mode: str) -> str:
    """RabbitMQ: the same publishes without confirms, measured in the same run."""
    plain = release.get("generic-rabbitmq-unconfirmed") or {}
    confirmed = release.get(mode) or {}
    if mode != "generic-rabbitmq" or "rate" not in plain or "rate" not in confirmed:
        return ""
    return (
        f"without confirms (comparison only): {fmt_int(plain['rate'])}/s, "
        f"so confirms cost {plain['rate'] / confirmed['rate']:.2f}x"
    )


def _limit_verdicts(results: dict[str, Any]) -> list[Verdict]:
    """P1 against the limit: the handoff's rate as a share of a bare Lua move's."""
    entry = results.get("limit")
    what = "handoff / bare Lua move, batch {}"
    if not entry or "error" in entry:
        reason = (entry or {}).get("error", "not run")
        return [_missing("P1", what.format("200 / 1,000"), "≥ 0.5x", reason)]
    rows = []
    for key, value in entry.items():
        if not key.startswith("batch-"):
            continue
        bare = value["bare"]
        paths = [("handoff", "ratio", what, _render_note(value))]
        if "handoff_whole" in value:
            paths.append(
                (
                    "handoff_whole",
                    "whole_ratio",
                    "handoff of whole messages (zdelay_whole_messages) / bare Lua move, batch {}",
                    "",
                )
            )
        for path, ratio_key, label, extra in paths:
            handoff, ratio = value[path], value[ratio_key]
            met, margin = _ratio_margin(ratio, 0.5, higher_is_better=True)
            runs = len(handoff.get("runs") or [1])
            rows.append(
                Verdict(
                    "P1",
                    label.format(f"{value['batch']:,}"),
                    f"{ratio:.2f}x ({fmt_int(handoff['rate'])}/s)",
                    f"bare move {fmt_int(bare['rate'])}/s; Redis script time per task: handoff "
                    f"{handoff['script_us_per_task']:.2f} µs, "
                    f"bare {bare['script_us_per_task']:.2f} µs" + extra,
                    "≥ 0.5x",
                    "met" if met else "missed",
                    margin,
                    f"N={entry['n']:,}, {value['message_bytes']} B messages"
                    + (f", median of {runs}" if runs > 1 else ""),
                )
            )
    return rows


def _render_note(value: dict[str, Any]) -> str:
    """The bound template rendering alone puts on the handoff's ratio (older runs: none)."""
    render = value.get("render")
    if not render:
        return ""
    return (
        f"; rendering a message from its template alone takes {render['us_per_entry']:.2f} µs, "
        f"which bounds the ratio at {value['render_bound']:.2f}"
    )


def _whole_note(entry: dict[str, Any]) -> str:
    """P7 under zdelay_whole_messages, the memory side of its trade-off (older runs: none)."""
    whole = entry.get("zdelay_whole")
    if not whole:
        return ""
    return (
        f"; with zdelay_whole_messages: {fmt_int(whole['redis_bytes_per_task'])} B "
        f"(payload {fmt_int(whole['mean_payload_bytes'])} B)"
    )


def _whole_memory_rows(memory: dict[str, Any]) -> list[list[str]]:
    """The memory table's row for zdelay_whole_messages (older runs: none)."""
    whole = memory.get("zdelay_whole")
    if not whole:
        return []
    return [
        [
            "celery-zdelay, parked whole (zdelay_whole_messages)",
            f"{fmt_int(whole['redis_bytes_per_task'])}",
            f"due zset {fmt_int(whole['due_zset_bytes_per_task'])}, message hash "
            f"{fmt_int(whole['msg_hash_bytes_per_task'])}; "
            f"payload {fmt_int(whole['mean_payload_bytes'])} B",
            "(not measured)",
        ]
    ]


def _lateness_verdicts(results: dict[str, Any]) -> list[Verdict]:
    entry = results.get("lateness")
    what = "lateness at a steady 1,000 due/s (p50 / p99 / max)"
    target = "p50 ≤ 2 ms, p99 ≤ 10 ms"
    if not entry or "observed_ms" not in entry:
        return [_missing("P3", what, target, (entry or {}).get("error", "not run"))]
    observed, reported = entry["observed_ms"], entry.get("reported_ms") or {}
    met50, m50 = _ratio_margin(observed["p50"], 2.0, higher_is_better=False)
    met99, m99 = _ratio_margin(observed["p99"], 10.0, higher_is_better=False)
    measured = (
        f"{fmt_ms(observed['p50'])} / {fmt_ms(observed['p99'])} / {fmt_ms(observed['max'])} ms"
    )
    comparison = (
        f"companion's own report: {fmt_ms(reported.get('p50'))} / "
        f"{fmt_ms(reported.get('p99'))} / {fmt_ms(reported.get('max'))} ms"
        if reported
        else ""
    )
    early = f"; {entry['early']} early" if entry.get("early") else "; none early"
    return [
        Verdict(
            "P3",
            what,
            measured,
            comparison,
            target,
            "met" if met50 and met99 else "missed",
            f"p50 {m50}, p99 {m99}",
            f"{entry['n']:,} tasks over {entry['seconds']:g} s{early}",
        )
    ]


def _burst_verdicts(results: dict[str, Any]) -> list[Verdict]:
    entry = results.get("burst")
    what = "burst: tasks due at one instant, due -> all in the queue"
    target = "≤ 3 s for 100,000"
    if not entry or "seconds" not in entry:
        return [_missing("P4", what, target, (entry or {}).get("error", "not run"))]
    met, margin = _ratio_margin(entry["seconds"], 3.0, higher_is_better=False)
    note = f"N={entry['n']:,}"
    if entry["n"] < 100_000:
        note += " (quick: smaller than the target's 100,000)"
    return [
        Verdict(
            "P4",
            what,
            f"{entry['seconds']:.2f} s ({fmt_int(entry['rate'])}/s)",
            "",
            target,
            "met" if met else "missed",
            margin,
            note,
        )
    ]


def _producer_verdicts(results: dict[str, Any]) -> list[Verdict]:
    entry = results.get("producer")
    what_call = "apply_delayed vs apply_async(countdown=) per call, same Redis"
    bulk = (entry or {}).get("bulk")
    what_bulk = (
        "bulk parking, apply_delayed_many (1,000 per call)"
        if bulk
        else "bulk parking, celery_zdelay.batch (1,000 per block)"
    )
    if not entry or "ratio" not in entry:
        reason = (entry or {}).get("error", "not run")
        return [
            _missing("P5", what_call, "≤ 1.0x", reason),
            _missing("P5", what_bulk, "≥ 20,000/s", reason),
        ]
    met_ratio, margin_ratio = _ratio_margin(entry["ratio"], 1.0, higher_is_better=False)
    met_bulk, margin_bulk = _ratio_margin(entry["bulk_rate"], 20_000, higher_is_better=True)
    plain_rate = 1e6 / entry["apply_async_us"] if entry["apply_async_us"] else None
    if bulk:
        many, bare = bulk["apply_delayed_many"], bulk["bare park"]
        comparison = (
            f"batch(): {fmt_int(bulk['batch']['rate'])}/s; apply_async one by one: "
            f"{fmt_int(bulk['apply_async']['rate'])}/s; bare Lua park: "
            f"{fmt_int(bare['rate'])}/s ({many['rate'] / bare['rate']:.2f}x of it); "
            f"Redis script time per task {many['script_us_per_task']:.2f} µs "
            f"(batch() {bulk['batch']['script_us_per_task']:.2f}, "
            f"bare {bare['script_us_per_task']:.2f})"
        )
        built = bulk.get("celery build")
        if built:
            comparison += (
                f"; Celery's own build and send per call alone (nothing parked): "
                f"{fmt_int(built['rate'])}/s ({many['rate'] / built['rate']:.2f}x of it)"
            )
    else:
        comparison = f"apply_async one by one: {fmt_int(plain_rate)}/s"
    per_call = entry.get("per_call")
    if per_call:
        call_rows = _per_call_verdicts(per_call)
    else:  # runs before the interleaved p50/p90 rounds
        call_rows = [
            Verdict(
                "P5",
                what_call,
                f"{entry['ratio']:.2f}x ({entry['apply_delayed_us']:.0f} µs per call)",
                f"apply_async(countdown=): {entry['apply_async_us']:.0f} µs per call",
                "≤ 1.0x",
                "met" if met_ratio else "missed",
                margin_ratio,
                f"median of {entry['rounds']} rounds of {entry['call_n']:,} calls",
            )
        ]
    rows = [
        *call_rows,
        Verdict(
            "P5",
            what_bulk,
            f"{fmt_int(entry['bulk_rate'])}/s",
            comparison,
            "≥ 20,000/s",
            "met" if met_bulk else "missed",
            margin_bulk,
            f"N={entry['bulk_n']:,}",
        ),
    ]
    rounds = entry.get("bulk_rounds")
    if rounds:
        ratio = rounds["ratio"]
        met, margin = _ratio_margin(ratio["median"], 0.95, higher_is_better=True)
        rows.append(
            Verdict(
                "P5",
                "bulk: apply_delayed_many vs Celery's own build and send (nothing parked)",
                f"{ratio['median']:.2f}x {fmt_spread(ratio)}",
                f"{fmt_int(rounds['apply_delayed_many_rate'])}/s vs "
                f"{fmt_int(rounds['celery_build_rate'])}/s (medians)",
                "≥ 0.95x",
                "met" if met else "missed",
                margin,
                f"median of {rounds['rounds']} interleaved rounds of {rounds['n']:,} tasks"
                + _bulk_ceiling(rounds),
            )
        )
    return rows


def _bulk_ceiling(rounds: dict[str, Any]) -> str:
    """The note on the best ratio a build then one bare park could reach (runs since 3 Dec)."""
    ceiling = rounds.get("ceiling")
    if not ceiling:
        return ""
    return (
        f"; ceiling, Celery's build then a bare ZADD+HSET park "
        f"({fmt_int(rounds['bare_park_rate'])}/s): {ceiling['median']:.2f}x {fmt_spread(ceiling)}"
    )


def fmt_spread(spread: dict[str, Any]) -> str:
    """A ratio's spread over rounds, as printed beside its median."""
    return (
        f"(min-max {spread['min']:.2f}-{spread['max']:.2f}, "
        f"IQR {spread['q1']:.2f}-{spread['q3']:.2f})"
    )


def _per_call_verdicts(per_call: dict[str, Any]) -> list[Verdict]:
    """P5 per call: p50 and p90 ratios, Redis broker and RabbitMQ broker."""
    rows = []
    for broker, label in (
        ("redis", "Redis broker = store"),
        ("rabbitmq", "RabbitMQ broker, store on Redis"),
    ):
        value = per_call.get(broker)
        for stat, us_key in (("p50", ""), ("p90", "_p90")):
            what = f"apply_delayed vs apply_async(countdown=) per call, {stat}, {label}"
            if not value:
                rows.append(_missing("P5", what, "≤ 1.0x", "RabbitMQ unreachable"))
                continue
            ratio = value[f"{stat}_ratio"]
            met, margin = _ratio_margin(ratio["median"], 1.0, higher_is_better=False)
            rows.append(
                Verdict(
                    "P5",
                    what,
                    f"{ratio['median']:.2f}x {fmt_spread(ratio)}",
                    f"{value[f'apply_delayed{us_key}_us']:.0f} µs vs "
                    f"{value[f'apply_async{us_key}_us']:.0f} µs per call (medians)",
                    "≤ 1.0x",
                    "met" if met else "missed",
                    margin,
                    f"median of {value['rounds']} interleaved rounds of {value['call_n']:,} calls",
                )
            )
    return rows


def _memory_verdicts(results: dict[str, Any]) -> list[Verdict]:
    entry = results.get("memory")
    what_rss = "worker RSS added by N delayed tasks (solo worker)"
    what_redis = "Redis memory per delayed small task"
    if not entry or "zdelay" not in entry:
        reason = (entry or {}).get("error", "not run")
        return [
            _missing("P6", what_rss, "< 5 MB", reason),
            _missing("P7", what_redis, "≤ 800 B", reason),
        ]
    z, native, n = entry["zdelay"], entry["native"], entry["n"]
    note = f"N={n:,}" + (" (quick: smaller than the target's 100,000)" if n < 100_000 else "")
    added_mb = z["worker_rss_added_mib"] * 1024 * 1024 / 1e6
    met_rss = added_mb < 5
    met_redis, margin_redis = _ratio_margin(z["redis_bytes_per_task"], 800, higher_is_better=False)
    return [
        Verdict(
            "P6",
            what_rss,
            f"{z['worker_rss_added_mib']:.1f} MiB",
            f"native ETA held by the worker: +{native['worker_rss_added_mib']:,.0f} MiB "
            f"({fmt_int(native['worker_rss_bytes_per_task'])} B per task)",
            "< 5 MB",
            "met" if met_rss else "missed",
            f"{added_mb:.1f} MB added" if met_rss else f"{added_mb - 5:.1f} MB over",
            note,
        ),
        Verdict(
            "P7",
            what_redis,
            f"{fmt_int(z['redis_bytes_per_task'])} B",
            f"native ETA: {fmt_int(native['queue_list_bytes_per_task'])} B in the queue list, "
            f"{fmt_int(native['held_bytes_per_task'])} B held (unacked + unacked_index)",
            "≤ 800 B",
            "met" if met_redis else "missed",
            margin_redis,
            f"{note}; a parked payload is {fmt_int(z['mean_payload_bytes'])} B"
            + _whole_note(entry),
        ),
    ]


def _idle_verdicts(results: dict[str, Any]) -> list[Verdict]:
    entry = results.get("idle")
    what = "companion CPU with nothing due"
    if not entry or "empty" not in entry:
        return [_missing("P8", what, "< 1 % of a core", (entry or {}).get("error", "not run"))]
    empty, parked = entry["empty"], entry["parked"]
    met, margin = _ratio_margin(max(empty["companion_cpu_pct"], 1e-9), 1.0, higher_is_better=False)
    return [
        Verdict(
            "P8",
            what,
            f"{empty['companion_cpu_pct']:.2f} % (empty store)",
            f"with {entry['parked_n']:,} parked an hour ahead: {parked['companion_cpu_pct']:.2f} %",
            "< 1 % of a core",
            "met" if met else "missed",
            margin if empty["companion_cpu_pct"] > 0 else "no CPU tick in the window",
            f"over {entry['seconds']:g} s",
        )
    ]


def _ratelimit_verdicts(results: dict[str, Any]) -> list[Verdict]:
    """Release control (issue 24): the rate a global limit achieves, at the broker."""
    return _ratelimit_verdict(results, "ratelimit", "") + _ratelimit_verdict(
        results, "ratelimit_cluster", ", 3-master Cluster store"
    )


def _ratelimit_verdict(results: dict[str, Any], name: str, where: str) -> list[Verdict]:
    entry = results.get(name)
    what = f"rate limit 200/s, 3 companions, 4 shards{where}: achieved"
    target = "within 5 % per 5 s window, never over the burst"
    if not entry:
        return []
    if "error" in entry:
        return [_missing("RL", what, target, entry["error"])]
    met = entry["window_max_error_pct"] <= 5 and entry["most_in_window"] <= entry["window_bound"]
    return [
        Verdict(
            "RL",
            what,
            f"{entry['achieved_per_s']:,.1f}/s",
            f"worst 5 s window {entry['window_max_error_pct']:.1f} % off; most in any 5 s "
            f"{entry['most_in_window']:,} (bound {entry['window_bound']:,}); unlimited queue: "
            f"{entry['free_arrived']:,}/{entry['free_n']:,}, last "
            f"{entry['free_last_after_first_limited_s']} s after the first limited",
            target,
            "met" if met else "missed",
            "",
            f"N={entry['n']:,}",
        )
    ]


_VERDICTS: list[Callable[[dict[str, Any]], list[Verdict]]] = [
    _release_verdicts,
    _limit_verdicts,
    _lateness_verdicts,
    _burst_verdicts,
    _producer_verdicts,
    _memory_verdicts,
    _idle_verdicts,
    _ratelimit_verdicts,
]


# -- console ---------------------------------------------------------------------------


def console_table(run: dict[str, Any]) -> str:
    """Return the summary as a plain-text table for the terminal."""
    rows = list(verdicts(run))
    headers = ("#", "what", "celery-zdelay", "target", "status", "comparison / notes")
    table = [
        (
            v.target_id,
            v.what,
            v.measured,
            v.target,
            f"{v.status} ({v.margin})" if v.margin else v.status,
            "; ".join(filter(None, [v.comparison, v.note])),
        )
        for v in rows
    ]
    widths = [min(max(len(str(row[i])) for row in [headers, *table]), 60) for i in range(5)]
    lines = []

    def line(cells: tuple[str, ...]) -> str:
        head = "  ".join(
            str(cell).ljust(widths[i])[: widths[i]] for i, cell in enumerate(cells[:5])
        )
        return f"{head}  {cells[5]}"

    lines.append(line(headers))
    lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 20)
    lines.extend(line(row) for row in table)
    lines.extend(_console_extras(run))
    return "\n".join(lines)


def _console_extras(run: dict[str, Any]) -> list[str]:
    results = run.get("results", {})
    lines = []
    e2e = results.get("end_to_end")
    if e2e:
        lines.append("")
        lines.append("End to end, N tasks due at one instant, executed by one worker:")
        for key, entry in e2e.items():
            if "rate" in entry:
                lines.append(
                    f"  {key:18} {fmt_int(entry['executed'])}/{fmt_int(entry['n'])} executed in "
                    f"{entry['seconds_after_due']:.2f} s after due = {fmt_int(entry['rate'])}/s"
                )
            else:
                lines.append(f"  {key:18} error: {entry.get('error')}")
    for name in ("release", "burst", "lateness", "lateness_generic"):
        entry = results.get(name)
        if not entry:
            continue
        scripts = _scripts_of(name, entry)
        for label, stats in scripts:
            lines.append(
                f"  Redis time per script call, {label}: "
                + ", ".join(
                    f"{script} {s['mean_ms']:.3f} ms mean / {s['max_ms']:.3f} max ({s['calls']})"
                    for script, s in stats.items()
                )
            )
    contention = results.get("contention")
    if contention and "error" not in contention:
        lines.append("")
        lines.append("Several companions on 16 shards, N tasks due at one instant (handoff):")
        for label, entry in contention.items():
            lines.append(
                f"  {label:28} {entry['redis_ms']:8.1f} ms of Redis time "
                f"({entry['redis_us_per_task']:.2f} µs a task, {entry['handoff_calls']} calls), "
                f"all released {entry['seconds']:.2f} s after due"
            )
    beat = results.get("beat")
    if beat and "error" not in beat:
        from .beat import console_lines

        lines += console_lines(beat)
    for note in run.get("notes_added_after_run") or []:
        lines.append("")
        lines.append(f"NOTE (added after the run): {note}")
    if run.get("code_changed_during_run"):
        lines.append("")
        lines.append("WARNING: the package code changed during this run (commit or edits).")
    load = run.get("load", {})
    if load:
        lines.append("")
        lines.append(
            f"Machine load: loadavg before {load.get('before')}, after {load.get('after')}"
        )
    return lines


def _scripts_of(name: str, entry: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    if name == "release":
        found = [
            (f"release {mode}", value["redis_script_calls"])
            for mode, value in entry.items()
            if isinstance(value, dict) and value.get("redis_script_calls")
        ]
    else:
        stats = entry.get("redis_scripts")
        found = [(name, stats)] if stats else []
    return [(label, _named_scripts(stats)) for label, stats in found]


def _named_scripts(stats: dict[str, Any]) -> dict[str, Any]:
    """Name scripts a run recorded by SHA prefix, when today's source has that SHA."""
    if not any(re.fullmatch(r"[0-9a-f]{12}", key) for key in stats):
        return stats
    from .infra import _script_names

    names = {sha[:12]: name for sha, name in _script_names().items()}
    return {names.get(key, key): value for key, value in stats.items()}


# -- docs -------------------------------------------------------------------------------


def render_docs(run: dict[str, Any], run_path: Path, plot: Path | None, *, full: bool) -> Path:
    """Refresh the generated regions of docs/performance.rst from *run*; copy the plot.

    A run of some benchmarks only (``--only``; *full* is False) refreshes the
    "against the limit" table alone, when it measured it: the other regions
    keep the figures of the last full run.
    """
    text = DOCS_PAGE.read_text() if DOCS_PAGE.exists() else ""
    regions = {"limits": rst_limits(run, run_path)}
    if full:
        regions.update(
            summary=rst_summary(run, run_path),
            machine=rst_machine(run),
            details=rst_details(run),
        )
    elif not _limit_rows(run.get("results", {})):
        raise SystemExit(
            "This run measured some benchmarks only and not the 'limit' or 'producer' ones: "
            "nothing in the docs comes from it. Render a full run."
        )
    for name, body in regions.items():
        pattern = re.compile(
            rf"(\.\. begin-generated: {name}\n)(.*?)(\.\. end-generated: {name}\n)", re.S
        )
        if not pattern.search(text):
            raise SystemExit(
                f"{DOCS_PAGE} has no '.. begin-generated: {name}' / '.. end-generated: {name}' "
                "markers; restore them to render the results."
            )
        text = pattern.sub(lambda m, body=body: m.group(1) + "\n" + body + "\n" + m.group(3), text)
    DOCS_PAGE.write_text(text)
    if plot is not None and plot.exists() and "summary" in regions:
        DOCS_PLOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(plot, DOCS_PLOT)
    return DOCS_PAGE


def _rst_escape(text: str) -> str:
    return text.replace("*", r"\*").replace("|", r"\|").replace("`", r"\`")


def _list_table(headers: list[str] | None, rows: list[list[str]], widths: list[int]) -> str:
    out = [
        ".. list-table::",
        f"   :header-rows: {1 if headers else 0}",
        f"   :widths: {' '.join(map(str, widths))}",
        "",
    ]
    for row in [headers, *rows] if headers else rows:
        for i, cell in enumerate(row):
            prefix = "   * - " if i == 0 else "     - "
            out.append(prefix + (_rst_escape(cell) if cell else r"\ "))
    return "\n".join(out) + "\n"


def rst_summary(run: dict[str, Any], run_path: Path) -> str:
    rows = [
        [
            v.target_id,
            v.what,
            v.measured,
            v.target,
            f"**{v.status}**" if v.status != "met" else v.status,
            "; ".join(filter(None, [v.margin, v.comparison, v.note])),
        ]
        for v in verdicts(run)
    ]
    # Bold markers must survive escaping: apply them after.
    table = _list_table(
        ["#", "what", "celery-zdelay", "target", "status", "margin, comparison (same run), notes"],
        [[*row[:4], row[4].replace("**", ""), row[5]] for row in rows],
        [4, 24, 14, 12, 8, 38],
    )
    for row in rows:
        if row[4].startswith("**"):
            status = row[4].replace("**", "")
            table = table.replace(f"     - {status}\n", f"     - **{status}**\n", 1)
    load = run.get("load", {})
    header = (
        f"Measured {run.get('started', '?')} in {run.get('mode', '?')} mode "
        f"(``{run_path.name}``), {run.get('duration_s', 0):.0f} s in all. "
        f"Machine load average (1/5/15 min) before: {_loadavg(load.get('before'))}, "
        f"after: {_loadavg(load.get('after'))}.\n"
    )
    for note in run.get("notes_added_after_run") or []:
        header += f"\n.. note:: {_rst_escape(note)}\n"
    if run.get("code_changed_during_run"):
        header += (
            "\n.. warning:: The package code changed while this run went on (commit "
            f"{(run['machine']['git'].get('commit') or '?')[:12]} at the start, "
            f"{(run['git_end'].get('commit') or '?')[:12]} at the end, or uncommitted edits): "
            "figures of different benchmarks may come from different code.\n"
        )
    misses = [v for v in verdicts(run) if v.status != "met"]
    if misses:
        lines = ["Not met in this run:", ""]
        for v in misses:
            detail = f"{v.margin}; " if v.margin else ""
            lines.append(
                f"- **{v.target_id}** {_rst_escape(v.what)}: {_rst_escape(v.measured)} against "
                f"{_rst_escape(v.target)} ({_rst_escape(detail + v.status)})."
            )
        table += "\n" + "\n".join(lines) + "\n"
    else:
        table += "\nEvery target was met in this run.\n"
    return header + "\n" + table


def _loadavg(values: Any) -> str:
    return " / ".join(f"{v:.2f}" for v in values) if values else "n/a"


def rst_machine(run: dict[str, Any]) -> str:
    m = run.get("machine", {})
    git = m.get("git") or {}
    commit = (git.get("commit") or "unknown")[:12]
    if git.get("src_dirty"):
        commit += " (with uncommitted changes under celery_zdelay/)"
    rows = [
        ["CPU", f"{m.get('cpu_model')}, {m.get('cpu_count')} cores visible"],
        ["RAM", f"{m.get('ram_gib')} GiB"],
        ["OS", f"{m.get('os')}"],
        ["Python", str(m.get("python"))],
        ["Redis server", str(m.get("redis_server"))],
        ["RabbitMQ", str(m.get("rabbitmq") or "not reachable")],
        [
            "Celery / kombu",
            f"{m.get('celery')} / {m.get('kombu')} (redis-py {m.get('redis_py')}, "
            f"py-amqp {m.get('amqp')})",
        ],
        ["celery-zdelay", f"{m.get('celery_zdelay')}, commit {commit}"],
    ]
    return _list_table(None, rows, [20, 80])


def rst_details(run: dict[str, Any]) -> str:
    results = run.get("results", {})
    parts = []
    release = results.get("release") or {}
    if release:
        rows = []
        for mode, entry in release.items():
            if "rate" not in entry:
                rows.append([mode, "error", entry.get("error", ""), "", "", ""])
                continue
            stats = entry.get("redis_script_calls") or {}
            lua_ms = sum(s["total_ms"] for s in stats.values())
            rows.append(
                [
                    mode,
                    fmt_int(entry["n"]),
                    f"{entry['seconds']:.3f}",
                    f"{fmt_int(entry['rate'])}/s",
                    ", ".join(fmt_int(r) for r in entry.get("runs", [])),
                    f"{lua_ms:.0f} ms ({100 * lua_ms / 1000 / entry['seconds']:.0f} %)",
                ]
            )
        parts.append("**Release rate** (one companion pass, in-process)\n")
        parts.append(
            _list_table(
                ["path", "tasks", "seconds", "rate", "all runs (/s)", "store's Lua time (share)"],
                rows,
                [18, 10, 10, 12, 26, 24],
            )
        )
    e2e = results.get("end_to_end") or {}
    if e2e:
        rows = []
        for key, entry in e2e.items():
            if "rate" not in entry:
                rows.append([key, "error", entry.get("error", ""), ""])
                continue
            rows.append(
                [
                    key,
                    f"{fmt_int(entry['executed'])} of {fmt_int(entry['n'])}",
                    f"{entry['seconds_after_due']:.2f}",
                    f"{fmt_int(entry['rate'])}/s",
                ]
            )
        parts.append("**End to end**: N tasks due at one instant, executed by one worker\n")
        parts.append(
            _list_table(
                ["path, worker pool", "executed", "seconds after due", "executions/s"],
                rows,
                [30, 20, 20, 20],
            )
        )
    contention = results.get("contention") or {}
    if contention and "error" not in contention:
        rows = [
            [
                label,
                fmt_int(entry["n"]),
                f"{entry['redis_ms']:.1f}",
                f"{entry['redis_us_per_task']:.2f}",
                fmt_int(entry["handoff_calls"]),
                f"{entry['seconds']:.2f}",
            ]
            for label, entry in contention.items()
        ]
        parts.append(
            "**Several companions** on 16 shards: N tasks due at one instant, handed off; "
            "the store's Lua time from the due time to the last task queued\n"
        )
        parts.append(
            _list_table(
                ["companions", "tasks", "Redis ms", "µs a task", "handoff calls", "seconds"],
                rows,
                [30, 12, 12, 12, 14, 12],
            )
        )
    lateness = results.get("lateness") or {}
    if "observed_ms" in lateness:
        rows = []
        generic = results.get("lateness_generic") or {}
        for label, source, key in (
            ("handoff, consumer-observed", lateness, "observed_ms"),
            ("handoff, companion-reported", lateness, "reported_ms"),
            ("generic Redis, consumer-observed", generic, "observed_ms"),
            ("generic Redis, companion-reported", generic, "reported_ms"),
        ):
            q = source.get(key) or {}
            if q:
                rows.append(
                    [
                        label,
                        *(fmt_ms(q.get(p)) for p in ("min", "p50", "p90", "p99", "p99_9", "max")),
                    ]
                )
        cpu = lateness.get("cpu") or {}
        cpu_text = (
            f"; meanwhile the companion used {cpu['companion_cpu_pct']:g} % of a core and "
            f"the store's redis-server {cpu['store_redis_cpu_pct']:g} %"
            if cpu
            else ""
        )
        parts.append(
            f"**Lateness** at {lateness['rate']:,} due/s for {lateness['seconds']:g} s "
            f"({lateness['n']:,} tasks, {lateness.get('early', 0)} early{cpu_text}), in ms\n"
        )
        parts.append(
            _list_table(
                ["", "min", "p50", "p90", "p99", "p99.9", "max"], rows, [34, 9, 9, 9, 9, 9, 9]
            )
        )
        parts.append(
            ".. image:: _static/lateness.png\n   :alt: Distribution of lateness at 1,000 due/s\n"
        )
    scripts_rows = []
    for name in ("release", "lateness", "lateness_generic", "burst"):
        for label, stats in _scripts_of(name, results.get(name) or {}):
            for script, s in stats.items():
                scripts_rows.append(
                    [
                        f"{label}: {script}.lua",
                        fmt_int(s["calls"]),
                        f"{s['mean_ms']:.3f}",
                        f"{s['p50_ms']:.3f}",
                        f"{s['p99_ms']:.3f}",
                        f"{s['max_ms']:.3f}",
                    ]
                )
    if scripts_rows:
        parts.append("**Redis time per script call** (SLOWLOG, server-side), in ms\n")
        parts.append(
            _list_table(
                ["benchmark: script", "calls", "mean", "p50", "p99", "max"],
                scripts_rows,
                [30, 10, 10, 10, 10, 10],
            )
        )
    memory = results.get("memory") or {}
    if "zdelay" in memory:
        z, native = memory["zdelay"], memory["native"]
        rows = [
            [
                "celery-zdelay, parked",
                f"{fmt_int(z['redis_bytes_per_task'])}",
                f"due zset {fmt_int(z['due_zset_bytes_per_task'])}, message hash "
                f"{fmt_int(z['msg_hash_bytes_per_task'])}; "
                f"payload {fmt_int(z['mean_payload_bytes'])} B",
                f"+{z['worker_rss_added_mib']:.1f} MiB (idle {z['worker_rss_idle_mib']:.1f} MiB)",
            ],
            *_whole_memory_rows(memory),
            [
                "native, in the queue list",
                f"{fmt_int(native['queue_list_bytes_per_task'])}",
                f"message {fmt_int(native['mean_message_bytes'])} B",
                "(no worker)",
            ],
            [
                "native, held by the worker",
                f"{fmt_int(native['held_bytes_per_task'])}",
                f"unacked hash {fmt_int(native['unacked_hash_bytes_per_task'])}, unacked_index "
                f"{fmt_int(native['unacked_index_bytes_per_task'])}",
                f"+{native['worker_rss_added_mib']:,.0f} MiB "
                f"({fmt_int(native['worker_rss_bytes_per_task'])} B per task)",
            ],
        ]
        parts.append(f"**Memory** of {memory['n']:,} delayed tasks\n")
        parts.append(
            _list_table(
                [
                    "where the tasks wait",
                    "Redis B per task",
                    "Redis breakdown (MEMORY USAGE)",
                    "solo worker RSS",
                ],
                rows,
                [24, 14, 38, 24],
            )
        )
    loads = []
    for name, seconds in (run.get("timings_s") or {}).items():
        busy = [v for v in _busy_values(results.get(name)) if v is not None]
        loads.append(
            [
                name,
                f"{seconds:g}",
                f"{min(busy):.0f}-{max(busy):.0f} %" if busy else "n/a",
            ]
        )
    if loads:
        parts.append(
            "**Machine load** while each benchmark measured: share of all cores busy "
            "(any process, from /proc/stat), over its measurement windows\n"
        )
        parts.append(_list_table(["benchmark", "seconds", "cores busy"], loads, [30, 20, 30]))
    return "\n".join(parts)


def rst_limits(run: dict[str, Any], run_path: Path) -> str:
    """The 'against the limit' table: each path beside a bare Lua script's rate."""
    rows = _limit_rows(run.get("results", {}))
    if not rows:
        return "Not measured in this run.\n"
    load = run.get("load", {})
    header = (
        f"Measured {run.get('started', '?')} in {run.get('mode', '?')} mode "
        f"(``{run_path.name}``, commit "
        f"{((run.get('machine') or {}).get('git') or {}).get('commit', '?')[:12]}). "
        f"Machine load average (1/5/15 min) before: {_loadavg(load.get('before'))}, "
        f"after: {_loadavg(load.get('after'))}.\n"
    )
    cores = (run.get("machine") or {}).get("cpu_count") or 0
    busiest = max([*(load.get("before") or [0])[:1], *(load.get("after") or [0])[:1]])
    if cores and busiest > cores:
        header += (
            f"\nThe machine was shared with other work while measuring (load average "
            f"{busiest:.1f} on {cores} cores): the rates are low, the ratios are side by side "
            "in the same run.\n"
        )
    table = _list_table(
        ["path", "rate", "limit, same run", "ratio", "Redis script time per task (path / bare)"],
        rows,
        [30, 12, 26, 8, 24],
    )
    return header + "\n" + table


def _limit_rows(results: dict[str, Any]) -> list[list[str]]:
    """Rows of the 'against the limit' table: path, rate, limit, ratio, script µs per task."""
    rows = []
    limit = results.get("limit") or {}
    for key, value in limit.items():
        if not key.startswith("batch-"):
            continue
        handoff, bare = value["handoff"], value["bare"]
        rows.append(
            [
                f"release, atomic handoff (batch {value['batch']:,})",
                f"{fmt_int(handoff['rate'])}/s",
                f"{fmt_int(bare['rate'])}/s (bare Lua move, ZSet+hash -> list)",
                f"{value['ratio']:.2f}",
                f"{handoff['script_us_per_task']:.2f} / {bare['script_us_per_task']:.2f} µs",
            ]
        )
        render = value.get("render")
        if render:
            rows.append(
                [
                    f"template rendering alone (batch {value['batch']:,}'s entries): "
                    "handoff.lua's zdelay_render, no Redis command; the ratio column is the "
                    "bound it sets, bare / (bare + render)",
                    f"{render['us_per_entry']:.2f} µs per entry",
                    f"{bare['script_us_per_task']:.2f} µs per task (bare Lua move)",
                    f"≤ {value['render_bound']:.2f}",
                    f"{render['us_per_entry']:.2f} / {bare['script_us_per_task']:.2f} µs",
                ]
            )
        whole = value.get("handoff_whole")
        if whole:
            rows.append(
                [
                    f"release, atomic handoff of whole messages (batch {value['batch']:,}; "
                    "zdelay_whole_messages)",
                    f"{fmt_int(whole['rate'])}/s",
                    f"{fmt_int(bare['rate'])}/s (bare Lua move, ZSet+hash -> list)",
                    f"{value['whole_ratio']:.2f}",
                    f"{whole['script_us_per_task']:.2f} / {bare['script_us_per_task']:.2f} µs",
                ]
            )
    bulk = (results.get("producer") or {}).get("bulk") or {}
    bare = bulk.get("bare park")
    if bare:
        labels = {
            "apply_delayed_many": "parking, apply_delayed_many",
            "batch": "parking, batch() of apply_delayed",
            "apply_async": "apply_async(countdown=), to the broker",
        }
        for name, label in labels.items():
            path = bulk[name]
            rows.append(
                [
                    label,
                    f"{fmt_int(path['rate'])}/s",
                    f"{fmt_int(bare['rate'])}/s (bare Lua park, ZADD + HSET)",
                    f"{path['rate'] / bare['rate']:.2f}",
                    f"{path['script_us_per_task']:.2f} / {bare['script_us_per_task']:.2f} µs"
                    if path["script_us_per_task"]
                    else f"no script ({path['redis_us_per_task']:.2f} µs of Redis commands)",
                ]
            )
        built = bulk.get("celery build")
        if built:
            many = bulk["apply_delayed_many"]
            rows.append(
                [
                    "parking, apply_delayed_many",
                    f"{fmt_int(many['rate'])}/s",
                    f"{fmt_int(built['rate'])}/s (Celery's own build and send per call, "
                    "nothing parked)",
                    f"{many['rate'] / built['rate']:.2f}",
                    "no Redis",
                ]
            )
    return rows


def _busy_values(node: Any) -> list[float]:
    """Every ``cpu_busy_pct`` recorded anywhere under *node*."""
    if isinstance(node, dict):
        found = [node["cpu_busy_pct"]] if "cpu_busy_pct" in node else []
        for value in node.values():
            found.extend(_busy_values(value))
        return found
    if isinstance(node, list):
        return [v for item in node for v in _busy_values(item)]
    return []


# -- plot -------------------------------------------------------------------------------


def plot_lateness(run: dict[str, Any], path: Path) -> Path | None:
    """Draw the lateness distribution of the steady-load run as a PNG at *path*."""
    lateness = (run.get("results") or {}).get("lateness") or {}
    samples = lateness.get("samples_ms")
    if not samples:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q = lateness["observed_ms"]
    fig, (hist, tail) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    upper = max(samples)
    # The histogram shows the body; a long tail is counted, and drawn on the right.
    shown = min(upper, max(q["p99"] * 1.5, 10.0))
    bins = [i * shown / 100 for i in range(101)]
    beyond = sum(1 for x in samples if x > shown)
    hist.hist([x for x in samples if x <= shown], bins=bins, color="#3b75af")
    if beyond:
        hist.plot([], [], " ", label=f"{beyond:,} later than {shown:.1f} ms (not shown)")
    hist.set_yscale("log")
    hist.set_xlabel("lateness (ms): reached the queue - due")
    hist.set_ylabel("tasks (log)")
    hist.set_title(f"{q['n']:,} tasks at {lateness['rate']:,} due/s")
    for label, value, color in (("p50", q["p50"], "#2ca02c"), ("p99", q["p99"], "#d62728")):
        hist.axvline(
            value, color=color, linestyle="--", linewidth=1, label=f"{label} {value:.2f} ms"
        )
    hist.legend(loc="upper right", fontsize=8)
    ordered = sorted(samples)
    n = len(ordered)
    tail.plot(ordered, [1 - i / n for i in range(n)], color="#3b75af", label="measured")
    # P3's limits as points the curve must pass under: at most half of the
    # tasks later than 2 ms, at most 1 % later than 10 ms.
    tail.plot([2.0, 10.0], [0.5, 0.01], "o", color="#d62728", label="P3 limits (p50, p99)")
    if upper > 30:
        tail.set_xscale("log")
        tail.set_xlim(max(min(ordered), 0.05), upper * 1.2)
    else:
        tail.set_xlim(0, max(upper, 10.0) * 1.05)
    tail.set_yscale("log")
    tail.set_xlabel("lateness (ms)")
    tail.set_ylabel("share of tasks later than x")
    tail.set_title("tail (complementary CDF)")
    tail.legend(loc="upper right", fontsize=8)
    machine = run.get("machine", {})
    fig.suptitle(
        f"celery-zdelay handoff lateness ({run.get('mode')} run {run.get('started', '')}, "
        f"{machine.get('cpu_count')} cores, Redis {machine.get('redis_server')})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
