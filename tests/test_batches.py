"""Batches: per-row cache lengths, batched self-speculative decoding, and the per-token batch designs."""

import copy
import types

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
    out = m.generate_speculative(model, idx, 100, 0, 4, temperature=0.0)  # 100 > 3 windows of 32
    for b in range(8):
        alone = m.generate(model, idx[b : b + 1], 100, temperature=0.0)
        assert torch.equal(out.tokens[b], alone.tokens[0]), f"row {b}"
        spec = m.generate_speculative(model, idx[b : b + 1], 100, 0, 4, temperature=0.0)
        assert torch.equal(out.exited_at[b], spec.exited_at[0]), f"row {b}: which tokens were drafts"
    drafted_kept = (out.exited_at == 0).sum(1)  # per row: drafts accepted
    assert len(set(drafted_kept.tolist())) > 1, "rows should accept different numbers of drafts"
    assert int(drafted_kept.sum()) == out.stats["accepted"]
    assert groups[0] == 8 and min(groups[1:]) < 8, "rows should slide their windows at different rounds"
    assert left[-1] == 0 and max(left) > 0, "rows that are done should leave while others decode on"
    assert 0.1 < out.stats["accepted"] / out.stats["drafted"] < 0.5


def test_a_batch_counts_each_block_call_at_the_share_of_rows_it_ran():
    """Block runs per row of the batch: a call on 4 rows of 3 positions is 3; once 2 rows have left, a
    call of 2 positions on the other 2 adds 2 x 2 / 4 = 1, the average over the 4 rows."""
    model = tiny_model()
    cache, block, C = m.RowKVCache(model.config, 4, "cpu"), model.transformer.h[0], model.config.n_embd
    cache.start_round(torch.zeros(4, dtype=torch.long), 0)
    block(torch.zeros(4, 3, C), cache, 0)
    assert cache.block_runs() == 3
    cache.keep_rows(torch.tensor([True, False, True, False]))
    cache.start_round(torch.zeros(2, dtype=torch.long), 3)
    block(torch.zeros(2, 2, C), cache, 0)
    assert cache.block_runs() == 4 and cache.row_bytes == (cache.k.nbytes + cache.v.nbytes) / 2  # a row's, as before


def test_skipdecode_reads_no_hole_and_emits_the_scheduled_exit():
    """A depth that never rises along the window: every token's logits are its scheduled exit head's,
    computed with the full context at every layer it runs (as the uncached model computes them), in
    the first window and in the next ones, after re-prefills."""
    model = tiny_model()
    schedule = [3] * 4 + [2] * 4 + [1] * 4 + [0] * 4  # block_size 16
    forced = torch.randint(0, 11, (3, 40), generator=torch.Generator().manual_seed(3))
    idx = torch.zeros(3, 1, dtype=torch.long)
    out, cache, _ = generate_with_cache(model, idx, 40, m.SkipDecode, exit_threshold=0.0,
                                        checked_exits=schedule, forced=forced)
    text, start = torch.cat([idx, forced], 1), None
    for i in range(40):
        if start != m.window_start(start, 1 + i, 16):  # a new window: its first positions re-prefilled
            start, prefilled = m.window_start(start, 1 + i, 16), i - m.window_start(start, 1 + i, 16)
        pos = i - start  # the window position of the token fed
        assert (out.exited_at[:, i] == schedule[pos]).all(), f"step {i}"
        full = model.all_exit_logits(text[:, start : i + 1])  # (L, B, T, V): the window from scratch
        assert torch.allclose(out.logits[:, i], full[schedule[pos], :, -1], atol=1e-5), f"step {i}"
    # layer l holds the re-prefilled positions, then exactly those whose scheduled depth reaches it
    n = cache.lengths[0]
    assert prefilled > 0 and cache.lengths == [prefilled + sum(e >= l for e in schedule[prefilled:n])
                                               for l in range(4)]


def test_choose_schedule_keeps_its_budget_and_never_rises():
    torch.manual_seed(0)
    N, L = 400, 4
    conf = torch.rand(L, N)
    pred = torch.randint(0, 3, (L, N))
    records = m.ExitRecords({"top1": conf}, pred, torch.rand(L, N), torch.randint(0, 3, (N,)))
    saved = []
    for budget in (0.0, 0.2, 0.6):
        s = m.choose_schedule(records, L, 16, budget)
        assert s["disagreement"] <= budget and s["threshold"] == 0.0 and s["measure"] == "top1"
        assert all(a >= b for a, b in zip(s["checked_exits"], s["checked_exits"][1:])), "the depth must never rise"
        exits = torch.tensor(s["checked_exits"])[m.window_positions(N, 16)]
        assert m.exit_summary(records, exits)["compute_saved"] == pytest.approx(s["compute_saved"])
        saved.append(s["compute_saved"])
    assert saved[0] < saved[2]


def test_val_times_each_drafter_at_two_draft_lengths_and_keeps_the_faster(trained, monkeypatch):
    """Lab.on_val: one interleaved pass over val's workload times full depth, each drafter at num_draft and its
    half, and every other model, in both modes; each speed-up is over full depth in its mode, call by
    call; a drafter's forecast and the plan it runs on test are those of its faster length in that mode, drafting
    to its own last layer (the draft model) or to draft_exit."""
    model, data = trained
    config = m.replace(model.config, bench_tokens=12, bench_repeats=2, bench_prompts=4, bench_prompt_len=8,
                       draft_exit=2, draft_layers=2, num_draft=5, shift_path="")
    lab = m.Lab(model, None, {"val": data[:5000], "test": data[5000:10000]}, config, "cpu")
    draft = tiny_model(n_layer=2, n_embd=32, block_size=32, vocab_size=model.config.vocab_size)
    lab.plain_gpts[2], lab.rules, lab.plans = (draft, 0.0), m.EXIT_RULES, {}  # the draft model: no training here
    passes, real = [], m.speed_pass

    def recording(decoders, prompts, cfg):
        passes.append((prompts, cfg, real(decoders, prompts, cfg)))
        return passes[-1][2]
    monkeypatch.setattr(m, "speed_pass", recording)
    names = ["full", "self_speculative", "draft_model"]
    sources = {"": (model, lab.rules, lab.plans, names, "full")}
    val, plans = lab.on_val(sources, {"2-layer GPT": (draft, "plain GPT")})
    (prompts, cfg, speed), = passes
    assert torch.equal(prompts, lab.workloads[0]), "val's workload"
    assert cfg.bench_repeats == 1, "one pass on val"
    assert (len(lab.workloads[0]), len(lab.workloads[1])) == (4, 4), "as many prompts as test's"
    assert not torch.equal(lab.workloads[0], lab.workloads[1])
    lengths = {n: 2 if m.DECODERS.get(n, m.DECODERS["full"]).drafter else 1 for n in (*names, "2-layer GPT")}
    assert sorted(speed) == sorted((n, mode, i) for n, k in lengths.items() for mode in m.MODES for i in range(k))
    assert set(val) == {(n, mode) for n in lengths for mode in m.MODES}
    for (name, mode, i), s in speed.items():
        assert sum(o.exited_at.numel() for o in s["outputs"]) == 4 * 12, "every prompt continued 12 tokens"
    for name, mode in val:
        tried = {i: m.speedup(speed[name, mode, i], speed["full", mode, 0]) for i in range(lengths[name])}
        assert val[name, mode] == max(tried.values()), "call by call beside full depth; a drafter's fastest"
        if lengths[name] == 2:
            ks = [speed[name, mode, i]["outputs"][0].stats["num_draft"] for i in range(2)]
            assert sorted(ks) == [2, 5], "num_draft and its half"
            for i, k in enumerate(ks):  # k drafts a round: k + 1 tokens a verify pass at most
                assert all(o.stats["num_draft"] == k for o in speed[name, mode, i]["outputs"])
                assert sum(o.stats["rounds"] for o in speed[name, mode, i]["outputs"]) >= 4 * 12 / (k + 1)
            assert plans[name, mode]["num_draft"] == ks[max(tried, key=tried.get)], "the fastest on val"
    for mode in m.MODES:
        own, other = plans["self_speculative", mode], plans["draft_model", mode]
        assert (own["draft_exit"], own["draft"]) == (2, None)
        assert (other["draft_exit"], other["draft"]) == (1, draft)
        assert plans["full", mode] is None and ("2-layer GPT", mode) not in plans, "nothing to choose"


@pytest.mark.parametrize("num_draft,lengths", [(1, [1]), (2, [1, 2]), (3, [1, 3]), (4, [2, 4]), (8, [4, 8])])
def test_a_drafter_tries_num_draft_and_its_half(num_draft, lengths):
    """run_plans: a drafter's candidate lengths are num_draft >> 0, 1, none below 1; an exit
    decoder has its one plan."""
    config = types.SimpleNamespace(num_draft=num_draft, draft_exit=0)
    plans = m.run_plans({"": (None, None, {"deferred": {"x": 1}}, ["full", "deferred", "self_speculative"],
                              "full")}, config, None)
    assert set(plans) == {(n, mode) for n in ("full", "deferred", "self_speculative") for mode in m.MODES}
    for mode in m.MODES:
        assert plans["full", mode] == [None] and plans["deferred", mode] == [{"x": 1}]
        assert sorted(p["num_draft"] for p in plans["self_speculative", mode]) == lengths


def test_a_batch_takes_the_rounds_of_its_slowest_row(trained):
    model, data = trained
    prompts = m.workload(data[:5000], 8, 6)
    alone = [m.generate_speculative(model, p[None], 40, 0, 3).stats["rounds"] for p in prompts]
    assert len(set(alone)) > 1, "rows should need different numbers of rounds"
    together = [m.generate_speculative(model, b, 40, 0, 3).stats["rounds"] for b in prompts.split(4)]
    assert together == [max(alone[:4]), max(alone[4:])]
