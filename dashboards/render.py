"""Draw a dashboard as a PNG with matplotlib from its own queries' results (no Grafana needed).

Panels sit where their ``gridPos`` puts them; each type is drawn the way Grafana shows it, closely
enough to read: time series as lines, stats as big numbers, heatmaps as colour rows, tables as
text, bar charts as stacked bars, state timelines as bands. Only for the pictures in docs/.
"""

from __future__ import annotations

import io
import re
from typing import Callable

import matplotlib
from PIL import Image

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .queries import PanelQuery, panel_queries, panels  # noqa: E402

#: (panel query) -> Prometheus API result list: range {"metric", "values"} or instant {"metric", "value"}.
Fetch = Callable[[PanelQuery], list[dict]]

BG, PANEL_BG, FG, DIM = "#111217", "#181b1f", "#ccccdc", "#8e8e9e"
COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff780a", "#f2495c", "#b877d9", "#37872d", "#fade2a",
          "#1f60c4", "#c4162a", "#8ab8ff", "#ffb357"]
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
UNIT_PX_X, UNIT_PX_Y = 70, 34           # Grafana's grid: 24 columns, 30 px rows (+ margin)


def legend(fmt: str, labels: dict) -> str:
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__") + "}"
    return _LEGEND.sub(lambda m: str(labels.get(m.group(1), "")), fmt)


def fmt_value(v: float, unit: str | None) -> str:
    if v != v:  # NaN
        return "NaN"
    if unit == "percentunit":
        return f"{v * 100:.1f}%"
    if unit == "s":
        return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"
    for suffix, units in (("W", "watt"), ("J", "joule"), ("Hz", "hertz"), ("B/s", "Bps"), ("°C", "celsius")):
        if unit == units:
            for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k"), (1, "")):
                if abs(v) >= scale or scale == 1:
                    return f"{v / scale:.3g} {prefix}{suffix}"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _unit(panel: dict, name: str | None = None) -> str | None:
    """The panel's unit, or the unit a by-name override gives the field ``name``."""
    config = panel.get("fieldConfig") or {}
    for o in config.get("overrides") or []:
        if o["matcher"].get("id") == "byName" and o["matcher"].get("options") == name:
            for prop in o["properties"]:
                if prop["id"] == "unit":
                    return prop["value"]
    return config.get("defaults", {}).get("unit")


def _results(panel: dict, queries: list[PanelQuery], fetch: Fetch) -> list[tuple[PanelQuery, dict]]:
    return [(q, s) for q in queries for s in fetch(q)]


def _draw_timeseries(ax, panel, rows, t0):
    unit = _unit(panel)
    for i, (q, s) in enumerate(rows[:12]):
        ts = [(float(t) - t0) / 60 for t, _ in s["values"]]
        vs = [float(v) for _, v in s["values"]]
        if unit == "percentunit":
            vs = [v * 100 for v in vs]
        ax.plot(ts, vs, color=COLORS[i % len(COLORS)], lw=1.3, label=legend(q.legend, s["metric"])[:28])
    ax.set_xlabel("minutes", color=DIM, fontsize=7)
    if unit == "percentunit":
        ax.set_ylabel("%", color=DIM, fontsize=7)
    elif unit:
        ax.set_ylabel(unit, color=DIM, fontsize=7)
    if rows:
        ax.legend(fontsize=6, loc="upper left", ncol=2 if len(rows) > 4 else 1, frameon=False,
                  labelcolor=FG)


def _draw_stat(ax, panel, rows, t0):
    ax.axis("off")
    n = max(len(rows), 1)
    for i, (q, s) in enumerate(rows[:4]):
        v = float((s.get("value") or s["values"][-1])[1])
        y = 1 - (i + 0.5) / min(n, 4)
        unit = _unit(panel, legend(q.legend, s["metric"]))
        ax.text(0.5, y, fmt_value(v, unit), ha="center", va="center", fontsize=17 if n == 1 else 12,
                color=COLORS[0], weight="bold", transform=ax.transAxes)
        if n > 1:
            ax.text(0.5, y - 0.28 / min(n, 4), legend(q.legend, s["metric"]), ha="center",
                    va="center", fontsize=6, color=DIM, transform=ax.transAxes)


def _sort_key(name: str):
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def _draw_heatmap(ax, panel, rows, t0):
    series = sorted(((legend(q.legend, s["metric"]), s) for q, s in rows), key=lambda x: _sort_key(x[0]))
    if not series:
        return
    times = sorted({float(t) for _, s in series for t, _ in s["values"]})
    index = {t: i for i, t in enumerate(times)}
    grid = [[float("nan")] * len(times) for _ in series]
    for r, (_, s) in enumerate(series):
        for t, v in s["values"]:
            grid[r][index[float(t)]] = float(v)
    extent = [(times[0] - t0) / 60, (times[-1] - t0) / 60, len(series) - 0.5, -0.5]
    im = ax.imshow(grid, aspect="auto", cmap="Oranges", interpolation="nearest", extent=extent, vmin=0)
    ax.set_yticks(range(len(series)), [n for n, _ in series], fontsize=6)
    ax.set_ylabel("rank", color=DIM, fontsize=7)
    ax.set_xlabel("minutes", color=DIM, fontsize=7)
    cb = plt.colorbar(im, ax=ax, fraction=0.02, pad=0.01)
    cb.ax.tick_params(labelsize=6, colors=DIM)


_FIRST_COLUMNS = ("train_job", "rank", "node", "gpu", "xid", "type", "phase", "alertname", "alertstate")


def _table_lines(panel, rows) -> tuple[list[str], list[list[str]]]:
    """Header and cell text: one row per series, or, with Grafana's ``merge`` transformation, one
    row per label set with a column per query (named by the ``organize`` renames), sorted like
    the panel's ``sortBy``."""
    transforms = {t["id"]: t.get("options") or {} for t in panel.get("transformations") or []}
    labels = sorted({k for _, s in rows for k in s["metric"] if k not in ("__name__", "instance", "job")})
    keys = [k for k in _FIRST_COLUMNS if k in labels] + [k for k in labels if k not in _FIRST_COLUMNS]
    if "merge" in transforms:
        rename = transforms.get("organize", {}).get("renameByName", {})
        columns = [rename.get(f"Value #{t['refId']}", t["refId"]) for t in panel["targets"]]
        ref_column = {t["refId"]: c for t, c in zip(panel["targets"], columns)}
        merged: dict[tuple, dict] = {}
        for q, s in rows:
            key = tuple(s["metric"].get(k, "") for k in keys)
            merged.setdefault(key, {})[ref_column[q.ref_id]] = float(s["value"][1])
        sort = (panel.get("options") or {}).get("sortBy") or [{"displayName": columns[0], "desc": True}]
        by = sort[0]["displayName"]
        order = sorted(merged, key=lambda k: merged[k].get(by, float("-inf")), reverse=sort[0].get("desc", False))
        lines = [list(k) + [fmt_value(merged[k][c], _unit(panel, c)) if c in merged[k] else ""
                            for c in columns] for k in order]
        return keys + columns, lines
    rows = sorted(rows, key=lambda r: -float(r[1]["value"][1]))
    keys = keys[:5]
    return keys + ["value"], [[str(s["metric"].get(k, "")) for k in keys]
                              + [fmt_value(float(s["value"][1]), _unit(panel))] for _, s in rows]


def _draw_table(ax, panel, rows, t0):
    ax.axis("off")
    header, lines = _table_lines(panel, rows)
    if not lines:
        return
    tbl = ax.table(cellText=lines[:9], colLabels=header, loc="upper center", cellLoc="left")
    tbl.auto_set_font_size(False)
    tbl.set_fontsize(6.5)
    for cell in tbl.get_celld().values():
        cell.set_edgecolor("#2c3235")
        cell.set_facecolor(PANEL_BG)
        cell.get_text().set_color(FG)


def _draw_barchart(ax, panel, rows, t0):
    """Stacked percent bars: one bar per rank, one segment per phase (the groupingToMatrix view)."""
    matrix: dict[str, dict[str, float]] = {}
    for _, s in rows:
        matrix.setdefault(s["metric"].get("rank", "?"), {})[s["metric"].get("phase", "?")] = float(s["value"][1])
    ranks = sorted(matrix, key=_sort_key)
    phases = sorted({p for m in matrix.values() for p in m})
    bottoms = [0.0] * len(ranks)
    for i, ph in enumerate(phases):
        vals = []
        for r in ranks:
            total = sum(matrix[r].values()) or 1
            vals.append(100 * matrix[r].get(ph, 0) / total)
        ax.bar(range(len(ranks)), vals, bottom=bottoms, color=COLORS[i % len(COLORS)], label=ph, width=0.8)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.set_xticks(range(len(ranks)), ranks, fontsize=6)
    ax.set_xlabel("rank", color=DIM, fontsize=7)
    ax.set_ylabel("% of time", color=DIM, fontsize=7)
    ax.set_xlim(-0.6, len(ranks) + 1.2)   # room on the right for the legend
    ax.legend(fontsize=6, loc="center right", frameon=False, labelcolor=FG)


def _draw_state_timeline(ax, panel, rows, t0):
    rows = sorted(rows, key=lambda r: -max(float(v) for _, v in r[1]["values"]))[:10]
    for i, (q, s) in enumerate(rows):
        for (t, v), nxt in zip(s["values"], s["values"][1:] + [s["values"][-1]]):
            x0, x1 = (float(t) - t0) / 60, (float(nxt[0]) - t0) / 60
            ax.fill_between([x0, max(x1, x0 + 1 / 60)], i - 0.4, i + 0.4,
                            color="#f2495c" if float(v) > 0 else "#37872d", lw=0)
    ax.set_yticks(range(len(rows)), [legend(q.legend, s["metric"])[:24] for q, s in rows], fontsize=6)
    ax.set_xlabel("minutes", color=DIM, fontsize=7)


DRAW = {"timeseries": _draw_timeseries, "stat": _draw_stat, "heatmap": _draw_heatmap,
        "table": _draw_table, "barchart": _draw_barchart, "state-timeline": _draw_state_timeline}


def render(dashboard: dict, fetch: Fetch, path, *, t0: float, dpi: int = 56) -> None:
    """Draw ``dashboard`` (its JSON) with data from ``fetch`` into the PNG ``path``."""
    all_panels = dashboard["panels"]
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in all_panels)
    width_in = 24 * UNIT_PX_X / 100
    height_in = bottom * UNIT_PX_Y / 100 + 0.5
    fig = plt.figure(figsize=(width_in, height_in), dpi=dpi, facecolor=BG)
    fig.text(0.01, 1 - 0.25 / height_in, dashboard["title"], color=FG, fontsize=13, va="center")
    by_title = {}
    for q in panel_queries(dashboard):
        by_title.setdefault(q.panel, []).append(q)

    def rect(g):
        pad_x, pad_top, pad_bottom = 0.35 / 24, 0.55, 0.45
        left = g["x"] / 24 + pad_x
        w = g["w"] / 24 - 2 * pad_x
        top_in = 0.5 + g["y"] * UNIT_PX_Y / 100
        h_in = g["h"] * UNIT_PX_Y / 100
        return [left, 1 - (top_in + h_in - pad_bottom * 0.4) / height_in, w,
                (h_in - pad_top - pad_bottom * 0.4) / height_in]

    for p in all_panels:
        g = p["gridPos"]
        if p["type"] == "row":
            fig.text(g["x"] / 24 + 0.005, 1 - (0.5 + (g["y"] + 0.5) * UNIT_PX_Y / 100) / height_in,
                     p["title"], color=FG, fontsize=10, weight="bold", va="center")
            continue
    for p in panels(dashboard):
        ax = fig.add_axes(rect(p["gridPos"]), facecolor=PANEL_BG)
        ax.set_title(p["title"], color=FG, fontsize=8.5, loc="left")
        ax.tick_params(colors=DIM, labelsize=6)
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        rows = _results(p, by_title.get(p["title"], []), fetch)
        if not rows:
            ax.axis("off")
            ax.text(0.5, 0.5, "No data", ha="center", va="center", color=DIM, transform=ax.transAxes)
            continue
        DRAW[p["type"]](ax, p, rows, t0)
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=dpi, facecolor=BG, format="png")
    plt.close(fig)
    # A 256-colour palette keeps each picture well under 200 KB; the flat colours lose nothing.
    Image.open(buffer).convert("RGB").quantize(256).save(path, optimize=True)
