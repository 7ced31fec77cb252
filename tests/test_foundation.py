"""The foundation's claims: exit heads, the joint loss, the KV cache, early exit, the CLI."""

import pytest
import torch
import torch.nn.functional as F

from conftest import generate_with_cache, m, reference_generate, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("no_grad")


# --- data ----------------------------------------------------------------------


def test_tokenizer_round_trip_and_unknown_characters():
    tok = m.CharTokenizer("hello world")
    assert tok.decode(tok.encode("low hole")) == "low hole"
    with pytest.raises(KeyError, match="'a'"):
        tok.encode("lazy")


def test_splits_are_contiguous_90_5_5():
    data = torch.arange(1000)
    s = m.split_data(data)
    assert [len(s[k]) for k in ("train", "val", "test")] == [900, 50, 50]
    assert torch.equal(torch.cat([s["train"], s["val"], s["test"]]), data)


# --- model ---------------------------------------------------------------------


def test_exit_head_shapes_and_parameter_overhead():
    cfg = tiny_config()
    model = m.GPT(cfg)
    assert len(model.exit_heads) == cfg.n_layer - 1
    idx = torch.randint(0, cfg.vocab_size, (2, 7))
    logits = model.all_exit_logits(idx)
    assert logits.shape == (cfg.n_layer, 2, 7, cfg.vocab_size)
    base, heads = m.count_params(model)
    C, V = cfg.n_embd, cfg.vocab_size
    assert heads == (cfg.n_layer - 1) * (C + C * V)  # LayerNorm weight (no bias) + Linear, per head
    assert base + heads == sum(p.numel() for p in model.parameters())


def test_joint_loss_equals_hand_computed_sum():
    model = tiny_model(alpha=0.3)
    idx = torch.randint(0, 11, (3, 9))
    y = torch.randint(0, 11, (3, 9))
    _, loss = model(idx, y)
    states = model.hidden_states(idx)
    ce = lambda lg: F.cross_entropy(lg.reshape(-1, 11), y.reshape(-1))  # noqa: E731
    expected = ce(model.lm_head(model.transformer.ln_f(states[-1])))
    expected = expected + 0.3 * sum(ce(model.exit_heads[l](states[l])) for l in range(3))
    assert torch.allclose(loss, expected, atol=1e-6)


def test_alpha_zero_skips_the_exit_heads():
    model = tiny_model(alpha=0.0)
    calls = []
    for head in model.exit_heads:
        head.register_forward_hook(lambda *a: calls.append(1))
    idx = torch.randint(0, 11, (2, 5))
    _, loss = model(idx, idx)
    assert calls == []
    assert torch.allclose(loss, F.cross_entropy(model(idx, idx)[0].reshape(-1, 11), idx.reshape(-1)))


# --- the KV cache ----------------------------------------------------------------


def test_cached_logits_equal_uncached_past_block_size(model):
    idx = torch.randint(0, 11, (2, 3))
    forced = torch.randint(0, 11, (2, 40))  # 40 > 2 x block_size: two re-prefills
    out = m.generate(model, idx, 40, forced=forced)
    start = None
    for i in range(40):
        n = 3 + i
        start = m.window_start(start, n, 16)
        ref, _ = model(out.tokens[:, start:n])
        assert torch.allclose(out.logits[:, i], ref[:, -1], atol=1e-5), f"step {i}"


def test_window_positions_never_pass_block_size():
    start, starts = None, []
    for n in range(1, 200):
        start = m.window_start(start, n, 16)
        assert 0 < n - start <= 16
        starts.append(start)
    assert len(set(starts)) > 10  # it re-prefilled many times, keeping the newest half


@pytest.mark.parametrize("strategy", m.KV_STRATEGIES)
def test_threshold_one_reproduces_full_depth(model, strategy):
    idx = torch.randint(0, 11, (1, 2))
    ref = reference_generate(model, idx, 40, temperature=1.0, generator=torch.Generator().manual_seed(5))
    out = m.generate(model, idx, 40, strategy=m.KV_STRATEGIES[strategy], exit_threshold=1.0, temperature=1.0,
                     generator=torch.Generator().manual_seed(5))
    assert torch.equal(out.tokens, ref)
    assert (out.exited_at == 3).all()


def test_threshold_zero_exits_everything_at_the_first_exit(model):
    idx = torch.randint(0, 11, (2, 2))
    forced = torch.randint(0, 11, (2, 20))
    out = m.generate(model, idx, 20, exit_threshold=0.0, forced=forced)
    assert (out.exited_at == 0).all()
    for i in range(15):  # the emitted logits are exit head 0's (steps inside the first window)
        h0 = model.hidden_states(out.tokens[:, : 2 + i])[0][:, -1]
        assert torch.allclose(out.logits[:, i], model.exit_heads[0](h0), atol=1e-5)


def test_first_exit_layer_is_respected(model):
    out = m.generate(model, torch.zeros(1, 1, dtype=torch.long), 20, exit_threshold=0.0, checked_exits=[2],
                     forced=torch.randint(0, 11, (1, 20)))
    assert (out.exited_at == 2).all()


def test_backfill_leaves_the_cache_of_a_full_depth_pass(model):
    idx = torch.randint(0, 11, (2, 2))
    out, cache, _ = generate_with_cache(model, idx, 37, exit_threshold=0.6, temperature=1.0,
                                        generator=torch.Generator().manual_seed(1))
    assert 0 < (out.exited_at < 3).float().mean() < 1, "the test needs some early exits"
    n = cache.lengths[0]
    assert cache.lengths == [n] * 4
    ref = m.KVCache(model.config, 2, "cpu")
    with torch.inference_mode():
        m.prefill(model, ref, out.tokens[:, cache.start : cache.start + n], cache.start)
    assert torch.allclose(cache.k[:, :, :, :n], ref.k[:, :, :, :n], atol=1e-5)
    assert torch.allclose(cache.v[:, :, :, :n], ref.v[:, :, :, :n], atol=1e-5)


def test_early_exit_logits_come_from_the_exit_head(model):
    """Teacher-forced backfill: a token exiting at layer l carries exit head l's logits."""
    forced = torch.randint(0, 11, (1, 14))
    out = m.generate(model, torch.zeros(1, 1, dtype=torch.long), 14, exit_threshold=0.6, forced=forced)
    all_logits = model.all_exit_logits(out.tokens[:, :14])  # (L, 1, T, V), one window: no re-prefill
    for i in range(14):
        l = out.exited_at[0, i]
        assert torch.allclose(out.logits[0, i], all_logits[l, 0, i], atol=1e-5)
        if l < 3:
            assert m.confidence(all_logits[l, :, i]) > 0.6
        assert all(m.confidence(all_logits[j, :, i]) <= 0.6 for j in range(l))


def test_generation_of_three_block_sizes(model):
    out = m.generate(model, torch.zeros(1, 1, dtype=torch.long), 48, exit_threshold=0.8, temperature=1.0,
                     generator=torch.Generator().manual_seed(0))
    assert out.tokens.shape == (1, 49)
    assert out.exited_at.shape == (1, 48)


def test_batch_rows_exit_on_their_own(model):
    prompts = torch.tensor([[1, 2], [7, 3], [4, 4]])
    batch = m.generate(model, prompts, 40, exit_threshold=0.7, temperature=0.0)
    for b in range(3):
        single = m.generate(model, prompts[b : b + 1], 40, exit_threshold=0.7, temperature=0.0)
        assert torch.equal(batch.tokens[b], single.tokens[0])
        assert torch.equal(batch.exited_at[b], single.exited_at[0])
    assert len(set(batch.exited_at[:, :5].flatten().tolist())) > 1, "rows should exit at different layers"


def test_confidence_measures_are_in_unit_range_and_ordered():
    logits = torch.tensor([[5.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    for measure in ("top1", "margin", "entropy"):  # the rules that read one head alone
        c = m.confidence(logits, measure)
        assert ((0 <= c) & (c <= 1)).all()
        assert c[0] > c[1]




def test_exit_statistics_in_the_seed_format():
    out = m.format_exit_stats([42, 0, 158])
    assert "Layer 0:" in out and "42 tokens ( 21.0%)" in out and "Layer 2 (full):" in out
    assert "mean exit depth: 2.58 of 3" in out


def test_draw_samples_each_row_from_its_own_distribution():
    probs = torch.tensor([[0.1, 0.0, 0.2, 0.3, 0.0, 0.4], [0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([m.draw(probs, gen) for _ in range(20000)])  # (n, 2)
    for row in range(2):
        emp = torch.bincount(draws[:, row], minlength=6).float() / len(draws)
        assert 0.5 * (emp - probs[row]).abs().sum() < 0.01
        assert emp[probs[row] == 0].sum() == 0, "a zero-probability token was drawn"
