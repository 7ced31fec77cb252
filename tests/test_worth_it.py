"""Is early exit worth it: every rule against the oracle, the tail, shifted text,
and a smaller model on the same curve."""

import json
import types

import pytest
import torch

from conftest import m

pytestmark = pytest.mark.usefixtures("no_grad")


@pytest.fixture(scope="module")
def records(trained):
    """The trained tiny model's records (its learned rule fitted on other text), and the text they read."""
    model, data = trained
    rules = m.exit_rules(m.fit_exit_predictor(model, data[30000:33001], 3000))
    return m.record_exits(model, data[20000:22001], 2000, rules), data[20000:22001]


def test_no_rule_beats_the_oracle_on_its_own_positions(records):
    """At every threshold of every rule, the oracle at that rule's disagreement saves at least as much."""
    recs = records[0]
    for exits_checked in ([0, 1, 2], [1]):
        for rule in recs.confidences:
            for entry in m.sweep(recs, rule, exits_checked)[::3]:
                best = m.oracle(recs, exits_checked, entry["disagreement"] + 1e-6)  # float32's share
                assert entry["compute_saved"] <= best["compute_saved"] + 1e-9, (rule, entry["threshold"])
                assert best["disagreement"] <= entry["disagreement"] + 1e-9


def test_the_oracle_spends_its_budget_where_it_saves_most():
    pred = torch.tensor([[1, 2, 3, 4], [1, 2, 0, 4], [1, 0, 0, 0]])  # (L, N): layer 2 is full depth
    recs = m.ExitRecords({}, pred, torch.zeros(3, 4), torch.zeros(4, dtype=torch.long))
    assert m.oracle(recs, [0, 1], 0.0)["exit_fractions"] == [0.25, 0.25, 0.5]  # first agreeing exit
    spent = m.oracle(recs, [0, 1], 0.25)  # one position may disagree: one of the two that run deepest
    assert spent["exit_fractions"] == [0.5, 0.25, 0.25] and spent["disagreement"] == 0.25
    # only exit 1 checked: it agrees at positions 0 and 2; positions 1 and 3 run to full depth, and the
    # one the budget lets disagree leaves at exit 1, the first exit checked, never at layer 0
    assert m.oracle(recs, [1], 0.0)["exit_fractions"] == [0.0, 0.5, 0.5]
    spent = m.oracle(recs, [1], 0.25)
    assert spent["exit_fractions"] == [0.0, 0.75, 0.25] and spent["disagreement"] == 0.25


def test_patience_asking_for_more_exits_than_there_are_never_exits_early(records):
    recs, L = records[0], 4
    never = m.exits_at_threshold(recs, "patience", 1 - 0.5 ** (L - 1), [0, 1, 2])  # k = 4 > 3 exits
    assert (never == L - 1).all()
    k3 = m.exits_at_threshold(recs, "patience", 1 - 0.5**2, [0, 1, 2])  # 3 in a row: only exit 2 can
    assert set(k3.tolist()) <= {2, 3} and (k3 == 2).any()
    agree = (recs.pred[0] == recs.pred[1]) & (recs.pred[1] == recs.pred[2])
    assert torch.equal(k3 == 2, agree)


def test_the_learned_rule_reaches_full_depth_at_its_cautious_end_and_predicts_agreement(records):
    recs = records[0]
    sweep = m.sweep(recs, "learned", [0, 1, 2])
    assert sweep[0]["threshold"] == 1.0 and sweep[0]["mean_layers"] == 4.0 and sweep[-1]["mean_layers"] < 4.0
    score, agree = recs.confidences["learned"][:3], recs.pred[:3] == recs.pred[-1]
    assert score[agree].mean() > score[~agree].mean() + 0.1, "it tells agreeing exits from the rest"


def test_saturation_is_the_cosine_between_a_layers_input_and_output():
    h, below = torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[2.0, 0.0], [1.0, -1.0]])
    assert torch.allclose(m.saturation(None, {"h": h, "below": below}), torch.tensor([1.0, 0.0]))


def test_tail_latency_as_a_streaming_reader_sees_it():
    """A round's tokens reach the reader together when it ends. Prompt 1: its tokens arrive at 1, 3, 13 and
    13 ms (the last two in one round of 10 ms); prompt 2: one token at 4 ms. First tokens: 1 and 4 ms; gaps
    between tokens: 2, 10 and 0 ms; whole prompts: 13 and 4 ms. Percentiles interpolate linearly between
    the sorted values (numpy's default), worked here by hand."""
    gen = m.Generation(None, None, None, 0, clock=[(0.0, 5), (0.001, 6), (0.003, 7), (0.013, 9)])
    t = m.tail([gen, m.Generation(None, None, None, 0, clock=[(0.0, 5), (0.004, 6)])])
    assert t["first_ms"] == pytest.approx(2.5)  # the median of 1 and 4
    assert t["gap_p50"] == pytest.approx(2.0)  # sorted gaps 0, 2, 10: the middle one
    assert t["gap_p95"] == pytest.approx(2 + 0.9 * 8)  # rank 0.95 x 2 = 1.9: 2 + 0.9 x (10 - 2)
    assert t["gap_p99"] == pytest.approx(2 + 0.98 * 8)
    assert t["ms_mean"] == pytest.approx(17 / 5) and t["prompt_ms_p95"] == pytest.approx(4 + 0.95 * (13 - 4))


def test_every_step_and_round_is_on_the_clock(trained):
    model, data = trained
    idx = data[None, :5]
    for out in (m.generate(model, idx, 20), m.generate_speculative(model, idx, 20, 0, 4)):
        lengths = [n for _, n in out.clock]
        assert lengths[0] == 5 and lengths[-1] == 25 and lengths == sorted(lengths)
        assert all(b > a for (a, _), (b, _) in zip(out.clock, out.clock[1:]))


def test_a_shifted_text_built_to_break_epsilon_is_reported_broken(records):
    recs = records[0]
    cal = m.calibration_report({"val": recs, "test": recs, "shift": recs}, "top1", [0, 1, 2], 0.05, 0.05)
    assert cal["shift"]["held"] is True  # text like val: it holds
    broken = m.ExitRecords({k: torch.ones_like(v) for k, v in recs.confidences.items()}, recs.pred, recs.nll,
                           recs.targets)  # every exit sure of itself: all leave at exit 0
    lab = types.SimpleNamespace(records={"val": recs, "test": recs, "shift": broken},
                                config=m.LabConfig(shift_path="shuffled.txt", epsilon=0.05))
    lab.calibrations = {"top1": m.calibration_report(lab.records, "top1", [0, 1, 2], 0.05, 0.05)}
    cal = lab.calibrations["top1"]
    assert cal["shift"]["disagreement"] > 0.05 and cal["shift"]["held"] is False
    notes = m.shifted_text(lab)["notes"]
    assert "epsilon was BROKEN for top1" in notes[2] and "shifted 100.0%" in notes[1]


def test_a_shifted_text_outside_the_vocabulary_is_one_line_and_status_2(tmp_path, capsys):
    odd = tmp_path / "odd.txt"
    odd.write_text("caf\u00e9 \u00fcber")
    assert m.main([f"--shift_path={odd}", f"--out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'\u00e9\u00fc'" in err and "--shift_path" in err
    one = tmp_path / "one.txt"
    one.write_text("a")
    assert m.main([f"--shift_path={one}", f"--out_dir={tmp_path}"]) == 2
    assert "under 2 characters" in capsys.readouterr().err


def test_a_point_is_beaten_only_by_one_no_worse_on_both_axes():
    rows = [{"name": n, "test_loss": loss, "speedup_greedy": x} for n, loss, x in
            (("full", 2.0, 1.0), ("spec", 2.0, 1.8), ("small", 1.9, 1.5), ("fast", 2.1, 3.0), ("twin", 1.9, 1.5),
             ("slow", 1.95, 1.49), ("quick", 1.98, 2.5))]
    zero = {(a["name"], b["name"]): 0.0 for a in rows for b in rows}  # no error bar
    # full: spec is as good and faster, small and quick better and faster: the fastest that beats it is named;
    # small and its twin tie, neither beaten; slow loses to small on both by a hair; fast, the fastest, stands
    assert m.dominated_by(rows, "greedy", zero) == ["quick", "quick", None, None, None, "small", None]


@pytest.mark.parametrize("error,beaten", [(0.124, "small"), (0.125, None), (0.126, None)])
def test_a_faster_point_beats_only_beyond_twice_the_paired_error_of_the_loss_difference(error, beaten):
    """small is faster and 0.25 lower in loss: it beats big only where 0.25 is over twice the paired
    standard error; at or under that the two are tied in loss, and big stays on the frontier. A point
    with the same predictions (an error of 0) beats only where it is faster."""
    rows = [{"name": "big", "test_loss": 2.0, "speedup_greedy": 1.0},
            {"name": "small", "test_loss": 1.75, "speedup_greedy": 1.5},
            {"name": "same", "test_loss": 2.0, "speedup_greedy": 1.0}]
    se = {(a["name"], b["name"]): error for a in rows for b in rows}
    se["same", "big"] = se["big", "same"] = 0.0
    assert m.dominated_by(rows, "greedy", se) == [beaten, None, beaten]
    rows[2]["speedup_greedy"] = 1.01  # as good, and faster
    assert m.dominated_by(rows, "greedy", se)[0] == (beaten or "same")
    assert m.dominated_by(rows, "greedy", {**se, ("small", "big"): 1.0})[0] == "same"


@pytest.mark.parametrize("margin,error,beaten", [
    (0.0, 3.6e-8, "fast"), (4e-7, 4e-7, "fast"), (6e-7, 5e-7, None), (-4e-7, 4e-7, "fast"),
    (0.0, 9e-7, "fast"), (0.0, 1.1e-6, None), (0.0, 1e-5, None), (-2e-6, 0.0, None)])
def test_a_point_whose_losses_differ_from_a_faster_ones_by_rounding_alone_is_beaten(margin, error, beaten):
    """A watched decoder at full depth predicts what the plain GPT does, its per-position losses a float
    rounding apart (another order of sums: a context-256 run gave an error of 3.6e-8 and equal means). With
    the difference (either sign) and its error together under 1e-6 the faster point beats it; at 1.1e-6, a
    difference of a real prediction (an error of 1e-5), or a slow point lower in loss by 2e-6, it stays tied."""
    rows = [{"name": "slow", "test_loss": 2.0 + margin, "speedup_greedy": 0.8},
            {"name": "fast", "test_loss": 2.0, "speedup_greedy": 1.1}]
    se = {(a["name"], b["name"]): error for a in rows for b in rows}
    assert m.dominated_by(rows, "greedy", se) == [beaten, None]


def test_a_paired_error_is_the_spread_of_the_pieces_mean_differences_over_root_n():
    """Four pieces of two positions: the differences' means a piece are -0.25, 0.25, 0 and 0.5; a
    piece's positions are not independent, so the error is over the 4 pieces, not the 8 positions."""
    a = torch.tensor([1.0, 2.0, 3.0, 4.0, 1.0, 1.0, 2.0, 2.0])
    b = torch.tensor([1.5, 2.0, 2.5, 4.0, 1.0, 1.0, 1.0, 2.0])
    se = m.paired_se({"a": a, "b": b}, 2)
    assert se["a", "a"] == 0.0 and se["a", "b"] == se["b", "a"]
    means = torch.tensor([-0.25, 0.25, 0.0, 0.5])
    assert se["a", "b"] == pytest.approx(float(means.std()) / 2)  # 4 pieces
    assert se["a", "b"] != pytest.approx(float((a - b).std()) / 8 ** 0.5)  # not over the positions


def test_compare_every_depth_as_points_of_the_frontier(tmp_path):
    args = ["--n_layer=3", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4", "--eval_iters=1",
            "--max_iters=2", "--max_new_tokens=10", "--device=cpu", "--quality_positions=30", "--bench_tokens=8",
            "--bench_repeats=1", "--bench_prompts=2", "--bench_prompt_len=8", "--sweep_positions=300",
            "--depths=all", f"--out_dir={tmp_path}"]
    with torch.enable_grad():
        assert m.main(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    names = [r["name"] for r in report["frontier"]]
    assert {"1-layer GPT", "2-layer GPT", "pruned 1", "pruned 2", "draft_model"} <= set(names)
    assert all(r["mean_layers"] == int(r["name"][0]) for r in report["strategies"] if r["name"].endswith("GPT"))
    # the draft model's depth and the exit model's (the undamaged deep model) always, then --depths
    assert m.plain_depths("", 1, 6) == [1, 6] and m.plain_depths("2,4", 1, 6) == [1, 2, 4, 6]
    assert m.plain_depths("all", 2, 4) == [1, 2, 3, 4] and m.plain_depths("6", 1, 6) == [1, 6]
    assert {"3-layer GPT", "frozen deferred"} <= set(names) and "frozen full" not in names
    # without --continued, the frozen model brings (the run's time) its decoders with an exact cache that skip
    # layers by a threshold: deferred and both drafters (its full depth is the plain GPT's point)
    assert [n for n in names if n.startswith("frozen ")] == [
        "frozen deferred", "frozen self_speculative", "frozen draft_model"]


def test_patience_k_is_exact(records):
    """Each threshold leaves a position at the first exit where k in a row agree (k the calibration's formula)."""
    recs = records[0]
    run, runs = torch.ones(recs.pred.size(1), dtype=torch.long), []
    for l in range(3):  # the run of agreeing exits up to each exit
        if l:
            run = torch.where(recs.pred[l] == recs.pred[l - 1], run + 1, torch.ones_like(run))
        runs.append(run)
    runs = torch.stack(runs)  # (3, N)
    for t in (0.0, 0.5, 0.7, 0.75, 0.8, 0.875, 0.9):
        k = next(k for k in range(1, 10) if 1 - 0.5**k > t)
        hit = torch.cat([runs >= k, torch.ones(1, runs.size(1), dtype=torch.bool)])
        assert torch.equal(m.exits_at_threshold(recs, "patience", t, [0, 1, 2]), hit.float().argmax(0)), t


def test_the_learned_rule_by_name_draws_the_sample_and_every_row(tmp_path, capsys):
    args = ["--n_layer=3", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4", "--eval_iters=1",
            "--max_iters=2", "--max_new_tokens=10", "--device=cpu", "--quality_positions=30", "--bench_tokens=8",
            "--bench_repeats=1", "--bench_prompts=2", "--bench_prompt_len=8", "--sweep_positions=300",
            "--confidence_measure=learned", "--kv_strategy=deferred", f"--out_dir={tmp_path}"]
    with torch.enable_grad():
        assert m.main(args) == 0
    assert "early-exit sample: deferred, learned > " in capsys.readouterr().out
    for bad in (["--lesson_only=1"], ["--exit_layers=0"]):
        assert m.main(args + bad) == 2
        assert "read every exit" in capsys.readouterr().err



def test_unit_costs_are_timed_at_the_workloads_typical_cache_length(model):
    """Prompts of 32 characters continued by 50, in windows of 64: a step feeds window positions 31..63, then
    (after the slide to the newest half) 31..47; their median, 43, is the cache a timed block attends to."""
    assert m.typical_position(32, 50, 64) == 43
    assert m.typical_position(3, 4, 16) == 3  # positions 2, 3, 4, 5: the median 3.5, taken down
    seen = []
    model.transformer.h[0].register_forward_pre_hook(lambda mod, args: seen.append(args[1].lengths[0]))
    costs = m.decode_costs(model, 3, 4, m.exit_rules(), repeats=3)
    assert costs["cache_length"] == 3 and seen == [3, 3, 3]  # the block stage, each repeat


def tie_lab(near_nll):
    """A lab whose frontier has full depth (loss 2.0, 1.0x), a faster point "near" with near_nll, and the
    plain GPT of full depth's shape (slower, far better): 4 pieces of 2 positions."""
    full = torch.full((8,), 2.0)
    nll = {"full": full, "near": near_nll, "2-layer GPT": torch.full((8,), 1.0)}
    speeds = {"full": 1.0, "near": 1.5, "2-layer GPT": 0.5}
    rows = [{"name": n, "mode": mode, "speedup": speeds[n], "test_loss": float(nll[n].mean()), "weight_bytes": 0,
             "cache_bytes": 0, "decoder": "full" if n != "near" else "deferred",
             "family": "plain GPT" if n.endswith("GPT") else "exit model"} for n in nll for mode in m.MODES]
    config = types.SimpleNamespace(n_layer=2, bench_tokens=2, num_draft=8)
    return types.SimpleNamespace(config=config, measured=rows, nll=nll,
                                 train_seconds=1.0, plain_gpts={})


def test_a_faster_point_within_twice_the_error_is_named_a_tie_and_beyond_it_beats():
    """near is faster and 0.05 lower in loss: with pieces' mean differences -0.3, 0.2, -0.3, 0.2 (standard error
    0.144) that is a tie, named in the notes, and full depth stays on the frontier; the same 0.05 on every
    position (error 0) beats it, and no tie is named."""
    noisy = torch.tensor([1.7, 1.7, 2.2, 2.2, 1.7, 1.7, 2.2, 2.2])
    found = m.frontier(tie_lab(noisy))
    rows = {r["name"]: r for r in found["frontier"]}
    assert rows["full"]["dominated_greedy"] is None and rows["full"]["dominated_sampled"] is None
    tie = next(n for n in found["notes"] if n.startswith("Within twice that error"))
    assert "greedy, full (near's loss); sampled, full (near's loss)." in tie
    found = m.frontier(tie_lab(torch.full((8,), 1.95)))
    assert {r["name"]: r["dominated_greedy"] for r in found["frontier"]}["full"] == "near"
    assert "greedy, none; sampled, none." in next(n for n in found["notes"] if n.startswith("Within twice"))
    assert found["recipe_cost"] == pytest.approx(1.0)  # full depth 2.0 against the 2-layer GPT's 1.0
    memory = next(n for n in found["notes"] if n.startswith("Memory:"))
    assert "Training: the exit model 1 s," in memory and "{" not in memory, "the figures filled in"
