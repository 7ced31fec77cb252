"""The HTML report: one self-contained page whose numbers are report.json's, checked in a real browser."""

import json
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser

import pytest
import torch

from conftest import m

ARGS = ["--n_layer=3", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4", "--eval_iters=1",
        "--max_iters=2", "--max_new_tokens=40", "--device=cpu", "--quality_positions=48", "--bench_tokens=12",
        "--bench_repeats=1", "--bench_prompts=2", "--bench_prompt_len=8", "--sweep_positions=500", "--spec_sweep=1"]


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


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    with torch.enable_grad():
        assert m.main(ARGS + [f"--out_dir={out}"]) == 0
    return out / "report.html", json.loads((out / "report.json").read_text())


def test_every_number_on_the_page_is_the_reports(page):
    path, report = page
    parser = Numbers()
    parser.feed(path.read_text())
    keys = {k.split(".")[0] for k, _ in parser.data}
    assert {"generation", "sweep_by_measure", "calibration_by_measure", "strategies", "spec_sweep", "logit_lens"} <= keys
    for key, value in parser.data:
        assert float(value) == pytest.approx(float(lookup(report, key)), rel=1e-12), key
    assert len(parser.data) > 200


def test_the_page_is_self_contained_and_has_both_schemes(page):
    html = page[0].read_text()
    assert "<script" not in html and "http://" not in html and "https://" not in html and "<link" not in html
    assert "prefers-color-scheme: dark" in html and "<svg" in html
    for question in ("What does early exit look like?", "Where do the tokens leave?", "Which threshold?",
                     "What does each KV strategy buy?", "Which draft_exit", "Does an exit need a trained head?"):
        assert question in html


def test_every_character_names_its_layer_and_confidence(page):
    path, report = page
    parser = Numbers()
    parser.feed(path.read_text())
    g = report["generation"]
    assert [int(s["data-layer"]) for s in parser.spans] == g["exited_at"]
    assert all(s["title"] == f"layer {l}, confidence {c:.2f}" for s, l, c in zip(parser.spans, g["exited_at"],
                                                                                    g["confidences"]))
    assert all(0 < c <= 1 for c in g["confidences"])


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


def png_size_and_variety(data):
    """(width, height, distinct byte values in the decompressed pixel data) of a PNG file."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat, i = b"", 8
    while i < len(data):
        n, kind = struct.unpack(">I4s", data[i : i + 8])
        if kind == b"IDAT":
            idat += data[i + 8 : i + 8 + n]
        i += 12 + n
    return width, height, len(set(zlib.decompress(idat)))


def chromium():
    return next((shutil.which(b) for b in ("chromium", "chromium-headless-shell", "chrome-headless-shell",
                                           "chromium-browser") if shutil.which(b)), None)


def test_the_page_renders_in_headless_chromium(page, tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("no headless Chromium here; .ci/run installs Debian's chromium-headless-shell")
    empty = tmp_path / "empty.html"  # the page with no section: a title on a plain background
    m.write_html_report({"config": page[1]["config"]}, str(empty))
    shots = {}
    for name, html in (("report", page[0]), ("empty", empty)):
        shots[name] = tmp_path / f"{name}.png"
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--screenshot={shots[name]}", "--window-size=1200,900", html.as_uri()],
                       check=True, capture_output=True, timeout=120)
    width, height, variety = png_size_and_variety(shots["report"].read_bytes())
    assert (width, height) == (1200, 900)
    assert variety > 50, "the screenshot is blank"
    # the coloured sample and the charts carry far more detail than a title alone
    assert shots["report"].stat().st_size > 2 * shots["empty"].stat().st_size
