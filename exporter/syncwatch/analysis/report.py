"""``syncwatch report``: one self-contained HTML file for a train job and time range.

Sections: the diagnosis, the scores over time, the straggler map (last arrivals per rank and
window), hardware coupling (GPU temperature / throttling and fabric counters next to the
collective time), and the scaling projection. Plots are inline SVG (``svg``); the file loads
nothing from the network.
"""

from __future__ import annotations

import json
import re
from html import escape
from pathlib import Path

from .. import __version__, cli
from ..rules.thresholds import THRESHOLDS
from . import svg
from .common import AnalysisError, command, ms, pct, plural
from .diagnose import Diagnosis, diagnose, estimate_mark
from .project import ESTIMATE_NOTE, Options, measurement, projection
from .source import add_source_flags, view_from_args
from .view import CONGESTION_SERIES, JobView, fmt_time

SECTIONS = ("diagnosis", "scores", "straggler-map", "hardware", "projection")

CSS = """body{font-family:sans-serif;max-width:980px;margin:24px auto;color:#222;padding:0 12px}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:32px}
.finding{border-left:4px solid #d62728;padding:4px 12px;margin:12px 0;background:#fafafa}
.healthy{border-left:4px solid #2ca02c;padding:8px 12px;background:#f4fbf4}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f3f3f3}.meta{color:#666;font-size:13px}svg{display:block;margin:8px 0}
.note{color:#666;font-size:13px}"""


def build(view: JobView, run_data: dict | None) -> tuple[str, dict]:
    """(HTML, a JSON-able summary of what it holds)."""
    d = diagnose(view)
    try:
        m = measurement(view, run_data)
        proj = projection(m, [2 * m.nodes, 4 * m.nodes, 8 * m.nodes, 16 * m.nodes], Options(), 64 * m.nodes)
        proj_error = None
    except AnalysisError as e:
        proj, proj_error = None, str(e)
    body = [
        f"<h1>syncwatch report: {escape(view.job)}</h1>",
        f'<p class="meta">{plural(len(view.rank_node), "rank")} on {plural(len(view.nodes), "node")} · '
        f"{fmt_time(view.start)} – {fmt_time(view.end)} · {plural(len(view.times), 'window')} of {view.window:.1f} s · "
        f"source {escape(view.source)} · syncwatch {__version__}</p>",
        _diagnosis_section(d), _scores_section(view), _straggler_section(view),
        _hardware_section(view), _projection_section(proj, proj_error),
    ]
    html = ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>syncwatch report: {escape(view.job)}</title><style>{CSS}</style></head><body>"
            + "".join(body) + "</body></html>")
    summary = {"job": view.job, "sections": list(SECTIONS), "healthy": d.healthy, "verdict": d.verdict,
               "findings": [f.mode for f in d.findings], "svg": html.count("<svg"),
               "projection": proj is not None}
    return html, summary


def _section(key: str, title: str, inner: str) -> str:
    return f'<section id="{key}"><h2>{escape(title)}</h2>{inner}</section>'


def _diagnosis_section(d: Diagnosis) -> str:
    s = d.scores
    est = estimate_mark(d)
    head = (f"<p>Mean step {ms(s['mean_step_seconds'])} · sync tax {pct(s['sync_tax'])} · coupling "
            f"{pct(s['coupling'])}{est('coupling')} · step CV {pct(s['step_cv'])} · straggler concentration "
            f"{pct(s['straggler_concentration'])}{est('straggler_concentration')} · {plural(d.steps, 'step', ',.0f')}</p>")
    if d.healthy:
        items = f'<div class="healthy"><strong>{escape(d.verdict[:1].upper() + d.verdict[1:])}.</strong></div>'
    else:
        items = ""
        for f in d.findings:
            ev = "".join(f"<li><code>{escape(e['series'])}</code>: {escape(str(e['reading']))}</li>" for e in f.evidence)
            opts = "".join(f"<li>{escape(o)}</li>" for o in f.options)
            items += (f'<div class="finding" data-mode="{escape(f.mode)}"><h3>{escape(f.title)} '
                      f'<small>(confidence {f.confidence_word}, {f.confidence:.2f})</small></h3>'
                      f"<p><strong>Observed:</strong> {escape(f.phenomenon)}</p><ul>{ev}</ul>"
                      f"<p><strong>Cause:</strong> {escape(f.cause)}</p>"
                      f"<p><strong>Options:</strong></p><ul>{opts}</ul></div>")
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in d.notes)
    return _section("diagnosis", "Diagnosis", head + items + notes)


SCORES_ESTIMATED_NOTE = ('<p class="note">Skew exchange off: slack, coupling, last arrivals and the collective '
                         "time are estimated from each rank's mean wait per window (marked est.).</p>")


def _scores_section(v: JobView) -> str:
    t = v.times
    est = "" if v.has_exact() else " (est.)"
    charts = [
        svg.line_chart("Mean step time", t, {"step": v.mean_step_series(), f"collective{est}": v.collective_series()},
                       unit="s"),
        svg.line_chart("Sync tax and coupling", t, {"sync tax": v.sync_tax_series(), f"coupling{est}": v.coupling_series()},
                       unit="%"),
        svg.line_chart("Step-time variation", t, {"step CV": v.cv}, unit="%"),
        svg.line_chart("Lag-1 autocorrelation of step time", t, {"autocorrelation": v.autocorrelation}),
    ]
    if any(x for x in v.restarts if x):
        charts.append(svg.line_chart("Restarts and re-run steps", t,
                                     {"restarts": v.restarts, "re-run steps": v.rerun_steps}))
    note = "" if v.has_exact() else SCORES_ESTIMATED_NOTE
    return _section("scores", "Scores over time", note + "".join(charts))


def _straggler_section(v: JobView) -> str:
    ranks = v.ranks
    per_window_total = v.window_sum("last_arrivals")
    matrix = []
    for r in ranks:
        row = v.rows("last_arrivals").get(r, [])
        matrix.append([(x / tot if tot else None) if x is not None else None for x, tot in zip(row, per_window_total)])
    labels = [f"{r} {v.rank_node[r]}" for r in ranks]
    by_node = v.node_last_arrivals()
    node_matrix = [[(x / tot if tot else None) for x, tot in zip(by_node[n], per_window_total)] for n in v.nodes]
    caption = ("<p>Share of each window's last arrivals (the rank everyone waited for).</p>" if v.has_exact() else
               "<p>Estimated share of each window's last arrivals (skew exchange off): the rank with the smallest "
               "mean wait of the window, shared with the ranks within "
               f"{pct(THRESHOLDS.last_arrival_tie)} of the step of it. Jitter averages out of mean waits: a "
               "healthy job shares every window among its ranks.</p>")
    what = "Last arrivals" if v.has_exact() else "Estimated last arrivals"
    return _section("straggler-map", "Straggler map", caption
                    + svg.heatmap(f"{what} per rank (rank node)", labels, matrix, max_value=1.0)
                    + svg.heatmap(f"{what} per node", v.nodes, node_matrix, max_value=1.0))


def _hardware_section(v: JobView) -> str:
    t = v.times
    charts = []
    titles = {"gpu_temperature_celsius": "GPU temperature (max per node, °C)",
              "gpu_thermal_throttle": "Thermal or hw_slowdown throttling active (per node)",
              "gpu_sm_clock_hertz": "SM clock (min per node, Hz)",
              "ib_xmit_wait_rate": "InfiniBand transmit waits per second",
              "roce_congestion_rate": "RoCE CNP + ECN per second",
              "net_bytes_rate": "NIC transmit bytes per second", "ib_bytes_rate": "InfiniBand bytes per second"}
    for name, title in titles.items():
        rows = v.hardware.get(name)
        if rows:
            charts.append(svg.line_chart(title, t, dict(sorted(rows.items()))))
    charts.append(svg.line_chart("Collective time per step (wait not explained by slack)" if v.has_exact() else
                                 "Collective time per step (estimated: smallest mean wait)", t,
                                 {"collective": v.collective_series()}, unit="s"))
    note = "" if v.hardware else '<p class="note">No GPU or fabric telemetry in range.</p>'
    if not any(n in v.hardware for n in CONGESTION_SERIES):
        note += '<p class="note">No congestion counters: compare the collective time with the fabric by other means.</p>'
    return _section("hardware", "Hardware coupling", note + "".join(charts))


def _projection_section(proj: dict | None, error: str | None) -> str:
    if proj is None:
        return _section("projection", "Scaling projection",
                        svg.empty_chart("Projected throughput", f"no projection: {error}"))
    rows = [proj["model_at_measured"], *proj["projections"]]
    table = ("<table><tr><th>nodes</th><th>ranks</th><th>mean step</th><th>step CV</th><th>coupling</th>"
             "<th>throughput</th><th>scaling efficiency</th></tr>")
    for p in rows:
        table += (f"<tr><td>{p['nodes']}</td><td>{p['ranks']}</td><td>{ms(p['mean_step_seconds'])}</td>"
                  f"<td>{pct(p['step_cv'])}</td><td>{pct(p['coupling'])}</td><td>{p['throughput']:.1f}</td>"
                  f"<td>{pct(p.get('scaling_efficiency', 1.0))}</td></tr>")
    table += "</table>"
    curve = proj["sync_wall"]["curve"]
    ns = [c["nodes"] for c in curve]
    wall = proj["sync_wall"]
    wall_text = (f"Sync wall: {wall['nodes']} nodes — beyond it adding nodes no longer shortens the job."
                 if wall["reached"] else f"Sync wall not reached up to {wall['max_nodes']} nodes.")
    m = proj["measured"]
    note = f'<p class="note">{escape(ESTIMATE_NOTE)}.</p>' if m["estimated"] else ""
    return _section("projection", "Scaling projection",
                    f"<p>Measured {plural(m['ranks'], 'rank')} on {plural(m['nodes'], 'node')} ({escape(m['method'])}); "
                    f"{proj['options']['scaling']} scaling, {proj['options']['algorithm']} all-reduce. "
                    f"{escape(wall_text)}</p>" + note + table
                    + svg.line_chart("Projected throughput", ns, {"throughput": [c["throughput"] for c in curve]},
                                     x_label="nodes (log scale)", x_is_time=False, log_x=True)
                    + svg.line_chart("Projected mean step time", ns,
                                     {"step": [c["mean_step_seconds"] for c in curve]}, unit="s",
                                     x_label="nodes (log scale)", x_is_time=False, log_x=True))


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="self-contained HTML report of a train job and time range",
                              description="Write an HTML report (diagnosis, scores, straggler map, hardware, "
                                          "projection) that opens without network access.")
    add_source_flags(p)
    cli.add_flag(p, "--output", default=None,
                 help="HTML file to write (default: syncwatch-report-JOB.html in the current directory, "
                      "characters of the job's name other than letters, digits and . _ - as _)")
    p.set_defaults(func=run)


def default_output(job: str) -> str:
    """``syncwatch-report-JOB.html`` in the current directory, whatever the train job's name holds
    (a ``/`` in ``team/llm-7b`` named a directory ``syncwatch-report-team`` that is not there)."""
    return f"syncwatch-report-{re.sub(r'[^A-Za-z0-9._-]', '_', job)}.html"


@command("report")
def run(args) -> int:
    view, run_data = view_from_args(args)
    html, summary = build(view, run_data)
    out = Path(args.output or default_output(view.job))
    try:
        out.write_text(html, encoding="utf-8")
    except OSError as e:
        raise AnalysisError(f"cannot write --output {out}: {e.strerror}") from None
    summary["output"] = str(out)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"syncwatch report: wrote {out} ({len(html) / 1024:.0f} KiB, {plural(summary['svg'], 'plot')}; "
              + (summary["verdict"] if summary["healthy"] else
                 f"findings: {', '.join(summary['findings'])}") + ")")
    return 0
