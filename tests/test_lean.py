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
    """The strategies table's rows sit beside the cost model's predictions for the plans they ran: an exit
    decoder's priced from where it left on val's workload in the row's mode, a drafter's as it ran on val, the
    plain GPT and pruned rows from their missing blocks' (never a bare 1.0x)."""
    model = tiny_model()
    config = m.LabConfig(**{**vars(model.config), "quality_positions": 40, "bench_tokens": 6, "bench_repeats": 1,
                            "bench_prompts": 4, "bench_prompt_len": 6, "sweep_positions": 300, "shift_path": "",
                            "exit_threshold": 0.5, "max_iters": 2, "eval_iters": 1})
    splits = {name: torch.randint(0, 11, (4000,), generator=torch.Generator().manual_seed(i))
              for i, name in enumerate(("train", "val", "test"))}
    vals, real = [], m.val_figures
    monkeypatch.setattr(m, "val_figures", lambda speed, n_layer: vals.append(real(speed, n_layer)) or vals[-1])
    lab = measured_lab(model, config, splits)
    (val,), rows, costs, plans, L = vals, lab.measured, lab.costs, lab.plans, config.n_layer
    assert costs["token greedy"] > 0 and costs["token sampled"] > 0
    assert set(plans) == {name for name, d in m.DECODERS.items() if d.strategy}
    exit_rows = [r for r in rows if m.DECODERS[r["decoder"]].strategy]
    assert {(r["name"], r["mode"]) for r in exit_rows} == {(n, mode) for n in plans for mode in m.MODES}
    for row in exit_rows:
        d, plan, counts = m.DECODERS[row["decoder"]], plans[row["name"]], val[row["name"], row["mode"], None]["counts"]
        expected = m.predict_speedup(d, counts, plan["measure"], costs, costs[f"token {row['mode']}"])
        assert row["predicted_speedup"] == pytest.approx(expected), (row["name"], row["mode"])
        # backfill runs every block: its steps are as deep as the model
        assert row["expected_layers"] == pytest.approx(L - d.skips * counts["skipped"]) and row["exit_at"] == plan["label"]
        if not d.schedule:  # the plan's own prediction: from val's records, at the greedy token
            at_plan = m.predict_speedup(d, m.plan_counts(lab.records["val"], plan), plan["measure"], costs,
                                        costs["token greedy"])
            assert plan["predicted_speedup"] == pytest.approx(at_plan)
    for row in rows:
        if m.DECODERS[row["decoder"]].drafter:
            k = row.get("num_draft")
            assert row["predicted_speedup"] == (val[row["name"], row["mode"], k]["speedup"] if k else 1.0)
        elif row["name"] == "full":
            assert row["predicted_speedup"] == 1.0
    smaller = [r for r in rows if r["name"].endswith("GPT") or r["name"].startswith("pruned")]
    assert {r["name"] for r in smaller} >= {"1-layer GPT", "pruned 1"}
    for row in smaller:
        skipped = (config.n_layer - row["mean_layers"]) * costs["block"]
        token = costs[f"token {row['mode']}"]  # a busy machine's token under its blocks: one block left
        assert row["predicted_speedup"] == pytest.approx(token / max(token - skipped, costs["block"]))
        assert row["predicted_speedup"] > 1, row["name"]


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


def test_a_smaller_models_prediction_never_divides_by_a_negative_time():
    """A busy machine can time a token under its blocks: a model that skips more than the token took
    is predicted as if one block were left, not at a negative speed-up."""
    row = {"name": "pruned 5", "decoder": "full", "mode": "greedy", "batch_size": 1}
    costs = {"token greedy": 1.0, "token sampled": 2.0, "block": 0.3, "final_head": 0.1, "check top1": 0.05}
    one_layer, five_layers = tiny_model(n_layer=1), tiny_model(n_layer=5)
    assert m.prediction(row, {}, {}, costs, 6, one_layer)["predicted_speedup"] == pytest.approx(1.0 / 0.3)
    # one block skipped: 1 / (1 - 0.3)
    assert m.prediction(row, {}, {}, costs, 6, five_layers)["predicted_speedup"] == pytest.approx(1.0 / 0.7)
    row["mode"] = "sampled"  # the row's mode's token: 2 / (2 - 0.3)
    assert m.prediction(row, {}, {}, costs, 6, five_layers)["predicted_speedup"] == pytest.approx(2.0 / 1.7)
