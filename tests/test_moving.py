"""A threshold that moves: its guarantee holds on any stream and is tight at its horizon, it follows a
jump in disagreement and brings the rate back, it stays put on a stream like its calibration, and the
monitor's bounds hold at every position under shift."""

import json
import math

import pytest
import torch

from conftest import THREE_LAYER_RUN, m

EPS, CREDIT, CLIMB, HORIZON = 0.01, 15, 4, 20000
TARGET = EPS - (CREDIT + CLIMB + 1) / HORIZON


def coupled(chances, start, seed=0):
    """wrong[i][t] for a stream whose chance of disagreeing at position t, at the calibrated index start, is
    chances[t], and i / start of it at index i (index 0, threshold 1.0, never disagrees): one uniform draw a
    position, so a more cautious index never disagrees where a less cautious one agrees."""
    u = torch.rand(len(chances), generator=torch.Generator().manual_seed(seed))
    scale = torch.arange(start + 1)[:, None] / start
    return (u[None, :] < scale * torch.as_tensor(chances)[None, :]).tolist()


def run(wrong, start):
    return m.moving_threshold(wrong, start, EPS, CREDIT, HORIZON)


def disagreements(wrong, path, a=0, b=None):
    return sum(wrong[i][t] for t, i in enumerate(path) if a <= t < (len(path) if b is None else b))


def test_the_bound_holds_at_the_horizon_on_the_worst_stream_and_not_before_it():
    """Every position disagrees wherever it may leave early: the moving threshold's disagreements are at most
    target * T + credit + climb + 1, which is epsilon * T at T = horizon; a tenth sooner, the worst stream is
    over epsilon."""
    start = 40
    wrong = [[i > 0] * HORIZON for i in range(start + 1)]
    path = run(wrong, start)
    for T in (HORIZON // 2, 9 * HORIZON // 10, HORIZON):
        k = disagreements(wrong, path, 0, T)
        assert TARGET * T + CREDIT + CLIMB - 1 <= k <= TARGET * T + CREDIT + CLIMB + 1  # the bound, nearly reached
    assert disagreements(wrong, path) <= EPS * HORIZON
    assert disagreements(wrong, path, 0, 9 * HORIZON // 10) > EPS * 9 * HORIZON // 10
    assert min(path) == 0 and max(path) == start  # to full depth, never past the calibrated threshold


def test_a_jump_to_three_epsilon_raises_the_threshold_and_the_rate_comes_back():
    """Disagreement jumps from epsilon / 2 to 3 epsilon at position 5,000. The threshold rises within 2,000
    positions (at most 2 credit saved, spent at 3 epsilon - target: at most about 1,400); the rate since the jump, over
    3 epsilon at first, is under epsilon once (2 credit + climb + 1) / (epsilon - target) = 35,000 positions have
    run since it, the bound; the rate since the start, once the horizon's 20,000 have run."""
    start, jump, after = 30, 5000, 35000
    wrong = coupled([EPS / 2] * jump + [3 * EPS] * after, start)
    path = run(wrong, start)
    assert all(i == start for i in path[:jump])  # before the jump it stays
    rose = next(t for t in range(jump, len(path)) if path[t] < start)
    assert 300 < rose - jump < 2000  # the credit absorbs the first of it
    assert disagreements(wrong, path, jump, jump + 500) > 2 * EPS * 500  # above epsilon at first
    assert (2 * CREDIT + CLIMB + 1) / (EPS - TARGET) == pytest.approx(after)
    assert disagreements(wrong, path, jump, jump + after) <= EPS * after
    assert all(disagreements(wrong, path, 0, T) <= EPS * T for T in range(HORIZON, jump + after, 1000))
    fixed = sum(wrong[start][jump:])  # the calibrated threshold, kept: three times over
    assert fixed > 2.5 * EPS * after


def exit_records(n, seed, q=0.1):
    """Two layers: exit 0's confidence is uniform, and it disagrees with full depth with chance
    q * (1 - confidence); full depth always agrees with itself."""
    g = torch.Generator().manual_seed(seed)
    conf = torch.rand(2, n, generator=g)
    pred = torch.zeros(2, n, dtype=torch.long)
    pred[0] = (torch.rand(n, generator=g) < q * (1 - conf[0])).long()
    return m.ExitRecords({"top1": conf}, pred, torch.zeros(2, n), torch.zeros(n, dtype=torch.long))


def test_on_streams_like_its_calibration_the_threshold_stays_unless_epsilon_broke_there():
    """Calibrated by Learn then Test on one draw, then run on a fresh draw of the same kind, ten times: where the
    calibrated threshold keeps epsilon on the fresh draw, the moving one stays within one grid step of it for at
    least 95% of positions; where chance breaks epsilon there, it moves, and keeps epsilon."""
    config, kept = m.LabConfig(), 0
    for seed in range(10):
        threshold = m.calibrate(exit_records(20000, 100 + seed), "top1", [0], config.epsilon, config.delta)
        records = exit_records(20000, seed)
        start = m.THRESHOLDS.index(threshold)
        exits = torch.stack([m.exits_at_threshold(records, "top1", t, [0]) for t in m.THRESHOLDS[: start + 1]])
        wrong = (records.pred != records.pred[-1]).gather(0, exits)
        path = m.moving_threshold(wrong.tolist(), start, config.epsilon, config.adapt_credit,
                                  config.adapt_horizon)
        stays = sum(i >= start - 1 for i in path) / len(path)
        if wrong[start].float().mean() <= config.epsilon:
            kept += 1
            assert stays >= 0.95, seed
        else:
            assert stays < 0.95 and sum(wrong[i][t] for t, i in enumerate(path)) <= config.epsilon * len(path)
    assert kept >= 7


def test_the_monitor_notices_a_threshold_that_breaks_epsilon_and_not_one_that_keeps_it():
    """The calibrated threshold on text like its calibration: the lower bound never passes epsilon. On text that
    disagrees three times as often, it passes within a few thousand positions, and the moving threshold keeps
    epsilon there while the fixed one runs over twice epsilon."""
    config = m.LabConfig()
    threshold = m.calibrate(exit_records(20000, 100), "top1", [0], config.epsilon, config.delta)
    like = m.fixed_and_moving(exit_records(20000, 0), "top1", threshold, [0], config)
    assert like["noticed"] is None and like["fixed"]["disagreement"] <= config.epsilon
    shifted = m.fixed_and_moving(exit_records(20000, 0, q=0.3), "top1", threshold, [0], config)
    assert 200 < shifted["noticed"] < 3000
    assert shifted["fixed"]["disagreement"] > 2 * config.epsilon
    assert shifted["moving"]["disagreement"] <= config.epsilon
    assert shifted["moving"]["upper"] > shifted["moving"]["disagreement"]
    assert 0 < shifted["moving"]["at_start"] < 0.5 and like["moving"]["at_start"] == 1


def test_the_bounds_hold_at_every_position_under_shift():
    """Streams whose chance of disagreeing jumps between 0.5% and 4% in blocks: the mean chance so far stays
    between the bounds at every position in at least 1 - alpha of the streams, and the bounds close in."""
    alpha, n, streams = 0.2, 4000, 200
    g = torch.Generator().manual_seed(0)
    t = torch.arange(n)
    chances = torch.where((t // 500) % 2 == 0, 0.005, 0.04)
    mean = chances.cumsum(0) / (t + 1)
    misses = 0
    for _ in range(streams):
        k = (torch.rand(n, generator=g) < chances).float().cumsum(0)
        lower, upper = m.rate_bounds(k, t + 1.0, alpha)
        misses += bool(((mean < lower) | (mean > upper)).any())
    assert misses <= alpha * streams
    assert float(upper[-1] - lower[-1]) < 0.02


def test_the_bounds_are_the_tightest_of_their_bets_one_step_either_side():
    """At k = 20 of n = 1000, the upper bound is a disagreement rate whose supermartingale reaches 1 / alpha,
    split among the bets: a rate a little above it is ruled out, one a little below is not."""
    k, n, alpha = torch.tensor(20.0), torch.tensor(1000.0), 0.05
    lower, upper = m.rate_bounds(k, n, alpha)
    a = math.log(8 / alpha)

    def wealth(p, b, up):  # the log of a bet's supermartingale at mean chance p
        return (-math.expm1(-b)) * p * 1000 - b * 20 if up else b * 20 - math.expm1(b) * p * 1000

    bets = (0.1, 0.3, 1.0, 3.0)
    assert max(wealth(float(upper) + 1e-4, b, True) for b in bets) > a
    assert max(wealth(float(upper) - 1e-4, b, True) for b in bets) < a
    assert max(wealth(float(lower) - 1e-4, b, False) for b in bets) > a
    assert max(wealth(float(lower) + 1e-4, b, False) for b in bets) < a
    assert 0.005 < float(lower) < 0.02 < float(upper) < 0.04


def test_the_report_holds_each_exit_models_fixed_and_moving_threshold(lab_runs):
    r = json.loads((lab_runs(THREE_LAYER_RUN)[2] / "report.json").read_text())
    rows = r["moving"]
    assert [(row["model"], row["measure"], row["text"]) for row in rows] == [
        (model, measure, text) for model in ("joint", "frozen", "continued") for measure in ("top1", "learned")
        for text in ("test", "shift")]
    for row in rows:
        assert row["moving"]["compute_saved"] <= row["fixed"]["compute_saved"] + 1e-9
        assert row["moving"]["disagreement"] <= row["moving"]["upper"]
        assert 0 <= row["moving"]["at_start"] <= 1
    assert "Self-speculation needs none of this" in " ".join(r["notes"]["moving"])
