"""What a careful reader would break: inline edits take effect, --lesson_only is Part I alone, a strategy's
name is checked, and full depth has one baseline."""

import importlib.util
import json
import re
import sys

import pytest
import torch

from conftest import ROOT, m, tiny_model
from test_cli import part_one_text
from test_frontier import measured_lab

TINY = ["--n_layer=3", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4", "--eval_iters=1",
        "--max_iters=3", "--eval_interval=2", "--max_new_tokens=30", "--device=cpu", "--quality_positions=48",
        "--bench_tokens=12", "--bench_repeats=1", "--bench_prompts=4", "--bench_prompt_len=8",
        "--sweep_positions=500"]


def load_as_module(text, name, monkeypatch, folder):
    """text as a module of its own, from a file (dataclasses look their module up, argparse help reads
    the source)."""
    path = folder / f"{name}.py"
    path.write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_editing_exit_threshold_inline_takes_effect(tmp_path, monkeypatch):
    """The script is edited inline: a number written in place of exit_threshold's default is the one used."""
    source = open(m.__file__, encoding="utf-8").read()
    edited, n = re.subn(r"(\n    exit_threshold: float = )-?[\d.]+", r"\g<1>0.55", source)
    assert n >= 1
    module = load_as_module(edited, "edited_script", monkeypatch, tmp_path)
    with torch.enable_grad():
        assert module.main(TINY + [f"--out_dir={tmp_path}"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["generation"]["exit_threshold"] == 0.55


def strip_timings(text):
    """The lines of a run that depend on the seed alone: losses, samples, exit statistics."""
    text = re.sub(r"\(\d[\d,]* tok/s\)", "(tok/s)", text)
    return [line for line in text.splitlines() if not re.search(r"full depth's speed|ms|it/s", line)]


def test_lesson_only_is_part_one_alone(tmp_path, capsys, monkeypatch):
    """--lesson_only runs what the text above the Part II banner runs on its own: Part I's GPT, its
    training, the threshold of its config and backfill; the same numbers on the same tiny config."""
    path = f"--input_path={ROOT}/input.txt"
    with torch.enable_grad():
        assert m.main(TINY + ["--lesson_only=true", path, f"--out_dir={tmp_path}"]) == 0
    lab, err = capsys.readouterr()
    # stdout and stderr are not terminals here (captured, as in a log): no progress bar in either
    assert "step 2: train loss" in lab and "training" not in err and "it/s" not in lab + err
    part_one = load_as_module(part_one_text()[0], "part_one_alone", monkeypatch, tmp_path)
    config = part_one.Config(input_path=f"{ROOT}/input.txt", n_layer=3, n_head=2, n_embd=16, block_size=16,
                             batch_size=4, max_iters=3, eval_interval=2, eval_iters=1, max_new_tokens=30)
    with torch.enable_grad():
        part_one.run_lesson(config, "cpu")
    alone = capsys.readouterr().out
    assert "--- early-exit sample: backfill, top1 > 0.9" in alone
    assert strip_timings(lab) == strip_timings(alone)
    assert not (tmp_path / "report.json").exists(), "Part I writes no report"


def test_an_unknown_strategy_name_is_an_error_not_backfill(capsys):
    model = tiny_model()
    plan = {"measure": "margin", "threshold": 0.5, "checked_exits": [0, 1, 2]}
    with pytest.raises(KeyError, match="defered"):
        m.build("defered", model, plan)
    made = m.build("deferred", model, plan).keywords
    assert made["strategy"] is m.Deferred and made["measure"] is m.EXIT_RULES["margin"]
    # on the command line the name is checked before anything runs: an error, status 2
    assert m.main(TINY + ["--kv_strategy=defered"]) == 2
    err = capsys.readouterr().err
    assert "defered" in err and "deferred" in err, "the error names the choices"


def test_each_strategy_row_carries_its_plans_prediction(monkeypatch):
    """Every row of the decoder table sits beside its forecast from val: the speed-up the same decoder at the
    same plan (a drafter at the draft length chosen on val in the row's mode), or the same model at full depth,
    ran at on val's workload in the row's mode; full depth's is 1. An exit decoder's plan is the one the unit
    costs priced on val's records."""
    model = tiny_model()
    config = m.LabConfig(**{**vars(model.config), "quality_positions": 40, "bench_tokens": 6, "bench_repeats": 1,
                            "bench_prompts": 4, "bench_prompt_len": 6, "sweep_positions": 300, "shift_path": "",
                            "exit_threshold": 0.5, "max_iters": 2, "eval_iters": 1})
    splits = {name: torch.randint(0, 11, (4000,), generator=torch.Generator().manual_seed(i))
              for i, name in enumerate(("train", "val", "test"))}
    vals, real = [], m.Lab.on_val
    lengths = {"greedy": 2, "sampled": 4}  # each mode's chosen length, set apart: each row must run its own

    def on_val(lab, *a):
        val, chosen = real(lab, *a)
        chosen = {key: {**plan, "num_draft": lengths[key[1]]} if plan and "num_draft" in plan else plan
                  for key, plan in chosen.items()}
        vals.append((val, chosen))
        return val, chosen
    monkeypatch.setattr(m.Lab, "on_val", on_val)
    lab = measured_lab(model, config, splits)
    ((val, chosen),), rows, costs, plans = vals, lab.measured, lab.costs, lab.plans
    assert set(plans) == {name for name, d in m.DECODERS.items() if d.strategy}
    exit_rows = [r for r in rows if m.DECODERS[r["decoder"]].strategy and not r["name"].startswith("watched")]
    assert {(r["name"], r["mode"]) for r in exit_rows} == {(n, mode) for n in plans for mode in m.MODES}
    assert {r["name"] for r in rows if r["name"].startswith("watched")} == {"watched backfill", "watched deferred"}
    for row in exit_rows:
        d, plan = m.DECODERS[row["decoder"]], plans[row["name"]]
        assert (row["exit_at"], row["threshold"]) == (plan["label"], plan["threshold"])
        if not d.schedule:  # the plan's price: from val's records at the unit costs
            priced = m.priced_saving(d, m.plan_counts(lab.records["val"], plan), plan["measure"], costs)
            assert plan["saved_blocks"] == pytest.approx(priced / costs["block"])
    for row in rows:
        if row["family"] == "pruned":  # no table shows a pruned model's forecast: none timed on val
            assert "predicted_speedup" not in row and (row["name"], row["mode"]) not in val
            continue
        if row["name"] == "full":
            assert row["predicted_speedup"] == 1.0
        else:
            assert row["predicted_speedup"] == val[row["name"], row["mode"]], row["name"]
    drafters = [r for r in rows if m.DECODERS[r["decoder"]].drafter]
    assert len(drafters) == 4  # each drafter in each mode runs on test at the length chosen for it
    for row in drafters:
        plan = chosen[row["name"], row["mode"]]
        assert (row["num_draft"], row["draft_exit"]) == (lengths[row["mode"]], plan["draft_exit"]), row["name"]
    smaller = [r for r in rows if r["name"].endswith("GPT")]
    assert {r["name"] for r in smaller} >= {"1-layer GPT"}
    assert all((r["name"], r["mode"]) in val for r in smaller)

@pytest.mark.parametrize("terminal", ["stdout", "stderr"])
def test_no_progress_bar_unless_stdout_and_stderr_are_both_terminals(terminal, capsys, monkeypatch):
    """A log of either stream (the other one a terminal) gets the evaluation lines and no tqdm bar."""
    monkeypatch.setattr(getattr(sys, terminal), "isatty", lambda: True)
    config = m.Config(n_layer=2, n_head=2, n_embd=16, block_size=8, batch_size=2, max_iters=3, eval_interval=2,
                      eval_iters=1, vocab_size=11)
    torch.manual_seed(0)
    model, data = m.GPT(config), torch.randint(0, 11, (200,))
    with torch.enable_grad():
        m.train(model, m.configure_optimizer(model, config), {"train": data, "val": data}, config, "cpu")
    out, err = capsys.readouterr()
    assert "step 2: train loss" in out and "training" not in err and "it/s" not in err
