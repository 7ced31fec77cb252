"""Runs that survive: every bad input caught, checkpoints on every evaluation and on Ctrl-C, exact resume,
safe loading, the sample-only mode, and training across processes with torchrun."""

import datetime
import json
import os
import signal
import subprocess
import sys
import zipfile
from dataclasses import fields

import pytest
import torch

from conftest import ROOT, m

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
    "sweep_positions": "0", "compare_depths": "maybe", "shift_path": "/nonexistent/shift.txt",
    "bench_batch": "maybe", "schedule_disagreement": "2",
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
    assert name in err or "vocabulary" in err
    assert not (tmp_path / "out" / "ckpt.pt").exists()


def test_help_states_every_rule(capsys):
    assert m.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps help text at the terminal's width
    for rule, names in m.RANGES.items():
        for name in names:
            assert f"--{name} " in out and f"in {rule}" in out, name
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


def trained_checkpoint(tmp_path):
    assert run_main(tmp_path, "--max_iters=2") == 0
    return tmp_path / "ckpt.pt"


def test_broken_checkpoints_end_in_one_line(tmp_path, capsys):
    ckpt = trained_checkpoint(tmp_path)
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


def test_checkpoint_loads_with_weights_only(tmp_path):
    ckpt = torch.load(trained_checkpoint(tmp_path), weights_only=True)
    assert m.CHECKPOINT_KEYS <= set(ckpt) and set(ckpt["rng"]) == {"torch"}  # no GPU state on the CPU


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


def test_a_large_block_size_runs(tmp_path):
    assert run_main(tmp_path, "--max_iters=1", "--block_size=2000", "--quality_positions=30", "--sweep_positions=100",
                    "--max_new_tokens=5") == 0


def test_ctrl_c_saves_and_resume_repeats_the_uninterrupted_run(tmp_path, monkeypatch, capsys):
    args = ["--max_iters=30", "--eval_interval=10"]
    assert run_main(tmp_path / "whole", *args) == 0
    whole = json.loads((tmp_path / "whole" / "report.json").read_text())
    steps = []
    original = m.train_step

    def interrupting(*a, **k):
        steps.append(1)
        if len(steps) == 16:  # Ctrl-C during step 15
            os.kill(os.getpid(), signal.SIGINT)
        return original(*a, **k)

    monkeypatch.setattr(m, "train_step", interrupting)
    capsys.readouterr()
    assert run_main(tmp_path / "cut", *args) == 130
    assert "continue with --init_from=resume" in capsys.readouterr().err
    saved = torch.load(tmp_path / "cut" / "ckpt.pt", weights_only=True)
    assert saved["iter_num"] == 16  # step 15 finished, then the loop stopped
    monkeypatch.setattr(m, "train_step", original)
    assert run_main(tmp_path / "cut", *args, "--init_from=resume") == 0
    resumed = json.loads((tmp_path / "cut" / "report.json").read_text())
    assert resumed["train_log"] == whole["train_log"]  # every logged loss, bit for bit
    assert [e["iter"] for e in whole["train_log"] if "val_loss" in e] == [10, 20]
    assert resumed["val_loss"] == whole["val_loss"]


def test_a_checkpoint_is_written_at_every_evaluation(tmp_path, monkeypatch):
    seen = []
    original = m.save_checkpoint
    monkeypatch.setattr(m, "save_checkpoint", lambda *a: (seen.append(a[4]["iter_num"]), original(*a)))
    assert run_main(tmp_path, "--max_iters=12") == 0
    assert seen == [5, 10, 12]  # evaluations at 5 and 10, then the end


def test_sample_only_prints_the_samples_and_nothing_else(tmp_path, capsys):
    trained_checkpoint(tmp_path)
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


def test_torchrun_two_processes(tmp_path):
    """Two CPU processes (gloo): rank 0 writes the checkpoint; its first loss is the one-process run's."""
    args = TINY + ["--max_iters=3", "--eval_interval=100"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(ROOT, "nanogpt_exit_head.py"), *args, f"--out_dir={tmp_path / 'ddp'}"],
                          capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ddp = json.loads((tmp_path / "ddp" / "report.json").read_text())
    assert (tmp_path / "ddp" / "ckpt.pt").exists() and ddp["processes"] == 2
    assert m.main(args + [f"--out_dir={tmp_path / 'one'}"]) == 0
    one = json.loads((tmp_path / "one" / "report.json").read_text())
    assert ddp["train_log"][0] == one["train_log"][0]  # step 0: the same weights on the same batch
    assert ddp["train_log"][0]["iter"] == 0


def test_each_process_draws_its_own_batches(tmp_path, monkeypatch):
    """Under torchrun, process r draws its batches from seed + r: the same rank repeats, another rank differs."""
    from conftest import tiny_config

    data, first = torch.randint(0, 11, (2000,)), []
    original = m.get_batch
    monkeypatch.setattr(m, "get_batch", lambda *a: first.append(original(*a)) or first[-1])
    tok = m.CharTokenizer("abcdefghijk")
    for rank in (0, 1, 0):
        torch.manual_seed(0)
        cfg = tiny_config(max_iters=1, eval_interval=100, batch_size=2, eval_iters=1, out_dir=str(tmp_path / str(rank)))
        start = len(first)
        model = m.train_or_resume(cfg, tok, {"train": data, "val": data, "test": data}, "cpu", rank=rank, report={})
        assert (model is None) == (rank > 0), "only rank 0 evaluates and writes"
        first[start + 1 :] = []  # keep the first batch of training; the rest are evaluation's
    assert torch.equal(first[0][0], first[2][0]) and not torch.equal(first[0][0], first[1][0])


def test_a_resumed_process_draws_its_own_batches(tmp_path, monkeypatch):
    """Under torchrun each process resumes its own batches: process 1, resumed from rank 0's checkpoint, draws
    what it would have drawn without the break (it trains alone here: rank 1 of a world of 1)."""
    from conftest import tiny_config

    data, drawn = torch.randint(0, 11, (2000,)), []
    original = m.get_batch
    monkeypatch.setattr(m, "get_batch", lambda *a: drawn.append(original(*a)) or drawn[-1])
    tok, splits = m.CharTokenizer("abcdefghijk"), {"train": data, "val": data, "test": data}

    def train(rank, max_iters, init_from, out):
        torch.manual_seed(0)
        cfg = tiny_config(max_iters=max_iters, eval_interval=100, batch_size=2, eval_iters=1, init_from=init_from,
                          out_dir=str(tmp_path / out))
        start = len(drawn)
        m.train_or_resume(cfg, tok, splits, "cpu", rank=rank, report={})
        return drawn[start:]

    whole = train(1, 4, "scratch", "whole")  # rank 1 neither evaluates nor saves: its draws are its batches
    train(0, 2, "scratch", "cut")
    resumed = train(1, 4, "resume", "cut")
    assert len(whole) == 4 and all(torch.equal(a[0], b[0]) for a, b in zip(whole[2:], resumed[-2:]))


def test_auto_picks_cuda_then_the_cpu_never_mps(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert m.pick_device("auto") == "cpu" and m.pick_device("mps") == "mps"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert m.pick_device("auto") == "cuda"


def test_synchronize_waits_for_mps(monkeypatch):
    """Timings on Apple's GPU read finished work only if the timer waits for it."""
    calls = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("cuda"))
    for device in ("mps", "cpu", "cuda:0"):
        m.synchronize(device)
    assert calls == ["mps", "cuda"]


def test_a_checkpoint_keeps_the_gpu_random_state(tmp_path, monkeypatch):
    """Layer dropout on a GPU draws from the CUDA generator: its state goes into the checkpoint and comes back on
    resume, so resume is exact there too (no GPU here: torch.cuda's state functions are stand-ins)."""
    state, restored = torch.arange(16, dtype=torch.uint8), []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda new, device="cuda": restored.append((new, device)))
    saved = m.random_states("cuda:0")
    torch.save(saved, tmp_path / "rng.pt")
    m.set_random_states(torch.load(tmp_path / "rng.pt", weights_only=True), "cuda:0")
    assert torch.equal(restored[0][0], state) and restored[0][1] == "cuda:0"
    assert "cuda" not in m.random_states("cpu")
