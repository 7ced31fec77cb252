"""Batches: per-row cache lengths, batched self-speculative decoding, and the two per-token batch designs."""

import copy
from functools import partial
import json

import pytest
import torch

from conftest import generate_with_cache, m, tiny_model

pytestmark = pytest.mark.usefixtures("no_grad")


def test_batched_greedy_speculation_equals_every_row_alone(trained, monkeypatch):
    """8 rows of different text: they accept different lengths and slide their windows at different rounds."""
    model, data = copy.deepcopy(trained[0]), trained[1]
    with torch.no_grad():  # a noisier draft head: rows reject drafts often, and at different places
        head = model.exit_heads[0].lm_head.weight
        head.add_(0.3 * torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
    groups = []
    original = m.prefill_rows

    def recording(model_, cache, tokens, rows, starts, n):
        groups.append(len(rows))
        return original(model_, cache, tokens, rows, starts, n)

    monkeypatch.setattr(m, "prefill_rows", recording)
    left, keep_rows = [], m.RowKVCache.keep_rows
    monkeypatch.setattr(m.RowKVCache, "keep_rows", lambda self, keep: left.append(int(keep.sum())) or keep_rows(self, keep))
    idx = torch.stack([data[2500 * b : 2500 * b + 5] for b in range(8)])
    out = m.generate_self_speculative(model, idx, 100, 0, 4, temperature=0.0)  # 100 > 3 windows of 32
    for b in range(8):
        alone = m.generate(model, idx[b : b + 1], 100, temperature=0.0)
        assert torch.equal(out.tokens[b], alone.tokens[0]), f"row {b}"
        spec = m.generate_self_speculative(model, idx[b : b + 1], 100, 0, 4, temperature=0.0)
        assert torch.equal(out.exited_at[b], spec.exited_at[0]), f"row {b}: which tokens were drafts"
    drafted_kept = (out.exited_at == 0).sum(1)  # per row: drafts accepted
    assert len(set(drafted_kept.tolist())) > 1, "rows should accept different numbers of drafts"
    assert groups[0] == 8 and min(groups[1:]) < 8, "rows should slide their windows at different rounds"
    assert left[-1] == 0 and max(left) > 0, "rows that are done should leave while others decode on"
    assert 0.1 < out.stats["accepted"] / out.stats["drafted"] < 0.5


@pytest.mark.parametrize("top_k", [0, 3])
def test_batched_sampled_speculation_has_the_full_model_distribution(top_k):
    model = tiny_model(n_layer=3)
    with torch.no_grad():
        model.lm_head.weight.div_(10)  # a flatter final head, so top_k changes the distribution
    idx, V = torch.tensor([[3, 1, 4]]), 11
    dist = lambda ctx: m.probs_from_logits(model(ctx)[0][0, -1], 1.0, top_k)  # noqa: E731
    probs1 = dist(idx)
    joint = torch.stack([probs1[a] * dist(torch.cat([idx, torch.tensor([[a]])], 1)) for a in range(V)])
    gen, counts = torch.Generator().manual_seed(0), torch.zeros(V, V)
    for _ in range(400):  # 400 batches of 8 rows
        out = m.generate_self_speculative(model, idx.repeat(8, 1), 2, 0, 2, 1.0, top_k, gen)
        for a, b in out.tokens[:, 3:].tolist():
            counts[a, b] += 1
    emp = counts / counts.sum()
    assert 0.5 * (emp.sum(1) - joint.sum(1)).abs().sum() < 0.04
    assert 0.5 * (emp - joint).abs().sum() < 0.1
    assert emp[joint == 0].sum() == 0


def test_skipdecode_reads_no_hole_and_emits_the_scheduled_exit():
    """A depth that never rises along the window: every token's logits are its scheduled exit head's,
    computed with the full context at every layer it runs (as the uncached model computes them)."""
    model = tiny_model()
    schedule = [3] * 4 + [2] * 4 + [1] * 4 + [0] * 4  # block_size 16
    forced = torch.randint(0, 11, (3, 15), generator=torch.Generator().manual_seed(3))
    idx = torch.zeros(3, 1, dtype=torch.long)
    out, cache, _ = generate_with_cache(model, idx, 15, partial(m.SkipDecode, schedule), exit_threshold=0.0,
                                        forced=forced)
    assert out.exited_at[0].tolist() == schedule[:15]
    full = model.all_exit_logits(out.tokens[:, :15])  # (L, B, T, V): one window, no re-prefill
    for i in range(15):
        assert torch.allclose(out.logits[:, i], full[schedule[i], :, i], atol=1e-5), f"position {i}"
    # layer l holds exactly the positions whose scheduled depth reaches it
    assert cache.lengths == [sum(e >= l for e in schedule[:15]) for l in range(4)]


def test_choose_schedule_keeps_its_budget_and_never_rises():
    torch.manual_seed(0)
    N, L = 400, 4
    conf = torch.rand(L, N)
    pred = torch.randint(0, 3, (L, N))
    records = m.ExitRecords({"top1": conf}, pred, torch.rand(L, N), torch.randint(0, 3, (N,)))
    for budget in (0.0, 0.2, 0.6):
        s = m.choose_schedule(records, L, 16, budget)
        assert s["disagreement"] <= budget
        assert all(a >= b for a, b in zip(s["schedule"], s["schedule"][1:])), "the depth must never rise"
    assert m.choose_schedule(records, L, 16, 0.0)["compute_saved"] < m.choose_schedule(records, L, 16, 0.6)["compute_saved"]


def test_batch_table_in_the_report(tmp_path, capsys):
    args = ["--n_layer=3", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4", "--eval_iters=1",
            "--max_iters=2", "--max_new_tokens=10", "--device=cpu", "--quality_positions=48", "--bench_tokens=12",
            "--bench_repeats=1", "--bench_prompts=4", "--bench_prompt_len=8", "--bench_batch=1", "--sweep_positions=500",
            f"--out_dir={tmp_path}"]
    with torch.enable_grad():
        assert m.main(args) == 0
    assert "Does early exit still save in a batch?" in capsys.readouterr().out
    batched = json.loads((tmp_path / "report.json").read_text())["batched"]
    rows = batched["entries"]
    assert {(r["batch_size"], r["mode"], r["name"]) for r in rows} == {
        (b, mode, n) for b in (1, 4) for mode in ("greedy", "sampled") for n in m.BATCH_DESIGNS}
    keys = {"batch_size", "name", "mode", "tokens_per_second", "speedup", "agreement"}
    assert all(keys <= set(r) for r in rows)
    assert all(r["identical_to_full"] is True for r in rows if r["name"] in m.SPECULATIVE and r["mode"] == "greedy")
    assert all(r["predicted_speedup"] > 0 for r in rows), "every measured speed has a prediction beside it"
    for r in rows:
        chosen = batched["drafts"][str(r["batch_size"])]
        if r["name"] == "self_speculative":
            assert r["num_draft"] == chosen["num_draft"][r["mode"]]  # the k that ran is the one chosen on val
        if r["name"] == "auto":
            k = chosen["auto"][r["mode"]]
            assert r["choice"] == ("full depth" if k is None else f"k={k}")
            assert r.get("num_draft") == k


def test_auto_runs_the_fastest_draft_on_val_or_full_depth(trained, monkeypatch):
    model, data = trained
    config = copy.copy(model.config)
    config.bench_tokens, config.bench_repeats = 12, 1
    prompts = m.workload(data[:5000], 4, 8)
    entries = m.speculation_costs(model, prompts, config, 2, [(0, 2), (0, 5)])
    assert {(e["mode"], e["num_draft"]) for e in entries} == {(mode, k) for mode in m.MODES for k in (2, 5)}
    for e in entries:  # a round's time over the tokens it emits, against full depth's time per token
        assert e["tokens_per_verify"] > 2 and e["ms_per_round"] > 0 and e["speedup"] > 0
    fake = [{"mode": "greedy", "num_draft": 2, "speedup": 1.3}, {"mode": "greedy", "num_draft": 5, "speedup": 1.6},
            {"mode": "sampled", "num_draft": 2, "speedup": 0.9}, {"mode": "sampled", "num_draft": 5, "speedup": 0.7}]
    drafts, auto = m.choose_drafts(fake)
    assert drafts == {"greedy": 5, "sampled": 2} and auto == {"greedy": 5, "sampled": None}
    decoders = m.batch_decoders(model, config, {"threshold": 0.9, "checked_exits": [0]},
                                {"schedule": [3] * 32}, drafts, auto)
    assert decoders["auto"]["sampled"] is decoders["full"]["sampled"]
    assert decoders["auto"]["greedy"](prompts[:2], 6).stats["num_draft"] == 5


def test_a_batch_takes_the_rounds_of_its_slowest_row(trained):
    model, data = trained
    prompts = m.workload(data[:5000], 8, 6)
    alone = [m.generate_self_speculative(model, p[None], 40, 0, 3).stats["rounds"] for p in prompts]
    assert len(set(alone)) > 1, "rows should need different numbers of rounds"
    together = [m.generate_self_speculative(model, b, 40, 0, 3).stats["rounds"] for b in prompts.split(4)]
    assert together == [max(alone[:4]), max(alone[4:])]
