"""Exit heads on a frozen trunk: full depth stays the plain GPT's, bit for bit."""

import pytest
import torch

from conftest import m, tiny_config


@pytest.fixture
def plain_and_frozen():
    splits = {name: torch.randint(0, 11, (2000,), generator=torch.Generator().manual_seed(i))
              for i, name in enumerate(("train", "val", "test"))}
    torch.manual_seed(0)
    plain = m.GPT(tiny_config(alpha=0.0)).eval()  # untrained heads, as a plain GPT's are
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    config = tiny_config(max_iters=12, warmup_iters=2, batch_size=4, distill_weight=0.1, layer_dropout=0.2,
                         dropout=0.1)
    frozen, seconds = m.frozen_exit_model(plain, config, splits)
    return plain, before, frozen, seconds


def test_the_trunk_and_final_head_are_unchanged_and_only_the_heads_learn(plain_and_frozen):
    plain, before, frozen, seconds = plain_and_frozen
    after = frozen.state_dict()
    trunk = [k for k in before if not k.startswith("exit_heads.")]
    assert trunk and all(torch.equal(after[k], before[k]) for k in trunk), "a checksum of the trunk"
    assert all(torch.equal(v, before[k]) for k, v in plain.state_dict().items()), "the plain GPT itself"
    heads = [k for k in before if k.startswith("exit_heads.")]
    assert all(not torch.equal(after[k], before[k]) for k in heads if k.endswith("weight")), "every head learned"
    assert seconds > 0 and not frozen.training and (frozen.config.dropout, frozen.config.layer_dropout) == (0, 0)
    assert frozen.config.max_iters == 6, "the heads train for half the run's 12 steps"
    # no gradient reaches the trunk: a head step costs a forward pass and the heads' backward
    assert [n for n, p in frozen.named_parameters() if p.requires_grad] == [
        n for n, _ in frozen.named_parameters() if n.startswith("exit_heads.")]


@pytest.mark.parametrize("batch_size", [1, 8])
def test_full_depth_is_the_plain_gpts_bit_for_bit(plain_and_frozen, batch_size):
    plain, _, frozen, _ = plain_and_frozen
    x = torch.randint(0, 11, (batch_size, 16), generator=torch.Generator().manual_seed(batch_size))
    with torch.no_grad():
        assert torch.equal(frozen.all_exit_logits(x)[-1], plain.all_exit_logits(x)[-1])
        assert not torch.equal(frozen.all_exit_logits(x)[0], plain.all_exit_logits(x)[0])
    a, b = (m.generate(model, x[:, :4], 10, temperature=0.0).tokens for model in (plain, frozen))
    assert torch.equal(a, b), "greedy decoding at full depth: the same tokens"


def test_the_plain_gpt_of_its_depth_and_the_frozen_model_join_every_table_and_the_recipe_has_a_cost():
    """In every run (no --depths): the plain GPT of the exit model's depth is trained; the frozen model brings
    the decoders it is given (run_lab: every decoder with --continued) to the same interleaved pass (named
    "frozen <decoder>", over the exit model's full depth), its exact ones equal to the plain GPT of the
    exit model's shape, itself a point of the frontier table; the recipe's cost is full depth's test loss minus that
    GPT's on the frontier's positions; the frozen model's rules, chosen rule and oracle follow the exit
    model's in the rule table, its full loss that GPT's."""
    from conftest import tiny_model

    model = tiny_model()
    config = m.LabConfig(**{**vars(model.config), "quality_positions": 40, "bench_tokens": 6, "bench_repeats": 1,
                            "bench_prompts": 2, "bench_prompt_len": 6, "sweep_positions": 300, "shift_path": "",
                            "exit_threshold": 0.5, "max_iters": 4, "eval_iters": 1, "batch_size": 2,
                            "draft_exit": 1, "depths": ""})
    splits = {name: torch.randint(0, 11, (4000,), generator=torch.Generator().manual_seed(i))
              for i, name in enumerate(("train", "val", "test"))}
    lab = m.Lab(model, m.CharTokenizer("abcdefghijk"), splits, config, "cpu")
    names = list(m.DECODERS)
    with torch.enable_grad():
        lab.records, lab.calibrations, sampling = m.calibrate_exits(model, lab.splits, config)
        lab.use(sampling)
        lab.plan()
        others = lab.freeze(names[1:])
        lab.measured = lab.measure(names, lab.other_models(), others)
    frozen, records, calibrations, rules, about = lab.exit_models["frozen"]
    plain = lab.plain_gpts[4][0]
    # the frozen model's own calibration: its threshold, its plans on its records, its learned rule
    (source, (model_, rules_, plans, points, ref)), = others.items()
    assert (source, model_, rules_, points, ref) == ("frozen ", frozen, rules, names[1:], "4-layer GPT")
    assert plans == lab.plans_for(records, 0.5, m.choose_schedule(  # the run's --exit_threshold
        records["val"], 4, config.block_size, config.schedule_disagreement))
    assert not torch.equal(rules["learned"].args[0], lab.rules["learned"].args[0]), "its own fit"
    lab.config = m.replace(config, exit_threshold=-1)  # calibrated: the frozen model's own threshold
    with torch.enable_grad():
        (_, (_, _, own_plans, _, _)), = lab.freeze(names[1:]).items()
    own = lab.exit_models["frozen"][2]["top1"]["threshold"]
    assert own_plans["backfill"]["threshold"] == own
    assert own != lab.calibrations["top1"]["threshold"], "they differ here"
    lab.config = config
    x = splits["test"][:64].view(4, 16)
    with torch.no_grad():
        assert torch.equal(frozen.all_exit_logits(x)[-1], plain.all_exit_logits(x)[-1])
    assert f"the plain 4-layer GPT ({lab.plain_gpts[4][1]:.0f} s of training), exit heads" in about
    rows = {(r["name"], r["mode"]): r for r in lab.measured}
    assert {n for n, _ in rows} >= {"full", "4-layer GPT", *(f"frozen {n}" for n in names[1:])}
    assert "frozen full" not in {n for n, _ in rows}, "its full depth is the plain GPT's point"
    for mode in m.MODES:  # exact: the plain GPT's output, at its quality
        for name in ("frozen self_speculative", "frozen draft_model"):
            r = rows[name, mode]
            assert r["output"] == ("same tokens" if mode == "greedy" else "same dist."), (name, mode)
            assert r["test_loss"] == rows["4-layer GPT", mode]["test_loss"] and r["agreement"] == 1.0
        backfill = rows["frozen backfill", mode]
        assert backfill["family"] == "exit model" and backfill["output"].startswith("agree ")
    table = m.rule_calibrations(lab)
    cal_rows = table["calibration_by_measure"]
    joint, cold = [r for r in cal_rows if r["model"] == "joint"], [r for r in cal_rows if r["model"] == "frozen"]
    assert len(joint) == len(cold) == len(lab.rules) + 2 and cal_rows == joint + cold
    assert cold[-1]["measure"] == "oracle" and cold[-2]["measure"].endswith(", chosen")
    plain_loss = m.average(m.record_exits(plain, lab.splits["test"], 300, {"top1": m.top1}).nll[-1])
    assert cold[0]["test"]["full_loss"] == pytest.approx(plain_loss, abs=1e-6)
    assert "frozen: the plain 4-layer GPT" in table["notes"][-1]
    found = m.frontier(lab)
    losses = {r["name"]: r["test_loss"] for r in found["frontier"]}
    assert found["recipe_cost"] == pytest.approx(losses["full"] - losses["4-layer GPT"])
    se = m.paired_se({n: lab.nll[n] for n in ("full", "4-layer GPT")}, config.bench_tokens)["full", "4-layer GPT"]
    assert f"The exit recipe's cost at full depth: {found['recipe_cost']:+.4f} (paired standard error {se:.4f})" in found["notes"][-1]


def test_the_runs_threshold_is_the_flags_or_the_calibrations_or_part_ones():
    sampling = {"thresholds": {"top1": 0.73, "margin": 0.2}}
    assert m.run_threshold(m.LabConfig(exit_threshold=0.5), sampling) == 0.5
    assert m.run_threshold(m.LabConfig(exit_threshold=0.0), sampling) == 0.0
    assert m.run_threshold(m.LabConfig(exit_threshold=-1, confidence_measure="margin"), sampling) == 0.2
    assert m.run_threshold(m.LabConfig(exit_threshold=-1), None) == m.Config.exit_threshold


def test_frozen_heads_learn_even_where_the_run_trains_no_exit(plain_and_frozen):
    """--alpha=0 --distill_weight=0 gives the exit losses no weight: the frozen heads still need one (alpha 1),
    or backward has nothing to differentiate; they train at the plain GPT's batch."""
    plain, before, _, _ = plain_and_frozen
    splits = {name: torch.randint(0, 11, (2000,), generator=torch.Generator().manual_seed(i))
              for i, name in enumerate(("train", "val", "test"))}
    config = tiny_config(max_iters=3, warmup_iters=1, batch_size=4, alpha=0.0, distill_weight=0.0)
    frozen, _ = m.frozen_exit_model(plain, config, splits)
    assert frozen.config.alpha == 1.0 and frozen.config.batch_size == 4, "and the plain GPT's batch"
    assert frozen.config.max_iters == 1, "half of 3 steps, rounded down"
    distilling = m.frozen_exit_model(plain, m.replace(config, distill_weight=0.1), splits)[0]
    assert distilling.config.alpha == 0.0, "distillation alone is a loss: the run's recipe, unchanged"
    assert not torch.equal(frozen.state_dict()["exit_heads.0.lm_head.weight"], before["exit_heads.0.lm_head.weight"])


def test_the_continued_model_trains_a_plain_gpt_then_the_recipe_within_the_runs_steps():
    """LayerSkip's continual setting at the same budget: a plain GPT for (1 - continued) of max_iters, then
    the whole model, trunk and heads, with the recipe for the rest: 10 steps, 7 then 3."""
    splits = {name: torch.randint(0, 11, (2000,), generator=torch.Generator().manual_seed(i))
              for i, name in enumerate(("train", "val", "test"))}
    config = m.LabConfig(**{**vars(tiny_config()), "max_iters": 10, "warmup_iters": 2, "batch_size": 4,
                            "eval_iters": 1, "continued": 0.3})
    with torch.enable_grad():
        model, about = m.continued_exit_model(config, splits)
        plain = m.train_plain_gpt(m.replace(config, max_iters=7), splits, config.n_layer)[0]
    assert isinstance(model, m.RecipeGPT) and not model.training and "for 7 steps" in about
    assert about.endswith(" s)") and "the recipe for 3 (" in about
    after, before = model.state_dict(), plain.state_dict()  # the same seed: the first stage is this GPT
    changed = [k for k in before if not torch.equal(after[k], before[k])]
    assert any(k.startswith("exit_heads.") for k in changed), "the heads learn"
    assert any(k.startswith("transformer.h.") for k in changed), "and so does the trunk"


@pytest.mark.parametrize("continued,first", [(0.2, 8), (0.25, 8), (0.5, 5)])
def test_the_continued_split_of_steps_rounds_to_the_nearest(continued, first, monkeypatch):
    """The plain stage's steps and then the recipe's, within max_iters; the recipe draws batches of its own
    (seed + 1: the plain stage's seed would replay its first batches), at the run's batch."""
    seen = []
    monkeypatch.setattr(m, "train_plain_gpt", lambda cfg, splits, n_layer: seen.append(
        (cfg.max_iters, cfg.seed, cfg.batch_size)) or (None, 0.0, 1.0))
    monkeypatch.setattr(m, "recipe_from", lambda plain, cfg, splits: seen.append(
        (cfg.max_iters, cfg.seed, cfg.batch_size)) or (None, 2.0))
    m.continued_exit_model(m.LabConfig(max_iters=10, continued=continued, seed=7, batch_size=3), {})
    assert seen == [(first, 7, 3), (10 - first, 8, 3)]
