"""The KV-cache strategies: deferred is exact, state copy writes what it claims, holes leaves holes."""

import types
from functools import partial

import numpy as np
import pytest
import torch

from conftest import KV_STRATEGIES, flush, generate_with_cache, m, strategy, tiny_model

pytestmark = pytest.mark.usefixtures("no_grad")


@pytest.mark.parametrize("n_new", [12, 50])  # inside one window, and across two re-prefills
@pytest.mark.parametrize("batch", [1, 2])
def test_deferred_equals_backfill_tokens_and_cache(n_new, batch):
    model = tiny_model()
    idx = torch.randint(0, 11, (batch, 3))
    kw = dict(exit_threshold=0.6, temperature=1.0)
    back, back_cache, _ = generate_with_cache(model, idx, n_new, generator=torch.Generator().manual_seed(3), **kw)
    defer, cache, deferred = generate_with_cache(model, idx, n_new, m.Deferred,
                                                 generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(back.tokens, defer.tokens)
    assert torch.equal(back.exited_at, defer.exited_at)
    assert (defer.exited_at < 3).all(0).any(), "the test needs steps where every row exits early"
    flush(model, cache, deferred)
    n = back_cache.lengths[0]
    assert cache.lengths == back_cache.lengths == [n] * 4
    assert torch.allclose(cache.k[:, :, :, :n], back_cache.k[:, :, :, :n], atol=1e-5)
    assert torch.allclose(cache.v[:, :, :, :n], back_cache.v[:, :, :, :n], atol=1e-5)


def test_deferred_never_runs_a_layer_twice_for_a_position():
    model = tiny_model()
    cache_trace = []

    def record(block, args):  # (layer, window start, window position) of every position the block runs
        x, cache, layer = args
        n = cache.lengths[layer]
        cache_trace.extend((layer, cache.start, n + t) for t in range(x.size(1)))

    for block in model.transformer.h:
        block.register_forward_pre_hook(record)
    out, cache, deferred = generate_with_cache(model, torch.zeros(1, 1, dtype=torch.long), 45, m.Deferred,
                                               exit_threshold=0.6, temperature=1.0,
                                               generator=torch.Generator().manual_seed(0))
    flush(model, cache, deferred)
    assert (out.exited_at < 3).float().mean() > 0.2
    assert len(cache_trace) == len(set(cache_trace)), "a (layer, window, position) ran twice"
    # and after the flush every position of the last window ran every layer exactly once
    last = [t for t in cache_trace if t[1] == cache.start]
    for layer in range(4):
        assert sorted(p for l, _, p in last if l == layer) == list(range(cache.lengths[0]))


def test_deferred_batches_the_catch_up():
    """A token after an early exit runs the skipped layers for both positions in one block call."""
    model = tiny_model()
    out = m.generate(model, torch.zeros(1, 1, dtype=torch.long), 15, strategy=strategy("deferred"), exit_threshold=0.6,
                     forced=torch.randint(0, 11, (1, 15)))
    back = m.generate(model, torch.zeros(1, 1, dtype=torch.long), 15, strategy=strategy("backfill"), exit_threshold=0.6,
                      forced=out.tokens[:, 1:])
    assert torch.allclose(out.logits, back.logits, atol=1e-5)
    assert out.layers_run < back.layers_run  # the work still pending at the end is dropped


@pytest.mark.parametrize("bias", [False, True])
def test_state_copy_writes_kv_from_the_exit_state(bias):
    model = tiny_model(bias=bias)
    cache = m.KVCache(model.config, 1, "cpu")
    idx = torch.tensor([[4]])
    logits, layer, checks = m.decode_step(model, cache, idx, 0, m.StateCopy(), 0.0, [1])
    assert int(layer) == 1 and checks == 1 and cache.lengths == [1, 1, 1, 1]
    x = model.embed(idx)
    for l in range(2):
        x = model.transformer.h[l](x)
    for j in (2, 3):
        block = model.transformer.h[j]
        C = model.config.n_embd
        k, v = block.attn.c_attn(block.ln_1(x))[..., C:].split(C, dim=-1)  # the plain, unfolded way
        k, v = block.attn.heads(k), block.attn.heads(v)
        assert torch.allclose(cache.k[j, :, :, :1], k, atol=1e-6)
        assert torch.allclose(cache.v[j, :, :, :1], v, atol=1e-6)
    assert cache.layer_evals == [1, 1, 0, 0]  # the skipped blocks did not run


def test_holes_leave_the_upper_layers_short():
    model = tiny_model()
    out, cache, _ = generate_with_cache(model, torch.zeros(1, 1, dtype=torch.long), 12, m.Holes,
                                        exit_threshold=0.6, forced=torch.randint(0, 11, (1, 12)))
    early = (out.exited_at[0] < 3).sum().item()
    assert early > 0
    assert cache.lengths[0] == 12 and cache.lengths[3] == 12 - early
    assert cache.lengths == sorted(cache.lengths, reverse=True)


@pytest.mark.parametrize("name", KV_STRATEGIES)
def test_every_strategy_decodes_past_block_size_in_a_batch(name):
    """Three windows of 16 at batch 3: each row's teacher-forced choices, decoded alone, are the
    batch's; and the early exits really happen."""
    model = tiny_model()
    plan = {"threshold": 0.6, "checked_exits": [0, 1, 2]}
    if name == "skipdecode":  # its checked exits are its schedule, by window position
        plan = {"threshold": 0.0, "checked_exits": [3] * 6 + [1] * 10}
    forced = torch.randint(0, 11, (3, 48), generator=torch.Generator().manual_seed(0))
    kw = dict(strategy=KV_STRATEGIES[name], exit_threshold=plan["threshold"],
              checked_exits=plan["checked_exits"])
    out = m.generate(model, torch.zeros(3, 1, dtype=torch.long), 48, forced=forced, **kw)
    assert 0.1 < (out.exited_at < 3).float().mean() < 0.9
    if name in ("backfill", "deferred", "skipdecode"):  # an exact cache: rows do not interact
        for b in range(3):
            alone = m.generate(model, torch.zeros(1, 1, dtype=torch.long), 48, forced=forced[b : b + 1], **kw)
            assert torch.equal(out.exited_at[b], alone.exited_at[0])
            assert torch.allclose(out.logits[b], alone.logits[0], atol=1e-5)


def test_batch_step_runs_as_deep_as_its_deepest_row():
    model = tiny_model()
    out = m.generate(model, torch.tensor([[1], [7], [3]]), 10, strategy=strategy("state_copy"), exit_threshold=0.6,
                     forced=torch.randint(0, 11, (3, 10)))
    deepest = out.exited_at.max(0).values + 1  # (N,) layers each step needed
    assert out.layers_run == deepest.sum().item()


SPEED = types.SimpleNamespace(bench_tokens=2, bench_repeats=3, seed=7)  # speed_pass's fields


def test_speed_pass_interleaves_the_decoders_a_call_at_a_time_in_a_new_order_each_time():
    """A burst of load on the machine must fall on every decoder alike: each decoder once a prompt
    before the next prompt, not a, a, b, b; and in a random order each time, so that no decoder always
    runs after the same one (whose weights it would find in the CPU's cache)."""
    model, calls = tiny_model(), []

    def recorder(name):
        def decode(idx, n, **kw):
            calls.append((name, kw["generator"].initial_seed()))
            return m.generate(model, idx, n, **kw)
        return decode

    prompts = torch.randint(0, 11, (4, 2))
    names = "abc"
    out = m.speed_pass({n: recorder(n) for n in names}, prompts, SPEED)
    # 4 calls a pass, 3 passes; prompt i samples from seed + i whichever decoder and pass runs it
    rounds = [calls[j:j + 3] for j in range(0, len(calls), 3)]
    assert len(rounds) == 12
    assert all(sorted(r) == [(n, 7 + i % 4) for n in names] for i, r in enumerate(rounds))
    orders = ["".join(n for n, _ in r) for r in rounds]
    assert len(set(orders)) > 1  # not one fixed order
    before_a = {o[o.index("a") - 1] if o.index("a") else None for o in orders}
    assert len(before_a) > 1  # a follows different decoders (or none)
    calls.clear()
    m.speed_pass({n: recorder(n) for n in names}, prompts, SPEED)
    assert [c[0] for c in calls] == [n for o in orders for n in o]  # seeded: the same order again
    assert len(out["a"]["outputs"]) == len(out["b"]["outputs"]) == 4  # the last pass's
    assert out["a"]["seconds"].shape == (3, 4) and (out["a"]["seconds"] > 0).all()  # a call's time


def test_a_speed_up_pairs_each_call_with_full_depths_and_averages_the_middle_half():
    """Full depth's speed over a decoder's: each call's time over full depth's on the same prompts in
    the same pass; the quarter of the ratios at each end dropped, so a burst of load on one call moves
    it little."""
    full = {"seconds": np.full((2, 4), 0.2)}
    half = {"seconds": np.full((2, 4), 0.1)}
    assert m.speedup(half, full) == pytest.approx(2.0)
    burst = {"seconds": half["seconds"].copy()}
    burst["seconds"][1, 2] = 5.0  # one call of eight caught a burst of load
    assert m.speedup(burst, full) == pytest.approx(2.0)
    slow_full = {"seconds": full["seconds"].copy()}
    slow_full["seconds"][0, 0] = 5.0  # full depth's call caught it: that prompt's ratio is dropped
    assert m.speedup(half, slow_full) == pytest.approx(2.0)
    # ratios 1, 2, 3, 4 (and 5): the middle half is 2 and 3 (2, 3 and 4), paired call by call
    four = {"seconds": np.array([[0.4, 0.1, 0.3, 0.2]])}
    assert m.speedup(four, {"seconds": np.full((1, 4), 0.1)}) == pytest.approx(1 / 2.5)
    five = {"seconds": np.array([[0.4, 0.1, 0.3, 0.2, 0.5]])}
    assert m.speedup(five, {"seconds": np.full((1, 5), 0.1)}) == pytest.approx(1 / 3.0)
    three = {"seconds": np.array([[0.1, 0.2, 0.6]])}  # under four calls nothing is dropped
    assert m.speedup(three, {"seconds": np.full((1, 3), 0.1)}) == pytest.approx(1 / 3.0)


def test_quality_pass_and_speed_pass_report_what_they_ran():
    model = tiny_model()
    data = torch.randint(0, 11, (100,))
    plan = {"measure": "top1", "threshold": 0.6, "checked_exits": [0, 1, 2]}
    names = ("full", "backfill", "deferred", "state_copy", "holes", "self_speculative")
    spec = m.draft_plan("self_speculative", types.SimpleNamespace(draft_exit=0), 4, None)
    runs = {n: m.build(n, model, spec if m.DECODERS[n].drafter else plan) for n in names}
    quality = {n: m.quality_pass(runs[n], data, 40, 1, 1, 40) for n in names[:-1]}  # one piece of 40
    assert quality["full"]["mean_layers"] == 4.0
    assert quality["deferred"]["test_loss"] == pytest.approx(quality["backfill"]["test_loss"], abs=1e-5)
    # state_copy runs as deep as each token needs: its mean exit depth plus one
    forced = m.build("state_copy", model, plan)(data[None, :1], 40, forced=data[None, 1:41])
    assert quality["state_copy"]["mean_layers"] == pytest.approx(float(forced.exited_at.float().mean()) + 1)
    assert quality["state_copy"]["mean_layers"] < 4
    speed = m.speed_pass({n: partial(r, temperature=1.0) for n, r in runs.items()}, data[:6].view(3, 2),
                         types.SimpleNamespace(bench_tokens=20, bench_repeats=2, seed=0))
    assert speed["full"]["mean_layers"] == 4.0 and speed["backfill"]["mean_layers"] == 4.0
    outputs = speed["holes"]["outputs"]  # holes runs only the layers each step's deepest row needs
    assert speed["holes"]["mean_layers"] == pytest.approx(sum(int((o.exited_at + 1).sum()) for o in outputs) / 60)
    assert speed["holes"]["mean_layers"] < 4.0
    assert all(len(s["outputs"]) == 3 for s in speed.values())  # every prompt of the workload was continued
    # 20 tokens after 2: the prompt's first token, then one re-prefill of block_size/2 - 1 = 7 tokens, 4 layers each
    assert speed["full"]["prefill_layers"] == pytest.approx((1 + 7) * 4 / 20)
