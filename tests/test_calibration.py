"""Choosing the exit rule: records equal the decoder, the calibration keeps its guarantee."""

import pytest
import torch

from conftest import m

pytestmark = pytest.mark.usefixtures("no_grad")


@pytest.fixture
def with_learned_rule(trained):
    """The trained model with its learned exit rule fitted on a piece of text it is not tested on."""
    model, data = trained
    m.fit_exit_predictor(model, data[30000:33001], 3000)
    yield model, data
    del model.exit_predictor


@pytest.mark.parametrize("measure", [*m.CONFIDENCE_MEASURES, "learned"])
def test_parallel_records_equal_the_sequential_decoder(with_learned_rule, measure):
    """Every rule, read in one parallel pass, makes the decoder's own choices (backfill and deferred)."""
    model, data = with_learned_rule
    text = data[5000:5200]
    records = m.record_exits(model, text, 150)  # 150 positions: several windows of 32, re-prefills included
    threshold = 0.8  # patience: 3 exits in a row agree
    if measure != "patience":  # the middle of the widest gap between confidences near the median
        values = records.confidences[measure][:3].amax(0).sort().values[50:100]
        i = int((values[1:] - values[:-1]).argmax())
        threshold = (values[i] + values[i + 1]).item() / 2
    rule = m.exit_rules(model)[measure]
    for strategy in ("backfill", "deferred"):
        out = m.generate(model, text[None, :1], 150, strategy=m.KV_STRATEGIES[strategy], exit_threshold=threshold, measure=rule,
                         forced=text[None, 1:151])
        exits = m.exits_at_threshold(records, measure, threshold, [0, 1, 2])
        assert torch.equal(out.exited_at[0], exits)
        assert 0.1 < (exits < 3).float().mean() < 0.9
        emitted = records.pred[exits, torch.arange(150)]
        assert torch.equal(out.logits[0].argmax(-1), emitted)


def test_the_decoder_reads_every_state_the_records_read(trained):
    """Not only the choices: every saturation the decoder computes is the records' own, deferred's catch-up
    included (a rule reads a layer's input after the layer ran)."""
    model, data = trained
    text = data[5000:5200]
    records = m.record_exits(model, text, 150)
    seen = []

    def spy(probs, state):
        value = m.saturation(probs, state)
        seen.append(value.item())
        return value

    # exits 0 and 2 checked: after a token leaves at 0, the next one's check at 2 follows two catch-ups
    threshold = records.confidences["saturation"][0].median().item()
    out = m.generate(model, text[None, :1], 150, strategy=m.KV_STRATEGIES["deferred"], exit_threshold=threshold,
                     checked_exits=[0, 2], measure=spy, forced=text[None, 1:151])
    expected = [records.confidences["saturation"][l, i].item()
                for i, e in enumerate(out.exited_at[0].tolist()) for l in (0, 2)[: 1 + (e > 0)]]
    assert 20 < (out.exited_at[0] == 0).sum() < 130
    assert seen == pytest.approx(expected, abs=1e-5)


def test_record_batching_does_not_change_records(trained):
    model, data = trained
    a = m.record_exits(model, data[:400], 300, batch_size=64)
    b = m.record_exits(model, data[:400], 300, batch_size=2)
    assert torch.equal(a.pred, b.pred) and torch.allclose(a.nll, b.nll, atol=1e-5)


def simulate_choices(rule, n=400, sets=400, epsilon=0.05, delta=0.1, seed=0):
    """Known per-threshold risks; many calibration sets; how often the chosen threshold's true risk > epsilon."""
    grid = torch.linspace(1, 0, 21)
    risk = 0.12 * (1 - grid)  # true disagreement rate at each threshold: crosses epsilon near the middle
    gen = torch.Generator().manual_seed(seed)
    bad = 0
    for _ in range(sets):
        u = torch.rand(n, generator=gen)
        failures = [int((u < r).sum()) for r in risk]  # nested: a lower threshold fails wherever a higher one does
        i = rule(failures, n, epsilon, delta)
        bad += i >= 0 and risk[i] > epsilon
    return bad / sets


def naive_rule(failures, n, epsilon, delta):
    """The invalid rule: the lowest threshold whose empirical risk is within epsilon."""
    ok = [i for i, k in enumerate(failures) if k / n <= epsilon]
    return max(ok) if ok else -1


def test_calibration_keeps_its_guarantee_and_the_naive_rule_does_not():
    assert simulate_choices(m.fixed_sequence_test) <= 0.1 + 0.03
    assert simulate_choices(naive_rule) > 0.1 + 0.1  # the test can tell a rule that breaks the promise


def test_binomial_tail_is_exact():
    from math import comb

    n, k, eps = 30, 2, 0.1
    exact = sum(comb(n, i) * eps**i * (1 - eps) ** (n - i) for i in range(k + 1))
    assert m.binomial_tail(k, n, eps) == pytest.approx(exact, rel=1e-9)


def test_smaller_epsilon_never_gives_a_lower_threshold(trained):
    model, data = trained
    records = m.record_exits(model, data[10000:12001], 2000)
    chosen = [m.calibrate(records, "top1", [0, 1, 2], eps, 0.05) for eps in (0.3, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005)]
    assert chosen == sorted(chosen)
    assert chosen[0] < 1.0 and chosen[-1] > chosen[0], "the sweep should move"


def test_calibration_report_says_what_it_chose(trained):
    model, data = trained
    val = m.record_exits(model, data[10000:12001], 2000)
    test = m.record_exits(model, data[20000:22001], 2000)
    cal = m.calibration_report(val, test, None, "margin", [0, 1, 2], 0.05, 0.05)
    assert set(cal) == {"measure", "epsilon", "delta", "threshold", "val", "test"}
    assert {"disagreement", "loss", "full_loss", "accuracy", "compute_saved", "held", "oracle_share"} <= set(cal["test"])
    assert cal["val"]["held"] and 0 < cal["test"]["oracle_share"] <= 1
    assert cal["val"]["disagreement"] <= 0.05
    exits = m.exits_at_threshold(test, "margin", cal["threshold"], [0, 1, 2])
    assert cal["test"]["compute_saved"] == pytest.approx(1 - (exits + 1).float().mean().item() / 4)


def test_sweep_trades_compute_for_quality(trained):
    model, data = trained
    entries = m.sweep(m.record_exits(model, data[:1001], 1000), "top1", [0, 1, 2])
    assert [e["threshold"] for e in entries] == list(m.THRESHOLDS)
    rows = [e for e in entries if e["threshold"] in (1.0, 0.8, 0.5, 0.0)]
    saved = [r["compute_saved"] for r in rows]
    assert saved == sorted(saved) and saved[0] == 0.0 and saved[-1] == pytest.approx(0.75)
    assert rows[0]["disagreement"] == 0.0 and rows[0]["loss"] == pytest.approx(rows[0]["full_loss"])


def test_logit_lens_reads_each_layer_two_ways(trained):
    model, data = trained
    rows = m.logit_lens(model, data[:256].view(8, 32))
    assert [(r["layer"], r["readout"]) for r in rows[:2]] == [(0, "ln_f + lm_head"), (0, "exit head")]
    assert len(rows) == 2 * 3
    exit_rows = [r for r in rows if r["readout"] == "exit head"]
    lens_rows = [r for r in rows if r["readout"] != "exit head"]
    assert all(e["agreement"] > l["agreement"] for e, l in zip(exit_rows, lens_rows))
