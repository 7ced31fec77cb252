"""Speed figures that hold on real text: the workload, repetition, adaptive drafts, the cost-aware exit plan."""

import types

import pytest
import torch

from conftest import m

pytestmark = pytest.mark.usefixtures("no_grad")


def test_workload_takes_evenly_spaced_prompts_from_the_split():
    data = torch.arange(1000)
    w = m.workload(data, 5, 10)
    assert w.shape == (5, 10)
    starts = w[:, 0].tolist()
    assert starts[0] == 0 and starts[-1] == 1000 - 10 - 1
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert max(gaps) - min(gaps) <= 1
    assert all(torch.equal(row, data[s : s + 10]) for row, s in zip(w, starts))


def test_repetition_scores_a_loop_high_and_fresh_text_zero():
    assert m.repetition(list(range(20))) == 0.0
    assert m.repetition([1, 2, 3] * 10) == pytest.approx(1 - 3 / 27)  # 27 4-grams, 3 distinct
    assert m.repetition([1, 2, 3]) == 0.0  # no 4-gram at all


def test_repetition_of_a_batch_averages_every_row():
    loop, fresh = torch.tensor([1, 2, 3] * 10), torch.arange(30)

    def run(prompt, n, generator=None):  # a batch of two rows: one loops, one never repeats
        return m.Generation(torch.stack([loop, fresh]), None, None, 0)
    speed = m.speed_pass({"two rows": run}, torch.zeros(2, 4, dtype=torch.long),
                         types.SimpleNamespace(bench_tokens=30, bench_repeats=1, seed=0))
    assert speed["two rows"]["repetition"] == pytest.approx((m.repetition(loop.tolist()) + 0.0) / 2)


COSTS = {"block": 1.0, "check top1": 0.25, "state_copy": 0.5, "final_head": 0.2}


def three_layer_records():
    """4 positions, 3 layers: exit 0 is confident at positions 0 and 2, exit 1 at position 1."""
    conf = torch.tensor([[0.9, 0.1, 0.9, 0.1], [0.2, 0.9, 0.2, 0.2], [1.0, 1.0, 1.0, 1.0]])
    zeros = torch.zeros(3, 4, dtype=torch.long)
    return m.ExitRecords({"top1": conf}, zeros, zeros.float(), torch.zeros(4, dtype=torch.long))


def plan(checked, threshold=0.5):
    return {"measure": "top1", "threshold": threshold, "checked_exits": checked}


def test_a_plans_price_by_hand():
    records = three_layer_records()

    def price(name, p):
        return m.priced_saving(m.DECODERS[name], m.plan_counts(records, p), "top1", COSTS)
    # checking exit 0 only: exits [0, 2, 0, 2]: 1 block and 0.5 final heads saved per token on average, 1 check each
    assert m.plan_counts(records, plan([0])) == pytest.approx({"early": 0.5, "skipped": 1.0, "checks": 1.0})
    assert price("holes", plan([0])) == pytest.approx(1.1 - 0.25)
    assert price("state_copy", plan([0])) == pytest.approx(1.1 - 0.25 - 0.5 * 0.5)
    # backfill runs every block for the cache, but no final head for a token that has left
    assert price("backfill", plan([0])) == pytest.approx(0.1 - 0.25)
    # checking both: exits [0, 1, 0, 2]: 1.25 blocks and 0.75 heads saved, 1 + 0.5 checks per token
    assert m.plan_counts(records, plan([0, 1])) == pytest.approx({"early": 0.75, "skipped": 1.25, "checks": 1.5})
    assert price("holes", plan([0, 1])) == pytest.approx(1.25 + 0.15 - 1.5 * 0.25)
    # at threshold 1 nothing exits and nothing is checked: every strategy is full depth
    assert price("backfill", plan([0, 1], 1.0)) == price("holes", plan([0, 1], 1.0)) == 0.0


def greedy_path(records, decl, costs):
    """best_plan's search, written out: from no exit, add the exit that prices fastest, until all are in."""
    def price(exits):
        return m.priced_saving(decl, m.plan_counts(records, plan(exits)), "top1", costs) / costs["block"]
    exits, path, n_exits = [], [], len(records.pred) - 1
    while len(exits) < n_exits:
        exits = max((sorted({*exits, e}) for e in range(n_exits) if e not in exits), key=price)
        path.append((exits, price(exits)))
    return path


def random_records(n_layer, seed, n=64):
    gen = torch.Generator().manual_seed(seed)
    conf = torch.rand(n_layer, n, generator=gen)
    zeros = torch.zeros(n_layer, n, dtype=torch.long)
    return m.ExitRecords({"top1": conf}, zeros, zeros.float(), torch.zeros(n, dtype=torch.long))


def test_the_plan_is_the_fastest_plan_of_a_greedy_search(monkeypatch):
    """best_plan adds one exit at a time, each time the one that saves most at the unit costs, and returns the best plan
    it met: n_layer^2 / 2 plans priced, not every subset; at 4 layers, the best of every subset."""
    records, holes = three_layer_records(), m.DECODERS["holes"]
    best = m.best_plan(records, holes, "top1", 0.5, COSTS)
    priced = {tuple(s): m.priced_saving(holes, m.plan_counts(records, plan(s)), "top1", COSTS)
              for s in ([0], [1], [0, 1])}
    assert best["checked_exits"] == [0, 1] and best["saved_blocks"] == max(priced.values())
    assert best["label"] == "0,1" and (best["measure"], best["threshold"]) == ("top1", 0.5)
    # checks dear: the search passes [0] on its way to [0, 1], and returns [0], the fastest it met
    expensive = dict(COSTS, **{"check top1": 0.9})
    assert [e for e, _ in greedy_path(records, holes, expensive)] == [[0], [0, 1]]
    assert m.best_plan(records, holes, "top1", 0.5, expensive)["checked_exits"] == [0]
    # the plan returned is the fastest on the search's path, for every strategy, on random records
    for seed in range(5):
        records = random_records(6, seed)
        for name in ("backfill", "holes", "state_copy"):
            path = greedy_path(records, m.DECODERS[name], COSTS)
            best = m.best_plan(records, m.DECODERS[name], "top1", 0.5, COSTS)
            assert (best["checked_exits"], best["saved_blocks"]) == max(path, key=lambda p: p[1]), (seed, name)
            singles = [m.best_plan(records, m.DECODERS[name], "top1", 0.5, COSTS, [e]) for e in range(5)]
            assert all(best["saved_blocks"] >= s["saved_blocks"] for s in singles), "never slower"
    # 4 layers, 8 positions: exit 0 is sure of the first half, exit 1 of nothing more, exit 2 of 2 more.
    # The search prices [0], then [0, 2], then [0, 1, 2]; [0, 2], the best of all 7 subsets, is neither
    # one exit nor every exit
    conf = torch.tensor([[0.9] * 4 + [0.1] * 4, [0.9] * 4 + [0.1] * 4, [0.1] * 4 + [0.9] * 2 + [0.1] * 2, [1.0] * 8])
    zeros = torch.zeros(4, 8, dtype=torch.long)
    records = m.ExitRecords({"top1": conf}, zeros, zeros.float(), torch.zeros(8, dtype=torch.long))
    subsets = [[0], [1], [2], [0, 1], [0, 2], [1, 2], [0, 1, 2]]
    every = {tuple(s): m.best_plan(records, holes, "top1", 0.5, COSTS, s)["saved_blocks"] for s in subsets}
    best = m.best_plan(records, holes, "top1", 0.5, COSTS)
    assert best["saved_blocks"] == max(every.values()) == every[tuple(best["checked_exits"])]
    assert best["checked_exits"] == [0, 2] and best["saved_blocks"] == pytest.approx(1.9 - 0.375)
    # the plans priced: 8 exits, 8 + 7 + ... + 1 = 36 (every subset would be 255)
    priced = []
    real = m.plan_counts
    monkeypatch.setattr(m, "plan_counts", lambda r, p: priced.append(list(p["checked_exits"])) or real(r, p))
    m.best_plan(random_records(9, 0), holes, "top1", 0.5, COSTS)
    assert len(priced) == 8 * 9 // 2 and len({tuple(p) for p in priced}) == 36


def test_a_plan_given_or_at_threshold_one_is_not_searched():
    records, holes = three_layer_records(), m.DECODERS["holes"]
    # checked given: that plan, priced
    given = m.best_plan(records, holes, "top1", 0.5, COSTS, [1])
    expected = m.priced_saving(holes, m.plan_counts(records, plan([1])), "top1", COSTS)
    assert (given["checked_exits"], given["label"], given["saved_blocks"]) == ([1], "1", expected)
    # where checks are dear the search would pick [0]: given [0, 1], the plan is [0, 1]
    expensive = dict(COSTS, **{"check top1": 0.9})
    assert m.best_plan(records, holes, "top1", 0.5, expensive, [0, 1])["checked_exits"] == [0, 1]
    # at threshold 1 nothing can leave: the plan checks no exit, and says so (even where exits were given)
    for checked in (None, [0, 1]):
        nothing = m.best_plan(records, holes, "top1", 1.0, COSTS, checked)
        assert (nothing["checked_exits"], nothing["label"], nothing["saved_blocks"]) == ([], "-", 0.0)
    just_below = m.best_plan(records, holes, "top1", 0.999, COSTS)
    assert just_below["checked_exits"] and just_below["label"] != "-"
