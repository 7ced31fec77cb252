"""The command line: overrides, --help, checkpoints and resume, the report, bad input."""

import json
import math
import os
import re
import sys

import pytest
import torch

from conftest import KV_STRATEGIES, ROOT, THREE_LAYER_RUN, m


# --- command line, checkpoints, bad input --------------------------------------------

TINY_ARGS = ["--n_layer=2", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4",
             "--eval_iters=1", "--eval_interval=2", "--max_new_tokens=20", "--device=cpu",
             "--draft_exit=0", "--quality_positions=50", "--bench_tokens=20", "--bench_repeats=1",
             "--bench_prompts=2", "--bench_prompt_len=8", "--sweep_positions=500"]


def run_main(tmp_path, *args):
    return m.main(TINY_ARGS + [f"--out_dir={tmp_path}"] + list(args))


# whole runs several tests read, each made once a session (conftest's lab_runs)
TWO_STEPS = TINY_ARGS + ["--max_iters=2", "--exit_threshold=0.05"]  # a threshold that lets tokens exit
THREE_LAYERS = THREE_LAYER_RUN  # test_report_html's page too


def test_overrides_type_check():
    config, overridden = m.parse_args(["--n_layer=3", "--exit_threshold=0.5", "--compile=true"])
    assert (config.n_layer, config.exit_threshold, config.compile) == (3, 0.5, True)
    assert overridden == {"n_layer", "exit_threshold", "compile"}


def test_help_lists_every_field(capsys):
    assert m.main(["--help"]) == 0
    out = capsys.readouterr().out
    for f in m.fields(m.LabConfig):
        if f.name != "vocab_size":
            assert f"--{f.name}" in out
    assert "how many transformer blocks" in out


def train_only(tmp_path, *args):
    """The command line's config, trained or resumed, without the lab after it: (report, stdout is the
    caller's)."""
    config, overridden = m.parse_args(TINY_ARGS + [f"--out_dir={tmp_path}", *args])
    tokenizer, splits = m.load_data(config)
    report = {}
    torch.manual_seed(config.seed)
    with torch.enable_grad():
        m.train_or_resume(config, tokenizer, splits, "cpu", overridden, report=report)
    return report


def test_checkpoint_round_trip_and_resume(tmp_path, capsys):
    report = train_only(tmp_path, "--max_iters=4")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ckpt["iter_num"] == 4 and set(ckpt) >= {"model", "optimizer", "config", "vocab"}
    # resuming a finished run trains nothing and evaluates the same weights
    capsys.readouterr()
    again = train_only(tmp_path, "--init_from=resume")
    out = capsys.readouterr().out
    assert again["val_loss"] == report["val_loss"] and again["ms_per_iter"] is None
    assert f"resumed from {tmp_path / 'ckpt.pt'} at step 4, max_iters=4: no training this run" in out
    assert "trained steps" not in out
    train_only(tmp_path / "new", "--max_iters=0")  # a new model, trained 0 steps, is not a resume
    assert "a new model, max_iters=0: no training this run" in capsys.readouterr().out
    train_only(tmp_path / "new", "--max_iters=0", "--init_from=resume")  # its checkpoint, at step 0, is
    assert f"resumed from {tmp_path / 'new' / 'ckpt.pt'} at step 0, max_iters=0" in capsys.readouterr().out
    # resuming with a larger budget continues from iteration 4
    train_only(tmp_path, "--max_iters=6", "--init_from=resume")
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["iter_num"] == 6
    assert "trained steps 4..6 in" in capsys.readouterr().out
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_report_has_the_promised_keys(lab_runs):
    r = json.loads((lab_runs(TWO_STEPS)[2] / "report.json").read_text())
    assert {"config", "n_params", "n_params_exit_heads", "train_seconds", "val_loss", "generation"} <= set(r)
    assert len(r["val_loss"]["exits"]) == 1 and isinstance(r["val_loss"]["final"], float)
    g = r["generation"]
    assert {"exit_threshold", "exit_counts", "tokens_per_second"} <= set(g)
    assert sum(g["exit_counts"]) == 20 and len(g["exit_counts"]) == 2


def test_default_run_prints_the_statistics(lab_runs):
    out = lab_runs(TWO_STEPS)[0]
    assert "Layer 0:" in out and "Layer 1 (full):" in out
    assert "full-depth sample" in out and "early-exit sample" in out
    assert "% overhead" in out and "mean exit depth" in out


BAD_INPUTS = [
    (["--input_path=/nonexistent/input.txt"], "No such file"),
    (["--prompt=\u00e9t\u00e9"], "not in the vocabulary of 'input.txt': '\u00e9'"),
    (["--exit_threshold=1.5"], "outside [-1, 1]"),
    (["--exit_threshold=-0.1"], "-1 (calibrate on val) or in [0, 1]"),
    (["--n_embd=30", "--n_head=4"], "not divisible"),
    (["--n_layr=3"], "unknown argument '--n_layr=3'"),
    (["--n_layr=3"], "did you mean --n_layer?"),
    (["--max_iters=ten"], "invalid int value: 'ten'"),
    (["max_iters=10"], "--name=value"),
    (["--kv_strategy=magic"], "kv_strategy"),
    (["--init_from=resume"], "no readable checkpoint"),
    (["--sweep_positions=9"], "--sweep_positions=9 is outside [10, inf)"),  # the learned rule's ten pieces
]


@pytest.mark.parametrize("args,message", BAD_INPUTS)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, message):
    assert run_main(tmp_path, *args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "ckpt.pt").exists()


@pytest.mark.parametrize("args,ok", [
    (["--seed=4294967295"], True), (["--seed=4294967296"], False),  # numpy's seed range
    (["--num_draft=16"], True), (["--num_draft=17"], False),  # TINY_ARGS' block_size is 16
    (["--temperature=0"], True), (["--temperature=1e-6"], True), (["--temperature=1e-7"], False)])
def test_a_bound_holds_one_step_either_side_and_is_said_before_any_work(tmp_path, capsys, args, ok):
    """The largest seed, num_draft and the smallest temperature that run pass; one step past each is
    one line naming the flag, status 2, and nothing written to out_dir."""
    if ok:
        m.parse_args(TINY_ARGS + [f"--out_dir={tmp_path}", *args])
        return
    assert run_main(tmp_path, *args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {args[0].split('=')[0]}=") and err.count("\n") == 1, err
    assert not any(tmp_path.iterdir())


def test_a_resume_checks_num_draft_against_the_checkpoints_block_size(tmp_path, capsys, lab_runs):
    """Before a resume the block size is the checkpoint's, not the default (64); after, it is
    checked."""
    argv = [a for a in TINY_ARGS if not a.startswith("--block_size")]
    argv += [f"--out_dir={tmp_path}", "--init_from=resume"]
    m.parse_args(argv + ["--num_draft=70"])
    lab_runs.copy_to(TWO_STEPS, tmp_path)  # its block_size is 16
    assert m.main(argv + ["--num_draft=17"]) == 2
    assert "--num_draft=17: at most block_size=16" in capsys.readouterr().err


@pytest.mark.parametrize("lesson_only", ["false", "true"])
def test_a_diverged_run_ends_in_one_line(tmp_path, capsys, lesson_only):
    """A learning rate that turns the weights to nan stops at the evaluation that sees it, in one
    line, before a sampler draws from nan probabilities."""
    rc = run_main(tmp_path, "--learning_rate=1e30", "--min_lr=0", "--warmup_iters=1",
                  "--max_iters=4", f"--lesson_only={lesson_only}")
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: training diverged: val loss nan at step ")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_lesson_only_writes_no_file_as_the_readme_says(tmp_path, capsys):
    """--lesson_only is Part I alone: it prints its samples and exit statistics; out_dir stays
    empty."""
    assert run_main(tmp_path / "out", "--lesson_only=true", "--max_iters=2") == 0
    assert "per-layer exit statistics" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())  # not even the folder
    readme = " ".join(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().split())
    told = "--lesson_only=true # Part I alone: prints its samples and exit statistics, writes no file"
    assert told in readme
    assert "Every run writes" not in readme


def test_a_text_of_fewer_than_two_characters_is_refused_before_training(tmp_path, capsys):
    """A model chooses between characters: a text of none or one is one line and status 2; two run."""
    for text, distinct in (("", 0), ("a" * 5000, 1)):
        path = tmp_path / f"{distinct}.txt"
        path.write_text(text)
        assert run_main(tmp_path / "out", f"--input_path={path}", "--prompt=a") == 2
        err = capsys.readouterr().err
        assert f"holds {distinct} distinct characters" in err and err.count("\n") == 1
        assert not (tmp_path / "out" / "ckpt.pt").exists()
    two = tmp_path / "two.txt"
    two.write_text("ab" * 2500)
    assert run_main(tmp_path / "ok", f"--input_path={two}", "--prompt=a", "--max_iters=1", "--shift_path=") == 0


def test_sweep_positions_of_ten_run_the_whole_lab(tmp_path):
    """The learned rule is fitted on ten pieces of train: ten positions is the least that runs, one fewer
    is refused before training (BAD_INPUTS)."""
    assert run_main(tmp_path, "--sweep_positions=10", "--max_iters=1") == 0
    assert json.loads((tmp_path / "report.json").read_text())["config"]["sweep_positions"] == 10


def test_mismatched_checkpoint(tmp_path, capsys, lab_runs):
    lab_runs.copy_to(TWO_STEPS, tmp_path)  # its checkpoint, trained 2 steps; this test breaks the copy
    assert run_main(tmp_path, "--init_from=resume", "--n_layer=3") == 2
    assert "n_layer=2" in capsys.readouterr().err
    other = tmp_path / "other.txt"
    other.write_text("abc\n" * 1200)
    assert run_main(tmp_path, "--init_from=resume", f"--input_path={other}", "--prompt=a") == 2
    assert "vocabulary" in capsys.readouterr().err
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    ckpt["model"]["transformer.wpe.weight"] = torch.zeros(3, 16)
    torch.save(ckpt, tmp_path / "ckpt.pt")
    assert run_main(tmp_path, "--init_from=resume") == 2
    assert "does not fit" in capsys.readouterr().err


def test_report_has_the_strategies_and_calibration(lab_runs):
    r = json.loads((lab_runs(THREE_LAYERS)[2] / "report.json").read_text())
    joint = ["full", "backfill", "deferred", "state_copy", "holes", "skipdecode", "self_speculative", "draft_model"]
    # with --continued every exit model brings every decoder (the frozen model's full depth is the 3-layer GPT's),
    # then the plain GPTs
    names = joint + [f"frozen {n}" for n in joint[1:]] + [f"continued {n}" for n in joint]
    # then each exit model's exit decoders but skipdecode, watched (a study watches state copy and holes too)
    names += [f"watched {p}{n}" for p in ("", "frozen ", "continued ") for n in joint[1:5]] + ["1-layer GPT",
                                                                                             "3-layer GPT"]
    assert [(row["mode"], row["name"]) for row in r["strategies"]] == [(mode, n) for mode in ("greedy", "sampled")
                                                                      for n in names]
    assert [row["name"] for row in r["frontier"]] == names + ["pruned 1", "pruned 2"]
    acceptance = " ".join(r["notes"]["strategies"])  # every exit model's drafters, in the notes
    assert all(f"{p}self_speculative {mode}: drafts to layer" in acceptance for p in ("", "frozen ", "continued ")
               for mode in m.MODES)
    keys = {"name", "mode", "tokens_per_second", "speedup", "mean_layers", "prefill_layers",
            "repetition", "test_loss", "test_accuracy", "agreement"}
    assert all(keys <= set(row) for row in r["strategies"])
    assert all(row["decoder"] == ("full" if row["name"].endswith("GPT") else row["name"].split()[-1])
               and row["family"] == ("plain GPT" if row["name"].endswith("GPT") else "exit model")
               for row in r["strategies"])
    # the plans are the exit decoders': a threshold's priced on val's records, the schedule's not
    assert set(r["plans"]) == {"backfill", "deferred", "state_copy", "holes", "skipdecode"}
    assert "saved_blocks" not in r["plans"]["skipdecode"]
    costs, L = r["decode_costs"], 3
    assert {"block", "final_head", "state_copy", "check top1", "cache_length"} <= set(costs)
    per_token = [row for row in r["strategies"] if row["name"] in ("backfill", "deferred", "state_copy", "holes")]
    for row in per_token:  # the plan chosen on val is the row's; its forecast timed on val's workload
        plan = r["plans"][row["name"]]
        assert (row["exit_at"], row["threshold"]) == (plan["label"], plan["threshold"])
        assert row["threshold"] == r["generation"]["exit_threshold"]
        assert plan["saved_blocks"] <= L - 1  # a step skips at most the blocks above layer 0
        assert row["predicted_speedup"] > 0
    for row in r["strategies"]:  # full depth 1, by definition; every other row timed on val
        assert row["predicted_speedup"] > 0 and (row["name"] != "full" or row["predicted_speedup"] == 1)
        if row["name"] in ("self_speculative", "draft_model"):
            assert row["num_draft"] in (4, 8)  # num_draft's default or its half
    spec = [row for row in r["strategies"] if row["name"] == "self_speculative"]
    assert all({"acceptance_rate", "draft_exit", "num_draft", "identical_to_full"} <= set(s) for s in spec)
    assert spec[0]["identical_to_full"] is True and spec[1]["identical_to_full"] is None
    assert r["notes"]["strategies"][0] == "2 test prompts of 8 characters, 12 more each, batch 1, 1 interleaved passes"
    cal = r["calibration"]
    assert {"measure", "epsilon", "delta", "threshold", "val", "test"} <= set(cal)
    assert {"disagreement", "loss", "full_loss", "accuracy", "compute_saved"} <= set(cal["test"])
    assert [e["threshold"] for e in r["sweep"]] == [
        t / 10 for t in range(10, -1, -1)]  # the table shows every tenth
    # each exit model's rules, chosen rule and oracle, the joint model's first
    models = [c["model"] for c in r["calibration_by_measure"]]
    assert models == [model for model in ("joint", "frozen", "continued") for _ in range(8)]
    rules = [c["measure"] for c in r["calibration_by_measure"]][:8]
    chosen = r["chosen_rule"]
    assert rules == ["top1", "margin", "entropy", "patience", "saturation", "learned", f"{chosen['measure']}, chosen",
                     "oracle"]
    notes = r["notes"]["calibration_by_measure"]
    assert notes[-2].startswith("frozen: the plain 3-layer GPT (") and notes[-1].startswith(
        "continued: a plain GPT for 1 steps (") and notes[-1].endswith(" s)")
    assert chosen["delta"] == pytest.approx(0.05 / 6) and chosen["measure"] in rules[:6]
    oracle = {c["model"]: c["test"]["compute_saved"] for c in r["calibration_by_measure"] if c["measure"] == "oracle"}
    for c in r["calibration_by_measure"]:  # over its own model's oracle
        assert c["test"]["oracle_share"] == pytest.approx(c["test"]["compute_saved"] / max(oracle[c["model"]], 1e-9))
    assert all({"first_ms", "gap_p50", "gap_p95", "gap_p99", "prompt_ms_p95"} <= set(row) for row in r["strategies"])
    shift = r["calibration"]["shift"]
    assert shift["held"] == (shift["disagreement"] <= r["calibration"]["epsilon"])


def test_default_run_tells_the_story_in_order(lab_runs):
    out = lab_runs(THREE_LAYERS)[0]
    order = ["parameters:", "--- full-depth sample", "--- early-exit sample", "per-layer exit statistics", "Layer 0:",
             "=== Which threshold?", "=== Which exit rule, with a guarantee",
             "=== Does the guarantee hold on text of another kind?",
             "What does each KV strategy buy?",
             "=== Average or tail", "=== When does early exit pay?", "On the frontier, greedy:"]
    positions = [out.index(o) for o in order]
    assert positions == sorted(positions)


def part_one_text():
    """The text of the file above the Part II banner, and the banner's line number."""
    import re

    lines = open(m.__file__).read().splitlines()
    part2 = next(i + 1 for i, l in enumerate(lines) if re.match(r"# Part II\b", l))
    assert lines[part2 - 2].startswith("# ====")
    return "\n".join(lines[: part2 - 2]) + "\n", part2


def test_part_one_is_within_5000_tokens_and_never_calls_forward():
    """Part I (the lesson) is at most 5,000 Python tokens and never names anything Part II defines."""
    import ast

    import io
    import tokenize

    src = open(m.__file__).read()
    text, part2 = part_one_text()
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT, tokenize.ENDMARKER}
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type not in skip]
    assert len(tokens) <= 5000, f"Part I is {len(tokens)} tokens"
    tree = ast.parse(src)
    later = {n.name if hasattr(n, "name") else n.targets[0].id for n in tree.body
             if n.lineno > part2 and isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Assign))}
    for node in tree.body:
        if node.lineno < part2:
            used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            assert not used & later, f"line {node.lineno} calls forward into Part II: {used & later}"
    part1 = {n.name for n in tree.body if n.lineno < part2 and hasattr(n, "name")}
    assert {"ExitHead", "GPT", "KVCache", "decode_step", "generate", "format_exit_stats", "train", "run_lesson"} <= part1


def test_the_text_above_the_part_ii_banner_is_what_the_docstring_says(tmp_path):
    """Run as a script of its own it defines the lesson and runs nothing (no output, status 0); imported, its
    run_lesson trains and samples (the next test): as the docstring and the README say."""
    import subprocess
    import sys

    text, _ = part_one_text()
    (tmp_path / "part_one.py").write_text(text)
    proc = subprocess.run([sys.executable, str(tmp_path / "part_one.py")], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    readme = " ".join(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().split())
    for told in (" ".join(m.__doc__.split()), readme):
        assert "imports alone, and its run_lesson is what --lesson_only runs" in told
        assert "when run" not in told and "run only the text above" not in told


def test_part_one_runs_alone(capsys, monkeypatch):
    """Only the text above the Part II banner, executed on its own: it trains, samples and prints the statistics."""
    import os
    import sys
    import types

    text, _ = part_one_text()
    module = types.ModuleType("part_one")  # a module of its own (dataclasses look their module up)
    monkeypatch.setitem(sys.modules, "part_one", module)
    exec(compile(text, "part_one", "exec"), module.__dict__)
    namespace = module.__dict__
    assert "LabConfig" not in namespace and "generate_speculative" not in namespace
    config = namespace["Config"](input_path=os.path.join(os.path.dirname(m.__file__), "input.txt"), n_layer=2,
                                 n_head=2, n_embd=16, block_size=16, batch_size=4, max_iters=3, eval_interval=2,
                                 eval_iters=1, max_new_tokens=30, exit_threshold=0.0)
    with torch.enable_grad():
        _, samples = namespace["run_lesson"](config, "cpu")
    out = capsys.readouterr().out
    for line in ("step 2: train loss", "step 3: train loss", "--- full-depth sample", "--- early-exit sample: backfill",
                 "per-layer exit statistics", "Layer 0:", "Layer 1 (full):", "mean exit depth"):
        assert line in out, line
    early, _ = samples["early-exit"]
    assert early.exited_at.shape == (1, 30) and (early.exited_at == 0).all(), "threshold 0: every token exits at 0"


def test_explicit_exit_layers_still_work(tmp_path):
    args = ["--n_layer=3", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4", "--eval_iters=1",
            "--max_iters=2", "--max_new_tokens=20", "--device=cpu", "--quality_positions=50", "--bench_tokens=20",
            "--bench_repeats=1", "--bench_prompts=2", "--bench_prompt_len=8", "--exit_layers=1",
            "--sweep_positions=500", f"--out_dir={tmp_path}"]
    assert m.main(args) == 0
    rows = json.loads((tmp_path / "report.json").read_text())["strategies"]
    per_token = [r for r in rows if r["name"] in KV_STRATEGIES and r["name"] != "skipdecode"]
    assert len(per_token) == 8 and all(r["exit_at"] == "1" for r in per_token)


def test_no_line_of_the_script_is_over_100_characters():
    lines = open(m.__file__, encoding="utf-8").read().splitlines()
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 100]
    assert not long, f"lines over 100 characters: {long[:10]}"


def test_the_readmes_token_figures_are_the_files():
    """The README's count of the script's Python tokens, whole and by Part, counted as the budget does:
    every token but comments, newlines and indentation, Part II from its banner, Part III from its;
    within the budget; and the README's count of mistakes."""
    import io
    import tokenize

    src = open(m.__file__, encoding="utf-8").read()
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT, tokenize.ENDMARKER}
    rows = [t.start[0] for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type not in skip]
    lines = src.splitlines()
    banners = [next(i + 1 for i, line in enumerate(lines) if re.match(rf"# Part {n}\b", line)) for n in ("II", "III")]
    parts = [sum(1 for r in rows if r < banners[0]), sum(1 for r in rows if banners[0] <= r < banners[1]),
             sum(1 for r in rows if r >= banners[1])]
    readme = " ".join(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().split())
    said = re.search(r"The script is ([\d,]+) Python tokens.*?Part I ([\d,]+), Part II ([\d,]+), Part III ([\d,]+)",
                     readme)
    assert said, "the README states the script's size"
    assert [int(n.replace(",", "")) for n in said.groups()] == [len(rows), *parts]
    assert len(rows) <= 23500 and parts[2] <= parts[1], "the budget: 23,500 in all, Part III <= Part II"
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from mistakes import MISTAKES  # and the README's count of plausible mistakes is the record's

    assert f"puts {len(MISTAKES)} plausible mistakes" in readme and f"all {len(MISTAKES)} are" in readme


def test_a_diverged_plain_gpt_stops_the_run_in_one_line():
    """A plain GPT (a smaller model, the draft model) whose weights turn to nan stops the run with the
    same one line as the exit model, before any table reads it; one at a sane rate trains."""
    data = torch.randint(0, 11, (3000,), generator=torch.Generator().manual_seed(0))
    splits = dict(zip(("train", "val", "test"), data.split(1000)))
    config = m.Config(n_layer=2, n_head=2, n_embd=16, block_size=8, batch_size=2, max_iters=4, eval_iters=1,
                      min_lr=0, warmup_iters=1, vocab_size=11)
    with pytest.raises(ValueError, match=r"^training diverged: val loss nan at step 4; lower --learning_rate$"):
        m.train_plain_gpt(m.replace(config, learning_rate=1e30), splits, 1)
    model, loss, _ = m.train_plain_gpt(config, splits, 1)
    assert math.isfinite(loss) and model.config.n_layer == 1
