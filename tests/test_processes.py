"""Training across processes (torchrun): the global batch, each rank's own batches and dropout masks,
the smaller models' batch, which rank writes, and the devices a rank may take."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, m, tiny_config
from test_robustness import TWO_STEPS

TINY = ["--n_layer=2", "--n_head=2", "--n_embd=16", "--block_size=16", "--eval_iters=1", "--max_new_tokens=20",
        "--device=cpu", "--draft_exit=0", "--quality_positions=48", "--bench_tokens=12", "--bench_repeats=1",
        "--bench_prompts=2", "--bench_prompt_len=8", "--sweep_positions=500"]


def test_two_processes_train_as_one_at_the_same_global_batch(tmp_path):
    """Two CPU processes (gloo) of batch 2 each, three steps: rank 0's weights are those of one process
    stepping on both ranks' batches at once (batch 4), as DistributedDataParallel averages the gradients."""
    args = TINY + ["--max_iters=3", "--eval_interval=100", "--batch_size=2", "--layer_dropout=0", "--warmup_iters=1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(ROOT, "nanogpt_exit_head.py"), *args, f"--out_dir={tmp_path}"],
                          capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "report.json").read_text())["processes"] == 2
    ddp = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    config = m.parse_args(args + [f"--input_path={ROOT}/input.txt", f"--out_dir={tmp_path / 'one'}"])[0]
    _, splits = m.load_data(config)
    torch.manual_seed(config.seed)
    model = m.RecipeGPT(config)
    optimizer = m.configure_optimizer(model, config)
    start = {name: value.clone() for name, value in model.state_dict().items()}
    ranks = [torch.Generator().manual_seed(config.seed + r) for r in range(2)]  # each rank's batches
    with torch.enable_grad():
        for it in range(3):
            for group in optimizer.param_groups:
                group["lr"] = m.get_lr(it, config)
            x, y = zip(*(m.get_batch(splits["train"], 16, 2, g, "cpu") for g in ranks))
            m.train_step(model, optimizer, torch.cat(x), torch.cat(y), config)
    for name, value in model.state_dict().items():
        assert torch.allclose(ddp[name], value, atol=1e-5), name
    assert any(not torch.allclose(ddp[name], start[name]) for name in ddp), "the weights moved"


def train_rank(tmp_path, rank, data, **fields):
    cfg = tiny_config(max_iters=1, eval_interval=100, batch_size=2, eval_iters=1, out_dir=str(tmp_path / str(rank)),
                      **fields)
    tok = m.CharTokenizer("abcdefghijk")
    return m.train_or_resume(cfg, tok, {"train": data, "val": data, "test": data}, "cpu", rank=rank, report={})


def test_each_process_draws_its_own_batches(tmp_path, monkeypatch):
    """Under torchrun, process r draws its batches from seed + r: the same rank repeats, another rank differs."""
    data, first = torch.randint(0, 11, (2000,)), []
    original = m.get_batch
    monkeypatch.setattr(m, "get_batch", lambda *a: first.append(original(*a)) or first[-1])
    for rank in (0, 1, 0):
        start = len(first)
        model = train_rank(tmp_path, rank, data)
        assert (model is None) == (rank > 0), "only rank 0 evaluates and writes"
        first[start + 1 :] = []  # keep the first batch of training; the rest are evaluation's
    assert torch.equal(first[0][0], first[2][0]) and not torch.equal(first[0][0], first[1][0])


def test_each_process_draws_its_own_dropout_masks():
    """Every process builds the same model from the seed; then each rank's random stream (layer dropout,
    dropout) is its own: rank 0's repeats, rank 1's differs from it."""
    cfg, tok = tiny_config(), m.CharTokenizer("abcdefghijk")
    built = {}
    for rank in (0, 1, 0):
        model = m.new_or_resumed(cfg, tok, "cpu", (), rank)[0]
        built.setdefault(rank, []).append((model.lm_head.weight.clone(), torch.rand(8)))
    (w0, r0), (w0b, r0b), (w1, r1) = built[0] + built[1]
    assert torch.equal(w0, w1) and torch.equal(w0, w0b), "the same model on every rank"
    assert torch.equal(r0, r0b) and not torch.equal(r0, r1), "each rank its own masks"


def test_a_resumed_process_draws_its_own_batches(tmp_path, monkeypatch):
    """Each process resumes its own batches: process 1, resumed from rank 0's checkpoint, draws what it
    would have drawn without the break (it trains alone here: rank 1 of a world of 1)."""
    data, drawn = torch.randint(0, 11, (2000,)), []
    original = m.get_batch
    monkeypatch.setattr(m, "get_batch", lambda *a: drawn.append(original(*a)) or drawn[-1])
    tok, splits = m.CharTokenizer("abcdefghijk"), {"train": data, "val": data, "test": data}

    def train(rank, max_iters, init_from, out):
        cfg = tiny_config(max_iters=max_iters, eval_interval=100, batch_size=2, eval_iters=1, init_from=init_from,
                          out_dir=str(tmp_path / out))
        start = len(drawn)
        m.train_or_resume(cfg, tok, splits, "cpu", {"max_iters"}, rank=rank, report={})
        return drawn[start:]

    whole = train(1, 4, "scratch", "whole")  # rank 1 neither evaluates nor saves: its draws are its batches
    train(0, 2, "scratch", "cut")
    resumed = train(1, 4, "resume", "cut")
    assert len(whole) == 4 and len(resumed) == 4  # two redrawn to catch up, then the two steps left
    assert all(torch.equal(a[0], b[0]) for a, b in zip(whole, resumed))


def test_the_smaller_models_train_at_the_main_models_global_batch(monkeypatch):
    """Two processes of batch_size 4 train the main model on 8 sequences a step: so do the plain GPTs,
    trained on rank 0 alone."""
    sizes, original = [], m.get_batch
    monkeypatch.setattr(m, "get_batch", lambda data, T, B, *a: sizes.append(B) or original(data, T, B, *a))
    data = torch.randint(0, 11, (2000,))
    m.train_plain_gpt(tiny_config(max_iters=2, batch_size=4, eval_iters=1), {"train": data, "val": data}, 2, world=2)
    assert sizes[:2] == [8, 8]


@pytest.fixture
def no_process_group(monkeypatch):
    """torchrun's environment without a process group: joining one is a failure of the test."""
    def join(*a, **k):
        raise AssertionError("init_process_group was called")
    monkeypatch.setattr(torch.distributed, "init_process_group", join)
    monkeypatch.setenv("LOCAL_RANK", "0")
    return monkeypatch


def test_sample_only_under_torchrun_runs_in_rank_0_alone(tmp_path, capsys, no_process_group, lab_runs):
    # a checkpoint to sample from: test_robustness's tiny run trained 2 steps (made once a session), copied
    lab_runs.copy_to(TWO_STEPS, tmp_path)
    no_process_group.setenv("RANK", "1")
    assert m.main(TINY + ["--init_from=resume", "--sample_only=1", f"--out_dir={tmp_path}"]) == 0
    assert capsys.readouterr() == ("", "") and not (tmp_path / "samples.json").exists()
    no_process_group.setenv("RANK", "0")
    assert m.main(TINY + ["--init_from=resume", "--sample_only=1", f"--out_dir={tmp_path}"]) == 0
    assert "early-exit sample" in capsys.readouterr().out and (tmp_path / "samples.json").exists()


def test_a_named_device_under_torchrun_is_honoured_or_refused(tmp_path, capsys, no_process_group):
    """Each process takes cuda:LOCAL_RANK (auto, cuda) or the CPU (cpu): another name is one line and
    status 2 before any process group is joined; cpu runs on gloo."""
    no_process_group.setenv("RANK", "0")
    for device in ("cuda:1", "mps"):
        assert m.main(TINY + [f"--device={device}", f"--out_dir={tmp_path}"]) == 2
        err = capsys.readouterr().err
        assert f"--device={device} under torchrun" in err and err.count("\n") == 1
    joined = []
    no_process_group.setattr(torch.distributed, "init_process_group", joined.append)
    no_process_group.setattr(torch.distributed, "get_rank", lambda: 0)
    no_process_group.setattr(torch.distributed, "get_world_size", lambda: 2)
    assert m.start_processes(m.LabConfig(device="cpu")) == (0, 2, "cpu") and joined == ["gloo"]


def test_auto_picks_cuda_then_the_cpu_never_mps(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert m.pick_device("auto") == "cpu" and m.pick_device("mps") == "mps"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert m.pick_device("auto") == "cuda"


def test_a_named_gpu_becomes_the_current_one(monkeypatch):
    """One process on --device=cuda:1: the timers' synchronize and the memory counters read the
    current GPU, so cuda:1 must be it."""
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert m.pick_device("cuda:1") == "cuda:1" and current == ["cuda:1"]
    assert m.pick_device("cuda") == "cuda" and m.pick_device("cpu") == "cpu" and current == ["cuda:1"]

