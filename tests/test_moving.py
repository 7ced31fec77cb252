"""A threshold that moves: its guarantee holds on any stream and is tight at its horizon, it follows a
jump in disagreement and brings the rate back, it stays put on a stream like its calibration; a watched
decoder moves it as the rule does on the records, spot checks cost layers and find what backfill finds; the
monitor's bounds hold at every position under shift."""

import json
import math
from dataclasses import replace

import pytest
import torch

from conftest import THREE_LAYER_RUN, m, tiny_model

EPS, CREDIT, CLIMB, HORIZON = 0.01, 15, 4, 20000
TARGET = EPS - (CREDIT + CLIMB + 1) / HORIZON
CONFIG = m.LabConfig(epsilon=EPS, adapt_credit=CREDIT, adapt_horizon=HORIZON)


def moving_path(wrong, start, config=CONFIG):
    """The Monitor on a recorded stream, every label fed back at once: wrong[i][t], does position t disagree
    with full depth leaving at the i-th threshold (the 0th, 1.0, never does)? Each position's index."""
    monitor, path = m.Monitor(start, config), []
    for t in range(len(wrong[0])):
        path.append(monitor.index())
        monitor.update(wrong[path[-1]][t])
    return path


def coupled(chances, start, seed=0):
    """wrong[i][t] for a stream whose chance of disagreeing at position t, at the calibrated index start, is
    chances[t], and i / start of it at index i (index 0, threshold 1.0, never disagrees): one uniform draw a
    position, so a more cautious index never disagrees where a less cautious one agrees."""
    u = torch.rand(len(chances), generator=torch.Generator().manual_seed(seed))
    scale = torch.arange(start + 1)[:, None] / start
    return (u[None, :] < scale * torch.as_tensor(chances)[None, :]).tolist()


def run(wrong, start):
    return moving_path(wrong, start)


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


def test_a_monitor_for_a_batch_keeps_its_bound_when_a_step_brings_every_rows_disagreement():
    """32 rows a step, each disagreeing wherever it may leave early: the target leaves room for a step's 32, so
    at the horizon's 20,000 positions at most epsilon disagree; a target that leaves room for one would not."""
    for batch, keeps in ((32, True), (1, False)):
        monitor, k = m.Monitor(40, CONFIG, batch), 0
        for _ in range(HORIZON // 32):
            wrong = 32 if monitor.index() > 0 else 0
            k += wrong
            monitor.update(wrong, 32)
        assert (k <= EPS * HORIZON) == keeps


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
        path = moving_path(wrong.tolist(), start, config)
        stays = sum(i >= start - 1 for i in path) / len(path)
        if wrong[start].float().mean() <= config.epsilon:
            kept += 1
            assert stays >= 0.95, seed
        else:
            assert stays < 0.95 and sum(wrong[i][t] for t, i in enumerate(path)) <= config.epsilon * len(path)
    assert kept >= 7


@pytest.fixture(scope="module")
def watched_text(trained):
    """The trained tiny model, 1,200 positions of text recorded, a threshold (0.2) whose disagreement there is
    over four times epsilon (2%), and full depth's top-1 as the decoder makes it."""
    model, data = trained
    text, n = data[5000:6201], 1200
    records = m.record_exits(model, text, n, {"top1": m.EXIT_RULES["top1"]})
    full = m.generate(model, text[None, :1], n, forced=text[None, 1:]).logits[0].argmax(-1)
    config = m.LabConfig(epsilon=0.02, adapt_credit=3, adapt_horizon=1000)
    plan = {"measure": "top1", "threshold": 0.2, "checked_exits": range(3)}
    return model, text, records, full, config, plan


def decode(model, text, name, plan, config):
    watched_plan, monitor = m.watched(name, model, plan, config)
    return m.build(name, model, watched_plan)(text[None, :1], len(text) - 1, forced=text[None, 1:]), monitor


@pytest.mark.usefixtures("no_grad")
def test_a_watched_backfill_leaves_where_the_moving_rule_does_on_the_records(watched_text):
    """Backfill labels every exit at once: decoding, it leaves at every position where the Monitor run on the
    records of the same text leaves, and keeps epsilon where the fixed threshold is four times over it."""
    model, text, records, full, config, plan = watched_text
    start, cols = m.THRESHOLDS.index(0.2), torch.arange(len(full))
    exits = torch.stack([m.exits_at_threshold(records, "top1", t, range(3)) for t in m.THRESHOLDS[: start + 1]])
    wrong = (records.pred != records.pred[-1]).gather(0, exits)
    path = torch.tensor(moving_path(wrong.tolist(), start, config))
    out, monitor = decode(model, text, "backfill", plan, config)
    assert torch.equal(out.exited_at[0], exits[path, cols])
    assert len(set(path.tolist())) > 10  # it moved
    assert wrong[start].float().mean() > 4 * config.epsilon
    assert monitor.seen == len(full) and monitor.wrong == int(wrong[path, cols].sum())
    assert int((out.logits[0].argmax(-1) != full).sum()) == monitor.wrong <= config.epsilon * len(full)


@pytest.mark.usefixtures("no_grad")
@pytest.mark.parametrize("name", ["deferred", "state_copy", "holes"])
def test_spot_checks_label_their_share_and_keep_epsilon(watched_text, name):
    """A decoder that skips layers sees labels on its spot checks alone, about spot_share of positions; they
    run layers (none at share 0, which never moves); and its disagreement with full depth stays near epsilon,
    where its fixed threshold is four times over it."""
    model, text, _, full, config, plan = watched_text
    fixed = m.build(name, model, plan)(text[None, :1], len(full), forced=text[None, 1:])
    if name != "deferred":  # a shadowed window's room (17 steps / share) needs a longer horizon
        config = replace(config, adapt_horizon=5000)
    for share in (0.0, 0.25, 0.5):
        out, monitor = decode(model, text, name, plan, replace(config, spot_share=share))
        assert abs(monitor.seen / len(full) - share) < (0.05 if name == "deferred" else 0.15)  # windows
        if share == 0:
            assert torch.equal(out.exited_at, fixed.exited_at) and out.layers_run == fixed.layers_run
        else:
            assert out.layers_run > fixed.layers_run
            assert (out.logits[0].argmax(-1) != full).float().mean() < 1.5 * config.epsilon
    assert (fixed.logits[0].argmax(-1) != full).float().mean() > 4 * config.epsilon


@pytest.mark.usefixtures("no_grad")
def test_a_spot_check_on_every_step_is_backfill(watched_text):
    """At share 1 every step of deferred is a spot check: the layers above every exit run, as backfill's do,
    so it leaves where a watched backfill leaves and finds the same disagreements."""
    model, text, _, _, config, plan = watched_text
    ref, ref_monitor = decode(model, text, "backfill", plan, config)
    out, monitor = decode(model, text, "deferred", plan, replace(config, spot_share=1.0))
    assert torch.equal(out.exited_at, ref.exited_at)
    assert monitor.wrong == ref_monitor.wrong > 0 and monitor.seen == ref_monitor.seen


@pytest.mark.usefixtures("no_grad")
@pytest.mark.parametrize("name", ["state_copy", "holes"])
def test_a_shadowed_decoder_labels_with_full_depth_not_its_own_cache(watched_text, name):
    """State copy and holes read a cache that is not full depth's, so their spot checks shadow a window with an
    exact cache: at share 1 every position is labelled with full depth's own top-1, and the disagreements
    found are exactly the decoder's with full depth, those at the last layer (its cache's) included."""
    model, text, _, full, config, plan = watched_text
    out, monitor = decode(model, text, name, plan, replace(config, spot_share=1.0, adapt_horizon=5000))
    wrong = out.logits[0].argmax(-1) != full
    assert monitor.seen == len(full) and monitor.wrong == int(wrong.sum()) > 0
    assert (wrong & (out.exited_at[0] == model.config.n_layer - 1)).any(), "its cache alone misleads it"


@pytest.mark.usefixtures("no_grad")
@pytest.mark.parametrize("name", ["state_copy", "holes"])
def test_a_shadow_holds_its_threshold_through_a_window_and_its_runs_count(watched_text, name):
    """A shadowed decoder sets its threshold as a window begins and holds it till the window moves, so whether
    a window is labelled says nothing of where it leaves; it labels whole windows, about spot_share of them;
    and each labelled position costs n_layer layer runs, counted in its Generation beside its own."""
    model, text, _, full, config, plan = watched_text
    watched_plan, monitor = m.watched(name, model, plan, replace(config, spot_share=0.5, adapt_horizon=5000))
    decode = m.build(name, model, watched_plan)
    strategy, held = watched_plan["strategy"].func, []
    real = strategy.exit_threshold
    strategy.exit_threshold = lambda self, t: held.append(real(self, t)) or held[-1]
    out = decode(text[None, :1], len(full), forced=text[None, 1:])
    starts, start = [], None
    for n in range(1, len(full) + 1):  # each step's window, as generate places it
        starts.append(start := m.window_start(start, n, model.config.block_size))
    windows = {s: {t for t, w in zip(held, starts) if w == s} for s in starts}
    assert all(len(t) == 1 for t in windows.values()) and len(set(held)) > 1, "held through each, moved"
    assert 0.3 < monitor.seen / len(full) < 0.7 and monitor.seen % 1 == 0
    L = model.config.n_layer
    assert out.layers_run == int((out.exited_at + 1).sum()) + L * monitor.seen


@pytest.mark.parametrize("name,share", [("backfill", 1.0), ("deferred", 0.25), ("holes", 0.5)])
def test_a_watched_decoders_monitor_leaves_room_for_what_one_update_brings(model, name, share):
    """A spot check finds disagreements counted 1 / share, so one update of `rows` rows may bring rows / share:
    the target leaves that room (backfill labels every exit: rows; holes, decoded a piece a call whatever rows is
    asked, holds its threshold a window). It starts at the grid's threshold at or
    above the plan's, never a less cautious one: 0.905 starts at 0.91, 0.91 at itself, 0.9 at itself."""
    config = m.LabConfig(spot_share=0.25 if name == "deferred" else 0.5)
    for threshold, start in ((0.905, 0.91), (0.91, 0.91), (0.9, 0.9)):
        plan = {"measure": "top1", "threshold": threshold, "checked_exits": [0]}
        _, monitor = m.watched(name, model, plan, config, rows=8)
        assert m.THRESHOLDS[monitor.start] == start
        T = model.config.block_size  # a shadowed window's steps, with the workload's prompts
        steps = T - min(config.bench_prompt_len, T // 2) + 1 if name == "holes" else 1
        room = config.adapt_credit + 4 + (1 if name == "holes" else 8) * steps / share  # holes: a piece a call
        assert monitor.target == pytest.approx(config.epsilon - room / config.adapt_horizon)


def test_the_bound_holds_at_every_position_under_shift():
    """Streams whose chance of disagreeing jumps between 0.5% and 4% in blocks: the mean chance so far stays
    under the bound at every position in at least 1 - alpha of the streams, and the bound closes in."""
    alpha, n, streams = 0.2, 4000, 200
    g = torch.Generator().manual_seed(0)
    t = torch.arange(n)
    chances = torch.where((t // 500) % 2 == 0, 0.005, 0.04)
    mean = chances.cumsum(0) / (t + 1)
    misses = 0
    for _ in range(streams):
        k = (torch.rand(n, generator=g) < chances).float().cumsum(0)
        upper = m.rate_bound(k, t + 1.0, alpha)
        misses += bool((mean > upper).any())
    assert misses <= alpha * streams
    assert float(upper[-1] - mean[-1]) < 0.015


def test_the_bound_is_the_tightest_of_its_bets_one_step_either_side():
    """At k = 20 of n = 1000, the upper bound is a disagreement rate whose supermartingale reaches 1 / alpha,
    split among the bets: a rate a little above it is ruled out, one a little below is not."""
    k, n, alpha = torch.tensor(20.0), torch.tensor(1000.0), 0.05
    upper = m.rate_bound(k, n, alpha)
    a = math.log(4 / alpha)

    def wealth(p, b):  # the log of a bet's supermartingale at mean chance p
        return (-math.expm1(-b)) * p * 1000 - b * 20

    bets = (0.1, 0.3, 1.0, 3.0)
    assert max(wealth(float(upper) + 1e-4, b) for b in bets) > a
    assert max(wealth(float(upper) - 1e-4, b) for b in bets) < a
    assert 0.02 < float(upper) < 0.04


def test_the_report_holds_each_exit_models_watched_decoders(lab_runs):
    r = json.loads((lab_runs(THREE_LAYER_RUN)[2] / "report.json").read_text())
    rows = r["moving"]
    assert [(row["model"], row["decoder"], row["text"]) for row in rows] == [
        (model, decoder, text) for text in ("test", "shift") for model in ("joint", "frozen", "continued")
        for decoder in ("backfill", "deferred", "state_copy", "holes")]  # a study's: every exit decoder's
    for row in rows:  # an exact cache leaves at the same thresholds or more cautious ones
        if row["decoder"] in ("backfill", "deferred"):
            assert row["moving"]["compute_saved"] <= row["fixed"]["compute_saved"] + 1e-9
        assert 0 <= row["labelled"] <= 1 and row["upper"] >= 0
        assert (row["labelled"] == 1) == (row["decoder"] == "backfill")
        # exits before the last layer, on the text beside calibration's on val at the same plan
        L, early, saved = r["config"]["n_layer"], row["fixed"]["early"], row["fixed"]["compute_saved"]
        assert early / L - 1e-9 <= saved <= early * (L - 1) / L + 1e-9, "each early exit skips 1 to L - 1 layers"
        if row["model"] == "joint":
            assert row["val_early"] == r["plans"][row["decoder"]]["early"]
    assert "Self-speculation needs none of this" in " ".join(r["notes"]["moving"])


def looped_lab(**overrides):
    """A tiny lab whose val is random and whose test is a loop, planned at threshold 0.8, its sources set as
    Lab.measure sets them (full depth and every exit decoder of the joint model)."""
    model = tiny_model()
    config = m.LabConfig(**{**vars(model.config), "sweep_positions": 320, "shift_path": "", "exit_threshold": 0.8,
                            "bench_prompt_len": 6, "bench_tokens": 6, "max_iters": 2, "eval_iters": 1, **overrides})
    splits = {name: torch.randint(0, 11, (4000,), generator=torch.Generator().manual_seed(i))
              for i, name in enumerate(("train", "val"))} | {"test": torch.arange(4000) % 3}  # a loop
    lab = m.Lab(model, m.CharTokenizer("abcdefghijk"), splits, config, "cpu")
    with torch.enable_grad():
        lab.records, lab.calibrations, sampling = m.calibrate_exits(model, lab.splits, config)
    lab.use(sampling)
    lab.plan()
    lab.sources = {"": (model, lab.rules, lab.plans, list(m.DECODERS), "full")}
    return lab


def test_each_row_sets_the_texts_exits_beside_calibrations_on_val():
    """val_early is the plan's share of val positions leaving before the last layer (calibration's exits);
    early, the same share on the text at the fixed threshold: on text unlike val the two differ."""
    lab = looped_lab()
    rows = m.watched_decoders(lab)["moving"]
    assert [(r["decoder"], r["text"]) for r in rows] == [("backfill", "test"), ("deferred", "test")]
    for row in rows:
        plan = lab.plans[row["decoder"]]
        exits = m.exits_at_threshold(lab.records["val"], plan["measure"], plan["threshold"], plan["checked_exits"])
        assert row["val_early"] == m.average(exits < lab.config.n_layer - 1) and 0 < row["val_early"] < 1
        assert abs(row["fixed"]["early"] - row["val_early"]) > 0.1, "the loop leaves at other depths"


@pytest.mark.parametrize("continued", [0.0, 0.5])
def test_a_study_watches_state_copy_and_holes_a_piece_a_call(monkeypatch, continued):
    """Exact caches decode the table's 32 pieces together; a study (--continued) adds state copy and holes,
    each decoded a piece a call as it runs, its monitor leaving room for one piece's window of spot checks
    (its steps / share, the window held at one threshold).
    A watched decoder with an exact cache that skips layers saves (1 - spot_share) of what its exits skip: its
    spot checks run them again; backfill runs them anyway and a fixed threshold spot-checks nothing. A shadow
    runs every layer where it labels: state copy and holes save what their exits skip less that share."""
    lab, calls, real = looped_lab(continued=continued), [], m.quality_pass

    def recording(decode, data, n, rows, *a):
        calls.append(((n, rows), real(decode, data, n, rows, *a)))
        return calls[-1][1]
    monkeypatch.setattr(m, "quality_pass", recording)
    found = m.watched_decoders(lab)
    names = ["backfill", "deferred"] + ["state_copy", "holes"] * bool(continued)
    assert [r["decoder"] for r in found["moving"]] == names
    assert [c[0] for c in calls] == [(320, 32)] * 5 + [(320, 1)] * 4 * bool(continued), "full, then each twice"
    cfg = lab.config
    window = cfg.block_size - min(cfg.bench_prompt_len, cfg.block_size // 2) + 1
    for row in found["moving"]:
        room = {"backfill": 32, "deferred": 32 / cfg.spot_share}.get(row["decoder"], window / cfg.spot_share)
        assert row["target"] == m.Monitor(0, cfg, room).target
    L, share = lab.config.n_layer, lab.config.spot_share
    for row, (fixed, moving) in zip(found["moving"], zip(calls[1::2], calls[2::2])):
        for kind, (_, q) in (("fixed", fixed), ("moving", moving)):
            skipped = 1 - m.average(q["exits"] + 1) / L
            spot = share if kind == "moving" and row["decoder"] == "deferred" else 0.0
            shadow = row["labelled"] if kind == "moving" and row["decoder"] in ("state_copy", "holes") else 0.0
            assert row[kind]["compute_saved"] == pytest.approx((1 - spot) * skipped - shadow), (row["decoder"], kind)
        if row["decoder"] in ("state_copy", "holes"):  # a piece a call: a head on each labelled step at most
            assert 0 < row["heads"] <= row["labelled"] < 1


@pytest.mark.parametrize("block_size", [16, 64])
def test_a_shadowed_monitors_room_is_the_longest_window_its_prompts_give(block_size):
    """With the workload's prompts (bench_prompt_len characters), the most steps generate keeps in one window
    is the T a shadowed monitor leaves room for (rows * T / share): one step fewer would understate it."""
    model, config = tiny_model(block_size=block_size), m.LabConfig(spot_share=0.5)
    plan = {"measure": "top1", "threshold": 0.9, "checked_exits": [0]}
    _, monitor = m.watched("holes", model, plan, config)
    room = (config.epsilon - monitor.target) * config.adapt_horizon - config.adapt_credit - 4
    start, steps = None, []
    for n in range(config.bench_prompt_len, config.bench_prompt_len + 6 * block_size):
        s = m.window_start(start, n, block_size)
        steps = steps + [0] if s != start else steps
        steps[-1], start = steps[-1] + 1, s
    assert room * config.spot_share == pytest.approx(max(steps))


def test_the_strategies_table_times_each_watched_decoder_with_one_monitor_carried_from_val(monkeypatch):
    """The decoder table holds each watchable exit decoder watched ("watched deferred"), beside its fixed row in
    both modes: its forecast timed on val's workload, its loss teacher-forced on test, its speed on test's
    workload, every one of them by the Watched strategy, with one Monitor carried from val through test, sized
    for the rows its quality pass decodes a step (STREAMS, as the watched table's)."""
    from test_frontier import measured_lab
    model = tiny_model()
    config = m.LabConfig(**{**vars(model.config), "quality_positions": 40, "bench_tokens": 6, "bench_repeats": 1,
                            "bench_prompts": 2, "bench_prompt_len": 6, "sweep_positions": 300, "shift_path": "",
                            "exit_threshold": 0.5, "max_iters": 2, "eval_iters": 1, "batch_size": 2,
                            "spot_share": 1.0,  # every step labelled: each pass feeds the Monitor
                            "epsilon": 0.99})  # and its threshold never moves: the fixed one's output
    splits = {name: torch.randint(0, 11, (4000,), generator=torch.Generator().manual_seed(i))
              for i, name in enumerate(("train", "val", "test"))}
    seen, real_speed, real_quality = [], m.speed_pass, m.quality_pass

    def monitor(decode):  # the Monitor of a watched decoder (in_mode wraps it), None for any other
        plan = decode.keywords.get("strategy") or getattr(decode.func, "keywords", {}).get("strategy")
        return plan.args[1] if isinstance(plan, m.partial) and issubclass(plan.func, m.Watched) else None

    def speed_pass(decoders, prompts, *a):
        seen.extend(("speed", key[0], monitor(d), monitor(d) and monitor(d).seen) for key, d in decoders.items())
        return real_speed(decoders, prompts, *a)

    def quality_pass(decode, *a):
        seen.append(("quality", a[2], monitor(decode), monitor(decode) and monitor(decode).seen))
        return real_quality(decode, *a)
    monkeypatch.setattr(m, "speed_pass", speed_pass)
    monkeypatch.setattr(m, "quality_pass", quality_pass)
    lab = measured_lab(model, config, splits)
    watched = {r["name"]: r for r in lab.measured if r["name"].startswith("watched ")}
    assert sorted(watched) == ["watched backfill", "watched deferred"]
    assert {(r["name"], r["mode"]) for r in lab.measured} >= {(n, mode) for n in watched for mode in m.MODES}
    for row in watched.values():
        assert row["decoder"] == row["name"].split()[-1] and row["predicted_speedup"] > 0
    for name in watched:
        monitors = {id(s[2]) for s in seen if s[1] == name}
        assert len(monitors) == 1, "one Monitor a watched decoder, in both modes, val and test"
        mine = [s for s in seen if s[2] is not None and id(s[2]) in monitors]
        assert [s[0] for s in mine] == ["speed", "speed", "quality", "speed", "speed"], "val, test's positions, test"
        assert mine[2][1] == m.STREAMS, "its quality pass decodes the rows its Monitor leaves room for"
        assert mine[2][2].target == m.Monitor(0, lab.config, m.STREAMS).target  # a share of 1: rows a step
        counts = [s[3] for s in mine]  # the labels seen as each pass starts (a speed pass's modes at once)
        assert counts[0] == counts[1] < counts[2] < counts[3] == counts[4], "val's, then test's, carried on"
    fixed = {(r["name"], r["mode"]) for r in lab.measured if r["name"] in ("backfill", "deferred")}
    assert len(fixed) == 4, "each beside its fixed row"
    for name in ("backfill", "deferred"):  # its loss is its own decode's: here, at the fixed threshold, the fixed one's
        assert torch.allclose(lab.nll["watched " + name], lab.nll[name], atol=1e-5), name
        assert watched["watched " + name]["test_loss"] == pytest.approx(lab.nll["watched " + name].mean().item())
