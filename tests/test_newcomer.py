"""What a newcomer meets first: the console's samples and tables, and the words of the README and docs."""

import glob
import json
import os
import re
import types

import pytest
import torch

from conftest import KV_STRATEGIES, DEFAULT_RUN, ROOT, m

ARGS = DEFAULT_RUN  # the tiny default run


@pytest.fixture
def default_run(lab_runs):
    """A tiny default run: (its stdout, report.json, out_dir), made once a session
    (lab_runs); each test reads its own copy of report.json."""
    out, _, out_dir = lab_runs(ARGS)
    return out, json.loads((out_dir / "report.json").read_text()), out_dir


def tables(stdout):
    """Every printed table with its title and notes: the lines from a '=== ' title to the next blank line."""
    blocks, current = [], None
    for line in stdout.splitlines():
        if line.startswith("=== "):
            current = [line]
            blocks.append(current)
        elif current is not None and line.strip():
            current.append(line)
        else:
            current = None
    return blocks


def test_tables_fit_the_console_width_and_carry_a_legend(default_run):
    blocks = tables(default_run[0])
    titles = {b[0].split("?")[0] for b in blocks}
    assert {"=== Which threshold", "=== What does each KV strategy buy", "=== When does early exit pay"} <= titles
    for block in blocks:
        assert all(len(line) <= m.WIDTH for line in block), block[0]
    strategies = next(b for b in blocks if b[0].startswith("=== What does each KV strategy buy"))
    legend = " ".join(line.strip() for line in strategies)
    for word in ("speed-up:", "predicted:", "layers:", "repeats:", "cache:", "output:", "output's agreement:"):
        assert word in legend, word


def test_table_rows_are_aligned(default_run):
    """Every row of the sweep and strategies tables is exactly as wide as its header line."""
    row_start = {"=== Which threshold? The sweep": r"\d\.\d\d ", "=== What does each KV strategy buy": r"(greedy|sampled) "}
    for block in tables(default_run[0]):
        kind = next((k for k in row_start if block[0].startswith(k)), None)
        if kind is None:
            continue
        header = next(i for i, line in enumerate(block) if line.endswith("===")) + 1
        rows = [line for line in block[header + 1 :] if re.match(row_start[kind], line.strip())
                and "|" not in line]  # (not the text plot's lines)
        assert len(rows) >= 8, kind
        assert all(len(r) == len(block[header]) for r in rows), kind

def test_every_speed_has_a_prediction_beside_it(default_run):
    """Every row with a speed has its forecast from val beside it; full depth's is 1 (the baseline), and a
    plain GPT carries one in both modes."""
    report = default_run[1]
    rows = report["strategies"]
    gpts = [r for r in rows if r["family"] == "plain GPT"]
    assert gpts and {r["mode"] for r in gpts} == set(m.MODES)
    for row in rows:
        assert "speedup" in row
        assert isinstance(row["predicted_speedup"], float), (row["name"], row["mode"])
        if row["name"] == "full":
            assert row["predicted_speedup"] == pytest.approx(1.0)
        if row["family"] == "plain GPT":  # timed on val like every other row (test_lean checks the value)
            assert row["predicted_speedup"] > 0, row

def test_no_column_is_constant_by_construction(default_run):
    """The re-prefill is the same work for every per-token decoder (a round of speculation may slide its
    window a few tokens later): a note gives its range, not a column."""
    rows = default_run[1]["strategies"]
    per_token = [r for r in rows if r["name"] in ("full", *KV_STRATEGIES)]
    assert len({round(r["prefill_layers"], 6) for r in per_token}) == 1
    assert "prefill_layers" not in [key for key, *_ in m.STRATEGY_TABLE[1]]
    spread = sorted({round(r["prefill_layers"], 2) for r in rows if not r["name"].endswith(("GPT", "draft_model"))})
    assert f"adds {' to '.join(f'{p:.2f}' for p in spread)} per token for every decoder" in " ".join(default_run[0].split())


def test_losses_and_savings_say_their_split_and_positions(default_run):
    out = default_run[0]
    assert "The sweep on 500 val positions" in out and "val saved" in out and "val loss" in out
    assert "reported on 500 test positions" in out and "test saved" in out and "full depth's" in out
    assert "output's agreement: on 192 test positions, teacher-forced" in " ".join(out.split())
    assert "each split's mean over 1 batches of 4 random windows of 16 characters" in out
    assert "full depth's val loss on the 500 val positions" in out
    assert default_run[1]["summary"][0].endswith("full depth, on random windows of val")


def test_the_run_ends_with_its_summary_then_the_page(default_run):
    out, report, out_dir = default_run
    lines = out.rstrip("\n").splitlines()
    assert lines[-6] == "summary:" and lines[-5:-1] == ["  " + line for line in report["summary"]]
    assert lines[-1].startswith(f"page: {out_dir / 'report.html'}")
    val, saved, fastest, smaller = report["summary"]
    assert val.startswith(f"val loss {report['val_loss']['final']:.4f}: full depth")
    cal, chosen = report["calibration"], report["chosen_rule"]
    assert saved.startswith("saved at the guarantee (disagreement <= 1% with probability 95%): "
                            f"{cal['test']['compute_saved']:.1%} of layer runs on test")
    assert saved.endswith(f"the rule chosen on val, {chosen['measure']} (each rule at delta / 6): "
                          f"{chosen['test']['compute_saved']:.1%} (test disagreement "
                          f"{chosen['test']['disagreement']:.2%})")
    # the exit model's decoders, but those whose cache is copied or has holes
    exact = [r for r in report["strategies"] if r["name"] not in ("state_copy", "holes") and r["name"] in m.DECODERS]
    bests = [max((r for r in exact if r["mode"] == mode), key=lambda r: r["speedup"]) for mode in m.MODES]
    assert fastest == "fastest with an exact cache: " + ", ".join(
        f"{r['name']} {r['speedup']:.2f}x {r['mode']}" for r in bests), "greedy first, then sampled"
    on = [", ".join(r["name"] for r in report["frontier"] if r[f"dominated_{mode}"] is None) for mode in m.MODES]
    early = [r["name"] for r in report["frontier"] if r["family"] == "exit model" and r["decoder"] != "full"
             or r["decoder"] == "self_speculative"]  # an exit decoder or self-speculation, of any exit model
    early = [n for n in early if n in on[0].split(", ") + on[1].split(", ")]
    assert smaller == (f"when does early exit pay? On the frontier, greedy: {on[0]}; sampled: {on[1]}; early exit among "
                       f"them: {', '.join(early) or 'none'} (the exit recipe's cost at full depth: "
                       f"{report['recipe_cost']:+.4f})")


def test_summary_names_the_fastest_exact_decoder_of_the_exit_model_never_a_smaller_gpt():
    """A separate draft model and skipdecode are exact-cache decoders of the exit model; a plain GPT
    and state_copy are not, however fast."""
    cal = {"epsilon": 0.01, "delta": 0.05, "measure": "top1", "threshold": 0.9,
           "test": {"compute_saved": 0.3, "disagreement": 0.005, "held": True}}
    speeds = {"full": 1.0, "backfill": 0.9, "state_copy": 9.0, "holes": 9.0, "draft_model": 2.0,
              "skipdecode": 1.5, "1-layer GPT": 5.0, "self_speculative": 1.9}
    rows = [{"name": name, "mode": mode, "speedup": x + (mode == "sampled"),
             "family": "plain GPT" if name.endswith("GPT") else "exit model",
             "cache": {"state_copy": "approx.", "holes": "holes"}.get(name, "exact")}
            for name, x in speeds.items() for mode in m.MODES]
    next(r for r in rows if (r["name"], r["mode"]) == ("skipdecode", "sampled"))["speedup"] = 9.9
    # the frozen model's decoders are points of their own, not the exit model's
    rows += [{"name": "frozen draft_model", "mode": mode, "speedup": 20.0, "family": "exit model", "cache": "exact"}
             for mode in m.MODES]
    report = {"val_loss": {"final": 1.5}, "calibration": cal, "chosen_rule": cal, "strategies": rows,
              "calibration_by_measure": [{}] * 8, "frontier": [], "recipe_cost": 0.01}
    assert m.summary(report)[2] == "fastest with an exact cache: draft_model 2.00x greedy, skipdecode 9.90x sampled"


def summary_report(cal, chosen, frontier=()):
    """The least report summary() reads: no notes (it reads none), a strategies row a mode."""
    rows = [{"name": "full", "mode": mode, "speedup": 1.0, "cache": "exact", "family": "exit model"}
            for mode in m.MODES]
    return {"val_loss": {"final": 1.5}, "calibration": cal, "chosen_rule": chosen, "strategies": rows,
            "calibration_by_measure": [{}] * 8, "frontier": list(frontier), "recipe_cost": 0.0425}


@pytest.mark.parametrize("n_bad", [100, 101])
def test_the_summary_says_when_the_guarantee_did_not_hold_on_test(n_bad):
    """epsilon 1% of 10,000 test positions: 100 disagreeing hold it (today's words), 101 break it; then the
    summary says so, with test's disagreement beside the saving, and never 'at the guarantee'; the chosen
    rule's clause likewise."""
    from test_calibration import records_disagreeing
    records = {"val": records_disagreeing(0), "test": records_disagreeing(n_bad), "shift": records_disagreeing(0)}
    cal = m.calibration_report(records, "top1", [0], 0.01, 0.05)
    assert cal["test"]["disagreement"] == pytest.approx(n_bad / 10000) and cal["test"]["held"] is (n_bad == 100)
    saved = m.summary(summary_report(cal, cal))[1]
    if n_bad == 100:
        assert saved.startswith("saved at the guarantee (disagreement <= 1% with probability 95%): 50.0% of "
                                "layer runs on test (top1 > 0)")
        assert saved.endswith("(test disagreement 1.00%)") and "did not hold" not in saved
    else:
        assert saved.startswith("saved, but the guarantee did not hold on test (disagreement 1.01%, over "
                                "epsilon 1%): 50.0% of layer runs on test (top1 > 0)")
        assert saved.endswith("(test disagreement 1.01%, over epsilon: the guarantee did not hold)")
        assert "at the guarantee" not in saved
    # the chosen rule's clause alone broken, then the calibration's alone
    held, broken = (m.calibration_report(dict(records, test=records_disagreeing(n)), "top1", [0], 0.01, 0.05)
                    for n in (100, 101))
    assert m.summary(summary_report(held, broken))[1].startswith("saved at the guarantee")
    assert m.summary(summary_report(held, broken))[1].endswith("the guarantee did not hold)")
    assert m.summary(summary_report(broken, held))[1].startswith("saved, but the guarantee did not hold")
    assert m.summary(summary_report(broken, held))[1].endswith("(test disagreement 1.00%)")


def test_the_summary_names_the_frontier_from_its_rows():
    """The points nothing beats in each mode, in the rows' order, from report['frontier'] (no note read)."""
    cal = {"epsilon": 0.01, "delta": 0.05, "measure": "top1", "threshold": 0.9,
           "test": {"compute_saved": 0.3, "disagreement": 0.005, "held": True}}
    rows = [{"name": "a", "decoder": "full", "dominated_greedy": None, "dominated_sampled": "b"},
            {"name": "b", "decoder": "holes", "dominated_greedy": None, "dominated_sampled": None},
            {"name": "c", "decoder": "draft_model", "dominated_greedy": "a", "dominated_sampled": None},
            {"name": "d", "decoder": "self_speculative", "dominated_greedy": "a", "dominated_sampled": "b"}]
    assert m.summary(summary_report(cal, cal, rows))[3] == (
        "when does early exit pay? On the frontier, greedy: a, b; sampled: b, c; early exit among them: b (the exit "
        "recipe's cost at full depth: +0.0425)")
    rows[3]["dominated_sampled"] = None  # self-speculation on the frontier in one mode is early exit's
    assert "early exit among them: b, d (" in m.summary(summary_report(cal, cal, rows))[3]
    rows[1]["dominated_greedy"] = rows[1]["dominated_sampled"] = rows[3]["dominated_sampled"] = "c"
    assert "early exit among them: none (" in m.summary(summary_report(cal, cal, rows))[3]


def test_the_sample_reports_the_threshold_its_decoder_ran_at():
    """skipdecode's sample runs its schedule (threshold 0), self_speculative's no threshold at all;
    the calibrated threshold is only the gated strategies'."""
    plan = {"measure": "top1", "threshold": 0.0, "checked_exits": [2, 1, 0], "label": "2,1,0"}
    lab = types.SimpleNamespace(model=object(), rules=m.EXIT_RULES, threshold=0.7, schedule=plan)
    made = {}
    for name in ("skipdecode", "self_speculative", "deferred"):
        lab.config = m.LabConfig(kv_strategy=name, n_layer=4)
        made[name] = m.sample_decoder(lab)[1:]
    assert made["skipdecode"] == ("skipdecode, layer 2,1,0", 0.0)  # its schedule, at threshold 0
    assert made["self_speculative"][1] is None
    assert made["deferred"] == ("deferred, top1 > 0.7", 0.7)
    lab.schedule, lab.config = None, m.LabConfig(kv_strategy="skipdecode", n_layer=4)
    with pytest.raises(ValueError, match="no schedule"):  # a checkpoint without one
        m.sample_decoder(lab)


def test_output_says_not_same_where_greedy_speculation_differs(monkeypatch):
    """The output column reads the measured comparison: a greedy speculative decoder that differed says so."""
    monkeypatch.setattr(m, "spec_stats", lambda *a: {"identical_to_full": False})
    monkeypatch.setattr(m, "tail", lambda outputs: {})
    speed = {(n, mode): {"tokens_per_second": 1.0, "seconds": m.np.ones((1, 1)), "outputs": []} for n in ("full", "self_speculative")
             for mode in m.MODES}
    quality = {"full": {"pred": torch.zeros(3), "nll": torch.ones(3), "test_loss": 1.0, "test_accuracy": 0.5}}
    row = m.table_row("self_speculative", "self_speculative", "full", "greedy", speed, quality)
    assert row["output"] == "NOT same"
    assert m.table_row("full", "full", "full", "greedy", speed, quality)["output"] == "same tokens"
    assert m.table_row("full", "full", "full", "sampled", speed, quality)["output"] == "same dist."


def test_cache_and_output_are_two_columns(default_run):
    """'exact?' meant two things: whether the cache is exact, and whether the output is full depth's."""
    rows = {(r["name"], r["mode"]): r for r in default_run[1]["strategies"]}
    assert [key for key, *_ in m.STRATEGY_TABLE[1]][-2:] == ["cache", "output"]
    for mode, same in (("greedy", "same tokens"), ("sampled", "same dist.")):
        assert rows["full", mode]["output"] == rows["self_speculative", mode]["output"] == same
        assert rows["state_copy", mode]["cache"] == "approx." and rows["holes", mode]["cache"] == "holes"
        assert rows["self_speculative", "greedy"]["identical_to_full"] is True  # measured, not assumed
        for name in ("backfill", "deferred", "state_copy", "holes", "1-layer GPT"):
            assert rows[name, mode]["output"] == f"agree {rows[name, mode]['agreement']:.3f}", name
        assert rows["backfill", mode]["cache"] == rows["deferred", mode]["cache"] == "exact"


def test_a_line_under_the_early_exit_sample_says_why(default_run):
    out, report, _ = default_run
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("--- early-exit sample"))
    note = next(line for line in lines[start:] if "full depth's speed" in line)
    g = report["generation"]
    ratio = g["tokens_per_second"] / g["full_depth_tokens_per_second"]
    assert note.startswith(f"({ratio:.2f}x full depth's speed: 3.00 layer runs per token (of 3), plus ")
    assert "exit checks" in note and lines.index(note) < next(i for i, line in enumerate(lines) if "per-layer" in line)


def test_speed_note_counts_the_exit_checks_that_ran():
    out = m.Generation(torch.zeros(1, 5), torch.tensor([[0, 1, 3, 3, 0]]), None, 20, exit_checks=7)
    samples = {"full-depth": (None, 100.0), "early-exit": (out, 50.0)}
    assert m.speed_note(samples, 4) == ("0.50x full depth's speed: 4.00 layer runs per token (of 4), plus "
                                        "1.40 exit checks (each a head, a softmax and a host sync)")


def sample_from_the_default_run(lab_runs, tmp_path, *args):
    """The tiny default run's checkpoint (a copy in tmp_path) sampled again with args (--sample_only: the
    same sample path a whole run takes, with the calibration the run left in the checkpoint)."""
    lab_runs.copy_to(ARGS, tmp_path)
    assert m.main(ARGS + ["--init_from=resume", "--sample_only=1", f"--out_dir={tmp_path}", *args]) == 0


def test_the_calibrated_threshold_is_named_only_where_the_sample_runs_at_it(tmp_path, capsys, lab_runs):
    """skipdecode's sample runs its schedule at threshold 0: the console names the schedule (the run's,
    in report.json's plans); the samples' report keeps the threshold that ran."""
    sample_from_the_default_run(lab_runs, tmp_path, "--kv_strategy=skipdecode", "--max_new_tokens=20")
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    samples = json.loads((tmp_path / "samples.json").read_text())
    # the header names the schedule and its speed, not a threshold ("top1 > ...")
    assert "--- early-exit sample: skipdecode, layer " + report["plans"]["skipdecode"]["label"] + " (" in out
    assert "early-exit sample: skipdecode, top1 >" not in out and samples["generation"]["exit_threshold"] == 0.0
    assert samples["generation"]["decoder"] == "skipdecode, layer " + report["plans"]["skipdecode"]["label"]


def test_the_sample_can_be_drawn_with_self_speculation(tmp_path, capsys, lab_runs):
    """Greedy, the self-speculative sample is the full-depth one, character for character."""
    sample_from_the_default_run(lab_runs, tmp_path, "--kv_strategy=self_speculative", "--temperature=0",
                                "--max_new_tokens=60")
    out = capsys.readouterr().out
    full = out.split("--- full-depth sample")[1].split("\n", 1)[1].split("\n--- early-exit")[0]
    early = out.split("--- early-exit sample: self_speculative, layer 0 drafts up to 8 a round, the rest verify")[1]
    assert early.split("\n", 1)[1].startswith(full)


HOW_IT_WAS_MADE = (r"\bissues?\b", r"\bsessions?\b", r"\bcommits?\b", r"\bgit\s+(show|log|diff)\b", r"\bwork\s+periods?\b",
                   r"\bsprints?\b", r"\btickets?\b", r"\bpull\s+requests?\b",
                   r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b",  # a commit hash
                   r"\bthe\s+issue\s+sets?\b", r"\bearlier\s+version\b", r"\bprevious(ly)?\s+version\b",
                   r"\bfinal\s+code\b", r"\b(states?|versions?)\s+of\s+the\s+script\b", r"\bthis\s+version\b",
                   r"\bas\s+it\s+is\s+now\b", r"\bbefore\s+these\s+changes\b", r"\bby\s+mistake\b",
                   r"\bbefore\s+the\s+fair\s+trial\b", r"\blater\s+removed\b",
                   r"\bfinal\s+script\b", r"\bhad\s+then\b", r"\bscript\s+now\b", r"\bnow\s+has\b")


def docs():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def made_words(text):
    return [w for pattern in HOW_IT_WAS_MADE for w in re.findall(pattern, text, flags=re.IGNORECASE)]


def test_readme_and_docs_speak_of_the_project_not_of_its_making():
    assert len(docs()) >= 2, "README.md and docs/RESULTS.md"
    for path in docs():
        found = made_words(open(path, encoding="utf-8").read())
        assert not found, f"{os.path.basename(path)}: {found[:5]}"
    # the check itself catches such words
    assert made_words("fixed in an earlier session, see git show 9108b46 and issue 17")
    assert made_words("a run of the final code") and made_words("two states of the script")
    assert not made_words("two configurations of the script, the final head")


def test_readme_is_short_and_results_carry_their_commands():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert readme.count("\n") <= 350
    results = open(os.path.join(ROOT, "docs", "RESULTS.md"), encoding="utf-8").read()
    blocks = re.findall(r"```\n(.*?)```", results, flags=re.DOTALL)
    assert blocks and all(b.startswith("$ python") or b.startswith("$ time python") or b.startswith("$ OMP")
                          or b.startswith("$ torchrun") for b in blocks if "===" in b)


TEST_COMMAND = "pip install -r requirements.txt pytest && python -m pytest -q tests"


def test_the_first_screen_installs_and_runs_on_a_fresh_laptop():
    """Within the README's first 40 lines: a venv, the CPU wheel before the run command, the Python version,
    the disk, the page to open, the test command; .ci/run runs that same test command."""
    first = "\n".join(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()[:40])
    venv = first.index("python3 -m venv .venv && . .venv/bin/activate")
    wheel = first.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    run = first.index("pip install -r requirements.txt && python nanogpt_exit_head.py")
    assert venv < wheel < run
    assert re.search(r"Python 3\.\d+ or newer", first) and re.search(r"\d+ GB of disk", first)
    assert "open `out/report.html`" in first and TEST_COMMAND in first
    assert TEST_COMMAND in open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()


def test_the_glossary_is_short_and_the_seed_is_only_the_random_seed():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    glossary = readme.split("**Words used below.**")[1].split("\n\n")[0]
    assert glossary.count("\n") < 10 and "*Default recipe*: alpha 0.3" in glossary
    for text in [readme] + [open(p, encoding="utf-8").read() for p in docs()[1:]] + [open(m.__file__).read()]:
        assert not re.search(r"\bseed (design|recipe)|the seed's", text, flags=re.IGNORECASE)
