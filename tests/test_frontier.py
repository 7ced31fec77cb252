"""When does early exit pay: speculation with a separate draft model, depth pruning, memory, and every
point of the frontier measured on the same test positions and the same workload."""

import copy

import pytest
import torch

from conftest import KV_STRATEGIES, m, tiny_model

pytestmark = pytest.mark.usefixtures("no_grad")


def layer_zero_as_a_model(model):
    """A 1-layer GPT that drafts as self-speculation's draft does: the model's embeddings, block 0 and
    exit head 0, as a separate model with a cache of its own."""
    draft = m.GPT(m.replace(model.config, n_layer=1))
    draft.transformer.wte, draft.transformer.wpe = copy.deepcopy(model.transformer.wte), copy.deepcopy(model.transformer.wpe)
    draft.transformer.h = copy.deepcopy(model.transformer.h[:1])
    draft.transformer.ln_f, draft.lm_head = copy.deepcopy(model.exit_heads[0].ln), copy.deepcopy(model.exit_heads[0].lm_head)
    return draft.eval()


def test_a_draft_model_drafts_what_layer_zero_would_and_verifies_at_full_depth(trained):
    """The same accept rule, the draft model's own cache, the model verifying every layer: greedy output
    is full depth's, at batch 1 and 8, past block_size; with layer 0 as the draft model, it keeps exactly
    the drafts self-speculation keeps."""
    model, data = trained
    draft = layer_zero_as_a_model(model)
    idx = torch.stack([data[2500 * b : 2500 * b + 5] for b in range(8)])
    batch = m.generate_speculative(model, idx, 100, num_draft=4, draft_model=draft)  # 100 > 3 windows of 32
    for b in (0, 5):
        alone = m.generate_speculative(model, idx[b : b + 1], 100, num_draft=4, draft_model=draft)
        full = m.generate(model, idx[b : b + 1], 100, temperature=0.0)
        assert torch.equal(alone.tokens, full.tokens) and torch.equal(batch.tokens[b], full.tokens[0])
        self_spec = m.generate_speculative(model, idx[b : b + 1], 100, 0, 4)
        assert torch.equal(alone.exited_at, self_spec.exited_at) and alone.stats == self_spec.stats
    assert 0 < batch.stats["accepted"] < batch.stats["drafted"]


def test_a_draft_model_samples_the_full_models_distribution():
    """Two tokens from a fixed context, 20,000 rows at once, a draft model unlike the model: the pairs have
    the full model's distribution at temperature 0.7 (computed here from its logits)."""
    from test_speculative import tv_bound

    model, draft = tiny_model(n_layer=3), tiny_model(seed=1, n_layer=2)
    idx, V, n, t = torch.tensor([[3, 1, 4]]), 11, 20000, 0.7

    def dist(ctx):
        return (model(ctx)[0][0, -1] / t).softmax(-1)
    probs1 = dist(idx)
    joint = torch.stack([probs1[a] * dist(torch.cat([idx, torch.tensor([[a]])], 1)) for a in range(V)])
    gen = torch.Generator().manual_seed(0)
    pairs = m.generate_speculative(model, idx.repeat(n, 1), 2, num_draft=2, temperature=t, generator=gen,
                                   draft_model=draft).tokens[:, 3:]
    emp = torch.zeros(V * V).index_add_(0, pairs[:, 0] * V + pairs[:, 1], torch.ones(n)).view(V, V) / n
    assert 0.5 * (emp - joint).abs().sum() < tv_bound(V * V, n)
    assert 0.5 * ((draft(idx)[0][0, -1] / t).softmax(-1) - probs1).abs().sum() > 0.1, "the draft must differ"


def test_pruning_removes_the_blocks_that_change_the_residual_stream_least():
    model = tiny_model()
    with torch.no_grad():  # block 1 adds nothing to the residual stream: its output is its input
        model.transformer.h[1].attn.c_proj.weight.zero_()
        model.transformer.h[1].mlp.c_proj.weight.zero_()
    x = torch.randint(0, 11, (4, 16), generator=torch.Generator().manual_seed(0))
    distances = m.block_distances(model, x)
    states = [model.embed(x), *model.hidden_states(x)]
    cos = torch.nn.functional.cosine_similarity(states[2], states[3], dim=-1)
    assert distances[1] == pytest.approx(0.0, abs=1e-3) and min(distances) == distances[1]  # float32's cosine
    assert distances[2] == pytest.approx((torch.arccos(cos.clamp(-1, 1)) / torch.pi).mean().item())
    logits = model.all_exit_logits(x)[-1]
    same = m.pruned(model, distances, 0)  # k = 0: the full model
    assert same.config.n_layer == 4 and torch.equal(same.all_exit_logits(x)[-1], logits)
    one = m.pruned(model, distances, 1)  # without block 1, which changed nothing: the same logits
    assert one.config.n_layer == 3 and torch.allclose(one.all_exit_logits(x)[-1], logits, atol=1e-5)
    assert len(m.pruned(model, distances, 3).transformer.h) == 1 and model.config.n_layer == 4, "a copy"
    # decoded at full depth over the blocks left: its own cache, three layers a token
    out = m.generate(one, x[:1, :3], 20, temperature=0.0)
    assert out.layers_run == 20 * 3
    assert torch.equal(out.tokens, m.generate(model, x[:1, :3], 20, temperature=0.0).tokens)


def test_memory_is_read_from_the_tensors_a_decoder_holds(trained):
    model, data = trained
    cfg = model.config
    C, V, L, T = cfg.n_embd, cfg.vocab_size, cfg.n_layer, cfg.block_size
    head = C + C * V  # an exit head's LayerNorm weight and Linear, in floats
    every = sum(p.numel() for p in model.parameters())
    assert m.weight_bytes(model) == 4 * (every - (L - 1) * head)
    plan = {"measure": "top1", "threshold": 0.5, "checked_exits": [0, 2]}
    assert m.weight_bytes(model, "holes", plan) == 4 * (every - (L - 3) * head)
    # state copy reads the keys' and values' projections it folds, besides the heads it checks
    folded = sum(t.nbytes for t in m.state_copy_projections(model))
    assert folded > 0 and m.weight_bytes(model, "state_copy", plan) == m.weight_bytes(model, "holes", plan) + folded
    draft = m.pruned(model, [0.0] * L, L - 1)  # any one-layer model of the same width
    config = m.replace(cfg, draft_exit=1)
    # self-speculation reads the head it drafts from; a draft model's decoder reads the draft model too
    own = m.draft_plan("self_speculative", config, 4, draft)
    assert m.weight_bytes(model, "self_speculative", own) == 4 * (every - (L - 2) * head)
    other = m.draft_plan("draft_model", config, 4, draft)
    assert m.weight_bytes(draft) > 0
    assert m.weight_bytes(model, "draft_model", other) == m.weight_bytes(model) + m.weight_bytes(draft)
    idx = data[None, :5]
    # keys and values: 2 x layers x heads x positions x head size floats, a row
    assert m.generate(model, idx.repeat(3, 1), 5).cache_bytes == 2 * L * cfg.n_head * T * (C // cfg.n_head) * 4
    spec = m.generate_speculative(model, idx, 5, 0, 4)  # the window and 4 spare slots for drafts
    assert spec.cache_bytes == 2 * L * C * (T + 4) * 4
    both = m.generate_speculative(model, idx, 5, num_draft=4, draft_model=draft)
    assert both.cache_bytes == 2 * (L + 1) * C * (T + 4) * 4, "the draft model's cache counts for its decoder"


def measured_lab(model, config, splits):
    """A Lab through run_lab's steps up to its decoder table: every rule calibrated, the calibration
    in use, the unit costs and the exit plans chosen on val, every decoder and model measured (lab.measured)."""
    lab = m.Lab(model, m.CharTokenizer("abcdefghijk"), splits, config, "cpu")
    with torch.enable_grad():  # the learned rule is fitted, the smaller models trained
        lab.records, lab.calibrations, sampling = m.calibrate_exits(model, lab.splits, config)
        lab.use(sampling)
        lab.plan()
        lab.measured = lab.measure(list(m.DECODERS), lab.other_models(), {})
    return lab


def test_every_point_of_the_frontier_is_measured_on_the_same_positions_and_workload(monkeypatch):
    """Each point's test loss is its own decoder teacher-forced on the same test positions (pieces spread over test)
    (speculation: full depth's), and its speed-ups come from one interleaved pass over the same
    prompts; a point beaten on both axes names what beats it."""
    model = tiny_model()
    config = m.LabConfig(**{**vars(model.config), "quality_positions": 40, "bench_tokens": 6, "bench_repeats": 1,
                            "bench_prompts": 2, "bench_prompt_len": 6, "sweep_positions": 300, "shift_path": "",
                            "exit_threshold": 0.5, "max_iters": 2, "eval_iters": 1, "batch_size": 2,
                            "draft_exit": 1})
    splits = {name: torch.randint(0, 11, (4000,), generator=torch.Generator().manual_seed(i))
              for i, name in enumerate(("train", "val", "test"))}
    prompts = []
    real = m.speed_pass
    monkeypatch.setattr(m, "speed_pass", lambda decoders, p, *a: prompts.append((list(decoders), p)) or real(decoders, p, *a))
    lab = measured_lab(model, config, splits)
    rows = m.frontier(lab)["frontier"]
    table = [p for p in prompts if torch.equal(p[1], lab.workloads[1])]
    assert len(table) == 1 and ("pruned 1", "greedy") in table[0][0], "one pass, the test workload"
    val = [keys for keys, p in prompts if p is not table[0][1]]
    assert all(torch.equal(p, lab.workloads[0]) for _, p in prompts if p is not table[0][1]), "the rest: val's"
    # the forecasts: every point but the pruned models (no table shows theirs) timed on val's workload
    # too, before test's
    assert len(val) == 1 and {(n, "sampled", 0) for n in ("1-layer GPT", "holes")} <= set(val[0])
    assert not [key for key in val[0] if key[0].startswith("pruned")]
    assert all(("predicted_speedup" in r) != (r["family"] == "pruned") for r in lab.measured)
    test, plans = lab.splits["test"], lab.plans
    models = {"full": model, **{name: small for name, (small, _) in lab.other_models().items()}}
    for row in rows:
        name, d = row["name"], m.DECODERS[row["decoder"]]
        if name.startswith("watched "):  # its Monitor moved through val's workload first: test_moving's
            assert row["family"] == "exit model" and lab.nll[name].shape == lab.nll["full"].shape
            continue
        if d.strategy:
            assert name in KV_STRATEGIES and row["family"] == "exit model"
            decode = m.build(name, model, plans[name], lab.rules)
        else:  # speculation is full depth's by construction
            assert row["family"] == ("speculation" if d.drafter else "exit model" if name == "full" else
                                     "plain GPT" if name.endswith("GPT") else "pruned"), name
            decode = m.build("full", models.get(name, model), None)
        alone = m.quality_pass(decode, test, 40, 1, lab.config.bench_prompt_len, lab.config.bench_tokens)
        assert row["test_loss"] == pytest.approx(alone["test_loss"], abs=1e-5), name  # exact: any batch
        assert torch.allclose(lab.nll[name], alone["nll"], atol=1e-4), "each position's, kept for pairs"
    se = m.paired_se({r["name"]: lab.nll[r["name"]] for r in lab.measured}, lab.config.bench_tokens)
    for mode in m.MODES:
        assert [r[f"dominated_{mode}"] for r in rows] == m.dominated_by(rows, mode, se)
    assert {"full", "backfill", "self_speculative", "draft_model", "1-layer GPT", "pruned 3"} <= {r["name"] for r in rows}
    drafts = {r["name"]: r["draft_exit"] for r in lab.measured if "draft_exit" in r}
    assert drafts == {"self_speculative": 1, "draft_model": 0}  # each draft's own last layer


def test_each_drafter_is_the_one_its_name_says(trained):
    """self_speculative drafts with the model's own early layers (one cache), draft_model with the draft
    model (a cache of its own): the decoders of the tables are these, at the plans draft_plan makes."""
    model, data = trained
    draft, idx = layer_zero_as_a_model(model), data[None, 700:705]
    config = m.replace(model.config, draft_exit=1)
    own_plan, other_plan = (m.draft_plan(name, config, 4, draft) for name in ("self_speculative", "draft_model"))
    assert (own_plan["draft_exit"], own_plan["draft"], own_plan["checked_exits"]) == (1, None, [1])
    assert (other_plan["draft_exit"], other_plan["draft"], other_plan["checked_exits"]) == (0, draft, [])
    own = m.build("self_speculative", model, own_plan)(idx, 40, temperature=0.0)
    other = m.build("draft_model", model, other_plan)(idx, 40, temperature=0.0)
    L, C, T = model.config.n_layer, model.config.n_embd, model.config.block_size
    assert own.cache_bytes == 2 * L * C * (T + 4) * 4 and other.cache_bytes == 2 * (L + 1) * C * (T + 4) * 4
    assert own.stats == m.generate_speculative(model, idx, 40, 1, 4).stats  # layers 0 and 1 draft
    assert other.stats == m.generate_speculative(model, idx, 40, num_draft=4, draft_model=draft).stats
