"""Render the syncwatch dashboards into committed JSON, or check that the committed JSON is current.

    python -m dashboards.generate            # (re)write dashboards/json/*.json
    python -m dashboards.generate --check    # exit 1 and name the stale files if any differ

Each dashboard module exposes ``UID`` and ``build()``; the output file is ``json/<uid>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm

from . import efficiency, fleet, hardware, job_overview, straggler_map
from .common import number_panels

#: In the order of the README: job first, fleet last.
MODULES = (job_overview, straggler_map, hardware, efficiency, fleet)

OUT_DIR = Path(__file__).resolve().parent / "json"


def build_all() -> dict[str, dm.Dashboard]:
    """uid -> built dashboard model."""
    out: dict[str, dm.Dashboard] = {}
    for module in MODULES:
        dash = number_panels(module.build().build())
        if dash.uid != module.UID or dash.uid in out:
            raise ValueError(f"{module.__name__}: uid {dash.uid!r} not its UID or not unique")
        out[dash.uid] = dash
    return out


def render(dash: dm.Dashboard) -> str:
    """The committed form: sorted keys, two-space indent, trailing newline (stable diffs)."""
    return json.dumps(dash, cls=JSONEncoder, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def rendered() -> dict[Path, str]:
    return {OUT_DIR / f"{uid}.json": render(d) for uid, d in build_all().items()}


def stale(files: dict[Path, str]) -> list[str]:
    """Files that differ from the generator's output, plus committed JSON no generator makes."""
    out = [str(p) for p, text in files.items() if not p.exists() or p.read_text() != text]
    out += [str(p) for p in sorted(OUT_DIR.glob("*.json")) if p not in files]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.generate", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when the committed JSON differs from the generator")
    args = parser.parse_args(argv)
    files = rendered()
    if args.check:
        bad = stale(files)
        for path in bad:
            print(f"stale: {path} (run: python -m dashboards.generate)", file=sys.stderr)
        return 1 if bad else 0
    OUT_DIR.mkdir(exist_ok=True)
    for path, text in files.items():
        path.write_text(text)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
