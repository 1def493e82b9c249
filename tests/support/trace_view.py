"""One trace's spans drawn as a waterfall page, for the screenshot in docs/monitoring.rst.

No trace viewer (Jaeger, Tempo, Zipkin) is packaged for Debian, PyPI or npm
here, so the tracing test draws the spans the OpenTelemetry SDK recorded
itself: one row per span, in start order, indented under its parent, its bar
placed and sized by its start and end times, with its process and the
attributes that tell where the time went.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

__all__ = ["waterfall_html"]

#: Attributes shown beside a span's name, when it has them.
SHOWN = ("zdelay.lateness_ms", "zdelay.shard", "zdelay.path", "zdelay.task_count")


def waterfall_html(spans: Sequence[dict[str, Any]], *, title: str) -> str:
    """A page drawing *spans* (records of ``tests.project.otel.span_record``)."""
    ordered = sorted(spans, key=lambda s: s["start_ns"])
    start = ordered[0]["start_ns"]
    total = max(s["end_ns"] for s in ordered) - start or 1
    depth: dict[str, int] = {}
    rows = []
    for span in ordered:
        level = depth.get(span["parent_id"] or "", -1) + 1
        depth[span["span_id"]] = level
        left = 100 * (span["start_ns"] - start) / total
        width = max(0.3, 100 * (span["end_ns"] - span["start_ns"]) / total)
        took_ms = (span["end_ns"] - span["start_ns"]) / 1e6
        shown = ", ".join(
            f"{key.split('.', 1)[1]}={span['attributes'][key]}"
            for key in SHOWN
            if key in span["attributes"]
        )
        rows.append(
            f'<tr class="span"><td class="svc">{html.escape(span["service"])}</td>'
            f'<td class="name" style="padding-left:{8 + 18 * level}px">'
            f"{html.escape(span['name'])}"
            f'<div class="attrs">{html.escape(shown)}</div></td>'
            f'<td class="bar"><div style="margin-left:{left:.2f}%;width:{width:.2f}%"></div>'
            f'</td><td class="took">{took_ms:,.1f} ms</td></tr>'
        )
    return f"""<!doctype html><html><head><meta charset="utf-8"><style>
body {{ font: 14px sans-serif; margin: 24px; color: #222; }}
h1 {{ font-size: 18px; }} table {{ border-collapse: collapse; width: 100%; }}
td {{ border-bottom: 1px solid #eee; padding: 6px 8px; vertical-align: top; }}
.svc {{ width: 90px; color: #666; }} .name {{ width: 300px; font-family: monospace; }}
.attrs {{ color: #777; font-size: 12px; }} .took {{ width: 90px; text-align: right; }}
.bar div {{ background: #4a7fd6; height: 14px; border-radius: 2px; }}
</style></head><body><h1>{html.escape(title)}</h1>
<p>trace {html.escape(ordered[0]["trace_id"])}, {total / 1e6:,.1f} ms from the first span's
start to the last span's end</p><table>{"".join(rows)}</table></body></html>"""
