"""Panel queries of the generated dashboards, and the one rule that turns them into plain PromQL.

Grafana rewrites a query before it reaches Prometheus: template variables become the selected
values and ``$__rate_interval`` / ``$__range`` become durations. The query test and the pictures in
docs/ do the same through :func:`substitute`, so both see exactly what Grafana would send.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

JSON_DIR = Path(__file__).resolve().parent / "json"

#: Grafana's built-in variables the dashboards use.
BUILTINS = ("__rate_interval", "__interval", "__range_s", "__range")

_VAR = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
#: Characters Grafana escapes in values it puts into a Prometheus regex matcher.
_REGEX_SPECIAL = re.compile(r"([\\^$*+?.()|{}\[\]])")


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str      # dashboard uid
    panel: str          # panel title
    ref_id: str
    expr: str
    instant: bool
    legend: str


def load_all() -> dict[str, dict]:
    """uid -> dashboard JSON, from the committed files."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(JSON_DIR.glob("*.json"))}


def panels(dashboard: dict) -> list[dict]:
    """All panels in layout order, rows excluded (also panels nested in collapsed rows)."""
    out = []
    for p in dashboard.get("panels") or []:
        if p.get("type") == "row":
            out.extend(p.get("panels") or [])
        else:
            out.append(p)
    return out


def panel_queries(dashboard: dict) -> list[PanelQuery]:
    return [PanelQuery(dashboard["uid"], p["title"], t["refId"], t["expr"],
                       bool(t.get("instant")) and not t.get("range"), t.get("legendFormat", ""))
            for p in panels(dashboard) for t in p.get("targets") or []]


def variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in (dashboard.get("templating") or {}).get("list") or []}


def referenced(text: str) -> set[str]:
    """Names of the variables ``$name`` / ``${name}`` / ``${name:fmt}`` used in ``text``."""
    return {a or b for a, b in _VAR.findall(text)}


def duration(seconds: float) -> str:
    return f"{int(seconds)}s" if float(seconds).is_integer() else f"{int(seconds * 1000)}ms"


def substitute(expr: str, dashboard: dict, selected: dict[str, str | list[str] | None], *,
               rate_interval: float, range_seconds: float, interval: float | None = None) -> str:
    """``expr`` as Grafana sends it to Prometheus.

    ``selected`` maps each variable of ``dashboard`` to its value: a string, a list (multi-value),
    or ``None`` for "All". Like Grafana's Prometheus datasource, a multi-value or include-all
    variable is regex-escaped and joined as ``(a|b)``; "All" becomes the variable's ``allValue``.
    Built-ins: ``$__rate_interval``, ``$__interval``, ``$__range`` (durations in seconds) and
    ``$__range_s``. An unknown or unselected variable raises ``KeyError``.
    """
    defs = variables(dashboard)
    builtins = {
        "__rate_interval": duration(rate_interval),
        "__interval": duration(interval if interval is not None else rate_interval / 4),
        "__range": duration(range_seconds),
        "__range_s": str(int(range_seconds)),
    }

    def value(name: str) -> str:
        if name in builtins:
            return builtins[name]
        if name not in defs:
            raise KeyError(f"query uses ${name}, not a variable of {dashboard['uid']}")
        if name not in selected:
            raise KeyError(f"no value selected for ${name}")
        var, val = defs[name], selected[name]
        if val is None:
            if not var.get("includeAll"):
                raise KeyError(f"${name} has no 'All' option")
            return var.get("allValue") or ".*"
        if not (var.get("multi") or var.get("includeAll")):
            if isinstance(val, list):
                raise KeyError(f"${name} is single-valued")
            return val
        vals = [val] if isinstance(val, str) else list(val)
        escaped = [_REGEX_SPECIAL.sub(r"\\\\\1", v) for v in vals]
        return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"

    return _VAR.sub(lambda m: value(m.group(1) or m.group(2)), expr)
