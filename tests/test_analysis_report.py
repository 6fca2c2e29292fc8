"""``syncwatch report``: a self-contained HTML file, rendered in headless Chromium (Debian ``chromium``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from analysis_helpers import run_cli
from syncwatch.analysis import recording, svg
from syncwatch.analysis.report import SECTIONS, build

sim = pytest.importorskip("syncwatch.sim.scenarios", reason="the simulator (syncwatch.sim) is not in this checkout")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs the Debian package chromium "
                                                             "(apt-get install -y chromium)")

# Appended to a copy of the report: measures what the browser laid out and writes it into the DOM.
PROBE = """<script>
const out = {sections: [...document.querySelectorAll('section')].map(s => ({
  id: s.id, height: s.getBoundingClientRect().height,
  svgs: [...s.querySelectorAll('svg')].map(g => {const r = g.getBoundingClientRect();
    return {w: r.width, h: r.height, shapes: g.querySelectorAll('polyline,rect,circle').length};})}))};
const pre = document.createElement('pre'); pre.id = 'probe'; pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def chromium(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         f"--user-data-dir={cwd / 'profile'}", *args],
        capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.fixture(scope="module")
def report_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    run = recording.from_ground_truth(sim.run_scenario("straggler", nodes=4, ranks_per_node=8), start_wall=1.7e9)
    run["hardware"] = {"gpu_temperature_celsius": {f"sim-node-{n:02d}": [[s["t"], 60.0 + n] for s in run["steps"]]
                                                   for n in range(4)}}
    recording.save(run, d / "run.json")
    return d, d / "run.json"


def test_report_cli_writes_self_contained_html(report_file, monkeypatch, capsys):
    d, run = report_file
    out = d / "report.html"
    code, stdout, err = run_cli(monkeypatch, capsys, ["report", "--input", str(run), "--output", str(out), "--json"])
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["findings"] == ["straggler_persistent"] and summary["projection"]
    html = out.read_text()
    for key in SECTIONS:
        assert f'<section id="{key}">' in html
    assert html.count("<svg") >= 8
    # self-contained: nothing fetched from anywhere
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)
    assert "<script" not in html and "@import" not in html
    assert "Persistent straggler: rank 5 on sim-node-00" in html


@needs_chromium
def test_report_renders_its_sections_and_plots_in_headless_chromium(report_file, monkeypatch, capsys):
    d, run = report_file
    out = d / "report.html"
    code, _, err = run_cli(monkeypatch, capsys, ["report", "--input", str(run), "--output", str(out)])
    assert code == 0, err
    probe = d / "probe.html"
    probe.write_text(out.read_text().replace("</body>", PROBE + "</body>"))
    res = chromium("--dump-dom", probe.as_uri(), cwd=d)
    m = re.search(r'<pre id="probe">(.*?)</pre>', res.stdout, re.S)
    assert m, res.stderr[-2000:]
    laid_out = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    sections = {s["id"]: s for s in laid_out["sections"]}
    assert set(sections) == set(SECTIONS)
    for key, s in sections.items():
        assert s["height"] > 50, key
        assert s["svgs"] or key == "diagnosis", f"section {key} has no plot"
        for g in s["svgs"]:
            assert g["w"] >= 600 and g["h"] >= 50, (key, g)
    assert sum(g["shapes"] for g in sections["straggler-map"]["svgs"]) > 100  # heatmap cells drawn
    assert any(g["shapes"] for g in sections["hardware"]["svgs"])
    # and a screenshot comes out of it (the page paints)
    shot = d / "report.png"
    chromium("--window-size=1000,2400", f"--screenshot={shot}", out.as_uri(), cwd=d)
    assert shot.exists() and shot.stat().st_size > 20_000


def _text(html: str, section: str) -> str:
    inner = re.search(rf'<section id="{section}">(.*?)</section>', html, re.S).group(1)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", inner))


def test_report_without_the_skew_exchange_maps_and_projects_from_estimates():
    """With K = 0 the straggler map was an empty chart ("no last-arrival counters"), the projection
    one too ("no projection: ... turn on the exact skew exchange"), and the coupling line was
    drawn at 0 % beside an unmarked collective time that was the whole mean wait."""
    run = recording.from_ground_truth(sim.run_scenario("straggler", nodes=4, ranks_per_node=8), start_wall=1.7e9)
    view = recording.to_view(run, "test")
    for name in ("slack_seconds", "last_arrivals"):   # what Prometheus holds for a K = 0 job
        view.per_rank[name] = {}
    html, summary = build(view, None)
    assert summary["findings"] == ["straggler_persistent"] and summary["projection"], summary
    straggler_map = _text(html, "straggler-map")
    assert "Estimated share of each window's last arrivals (skew exchange off)" in straggler_map
    assert "Estimated last arrivals per rank (rank node)" in straggler_map
    assert "no last-arrival counters" not in html and "no data in range" not in html
    assert html.count('fill="rgb(170,0,0)"') >= 20   # rank 5 takes whole windows: full-share cells
    assert "coupling (est.)" in _text(html, "scores") and "collective (est.)" in _text(html, "scores")
    assert "Collective time per step (estimated: smallest mean wait)" in _text(html, "hardware")
    assert "coupling 6.0 % (estimated from mean waits)" in _text(html, "diagnosis")
    assert "estimated from mean waits (skew exchange off)" in _text(html, "projection")
    assert "n/a" not in html and "nan" not in html.lower()


def _heatmap_columns(chart: str) -> list[list[float]]:
    """The values a heatmap shows, column by column, read back from its cells' colours (white 0 to
    red 1, dark red for a full share; grey cells, without a value, left out)."""
    columns: dict[float, list[float]] = {}
    cell = r'<rect x="([0-9.]+)" y="[0-9.]+" width="[0-9.]+" height="[0-9.]+" fill="([^"]+)"/>'
    for x, fill in re.findall(cell, chart):
        if fill.startswith("rgb(255,"):
            columns.setdefault(float(x), []).append(1 - int(fill.split(",")[1]) / 255)
        elif fill == "rgb(170,0,0)":
            columns.setdefault(float(x), []).append(1.0)
    return [columns[x] for x in sorted(columns)]


def test_the_straggler_map_shows_each_windows_last_arrivals_as_shares():
    """Each cell is a rank's share of its window's last arrivals: a healthy job's ranks share
    every window, each column adding up to the whole (to the colours' 1/255 steps), and no rank
    takes a whole window; the straggler's rank takes nearly all of each window it straggles in."""
    for name, rank in (("healthy", None), ("straggler", sim.straggler_rank(32))):
        truth = sim.run_scenario(name, nodes=4, ranks_per_node=8)
        run = recording.from_ground_truth(truth, start_wall=1.7e9)
        html, _ = build(recording.to_view(run, "test"), None)
        section = re.search(r'<section id="straggler-map">(.*?)</section>', html, re.S).group(1)
        per_rank = section.split("</svg>")[0]
        columns = _heatmap_columns(per_rank)
        assert len(columns) >= 20 and all(len(c) == 32 for c in columns)
        sums = [sum(c) for c in columns]
        assert all(x == pytest.approx(1.0, abs=32 / 255) for x in sums), sums
        if rank is None:
            assert max(max(c) for c in columns) < 0.5
        else:
            assert sum(c[rank] > 0.9 for c in columns) > 0.8 * len(columns)


def test_the_projection_curves_reach_64_times_the_measured_nodes():
    """The projection's sync-wall sweep and its curves run to 64x the measured nodes, as
    ``project`` sweeps by default: a healthy 4-node job's throughput still rises at 256 nodes."""
    truth = sim.run_scenario("healthy", nodes=4, ranks_per_node=8)
    run = recording.from_ground_truth(truth, start_wall=1.7e9)
    html, _ = build(recording.to_view(run, "test"), None)
    projection = _text(html, "projection")
    assert "Sync wall not reached up to 256 nodes." in projection
    assert projection.count(" 128 256 nodes (log scale)") == 2, projection


def test_svg_charts_handle_gaps_and_empty_data():
    chart = svg.line_chart("t", [0, 60, 120, 180], {"a": [1.0, None, 2.0, 3.0]}, unit="s")
    assert chart.count("<polyline") == 1 and chart.count("<circle") == 1
    assert "no data in range" in svg.line_chart("t", [0, 1], {"a": [None, None]})
    assert "&lt;b&gt;" in svg.line_chart("<b>", [0, 1], {"a": [1, 2]})


@pytest.mark.parametrize("ys", [[-0.93, -0.97, -0.95, -0.96], [-0.5, 0.2, 0.4, -0.1], [0.1, 0.3, 0.2, 0.25]])
def test_every_point_of_a_line_chart_lies_inside_its_frame(ys):
    """An oscillating job's lag-1 autocorrelation is negative in every window: the y axis ran from
    the lowest value to 1.05 x the highest, which for a negative highest is below it, so the line
    was drawn above the frame and mostly off the image (y down to -85 in a 220-pixel chart)."""
    chart = svg.line_chart("Lag-1 autocorrelation of step time", [0, 60, 120, 180], {"autocorrelation": ys})
    top, bottom = svg.MT, svg.H - svg.MB
    (points,) = re.findall(r'<polyline[^>]* points="([^"]*)"', chart)
    heights = [float(p.split(",")[1]) for p in points.split()]
    assert all(top <= y <= bottom for y in heights), heights
    assert len(set(heights)) > 1  # the line still shows its variation


def test_long_node_names_stay_apart_in_a_legend():
    """The legend kept a name's first 20 characters: GKE nodes of one pool share their first 26,
    so every line of a per-node hardware chart carried the same name."""
    nodes = ["gke-train-a3-pool-7f3c9a1b-2x4k", "gke-train-a3-pool-7f3c9a1b-9qz2"]
    chart = svg.line_chart("GPU temperature", [0, 60], {n: [70.0, 71.0] for n in nodes})
    shown = re.findall(r'stroke-width="2"/><text [^>]*>([^<]*)', chart)
    assert len(shown) == 2 and shown[0] != shown[1] and all(len(name) <= 20 for name in shown)
    assert all(f"<title>{n}</title>" in chart for n in nodes)  # the whole name on hover


@pytest.mark.parametrize(("job", "name"), [("team/llm-7b", "syncwatch-report-team_llm-7b.html"),
                                           ("../../llm", "syncwatch-report-.._.._llm.html")])
def test_the_default_output_stays_in_the_current_directory(report_file, tmp_path, monkeypatch, capsys, job, name):
    """A train job named ``team/llm-7b`` made the default output a file in a directory
    ``syncwatch-report-team`` that is not there: "cannot write --output", though none was given."""
    run = json.loads(report_file[1].read_text())
    run["job"] = job
    recording.save(run, tmp_path / "run.json")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    code, out, err = run_cli(monkeypatch, capsys, ["report", "--input", str(tmp_path / "run.json"), "--json"])
    assert code == 0, err
    assert json.loads(out)["output"] == name and [p.name for p in (tmp_path / "cwd").iterdir()] == [name]
    assert f"syncwatch report: {job}" in (tmp_path / "cwd" / name).read_text()
