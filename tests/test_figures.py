"""Figures a reader takes at their word: the positions a quality pass reads, the thresholds a table
prints, the peaks a frontier point keeps, the counts a note names, a prediction's denominator."""
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import m, tiny_model


@pytest.mark.parametrize("batch_size,prompt_len", [(1, 1), (1, 6), (4, 1), (4, 4), (2, 6)])
def test_quality_pass_teacher_forces_each_row_after_its_prompt(no_grad, batch_size, prompt_len):
    """Every row predicts its piece's characters after a prompt, uncached: the same loss, at every
    batch size, as the whole model run over each piece at once."""
    model = tiny_model()
    data = torch.randint(0, 11, (100,), generator=torch.Generator().manual_seed(1))
    per_row = 10
    pieces = data[: batch_size * (prompt_len + per_row)].view(batch_size, -1)
    assert pieces.size(1) <= model.config.block_size  # one window: no re-prefill in the reference
    logits = model.all_exit_logits(pieces)[-1][:, prompt_len - 1 : -1]  # (B, per_row, V)
    want = F.cross_entropy(logits.flatten(0, 1), pieces[:, prompt_len:].flatten()).item()
    got = m.quality_pass(m.build("full", model, None), data, per_row * batch_size + batch_size - 1,
                         batch_size, prompt_len)  # a remainder under a row is dropped
    assert got["test_loss"] == pytest.approx(want, abs=1e-5)
    assert got["pred"].numel() == batch_size * per_row


def test_the_decoder_tables_read_quality_after_the_workloads_prompt(monkeypatch):
    """measure_decoders hands quality_pass the workload's prompt length at every batch size."""
    seen = []
    monkeypatch.setattr(m, "quality_pass", lambda *a: seen.append(a[3:]) or {})
    monkeypatch.setattr(m, "speed_pass", lambda *a: {})
    config = m.LabConfig(bench_prompt_len=7)
    for batch_size in (1, 16):
        decoders = {name: (name, dict.fromkeys(m.MODES, print), "full") for name in ("full", "self_speculative")}
        m.measure_decoders(decoders, "test", None, config, batch_size)
    assert seen == [(1, 7), (16, 7)]  # speculation: full depth's quality by construction


def test_the_strategies_table_prints_the_calibrated_threshold_as_calibrated():
    """Thresholds sit on a 0.001 grid near 1: 0.996 must not print as 1.00, which reads "no exit"."""
    fmt = {key: fmt for key, _, fmt, _ in m.STRATEGY_TABLE[1]}["threshold"]
    assert fmt.format(0.996) == "0.996" and fmt.format(0.5) == "0.5"


def test_a_frontier_point_keeps_the_larger_peak_of_its_two_modes():
    rows = [{"name": "full", "mode": "greedy", "speedup": 1.0, "test_loss": 2.0, "peak_bytes": 10},
            {"name": "full", "mode": "sampled", "speedup": 1.0, "test_loss": 2.0, "peak_bytes": 30},
            {"name": "holes", "mode": "greedy", "speedup": 1.5, "test_loss": 2.1, "peak_bytes": None},
            {"name": "holes", "mode": "sampled", "speedup": 1.2, "test_loss": 2.1, "peak_bytes": None}]
    points = {p["name"]: p for p in m.frontier_points(rows)}
    assert points["full"]["peak_bytes"] == 30 and points["holes"]["peak_bytes"] is None
    assert rows[0]["peak_bytes"] == 10  # the table's rows are left as they were


def test_a_notes_position_count_is_what_was_recorded_not_what_was_asked():
    """sweep_positions larger than a split records the split: the notes name that count."""
    records = {s: types.SimpleNamespace(targets=torch.zeros(n)) for s, n in (("val", 1234), ("test", 99))}
    lab = types.SimpleNamespace(records=records, config=m.LabConfig(sweep_positions=100_000))
    assert m.recorded(lab, "val") == "1,234" and m.recorded(lab, "test") == "99"
    # the sweep's notes, on 1,234 recorded val positions
    n, L = 1234, 4
    conf = torch.rand(L - 1, n, generator=torch.Generator().manual_seed(0))
    pred = torch.randint(0, 3, (L, n), generator=torch.Generator().manual_seed(1))
    recs = m.ExitRecords({"top1": conf}, pred, torch.rand(L, n), torch.zeros(n, dtype=torch.long))
    lab = types.SimpleNamespace(records={"val": recs}, checked=[0, 1, 2],
                                config=m.LabConfig(sweep_positions=100_000, confidence_measure="top1"))
    notes = m.threshold_sweep(lab)["notes"]
    assert "on 1,234 val positions" in notes[0] and "on the 1,234 val positions" in notes[1]
    assert m.rule_calibrations.__code__.co_names.count("recorded") == 1


def test_a_plans_price_by_hand(no_grad):
    """Every token leaving at layer 0 of 4: holes saves 3 blocks and the final head and pays a check a step;
    backfill runs the blocks above (only the head saved); state copy also pays its write."""
    model = tiny_model()
    records = m.record_exits(model, torch.randint(0, 11, (200,)), 100, {"top1": m.EXIT_RULES["top1"]})
    plan = {"measure": "top1", "threshold": 0.0, "checked_exits": [0]}
    costs = {"block": 0.5, "final_head": 0.1, "check top1": 0.05, "state_copy": 0.2}
    counts = m.plan_counts(records, plan)
    assert counts == {"early": 1.0, "skipped": 3.0, "checks": 1.0}
    price = {name: m.priced_saving(m.DECODERS[name], counts, "top1", costs) for name in ("holes", "backfill", "state_copy")}
    assert price == pytest.approx({"holes": 1.55, "backfill": 0.05, "state_copy": 1.35})
