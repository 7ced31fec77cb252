"""The HTML report: one self-contained page whose numbers are report.json's, checked in a real browser."""

import html as html_lib
import json
import math
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from conftest import THREE_LAYER_RUN, m

ARGS = THREE_LAYER_RUN  # the tiny 3-layer run, shared with test_cli


class Numbers(HTMLParser):
    """Collects (data-key, data-value) of every element, and the tags and titles the page uses."""

    def __init__(self):
        super().__init__()
        self.data, self.tags, self.spans = [], set(), []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        if "data-key" in a:
            self.data.append((a["data-key"], a["data-value"]))
        if "data-layer" in a:
            self.spans.append(a)


def lookup(report, key):
    for part in key.split("."):
        report = report[int(part)] if isinstance(report, list) else report[part]
    return report


@pytest.fixture
def page(lab_runs):
    """The run's page and its own copy of report.json (the run is made once a session: lab_runs)."""
    out = lab_runs(ARGS)[2]
    return out / "report.html", json.loads((out / "report.json").read_text())


def test_every_number_on_the_page_is_the_reports(page):
    path, report = page
    parser = Numbers()
    parser.feed(path.read_text())
    keys = {k.split(".")[0] for k, _ in parser.data}
    assert {"generation", "sweep", "calibration_by_measure", "strategies", "tail", "frontier", "shift"} <= keys
    # the Learn-then-Test table: every measure's test figures, and the summary's headline figures
    tagged = {k for k, _ in parser.data}
    for i in range(len(report["calibration_by_measure"])):
        assert {f"calibration_by_measure.{i}.test.{k}" for k in ("compute_saved", "disagreement", "loss",
                                                                 "accuracy", "oracle_share")} <= tagged
    assert {f"tail.{i}.gap_p99" for i in range(len(report["tail"]))} <= tagged
    assert {f"shift.{i}.shift.disagreement" for i in range(6)} <= tagged
    for key, value in parser.data:
        assert float(value) == pytest.approx(float(lookup(report, key)), rel=1e-12), key
    assert len(parser.data) > 200


def test_the_page_is_self_contained_and_has_both_schemes(page):
    html = page[0].read_text()
    assert "<script" not in html and "http://" not in html and "https://" not in html and "<link" not in html
    assert "prefers-color-scheme: dark" in html and "<svg" in html
    for question in ("What does early exit look like?", "Which threshold?",
                     "What does each KV strategy buy?",
                     "Which exit rule, with a guarantee", "Average or tail", "When does early exit pay?",
                     "Does the guarantee hold on text of another kind?"):
        assert question in html


def test_every_character_names_its_layer(page):
    path, report = page
    parser = Numbers()
    parser.feed(path.read_text())
    g = report["generation"]
    assert [int(s["data-layer"]) for s in parser.spans] == g["exited_at"]
    assert all(s["title"] == f"layer {l}" for s, l in zip(parser.spans, g["exited_at"]))


def test_layer_colours_are_sequential():
    """Viridis: lightness rises from the shallowest layer to the deepest, so order reads without hue."""
    for n in (2, 6, 12):
        lum = []
        for l in range(n):
            c = m.layer_colour(l, n)
            r, g, b = (int(c[j : j + 2], 16) for j in (1, 3, 5))
            lum.append(0.299 * r + 0.587 * g + 0.114 * b)
        assert lum == sorted(lum) and len(set(lum)) == n
    assert m.layer_colour(0, 6) == "#440154" and m.layer_colour(5, 6) == "#fde725"


def chromium():
    return next((shutil.which(b) for b in ("chromium", "chromium-headless-shell", "chrome-headless-shell",
                                           "chromium-browser") if shutil.which(b)), None)


def test_the_page_renders_in_headless_chromium(page, tmp_path):
    """At 1200 px wide every table and chart of the page has a box of its own, and nothing runs off."""
    browser = chromium()
    if browser is None:
        pytest.skip("no headless Chromium here; .ci/run installs Debian's chromium-headless-shell")
    html = page[0].read_text()
    found = probe(browser, html, tmp_path, "wide", 1200)
    assert found["width"] == 1200 and found["bad"] == []
    assert found["shown"] == html.count("<table") + html.count("<svg") >= 8  # six tables, two charts


def test_numbers_without_a_key_are_the_reports_too(page):
    """The numbers a page shows outside its keyed cells: the summary's lines, the conditions and notes under
    each question (report.json keeps them, word for word), and chart ticks that cover the chart's points."""
    html, report = page[0].read_text(), page[1]
    for key, (conditions, *notes) in report["notes"].items():
        section_html = html.split(f"<section id='{key}'>")[1].split("</section>")[0]
        assert f"<p>{m.esc(conditions)}</p>" in section_html, key
        assert all(f"<p class='muted'>{m.esc(note)}</p>" in section_html for note in notes), key
    prose = re.findall(r"<p(?: class='muted')?>([^<]*)</p>", html)
    told = {m.esc(t) for v in report["notes"].values() for t in v} | {m.esc(m.legend(a.table[1])) for a in m.ANALYSES}
    cfg, g = report["config"], report["generation"]
    rest = [[float(n) for n in re.findall(r"\d+(?:\.\d+)?", p)] for p in prose if re.search(r"\d", p) and p not in told]
    # the model's shape (the summary), and the sample's decoder (its threshold) and layers (its caption)
    assert g["decoder"].endswith(f" > {g['exit_threshold']:g}")
    assert rest == [[cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["block_size"]],
                    [*map(float, re.findall(r"\d+(?:\.\d+)?", g["decoder"])), 0, cfg["n_layer"] - 1]], \
        "a number the report does not hold"
    for chart in re.findall(r"<svg .*?</svg>", html, flags=re.DOTALL):
        if "epsilon:" in chart:  # its axis is zoomed on purpose: points above it sit at the top
            continue
        ticks = [float(t.strip("x%+")) for t in re.findall(r'text-anchor="end">([^<]+)</text>', chart)]
        values = [float(v) for v in re.findall(r'data-value="([^"]+)"', chart)]
        scale = 100 if "%" in chart.split('text-anchor="end">')[1][:12] else 1
        assert min(ticks) <= scale * min(values) + 1e-9 and max(ticks) >= scale * max(values) - 1e-9


def test_the_summary_opens_the_page_and_links_every_section(page):
    html = page[0].read_text()
    summary = html.split("<div id='summary'>")[1].split("</div>")[0]
    assert html.index("<div id='summary'>") < html.index("<h2")
    anchors = re.findall(r"<section id='([^']+)'>", html)
    assert len(anchors) >= 7 and all(f"href='#{a}'" in summary for a in anchors)
    report = page[1]
    assert f"{report['calibration']['test']['compute_saved']:.1%}" in summary
    assert "move with its load" in summary and "val loss" in summary
    assert all(f"<li>{m.esc(line)}</li>" in summary for line in report["summary"]), "the console's summary"
    assert "when does early exit pay? On the frontier, greedy: " in summary, "the answer opens the page"
    assert len(report["summary"]) == 4


def test_the_page_charts_the_frontier_with_axis_titles_ticks_and_a_legend(page):
    """The frontier, a chart a mode, is the page's chart; the rest, tables (the sweep's every threshold
    stays in report.json)."""
    charts = re.findall(r"<svg .*?</svg>", page[0].read_text(), flags=re.DOTALL)
    assert len(charts) == 2
    for chart in charts:
        assert "rotate(-90)" in chart, "a y axis title"
        assert chart.count('class="grid"') >= 3, "round ticks"
    front = [c for c in charts if "(line: the frontier)" in c]
    assert [f"speed-up over full depth, {mode} (" in c for mode, c in zip(m.MODES, front)] == [True, True]
    assert all(c.count("<circle ") == len(page[1]["frontier"]) for c in front), "every point, once a chart"
    assert all(c.count("<polyline") == 1 for c in front), "one line, the frontier's; dots otherwise"


def probe(browser, html, tmp_path, name, width=420):
    """The page in headless Chromium at `width` px: text under 11 px (computed, SVG scale included), tables
    or charts that run off the screen without a box that scrolls them, and how many tables and charts have
    a box at all (tests/phone_probe.js measures them)."""
    script = open(os.path.join(os.path.dirname(__file__), "phone_probe.js"), encoding="utf-8").read()
    path = tmp_path / f"{name}.html"
    path.write_text(html.replace("</body>", f"<script>{script}</script></body>"))
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--window-size={width},900", "--dump-dom", path.as_uri()],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    return json.loads(html_lib.unescape(re.search(r'<pre id="probe">(.*?)</pre>', dom).group(1)))


def phone_problems(browser, html, tmp_path, name):
    found = probe(browser, html, tmp_path, name)
    assert found["width"] == 420
    return found["bad"]


def test_the_page_reads_at_420_px_in_a_browser(page, tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("no headless Chromium here; .ci/run installs Debian's chromium-headless-shell")
    html = page[0].read_text()
    assert phone_problems(browser, html, tmp_path, "phone") == []
    # the probe itself sees a table cut off, and text shrunk under 11 px
    cut = phone_problems(browser, html.replace(".scroll { overflow-x: auto; }", ""), tmp_path, "cut")
    assert "cut off: TABLE" in cut and "page wider than the screen" in cut
    small = phone_problems(browser, html.replace("svg text { fill: var(--fg); font: 13px", "svg text { fill: var(--fg); font: 12px"),
                           tmp_path, "small")
    assert small and all(p.startswith("text 10.") for p in small)


def points(chart):
    return [float(y) for y in re.findall(r'<circle cx="[^"]+" cy="([^"]+)"', chart)]


def grid(chart):
    return [float(y) for y in re.findall(r'<line class="grid" x1="64" x2="630" y1="([^"]+)"', chart)]


def test_a_point_below_zero_is_on_the_chart():
    """A smaller model better than full depth sits under 0 on the depth chart: the axis reaches down to it."""
    chart = m.svg_chart([("a", "a", [(0.5, -0.0275, "k", "t"), (0.9, 0.024, "k", "t")])], {"1": 0.5}, ("x", "y"), "{:+.2f}",
                        [(0.5, -0.0275, "a"), (0.9, 0.024, "b")])
    assert min(grid(chart)) <= min(points(chart)) and max(points(chart)) <= max(grid(chart))
    assert ">-0.04</text>" in chart and ">+0.00</text>" in chart


def test_the_page_reads_on_a_phone(page):
    html = page[0].read_text()
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in html
    assert ".scroll { overflow-x: auto; }" in html
    tables = html.count("<table")
    assert tables >= 5 and html.count("<div class='scroll'><table>") == tables, "every table scrolls sideways"


def console_table(capsys, table, rows):
    m.print_table(table, rows)
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.endswith("===")) + 1
    return lines[header].split("  "), " ".join(lines[header + 1 + len(rows) :])


def test_a_console_table_and_the_page_table_come_from_one_definition(page, capsys):
    """The headers and the legend the console prints are the page's: one definition, no drift."""
    html, report = page[0].read_text(), page[1]
    for table, rows in ((m.STRATEGY_TABLE, report["strategies"]), (m.TAIL_TABLE, report["tail"]),
                        (m.CALIBRATION_TABLE, report["calibration_by_measure"])):
        headers, legend = console_table(capsys, table, rows)
        page_table = html.split(f"<h2>{m.esc(table[0])}</h2>")[1].split("</section>")[0]
        assert [m.esc(h.strip()) for h in headers if h.strip()] == re.findall(r"<th>([^<]*)</th>", page_table)
        assert " ".join(legend.split()) == " ".join(m.legend(table[1]).split())
        assert f"<p class='muted'>{m.esc(m.legend(table[1]))}</p>" in page_table
        for _, header, _, text in table[1]:  # the legend is the columns' help
            assert f"{header}: {text}" in m.legend(table[1])
    assert "acc." in [h for _, h, _, _ in m.CALIBRATION_TABLE[1]]


def test_round_ticks():
    for top in (0.037, 0.83, 1.0, 1.99, 2.6, 7, 13, 500, 1234):
        ticks = m.nice_ticks(top)
        step = ticks[1] - ticks[0]
        mantissa = step / 10 ** math.floor(math.log10(step))
        assert ticks[0] == 0 and ticks[-1] >= top and ticks[-2] < top and 3 <= len(ticks) <= 7
        assert min(abs(mantissa - q) for q in (1, 2, 5, 10)) < 1e-9, (top, ticks)
    for top, bottom in ((0.024, -0.0275), (1.7, -0.2), (0.5, -3)):
        ticks = m.nice_ticks(top, bottom)
        assert ticks[0] <= bottom < ticks[1] and ticks[-2] < top <= ticks[-1] and 0 in [round(t, 9) for t in ticks]


def test_newlines_show(page):
    html, report = page[0].read_text(), page[1]
    assert html.count("<pre class='sample'>") == html.count("<pre class='sample'>\n") >= 2
    newlines = report["generation"]["sample"].count("\n")
    assert html.count("&#8629;</span>\n") == newlines


def frontier_rows():
    """Points of every family whose frontiers differ by mode: pruned 1 (the best loss) and
    self_speculative (full depth's loss, faster) on both; state_copy and pruned 2 in greedy, the 1-layer
    GPT in sampled."""
    rows = [{"name": name, "decoder": decoder, "family": family, "test_loss": loss, "speedup_greedy": greedy,
             "speedup_sampled": sampled}
            for name, decoder, family, loss, greedy, sampled in (
                ("full", "full", "exit model", 1.50, 1.0, 1.0),
                ("state_copy", "state_copy", "exit model", 1.52, 2.2, 0.9),
                ("self_speculative", "self_speculative", "speculation", 1.50, 1.8, 1.1),
                ("draft_model", "draft_model", "speculation", 1.50, 1.4, 1.05),
                ("1-layer GPT", "full", "plain GPT", 1.90, 2.5, 2.4),
                ("pruned 1", "full", "pruned", 1.49, 0.9, 1.02), ("pruned 2", "full", "pruned", 1.60, 3.0, 1.0))]
    zero = {(a["name"], b["name"]): 0.0 for a in rows for b in rows}  # no error bar
    for mode in m.MODES:
        for row, better in zip(rows, m.dominated_by(rows, mode, zero)):
            row[f"dominated_{mode}"] = better
    return rows


def path_and_names(chart, on=()):
    """The frontier line's vertices as the report's rows (matched to the dots drawn at them; where
    dots share a pixel, a row of `on` not matched yet), and every text on the chart."""
    dots = {}
    for xy, i in re.findall(r'<circle cx="([^"]+" cy="[^"]+)" r="3" [^>]*data-key="frontier\.(\d+)\.', chart):
        dots.setdefault(xy, []).append(int(i))
    line = re.findall(r'<polyline class="path line" points="([^"]*)"', chart)
    assert len(line) == 1, "one frontier line"
    vertices = []
    for v in line[0].split():
        here = dots['{}" cy="{}'.format(*v.split(","))]
        vertices.append(next((i for i in here if i in on and i not in vertices), here[0]))
    return vertices, re.findall(r"<text[^>]*>([^<]+)</text>", chart)


@pytest.mark.parametrize("source", ["made up", "the run's"])
def test_the_frontier_line_joins_exactly_the_points_nothing_beats_and_names_them(source, page):
    rows = frontier_rows() if source == "made up" else page[1]["frontier"]
    charts = re.findall(r"<svg .*?</svg>", m.frontier_chart({"frontier": rows}), flags=re.DOTALL)
    assert len(charts) == len(m.MODES)
    for mode, chart in zip(m.MODES, charts):
        on = [i for i, r in enumerate(rows) if r[f"dominated_{mode}"] is None]
        vertices, texts = path_and_names(chart, on)
        assert sorted(vertices) == on, (mode, "the line's vertices: the frontier, no more, no fewer")
        speeds = [rows[i][f"speedup_{mode}"] for i in vertices]
        assert speeds == sorted(speeds), "slowest first"
        names = [t for t in texts if t in {r["name"] for r in rows}]
        assert sorted(names) == sorted(rows[i]["name"] for i in on), (mode, "each frontier point named")
    if source == "made up":  # the two modes' frontiers differ, and each family is in it
        assert [[rows[i]["name"] for i in path_and_names(c)[0]] for c in charts] == [
            ["pruned 1", "self_speculative", "state_copy", "pruned 2"],
            ["pruned 1", "self_speculative", "1-layer GPT"]]


def test_the_frontier_chart_tells_the_families_apart():
    """A point's class is its family's; the legend names each family once."""
    rows = frontier_rows()
    chart = re.findall(r"<svg .*?</svg>", m.frontier_chart({"frontier": rows}), flags=re.DOTALL)[0]
    classes = re.findall(r'<circle [^>]*class="([^"]+)" data-key="frontier\.(\d+)\.', chart)
    assert {rows[int(i)]["name"]: c for c, i in classes} == {
        "full": "decoder", "state_copy": "decoder", "self_speculative": "speculation",
        "draft_model": "speculation", "1-layer GPT": "gpt", "pruned 1": "pruned", "pruned 2": "pruned"}
    legend = re.findall(r'<rect class="([^"]+)" x="70"[^>]*/><text x="88"[^>]*>([^<]+)</text>', chart)
    assert legend == [("decoder", "the exit models&#x27; decoders"), ("speculation", "speculation (exact)"),
                      ("gpt", "plain GPTs"), ("pruned", "pruned models")]


@pytest.mark.parametrize("source", ["made up", "the run's"])
def test_frontier_names_sit_under_their_points_and_clear_of_each_other(source, page):
    """Each name starts just right of its point, under it; no two names overlap (13-unit text, about 7
    units a character), though the made-up sampled frontier has pruned 1 and self_speculative side by side
    at about one loss."""
    rows = frontier_rows() if source == "made up" else page[1]["frontier"]
    for mode, chart in zip(m.MODES, re.findall(r"<svg .*?</svg>", m.frontier_chart({"frontier": rows}),
                                               flags=re.DOTALL)):
        dots = {int(i): (float(x), float(y)) for x, y, i in
                re.findall(r'<circle cx="([^"]+)" cy="([^"]+)" r="3" [^>]*data-key="frontier\.(\d+)\.', chart)}
        at = {name: (float(x), float(y)) for x, y, name in
              re.findall(r'<text x="([^"]+)" y="([^"]+)">([^<]+)</text>', chart)}
        named = [r["name"] for r in rows if r[f"dominated_{mode}"] is None]
        for i, r in enumerate(rows):
            if r["name"] in named:
                x, y = dots[i]
                assert at[r["name"]][0] == pytest.approx(x + 5, abs=0.11) and at[r["name"]][1] > y
        for a in named:
            for b in named:
                (xa, ya), (xb, yb) = at[a], at[b]
                assert a == b or abs(ya - yb) >= 13 or xa + 7 * len(a) <= xb or xb + 7 * len(b) <= xa, (a, b)
        if source == "made up" and mode == "sampled":
            assert abs(at["pruned 1"][1] - at["self_speculative"][1]) >= 13
