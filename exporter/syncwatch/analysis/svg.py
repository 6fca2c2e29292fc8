"""Inline SVG charts for the HTML report: no plotting library, no network, nothing to load.

Every function returns one ``<svg>`` element as a string; text is escaped, numbers are finite.
"""

from __future__ import annotations

import math
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
W, H = 640, 220
ML, MR, MT, MB = 56, 140, 24, 34


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    start = math.ceil(lo / step) * step
    out, x = [], start
    while x <= hi + 1e-12 * abs(hi):
        out.append(round(x, 12))
        x += step
    return out


def _fmt(v: float, unit: str) -> str:
    if unit == "%":
        return f"{100 * v:.0f}%" if abs(v) >= 0.1 else f"{100 * v:.1f}%"
    if unit == "s":
        return f"{v * 1e3:.0f}ms" if abs(v) < 1 else f"{v:.2f}s"
    return f"{v:.3g}"


def line_chart(title: str, xs: list[float], series: dict[str, list[float | None]], *, unit: str = "",
               x_label: str = "minutes", x_is_time: bool = True, log_x: bool = False) -> str:
    """Lines over ``xs`` (gaps where a value is None); ``x_is_time`` shows minutes since the first x."""
    pts_all = [v for ys in series.values() for v in ys if v is not None and math.isfinite(v)]
    if not xs or not pts_all:
        return empty_chart(title, "no data in range")
    x0 = xs[0] if x_is_time else 0.0
    xv = [(x - x0) / 60 if x_is_time else x for x in xs]
    fx = (lambda x: math.log2(x)) if log_x else (lambda x: x)
    lo_x, hi_x = fx(min(xv)), fx(max(xv))
    if hi_x == lo_x:
        hi_x = lo_x + 1
    # the axis holds 0 and every value, with a 5 % margin above (for negative values too: an
    # oscillating job's autocorrelation is below 0 in every window)
    lo_y, hi_y = min(0.0, min(pts_all)), max(0.0, max(pts_all))
    if hi_y == lo_y:
        hi_y = lo_y + 1
    hi_y += 0.05 * (hi_y - lo_y)
    pw, ph = W - ML - MR, H - MT - MB

    def px(x):
        return ML + (fx(x) - lo_x) / (hi_x - lo_x) * pw

    def py(y):
        return MT + ph - (y - lo_y) / (hi_y - lo_y) * ph

    parts = [_head(title)]
    for t in _ticks(lo_y, hi_y):
        parts.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#ddd"/>'
                     f'<text x="{ML - 4}" y="{py(t) + 4:.1f}" text-anchor="end" font-size="10">{_fmt(t, unit)}</text>')
    xt = [2 ** e for e in range(int(lo_x), int(hi_x) + 1)] if log_x else _ticks(lo_x, hi_x, 5)
    for t in xt:
        parts.append(f'<text x="{px(t):.1f}" y="{MT + ph + 14}" text-anchor="middle" font-size="10">{t:g}</text>')
    parts.append(f'<text x="{ML + pw / 2}" y="{H - 4}" text-anchor="middle" font-size="10">{escape(x_label)}</text>')
    parts.append(f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    for i, (name, ys) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        segs, cur = [], []
        for x, y in zip(xv, ys):
            if y is None or not math.isfinite(y):
                if cur:
                    segs.append(cur)
                cur = []
            else:
                cur.append(f"{px(x):.1f},{py(y):.1f}")
        if cur:
            segs.append(cur)
        for seg in segs:
            if len(seg) == 1:
                x, y = seg[0].split(",")
                parts.append(f'<circle cx="{x}" cy="{y}" r="2" fill="{color}"/>')
            else:
                parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(seg)}"/>')
        ly = MT + 10 + 14 * i
        parts.append(f'<line x1="{W - MR + 8}" x2="{W - MR + 22}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"/>'
                     f'<text x="{W - MR + 26}" y="{ly + 4}" font-size="10">{escape(_short(name))}'
                     f'<title>{escape(name)}</title></text>')
    parts.append("</svg>")
    return "".join(parts)


def _short(name: str, width: int = 20) -> str:
    """A legend entry that fits the margin: a long name keeps its start and its end, where node
    names differ (``gke-train-a3-pool-7f3c9a1b-2x4k`` and ``...-9qz2`` share their first 26)."""
    if len(name) <= width:
        return name
    tail = (width - 1) // 2 + 1
    return name[:width - 1 - tail] + "…" + name[-tail:]


def heatmap(title: str, row_labels: list[str], matrix: list[list[float | None]], *,
            x_label: str = "window", max_value: float | None = None) -> str:
    """Rows x columns of values 0..max (white to dark red); None cells grey."""
    if not row_labels or not matrix or not matrix[0]:
        return empty_chart(title, "no data in range")
    vals = [v for row in matrix for v in row if v is not None]
    top = max_value or (max(vals) if vals else 1.0) or 1.0
    cols = len(matrix[0])
    cell_h = max(3.0, min(14.0, 300 / len(row_labels)))
    ml = min(200, max(ML, 6 * max(len(n) for n in row_labels) + 8))  # room for the row labels
    pw = W - ml - MR
    cw = pw / cols
    height = MT + cell_h * len(row_labels) + MB
    parts = [_head(title, height)]
    for r, (name, row) in enumerate(zip(row_labels, matrix)):
        y = MT + r * cell_h
        if cell_h >= 8 or r % max(1, int(8 / cell_h)) == 0:
            parts.append(f'<text x="{ml - 4}" y="{y + cell_h - 1:.1f}" text-anchor="end" font-size="{min(10, cell_h):.0f}">{escape(name)}</text>')
        for c, v in enumerate(row):
            if v is None:
                fill = "#eee"
            else:
                k = max(0.0, min(1.0, v / top))
                fill = f"rgb(255,{int(255 * (1 - k))},{int(255 * (1 - k))})" if k < 1 else "rgb(170,0,0)"
            parts.append(f'<rect x="{ml + c * cw:.1f}" y="{y:.1f}" width="{cw + 0.3:.1f}" height="{cell_h:.1f}" fill="{fill}"/>')
    parts.append(f'<text x="{ml + pw / 2}" y="{height - 6}" text-anchor="middle" font-size="10">{escape(x_label)}</text>')
    parts.append(f'<text x="{W - MR + 8}" y="{MT + 10}" font-size="10">dark = {top:.0%} of</text>'
                 f'<text x="{W - MR + 8}" y="{MT + 22}" font-size="10">last arrivals</text>')
    parts.append("</svg>")
    return "".join(parts)


def empty_chart(title: str, message: str) -> str:
    return (_head(title, 60) + f'<text x="{W / 2}" y="44" text-anchor="middle" font-size="12" fill="#666">'
            f'{escape(message)}</text></svg>')


def _head(title: str, height: float = H) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{W}" height="{height:.0f}" '
            f'viewBox="0 0 {W} {height:.0f}" font-family="sans-serif"><title>{escape(title)}</title>'
            f'<text x="{ML}" y="15" font-size="12" font-weight="bold">{escape(title)}</text>')
