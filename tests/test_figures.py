"""Figures a reader takes at their word: the positions a quality pass reads, the thresholds a table
prints, the counts a note names, a prediction's denominator."""
import types
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from conftest import m, tiny_model


@pytest.mark.parametrize("rows,prompt_len", [(1, 1), (1, 6), (4, 1), (4, 4), (2, 6), (3, 6)])
def test_quality_pass_teacher_forces_pieces_spread_over_the_text(no_grad, rows, prompt_len):
    """n_positions // piece pieces, evenly spread from the text's start to its end, each predicted
    after its prompt, uncached: the same loss and per-position losses, at any rows a call (3: a call
    short of rows), as the whole model run over each piece at once."""
    model = tiny_model()
    data = torch.randint(0, 11, (100,), generator=torch.Generator().manual_seed(1))
    piece, n = 10, 4
    got = m.quality_pass(m.build("full", model, None), data, piece * n + piece - 1, rows, prompt_len, piece)
    # a remainder under a piece is dropped; the first piece starts the text, the last ends it
    starts = torch.linspace(0, 100 - prompt_len - piece, n).long().tolist()
    assert starts[0] == 0 and starts[-1] + prompt_len + piece == 100 and len(set(starts)) == n
    windows = torch.stack([data[s : s + prompt_len + piece] for s in starts])
    assert windows.size(1) <= model.config.block_size  # one window: no re-prefill in the reference
    logits = model.all_exit_logits(windows)[-1][:, prompt_len - 1 : -1]  # (n, piece, V)
    nll = F.cross_entropy(logits.flatten(0, 1), windows[:, prompt_len:].flatten(), reduction="none")
    assert got["test_loss"] == pytest.approx(nll.mean().item(), abs=1e-5)
    assert torch.allclose(got["nll"], nll, atol=1e-5) and got["pred"].numel() == n * piece
    assert got["mean_layers"] == 4.0  # full depth, every row of every call


def test_the_decoder_tables_read_quality_after_the_workloads_prompt(monkeypatch):
    """measure_decoders hands quality_pass the workload's prompt length and tokens; an exact cache decodes a
    row alike in any batch, so it decodes 32 pieces a call (the watched table's STREAMS), while an approximate cache or holes decodes a piece
    a call, as it runs on the workload."""
    seen = []
    monkeypatch.setattr(m, "quality_pass", lambda decode, *a: seen.append((decode.args[0], *a[2:])) or {})
    monkeypatch.setattr(m, "speed_pass", lambda *a: {})
    config = m.LabConfig(bench_prompt_len=7, bench_tokens=9, quality_positions=90)
    names = ("full", "deferred", "state_copy", "holes", "self_speculative")
    decoders = {name: (name, dict.fromkeys(m.MODES, partial(print, name)), "full") for name in names}
    m.measure_decoders(decoders, "test", None, config)
    # speculation: full depth's quality by construction
    assert seen == [("full", 32, 7, 9), ("deferred", 32, 7, 9), ("state_copy", 1, 7, 9), ("holes", 1, 7, 9)]


def test_the_strategies_table_prints_the_calibrated_threshold_as_calibrated():
    """Thresholds sit on a 0.001 grid near 1: 0.996 must not print as 1.00, which reads "no exit"."""
    fmt = {key: fmt for key, _, fmt, _ in m.STRATEGY_TABLE[1]}["threshold"]
    assert fmt.format(0.996) == "0.996" and fmt.format(0.5) == "0.5"


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
    lab = types.SimpleNamespace(records={"val": recs}, config=m.LabConfig(
        n_layer=L, sweep_positions=100_000, confidence_measure="top1"))
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
