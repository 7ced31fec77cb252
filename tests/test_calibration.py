"""Choosing the exit rule: records equal the decoder, the calibration keeps its guarantee at its
boundaries, and the rule chosen among several is chosen on val with the guarantee kept."""

from math import comb

import pytest
import torch

from conftest import KV_STRATEGIES, m

pytestmark = pytest.mark.usefixtures("no_grad")


@pytest.fixture(scope="module")
def rules(trained):
    """Every rule, the learned one fitted on a piece of text the tests do not read."""
    model, data = trained
    return m.exit_rules(m.fit_exit_predictor(model, data[30000:33001], 3000))


@pytest.mark.parametrize("measure", [*m.EXIT_RULES, "learned"])
def test_parallel_records_equal_the_sequential_decoder(trained, rules, measure):
    """Every rule, read in one parallel pass, makes the decoder's own choices (backfill and deferred)."""
    model, data = trained
    text = data[5000:5200]
    records = m.record_exits(model, text, 150, rules)  # 150 positions: several windows of 32, re-prefills included
    threshold = 0.8  # patience: 3 exits in a row agree
    if measure != "patience":  # the middle of the widest gap between confidences near the median
        values = records.confidences[measure][:3].amax(0).sort().values[50:100]
        i = int((values[1:] - values[:-1]).argmax())
        threshold = (values[i] + values[i + 1]).item() / 2
    for strategy in ("backfill", "deferred"):
        out = m.generate(model, text[None, :1], 150, strategy=KV_STRATEGIES[strategy], exit_threshold=threshold,
                         measure=rules[measure], forced=text[None, 1:151])
        exits = m.exits_at_threshold(records, measure, threshold, [0, 1, 2])
        assert torch.equal(out.exited_at[0], exits)
        assert 0.1 < (exits < 3).float().mean() < 0.9
        emitted = records.pred[exits, torch.arange(150)]
        assert torch.equal(out.logits[0].argmax(-1), emitted)


def test_the_decoder_reads_every_state_the_records_read(trained, rules):
    """Not only the choices: every saturation the decoder computes is the records' own, deferred's catch-up
    included (a rule reads a layer's input after the layer ran)."""
    model, data = trained
    text = data[5000:5200]
    records = m.record_exits(model, text, 150, rules)
    seen = []

    def spy(probs, state):
        value = m.saturation(probs, state)
        seen.append(value.item())
        return value

    # exits 0 and 2 checked: after a token leaves at 0, the next one's check at 2 follows two catch-ups
    threshold = records.confidences["saturation"][0].median().item()
    out = m.generate(model, text[None, :1], 150, strategy=KV_STRATEGIES["deferred"], exit_threshold=threshold,
                     checked_exits=[0, 2], measure=spy, forced=text[None, 1:151])
    expected = [records.confidences["saturation"][l, i].item()
                for i, e in enumerate(out.exited_at[0].tolist()) for l in (0, 2)[: 1 + (e > 0)]]
    assert 20 < (out.exited_at[0] == 0).sum() < 130
    assert seen == pytest.approx(expected, abs=1e-5)


def test_record_batching_does_not_change_records(trained, rules):
    model, data = trained
    a = m.record_exits(model, data[:400], 300, rules, batch_size=64)
    b = m.record_exits(model, data[:400], 300, rules, batch_size=2)
    assert torch.equal(a.pred, b.pred) and torch.allclose(a.nll, b.nll, atol=1e-5)


def tail_by_hand(k, n, eps):
    """P(Binomial(n, eps) <= k), summed term by term."""
    return sum(comb(n, i) * eps**i * (1 - eps) ** (n - i) for i in range(k + 1))


def test_binomial_tail_is_exact():
    for n, k, eps in ((30, 2, 0.1), (400, 13, 0.05), (2000, 9, 0.01)):
        assert m.binomial_tail(k, n, eps) == pytest.approx(tail_by_hand(k, n, eps), rel=1e-9)


@pytest.mark.parametrize("n,eps,delta", [(100, 0.05, 0.1), (400, 0.05, 0.05), (2000, 0.01, 0.05)])
def test_one_threshold_is_certified_exactly_up_to_its_binomial_boundary(n, eps, delta):
    """The most failures one threshold may have and still be certified, k, is where the exact binomial
    tail crosses delta: P(Bin(n, eps) <= k) <= delta < P(Bin(n, eps) <= k + 1). One step either side
    of the boundary (an off-by-one, twice delta) moves k."""
    k = max(j for j in range(n) if m.fixed_sequence_test([j], n, eps, delta) == 0)
    assert m.fixed_sequence_test([k + 1], n, eps, delta) == -1
    assert tail_by_hand(k, n, eps) <= delta < tail_by_hand(k + 1, n, eps)


def test_fixed_sequence_test_stops_at_the_first_threshold_not_rejected():
    # thresholds 0, 1 pass, 2 fails, 3 and 4 would pass again: the test must stop at 2 and return 1
    failures = [0, 1, 60, 0, 0]
    assert m.fixed_sequence_test(failures, 1000, 0.01, 0.05) == 1
    assert m.fixed_sequence_test([60, 0, 0], 1000, 0.01, 0.05) == -1  # the first fails: full depth
    assert m.fixed_sequence_test([0, 0, 0], 1000, 0.01, 0.05) == 2


def simulate_choices(rule, n=400, sets=400, epsilon=0.05, delta=0.1, seed=0):
    """Known per-threshold risks, the first one over epsilon only by 1e-4; many calibration sets; how
    often the chosen threshold's true risk exceeds epsilon."""
    risk = torch.tensor([0.0, 0.01, 0.02, 0.03, 0.04, epsilon + 1e-4, 0.06, 0.08, 0.1])
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
    """The chance of choosing a threshold whose risk is over epsilon, however slightly, is at most delta:
    exactly, the chance that Bin(n, epsilon + 1e-4) falls at or under the certified boundary; and the
    simulation agrees. The naive rule, which trusts the empirical risk, breaks it often."""
    n, eps, delta = 400, 0.05, 0.1
    k = max(j for j in range(n) if m.fixed_sequence_test([j], n, eps, delta) == 0)
    assert tail_by_hand(k, n, eps + 1e-4) <= delta
    assert simulate_choices(m.fixed_sequence_test) <= delta + 3 * (delta * (1 - delta) / 400) ** 0.5
    assert simulate_choices(naive_rule) > 0.3  # the test can tell a rule that breaks the promise


def test_calibrate_returns_the_last_threshold_before_the_first_failure():
    """records whose disagreement is non-monotone in the threshold: calibrate must not skip past a failure."""
    N = 2000
    # exit 0 confidence 0.95 everywhere (agrees), exit 1 confidence 0.85 (disagrees), full depth predicts 0
    conf = torch.stack([torch.full((N,), 0.95), torch.full((N,), 0.85), torch.ones(N)])
    pred = torch.stack([torch.zeros(N, dtype=torch.long), torch.ones(N, dtype=torch.long),
                        torch.zeros(N, dtype=torch.long)])
    records = m.ExitRecords({"top1": conf}, pred, torch.zeros(3, N), torch.zeros(N, dtype=torch.long))
    # thresholds 1.00 .. 0.95: nobody exits (fine); 0.94 .. 0.85: exit 0 (agrees); below 0.85 still exit 0 first
    assert m.calibrate(records, "top1", [0, 1], 0.01, 0.05) == 0.0
    # checking only exit 1: thresholds below 0.85 send everybody to the disagreeing exit, so stop at 0.85
    assert m.calibrate(records, "top1", [1], 0.01, 0.05) == 0.85


def records_disagreeing(n_bad, N=10000):
    """Records where exit 0 is always sure and disagrees with full depth on the first n_bad positions."""
    pred = torch.zeros(2, N, dtype=torch.long)
    pred[0, :n_bad] = 1
    return m.ExitRecords({"top1": torch.ones(2, N)}, pred, torch.zeros(2, N), torch.zeros(N, dtype=torch.long))


def test_held_is_disagreement_within_epsilon_one_position_either_side():
    """epsilon 1% of 10,000 positions: 100 disagreeing positions hold it, 101 break it."""
    val = records_disagreeing(0)
    for n_bad, held in ((99, True), (100, True), (101, False)):
        cal = m.calibration_report({"val": val, "test": val, "shift": records_disagreeing(n_bad)}, "top1", [0],
                                   0.01, 0.05)
        assert cal["threshold"] == 0.0 and cal["shift"]["disagreement"] == pytest.approx(n_bad / 10000)
        assert cal["shift"]["held"] is held, n_bad


def test_smaller_epsilon_never_gives_a_lower_threshold(trained, rules):
    model, data = trained
    records = m.record_exits(model, data[10000:12001], 2000, rules)
    chosen = [m.calibrate(records, "top1", [0, 1, 2], eps, 0.05) for eps in (0.3, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005)]
    assert chosen == sorted(chosen)
    assert chosen[0] < 1.0 and chosen[-1] > chosen[0], "the sweep should move"


def test_calibration_report_says_what_it_chose(trained, rules):
    model, data = trained
    records = {"val": m.record_exits(model, data[10000:12001], 2000, rules),
               "test": m.record_exits(model, data[20000:22001], 2000, rules)}
    cal = m.calibration_report(records, "margin", [0, 1, 2], 0.05, 0.05)
    assert set(cal) == {"measure", "epsilon", "delta", "threshold", "val", "test"}
    assert cal["threshold"] == m.calibrate(records["val"], "margin", [0, 1, 2], 0.05, 0.05)  # chosen on val
    assert cal["val"]["held"] and cal["val"]["disagreement"] <= 0.05
    exits = m.exits_at_threshold(records["test"], "margin", cal["threshold"], [0, 1, 2])
    assert cal["test"]["compute_saved"] == pytest.approx(1 - (exits + 1).float().mean().item() / 4)
    best = m.oracle(records["test"], [0, 1, 2], 0.05)["compute_saved"]
    assert cal["test"]["oracle_share"] == pytest.approx(cal["test"]["compute_saved"] / best)


def test_the_rule_is_chosen_on_val_and_calibrated_for_the_choice():
    """Two rules: 'a' saves more on test, 'b' on val. The choice is 'b', each rule calibrated at delta / 2
    (Bonferroni), so the guarantee covers the choice; its test figures are reported, never used."""
    N = 4000
    gen = torch.Generator().manual_seed(0)

    def split(a_sure, b_sure):  # exit 0 always agrees with full depth; each rule sure on some positions
        conf = {"a": torch.stack([torch.rand(N, generator=gen) < a_sure, torch.ones(N, dtype=torch.bool)]).float(),
                "b": torch.stack([torch.rand(N, generator=gen) < b_sure, torch.ones(N, dtype=torch.bool)]).float()}
        return m.ExitRecords(conf, torch.zeros(2, N, dtype=torch.long), torch.zeros(2, N), torch.zeros(N, dtype=torch.long))

    records = {"val": split(0.2, 0.6), "test": split(0.8, 0.3)}
    chosen = m.choose_rule(records, {"a": None, "b": None}, [0], 0.01, 0.05)
    assert chosen["measure"] == "b" and chosen["delta"] == 0.025
    assert chosen["threshold"] == m.calibrate(records["val"], "b", [0], 0.01, 0.025)
    assert chosen["test"]["compute_saved"] < m.calibration_report(records, "a", [0], 0.01, 0.025)["test"]["compute_saved"]


def test_bonferroni_delta_moves_the_certified_boundary():
    """The chosen rule's test runs at delta / 6: fewer failures are certified than at delta."""
    n, eps = 2000, 0.01
    k = [max(j for j in range(n) if m.fixed_sequence_test([j], n, eps, d) == 0) for d in (0.05, 0.05 / 6)]
    assert k[1] < k[0] and tail_by_hand(k[1], n, eps) <= 0.05 / 6 < tail_by_hand(k[1] + 1, n, eps)


def test_sweep_trades_compute_for_quality(trained, rules):
    model, data = trained
    entries = m.sweep(m.record_exits(model, data[:1001], 1000, rules), "top1", [0, 1, 2])
    assert [e["threshold"] for e in entries] == list(m.THRESHOLDS)
    rows = [e for e in entries if e["threshold"] in (1.0, 0.8, 0.5, 0.0)]
    saved = [r["compute_saved"] for r in rows]
    assert saved == sorted(saved) and saved[0] == 0.0 and saved[-1] == pytest.approx(0.75)
    assert rows[0]["disagreement"] == 0.0 and rows[0]["loss"] == pytest.approx(rows[0]["full_loss"])
