"""Speed figures that hold on real text: the workload, repetition, adaptive drafts, the cost-aware exit plan."""

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
    with pytest.raises(ValueError, match="too short"):
        m.workload(torch.arange(5), 2, 10)


def test_repetition_scores_a_loop_high_and_fresh_text_zero():
    assert m.repetition(list(range(20))) == 0.0
    assert m.repetition([1, 2, 3] * 10) == pytest.approx(1 - 3 / 27)  # 27 4-grams, 3 distinct
    assert m.repetition([1, 2, 3]) == 0.0  # no 4-gram at all


def test_repetition_of_a_batch_averages_every_row():
    loop, fresh = torch.tensor([1, 2, 3] * 10), torch.arange(30)

    def run(prompt, n, generator=None):  # a batch of two rows: one loops, one never repeats
        return m.Generation(torch.stack([loop, fresh]), None, None, 0)
    speed = m.speed_pass({"two rows": run}, torch.zeros(2, 4, dtype=torch.long), 2, 30, 1, 0)
    assert speed["two rows"]["repetition"] == pytest.approx((m.repetition(loop.tolist()) + 0.0) / 2)


COSTS = {"block": 1.0, "check top1": 0.25, "state_copy": 0.5, "final_head": 0.2, "token": 4.0}


def three_layer_records():
    """4 positions, 3 layers: exit 0 is confident at positions 0 and 2, exit 1 at position 1."""
    conf = torch.tensor([[0.9, 0.1, 0.9, 0.1], [0.2, 0.9, 0.2, 0.2], [1.0, 1.0, 1.0, 1.0]])
    zeros = torch.zeros(3, 4, dtype=torch.long)
    return m.ExitRecords({"top1": conf}, zeros, zeros.float(), torch.zeros(4, dtype=torch.long))


def plan(checked, threshold=0.5):
    return {"measure": "top1", "threshold": threshold, "checked_exits": checked}


def test_predicted_speedup_by_hand():
    records = three_layer_records()

    def predict(name, p):
        return m.predict_speedup(records, name, p, COSTS, 16)
    # checking exit 0 only: exits [0, 2, 0, 2]: 1 block and 0.5 final heads saved per token on average, 1 check each
    assert predict("holes", plan([0])) == pytest.approx(4 / (4 - 1.1 + 0.25))
    assert predict("state_copy", plan([0])) == pytest.approx(4 / (4 - 1.1 + 0.25 + 0.5 * 0.5))
    # backfill runs every block for the cache, but no final head for a token that has left
    assert predict("backfill", plan([0])) == pytest.approx(4 / (4 - 0.1 + 0.25))
    # checking both: exits [0, 1, 0, 2]: 1.25 blocks and 0.75 heads saved, 1 + 0.5 checks per token
    assert predict("holes", plan([0, 1])) == pytest.approx(4 / (4 - 1.25 - 0.15 + 1.5 * 0.25))
    # at threshold 1 nothing exits and nothing is checked: every strategy is full depth
    assert predict("backfill", plan([0, 1], 1.0)) == predict("holes", plan([0, 1], 1.0)) == 1.0
    # SkipDecode: window positions 0..3 exit at 2, 0, 0, 0, each early one after one check
    skip = {"measure": "top1", "threshold": 0.0, "checked_exits": [2, 0, 0, 0] + [0] * 12}
    assert predict("skipdecode", skip) == pytest.approx(4 / (4 - 0.75 * 0.2 - 1.5 + 0.75 * 0.25))


def test_the_plan_is_the_subset_predicted_fastest():
    records = three_layer_records()
    subsets = [[0], [1], [0, 1]]
    best = m.best_plan(records, "holes", "top1", 0.5, COSTS, subsets, 16)
    predicted = {tuple(s): m.predict_speedup(records, "holes", plan(s), COSTS, 16) for s in subsets}
    assert best["checked_exits"] == [0, 1] and best["predicted_speedup"] == max(predicted.values())
    assert best["label"] == "0,1"
    expensive = dict(COSTS, **{"check top1": 0.9})
    assert m.best_plan(records, "holes", "top1", 0.5, expensive, subsets, 16)["checked_exits"] == [0]
    # at threshold 1 nothing can leave: the plan checks no exit, and says so
    nothing = m.best_plan(records, "holes", "top1", 1.0, COSTS, subsets, 16)
    assert (nothing["checked_exits"], nothing["label"], nothing["predicted_speedup"]) == ([], "-", 1.0)
    just_below = m.best_plan(records, "holes", "top1", 0.999, COSTS, subsets, 16)
    assert just_below["checked_exits"] and just_below["label"] != "-"
