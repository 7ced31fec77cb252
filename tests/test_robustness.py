"""Runs that survive: every bad input caught, checkpoints on every evaluation and on Ctrl-C, exact resume
with the checkpoint's recipe, safe loading, files never half written, the sample-only mode."""

import datetime
import json
import os
import re
import signal
import zipfile
from dataclasses import fields

import pytest
import torch

from conftest import m, tiny_config

TINY = ["--n_layer=2", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4", "--eval_iters=1",
        "--eval_interval=5", "--max_new_tokens=20", "--device=cpu", "--draft_exit=0", "--quality_positions=48",
        "--bench_tokens=12", "--bench_repeats=1", "--bench_prompts=2", "--bench_prompt_len=8", "--sweep_positions=500"]

# one bad value for every field a user can set
BAD_VALUES = {
    "out_dir": "FILE", "init_from": "restart", "input_path": "/nonexistent/input.txt", "seed": "-1",
    "device": "tpu", "compile": "maybe", "sample_only": "maybe", "lesson_only": "maybe", "n_layer": "1", "n_head": "0", "n_embd": "0",
    "block_size": "1", "dropout": "1.0", "bias": "maybe", "alpha": "-1",
    "distill_weight": "-0.1", "distill_temperature": "0", "layer_dropout": "1",
    "batch_size": "0", "max_iters": "-5", "learning_rate": "0", "min_lr": "-1", "warmup_iters": "-1",
    "weight_decay": "-0.1", "beta1": "1", "beta2": "-0.5", "grad_clip": "-1", "eval_interval": "0",
    "eval_iters": "0", "prompt": "", "max_new_tokens": "0", "temperature": "-1", "top_k": "-3",
    "exit_threshold": "1.5", "exit_layers": "7", "kv_strategy": "magic", "confidence_measure": "vibes",
    "draft_exit": "5", "num_draft": "0", "quality_positions": "0", "bench_prompts": "0",
    "bench_prompt_len": "0", "bench_tokens": "0", "bench_repeats": "0", "epsilon": "0", "delta": "1",
    "sweep_positions": "0", "depths": "1-3", "shift_path": "/nonexistent/shift.txt", "draft_layers": "0",
    "schedule_disagreement": "2", "continued": "1",
    "adapt_credit": "-1", "adapt_horizon": "0", "spot_share": "1.5",
}


def run_main(tmp_path, *args):
    return m.main(TINY + [f"--out_dir={tmp_path}"] + list(args))


def one_line_error(capsys, code, rc):
    err = capsys.readouterr().err
    assert rc == code, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_every_field_has_a_bad_value_in_the_table():
    assert set(BAD_VALUES) == {f.name for f in fields(m.LabConfig)} - {"vocab_size"}


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_every_field_rejects_a_bad_value(tmp_path, capsys, name):
    value = BAD_VALUES[name]
    if value == "FILE":
        value = str(tmp_path / "a_file")
        (tmp_path / "a_file").write_text("not a folder")
    rc = run_main(tmp_path / "out", f"--{name}={value}")
    err = one_line_error(capsys, 2, rc)
    assert name in err, "the line names the field"
    assert not (tmp_path / "out" / "ckpt.pt").exists()


def test_help_states_every_rule(capsys):
    assert m.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps help text at the terminal's width
    for rule, names in m.RANGES.items():
        for name in names.split():
            assert re.search(rf"--{name} .*? in {re.escape(rule)}", out), name
    for name, choices in m.CHOICES.items():
        assert f"one of {', '.join(choices)}" in out, name
    assert "[2, inf)" in out and "(0, 1)" in out and "[0, 1]" in out


@pytest.mark.parametrize("value,inside", [(0, False), (0.5, True), (1, True), (1.5, False), (float("nan"), False)])
def test_an_interval_keeps_or_leaves_out_its_ends(value, inside):
    assert m.in_range(value, "(0, 1]") == inside and m.in_range(value, "[0, inf)") == (value >= 0)


def test_the_commands_of_the_issue_end_in_one_line(tmp_path, capsys):
    for args in (["--n_head=0"], ["--top_k=-3"], ["--max_new_tokens=0"], ["--device=tpu"], ["--temperature=-1"],
                 ["--alpha=-1"]):
        one_line_error(capsys, 2, run_main(tmp_path, *args))


TWO_STEPS = TINY + ["--max_iters=2"]


def trained_checkpoint(lab_runs, tmp_path):
    """TINY's run trained 2 steps (made once a session: conftest's lab_runs), its ckpt.pt, report.json and
    report.html copied into tmp_path for the test to resume, break or read: the path of the checkpoint."""
    return lab_runs.copy_to(TWO_STEPS, tmp_path) / "ckpt.pt"


@pytest.mark.parametrize("args,ok", [
    (["--depths=1,2"], True), (["--depths=3"], False), (["--depths=0,1"], False),  # n_layer 2: 1, 2
    (["--draft_layers=1"], True), (["--draft_layers=2"], False),
    (["--lesson_only=1"], True), (["--lesson_only=1", "--confidence_measure=margin"], False),
    (["--lesson_only=1", "--kv_strategy=deferred"], False), (["--lesson_only=1", "--depths=1"], False),
    (["--lesson_only=1", "--continued=0.5"], False), (["--lesson_only=1", "--exit_layers=0"], False),
    (["--bench_tokens=2"], True), (["--bench_tokens=1"], False),  # one gap between two tokens
    (["--adapt_horizon=8301"], True), (["--adapt_horizon=8300"], False)])  # 0.01: 15 + 4 + 32 / 0.5
def test_the_rules_across_fields_hold_one_step_either_side(tmp_path, args, ok):
    argv = TINY + [f"--out_dir={tmp_path}", *args]
    if ok:
        m.parse_args(argv)
    else:
        with pytest.raises(ValueError):
            m.parse_args(argv)


def test_the_text_holds_a_prompt_and_a_quality_piece(tmp_path):
    """quality_pass cuts pieces of bench_prompt_len + bench_tokens characters spread over test (and the
    workload continues prompts as long): each split needs that and 2 more, one step either side."""
    smallest = min(map(len, m.split_data(open(m.Config.input_path, encoding="utf-8").read()).values()))
    tokens = smallest - 2 - 8  # TINY's bench_prompt_len is 8
    big = [f"--out_dir={tmp_path}", f"--quality_positions={smallest}"]
    m.parse_args(TINY + big + [f"--bench_tokens={tokens}"])
    with pytest.raises(ValueError, match="too short"):
        m.parse_args(TINY + big + [f"--bench_tokens={tokens + 1}"])


@pytest.mark.parametrize("continued,ok", [(0.05, False), (0.1, True), (0.9, True), (0.99, False)])
def test_continued_needs_a_step_in_each_stage(tmp_path, continued, ok):
    """Of 10 steps, 0.05 leaves the recipe none (the plain stage rounds to 10) and 0.99 the plain stage none."""
    argv = TINY + [f"--out_dir={tmp_path}", "--max_iters=10", f"--continued={continued}"]
    if ok:
        m.parse_args(argv)
    else:
        with pytest.raises(ValueError, match="--continued"):
            m.parse_args(argv)


@pytest.mark.parametrize("positions,ok", [(19, False), (20, True)])
def test_quality_positions_hold_a_piece(tmp_path, positions, ok):
    """At least bench_tokens (20 here) quality positions: a piece."""
    argv = TINY + [f"--out_dir={tmp_path}", "--bench_tokens=20", f"--quality_positions={positions}"]
    if ok:
        m.parse_args(argv)
    else:
        with pytest.raises(ValueError, match="--quality_positions"):
            m.parse_args(argv)

def test_a_resume_checks_the_rules_again_with_the_checkpoints_architecture(tmp_path, capsys, lab_runs):
    """--draft_exit=1 fits the default 6 layers, not the checkpoint's 2: said in one line, before training."""
    trained_checkpoint(lab_runs, tmp_path)
    argv = [a for a in TINY if not a.startswith(("--n_layer", "--draft_exit"))]
    rc = m.main(argv + [f"--out_dir={tmp_path}", "--init_from=resume", "--draft_exit=1", "--max_iters=4"])
    assert "draft_exit=1" in one_line_error(capsys, 2, rc)
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"] == 2


def test_a_resume_checks_its_rules_against_the_checkpoints_depth_not_the_default(tmp_path):
    """An 8-layer checkpoint resumed without --n_layer: --draft_exit=6 is outside the default 6 layers,
    inside the checkpoint's 8."""
    argv = [a for a in TINY if not a.startswith(("--n_layer", "--draft_exit"))] + [f"--out_dir={tmp_path}"]
    from test_cli import train_only
    train_only(tmp_path, "--n_layer=8", "--max_iters=1")
    config, overridden = m.parse_args(argv + ["--init_from=resume", "--draft_exit=6"])
    m.new_or_resumed(config, m.load_data(config)[0], "cpu", overridden)
    assert (config.n_layer, config.draft_exit) == (8, 6)
    with pytest.raises(ValueError, match="draft_exit=7"):  # the checkpoint's depth still bounds it
        config, overridden = m.parse_args(argv + ["--init_from=resume", "--draft_exit=7"])
        m.new_or_resumed(config, m.load_data(config)[0], "cpu", overridden)


def test_a_resume_trains_with_the_recipes_weight_decay_and_betas_fused(tmp_path, lab_runs):
    """Loading the optimizer's state brings back the hyperparameters it was saved with: the recipe's,
    given anew or not, must be the ones it steps with, fused even from a checkpoint saved unfused."""
    path = trained_checkpoint(lab_runs, tmp_path)
    ckpt = torch.load(path, weights_only=True)
    for group in ckpt["optimizer"]["param_groups"]:
        group["fused"] = None  # as a checkpoint written before the optimizer was fused holds it
    torch.save(ckpt, path)
    config, overridden = m.parse_args(TINY + [f"--out_dir={tmp_path}", "--init_from=resume", "--weight_decay=0.5",
                                              "--beta2=0.9"])
    tokenizer, _ = m.load_data(config)
    optimizer = m.new_or_resumed(config, tokenizer, "cpu", overridden)[1]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.5, 0.0]  # matrices, then the rest
    assert all(g["betas"] == (config.beta1, 0.9) and g["fused"] for g in optimizer.param_groups)


def test_broken_checkpoints_end_in_one_line(tmp_path, capsys, lab_runs):
    ckpt = trained_checkpoint(lab_runs, tmp_path)
    good = ckpt.read_bytes()
    cases = {"truncated": good[: len(good) // 2], "corrupt": b"\x00garbage" * 200, "text": b"hello world" * 100}
    for name, data in cases.items():
        ckpt.write_bytes(data)
        capsys.readouterr()
        err = one_line_error(capsys, 2, run_main(tmp_path, "--init_from=resume"))
        assert "no readable checkpoint" in err, name
    with zipfile.ZipFile(ckpt, "w") as z:  # a zip, but not one torch.save wrote
        z.writestr("hello.txt", "hi")
    assert "not a readable checkpoint" in one_line_error(capsys, 2, run_main(tmp_path, "--init_from=resume"))
    torch.save({"when": datetime.date(2020, 1, 1)}, ckpt)  # an object, not data: weights_only refuses it
    assert "UnpicklingError" in one_line_error(capsys, 2, run_main(tmp_path, "--init_from=resume"))
    torch.save({"weights": torch.zeros(3)}, ckpt)
    assert "not a checkpoint of this script" in one_line_error(capsys, 2, run_main(tmp_path, "--init_from=resume"))


def test_checkpoint_loads_with_weights_only(tmp_path, lab_runs):
    ckpt = torch.load(trained_checkpoint(lab_runs, tmp_path), weights_only=True)
    assert m.CHECKPOINT_KEYS <= set(ckpt) and ckpt["rng"]["cuda"] == []  # no GPU state on the CPU
    assert ckpt["rng"]["torch"].dtype == torch.uint8 and ckpt["iter_num"] == 2


def test_bad_files_end_in_one_line(tmp_path, capsys):
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"First line\nsecond caf\xe9 line\n" * 50)
    err = one_line_error(capsys, 2, run_main(tmp_path / "o1", f"--input_path={latin}"))
    assert "can't decode byte 0xe9 in position 21" in err  # 11 + 10 bytes before it
    short = tmp_path / "short.txt"
    short.write_text("abcdefghi\n" * 20)  # 200 characters: val and test get 10 each
    assert "too short" in one_line_error(capsys, 2, run_main(tmp_path / "o2", f"--input_path={short}"))
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert "cannot be a folder" in one_line_error(capsys, 2, run_main(a_file))


def test_a_folder_the_run_cannot_write_in_is_one_line_before_training(tmp_path, capsys, monkeypatch):
    """An existing out_dir that refuses a file (read-only: root writes anywhere, so the refusal is
    staged) is said at the start, not when the first checkpoint is saved minutes in."""
    def refuse(dir):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(m.tempfile, "TemporaryFile", refuse)
    err = one_line_error(capsys, 2, run_main(tmp_path))
    assert "cannot be a folder: Permission denied" in err and not any(tmp_path.iterdir())


def test_a_large_block_size_runs(tmp_path):
    assert run_main(tmp_path, "--max_iters=1", "--block_size=2000", "--quality_positions=30", "--sweep_positions=100",
                    "--max_new_tokens=5") == 0


def tiny_run(tmp_path, **fields):
    """A config for train_or_resume: the tiny model on input.txt, the joint-loss recipe."""
    return tiny_config(max_iters=30, eval_interval=10, batch_size=2, eval_iters=1, layer_dropout=0.1,
                       out_dir=str(tmp_path), **fields)


def train_tiny(config, splits, tokenizer, overridden=()):
    report = {}
    m.train_or_resume(config, tokenizer, splits, "cpu", overridden, report=report)
    return report


@pytest.fixture(scope="module")
def text():
    """The first 100,000 characters of input.txt: a tokenizer and the three splits."""
    with open(os.path.join(os.path.dirname(m.__file__), "input.txt"), encoding="utf-8") as f:
        chars = f.read()[:100_000]
    tokenizer = m.CharTokenizer(chars)
    return tokenizer, m.split_data(torch.tensor(tokenizer.encode(chars)))


def interrupting(monkeypatch, at_step, signal_it=True):
    """train_step that, during step at_step, sends Ctrl-C (or crashes, as a killed run would)."""
    steps, original = [], m.train_step

    def step(*a, **k):
        steps.append(1)
        if len(steps) == at_step + 1:
            if not signal_it:
                raise RuntimeError("the machine went away")
            os.kill(os.getpid(), signal.SIGINT)
        return original(*a, **k)
    monkeypatch.setattr(m, "train_step", step)


@pytest.mark.parametrize("at_step,saved_at", [(9, 10), (15, 16)])  # stopping at an evaluation step, and mid-interval
def test_ctrl_c_saves_and_resume_repeats_the_uninterrupted_run(tmp_path, monkeypatch, text, at_step, saved_at):
    """Ctrl-C lets the step under way finish, then saves and stops; resuming logs every loss and evaluation
    of the uninterrupted run, bit for bit, and none twice (the evaluation at step 10 too)."""
    tokenizer, splits = text
    torch.manual_seed(0)
    vocab = dict(vocab_size=tokenizer.vocab_size)
    whole = train_tiny(tiny_run(tmp_path / "whole", **vocab), splits, tokenizer)
    interrupting(monkeypatch, at_step)
    with pytest.raises(m.Interrupted):
        train_tiny(tiny_run(tmp_path / "cut", **vocab), splits, tokenizer)
    assert torch.load(tmp_path / "cut" / "ckpt.pt", weights_only=True)["iter_num"] == saved_at
    monkeypatch.undo()
    resumed = train_tiny(tiny_run(tmp_path / "cut", init_from="resume", **vocab), splits, tokenizer)
    assert [e["iter"] for e in whole["train_log"] if "val_loss" in e] == [10, 20]
    assert resumed["train_log"] == whole["train_log"] and resumed["val_loss"] == whole["val_loss"]


def test_a_crashed_run_resumes_from_its_last_periodic_checkpoint(tmp_path, monkeypatch, text):
    tokenizer, splits = text
    vocab = dict(vocab_size=tokenizer.vocab_size)
    whole = train_tiny(tiny_run(tmp_path / "whole", **vocab), splits, tokenizer)
    interrupting(monkeypatch, 25, signal_it=False)
    with pytest.raises(RuntimeError):
        train_tiny(tiny_run(tmp_path / "cut", **vocab), splits, tokenizer)
    assert torch.load(tmp_path / "cut" / "ckpt.pt", weights_only=True)["iter_num"] == 20  # written at step 20
    monkeypatch.undo()
    resumed = train_tiny(tiny_run(tmp_path / "cut", init_from="resume", **vocab), splits, tokenizer)
    assert resumed["train_log"] == whole["train_log"] and resumed["val_loss"] == whole["val_loss"]


def test_a_checkpoint_is_written_at_every_evaluation(tmp_path, monkeypatch):
    seen = []
    original = m.save_checkpoint
    monkeypatch.setattr(m, "save_checkpoint", lambda *a: (seen.append(a[4]["iter_num"]), original(*a)))
    assert run_main(tmp_path, "--max_iters=12") == 0
    assert seen == [5, 10, 12]  # evaluations at 5 and 10, then the end


def test_a_resume_keeps_the_checkpoints_recipe_and_names_what_the_command_line_changes(tmp_path, capsys):
    """Without the original flags a resume trains on with the recipe it started with; a flag given anew
    wins, and the run says so."""
    from test_cli import train_only

    train_only(tmp_path, "--max_iters=2", "--learning_rate=0.001", "--layer_dropout=0.3", "--seed=7")
    capsys.readouterr()
    config = train_only(tmp_path, "--init_from=resume", "--max_iters=4")["config"]
    assert (config["learning_rate"], config["layer_dropout"], config["seed"], config["max_iters"]) == (0.001, 0.3, 7, 4)
    assert "resumed with the checkpoint's recipe but --max_iters=4 (the checkpoint's: 2)" in capsys.readouterr().out
    config = train_only(tmp_path, "--init_from=resume", "--max_iters=4", "--learning_rate=0.0005")["config"]
    assert "but --learning_rate=0.0005 (the checkpoint's: 0.001)" in capsys.readouterr().out
    assert config["learning_rate"] == 0.0005


def test_sample_only_prints_the_samples_and_nothing_else(tmp_path, capsys, lab_runs):
    trained_checkpoint(lab_runs, tmp_path)
    capsys.readouterr()
    before = (tmp_path / "report.json").read_text(), (tmp_path / "report.html").read_text()
    assert run_main(tmp_path, "--init_from=resume", "--sample_only=1", "--prompt=ab", "--max_new_tokens=30") == 0
    assert ((tmp_path / "report.json").read_text(), (tmp_path / "report.html").read_text()) == before
    out = capsys.readouterr().out
    assert "early-exit sample" in out and "Layer 0:" in out and "mean exit depth" in out
    assert "full-depth sample" in out  # the lesson's two samples, from the checkpoint
    assert "=== Which threshold?" not in out and "KV strategy buy" not in out and "training" not in out
    html = (tmp_path / "samples.html").read_text()  # a page of the samples alone; the trained run's is left alone
    assert "What does early exit look like?" in html and "Which threshold?" not in html
    assert json.loads((tmp_path / "samples.json").read_text())["generation"]["sample"]
    assert run_main(tmp_path, "--sample_only=1") == 2  # it needs a checkpoint to sample from


def test_a_page_that_fails_to_render_writes_neither_file(tmp_path, monkeypatch):
    """report.json and report.html are a pair: a page that cannot be made leaves no report.json
    without it."""
    def broken(report):
        raise KeyError("strategies")
    monkeypatch.setattr(m, "html_report", broken)
    with pytest.raises(KeyError):
        m.write_report({"summary": []}, m.LabConfig(out_dir=str(tmp_path)), "report")
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_fails_leaves_the_old_file_whole(tmp_path, monkeypatch, lab_runs):
    """Never a half-written file: a report, a page or a checkpoint whose write fails midway leaves the
    previous one as it was."""
    path = tmp_path / "report.json"
    m.write_text(json.dumps({"old": 1}), str(path))
    real = m.Path.write_text

    def half(self, text, **kw):  # the disk fills up halfway
        real(self, text[: len(text) // 2], **kw)
        raise OSError("No space left on device")
    monkeypatch.setattr(m.Path, "write_text", half)
    with pytest.raises(OSError):
        m.write_text(json.dumps({"new": 2}), str(path))
    assert json.loads(path.read_text()) == {"old": 1}
    monkeypatch.undo()
    ckpt = trained_checkpoint(lab_runs, tmp_path / "run")
    good = ckpt.read_bytes()

    def broken_save(obj, f):
        open(f, "wb").write(b"PK half a zip")
        raise OSError("No space left on device")
    model = m.GPT(tiny_config(n_layer=2, vocab_size=11))
    monkeypatch.setattr(m.torch, "save", broken_save)
    with pytest.raises(OSError):
        m.save_checkpoint(str(ckpt), model, m.configure_optimizer(model, model.config), model.config,
                          {"vocab": "", "iter_num": 0, "train_seconds": 0.0, "train_log": []})
    assert ckpt.read_bytes() == good


def test_synchronize_waits_for_mps(monkeypatch):
    """Timings on Apple's GPU read finished work only if the timer waits for it."""
    calls = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("cuda"))
    for device in ("mps", "cpu", "cuda:0"):
        m.synchronize(device)
    assert calls == ["mps", "cuda"]


def test_a_checkpoint_keeps_every_gpus_random_state(tmp_path, monkeypatch):
    """Layer dropout on a GPU draws from the CUDA generators: their states go into the checkpoint and come
    back on resume, so resume is exact there too (no GPU here: torch.cuda's state functions are stand-ins)."""
    states, restored = [torch.arange(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)], []
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    torch.save(m.random_states(), tmp_path / "rng.pt")
    m.set_random_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert len(restored) == 1 and all(torch.equal(a, b) for a, b in zip(restored[0], states))


def test_a_resumed_run_draws_the_batches_it_would_have_drawn(tmp_path, monkeypatch):
    """A run cut after 2 of 4 steps and resumed redraws the 2 batches done (to catch up), then draws the 2
    the whole run drew for its last steps."""
    data, drawn = torch.randint(0, 11, (2000,)), []
    original = m.get_batch
    monkeypatch.setattr(m, "get_batch", lambda *a: drawn.append(original(*a)) or drawn[-1])
    monkeypatch.setattr(m, "estimate_loss", lambda model, splits, config, device: {  # draws no batch
        s: [2.0] * config.n_layer for s in ("train", "val")})
    tok, splits = m.CharTokenizer("abcdefghijk"), {"train": data, "val": data, "test": data}

    def train(max_iters, init_from, out):
        cfg = tiny_config(max_iters=max_iters, eval_interval=100, batch_size=2, eval_iters=1, init_from=init_from,
                          out_dir=str(tmp_path / out))
        start = len(drawn)
        m.train_or_resume(cfg, tok, splits, "cpu", {"max_iters"}, report={})
        return drawn[start:]

    whole = train(4, "scratch", "whole")
    train(2, "scratch", "cut")
    resumed = train(4, "resume", "cut")
    assert len(whole) == 4 and len(resumed) == 4  # two redrawn to catch up, then the two steps left
    assert all(torch.equal(a[0], b[0]) for a, b in zip(whole, resumed))


def test_auto_picks_cuda_then_the_cpu_never_mps(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert m.pick_device("auto") == "cpu" and m.pick_device("mps") == "mps"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert m.pick_device("auto") == "cuda"


def test_a_named_gpu_becomes_the_current_one(monkeypatch):
    """On --device=cuda:1 the timers' synchronize and the memory counters read the current GPU, so cuda:1
    must be it."""
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert m.pick_device("cuda:1") == "cuda:1" and current == ["cuda:1"]
    assert m.pick_device("cuda") == "cuda" and m.pick_device("cpu") == "cpu" and current == ["cuda:1"]
