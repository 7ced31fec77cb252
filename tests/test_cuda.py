"""On a GPU: every path runs on CUDA with tiny configs, and decode steps agree with the CPU's.
Skipped where CUDA is not available:
run them on a GPU with `python -m pytest -q tests/test_cuda.py`."""

import copy
import json

import pytest
import torch

from conftest import KV_STRATEGIES, m, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TINY = ["--n_layer=3", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4", "--eval_iters=1",
        "--eval_interval=2", "--max_iters=4", "--max_new_tokens=20", "--device=cuda", "--quality_positions=192",
        "--bench_tokens=12", "--bench_repeats=1", "--bench_prompts=4", "--bench_prompt_len=8",
        "--sweep_positions=500"]


@pytest.mark.parametrize("study", [[], ["--continued=0.5"], ["--depths=all", "--confidence_measure=learned"]])
def test_the_default_run_and_every_study_on_cuda(tmp_path, study):
    with torch.enable_grad():
        assert m.main(TINY + study + [f"--out_dir={tmp_path}"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["device"] == "cuda" and report["strategies"]
    assert all(r["identical_to_full"] for r in report["strategies"]
               if r["name"] in ("self_speculative", "draft_model") and r["mode"] == "greedy")


def test_resume_and_sample_only_on_cuda(tmp_path):
    with torch.enable_grad():
        assert m.main(TINY + [f"--out_dir={tmp_path}"]) == 0
        assert m.main(TINY + ["--max_iters=6", "--init_from=resume", f"--out_dir={tmp_path}"]) == 0
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"] == 6
    assert m.main(TINY + ["--init_from=resume", "--sample_only=1", f"--out_dir={tmp_path}"]) == 0


@torch.no_grad()
def test_decode_steps_on_cuda_equal_the_cpus():
    model = tiny_model()
    gpu = copy.deepcopy(model).cuda()
    idx, forced = torch.randint(0, 11, (2, 3)), torch.randint(0, 11, (2, 20))
    for strategy in KV_STRATEGIES:
        checked = [3] * 6 + [1] * 10 if strategy == "skipdecode" else [0, 1, 2]  # skipdecode: a schedule
        kw = dict(strategy=KV_STRATEGIES[strategy], exit_threshold=0.6, checked_exits=checked)
        cpu = m.generate(model, idx, 20, forced=forced, **kw)
        cuda = m.generate(gpu, idx.cuda(), 20, forced=forced.cuda(), **kw)
        assert torch.allclose(cpu.logits, cuda.logits.cpu(), atol=1e-4), strategy
        assert torch.equal(cpu.exited_at, cuda.exited_at.cpu()), strategy
    spec = m.generate_speculative(gpu, idx.cuda(), 40, 0, 4)
    assert torch.equal(spec.tokens.cpu(), m.generate(model, idx, 40).tokens)
