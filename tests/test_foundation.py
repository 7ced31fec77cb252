"""The foundation's claims: exit heads, the joint loss, the KV cache, early exit, backfill."""

import pytest
import torch
import torch.nn.functional as F

from conftest import KV_STRATEGIES, generate_with_cache, m, reference_generate, tiny_config, tiny_model

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


def test_exit_heads_read_each_layer_and_cost_what_they_should():
    cfg = tiny_config()
    model = m.GPT(cfg)
    assert len(model.exit_heads) == cfg.n_layer - 1
    idx = torch.randint(0, cfg.vocab_size, (2, 7))
    logits = model.all_exit_logits(idx)
    states = model.hidden_states(idx)
    for l in range(cfg.n_layer - 1):  # exit l reads block l's output through its own head
        assert torch.allclose(logits[l], model.exit_heads[l](states[l]))
    assert torch.allclose(logits[-1], model.lm_head(model.transformer.ln_f(states[-1])))
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

    def ce(lg):
        return F.cross_entropy(lg.reshape(-1, 11), y.reshape(-1))
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


def reference_starts(n_steps, prompt_len, block_size):
    """Where each step's window begins, by the README's rule written out: positions never pass
    block_size, and a full window keeps its newest half."""
    start, starts = None, []
    for i in range(n_steps):
        fed = prompt_len + i  # tokens in the sequence when its last one is fed
        if start is None:
            start = max(0, fed - block_size)  # the newest block_size characters
        elif fed - start > block_size:
            start = fed - block_size // 2
        starts.append(start)
    return starts


@pytest.mark.parametrize("prompt_len", [3, 40])  # 40 > block_size: a prompt longer than the window
def test_cached_logits_equal_uncached_past_block_size(model, prompt_len):
    """Teacher-forced decoding against the model run on each window from scratch; the reference
    builds its text from the inputs and its windows from the rule, not from the decoder."""
    idx = torch.randint(0, 11, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    forced = torch.randint(0, 11, (2, 40), generator=torch.Generator().manual_seed(2))
    text = torch.cat([idx, forced], 1)  # what the decoder should read
    out = m.generate(model, idx, 40, forced=forced)
    for i, start in enumerate(reference_starts(40, prompt_len, 16)):
        ref, _ = model(text[:, start : prompt_len + i])  # 40 steps > 2 x block_size: re-prefills
        assert torch.allclose(out.logits[:, i], ref[:, -1], atol=1e-5), f"step {i}"


@pytest.mark.parametrize("strategy", KV_STRATEGIES)
def test_threshold_one_reproduces_full_depth(model, strategy):
    idx = torch.randint(0, 11, (1, 2))
    ref = reference_generate(model, idx, 40, temperature=1.0, generator=torch.Generator().manual_seed(5))
    out = m.generate(model, idx, 40, strategy=KV_STRATEGIES[strategy], exit_threshold=1.0, temperature=1.0,
                     generator=torch.Generator().manual_seed(5))
    assert torch.equal(out.tokens, ref)
    assert (out.exited_at == 3).all() and out.exit_checks == 0, "a confidence never exceeds 1: nothing checked"


def test_threshold_zero_exits_everything_at_the_first_exit(model):
    idx = torch.randint(0, 11, (2, 2))
    forced = torch.randint(0, 11, (2, 20))
    out = m.generate(model, idx, 20, exit_threshold=0.0, forced=forced)
    assert (out.exited_at == 0).all()
    for i in range(15):  # the emitted logits are exit head 0's (steps inside the first window)
        h0 = model.hidden_states(torch.cat([idx, forced], 1)[:, : 2 + i])[0][:, -1]
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


def count_head_calls(model):
    """Hooks that count the exit heads' calls and the final head's, rows included."""
    calls = {"exit": 0, "final": 0}
    for head in model.exit_heads:
        head.register_forward_hook(lambda mod, args, out: calls.__setitem__("exit", calls["exit"] + 1))
    model.lm_head.register_forward_hook(lambda mod, args, out: calls.__setitem__("final", calls["final"] + 1))
    return calls


def test_backfill_checks_no_exit_after_a_token_has_left():
    """Once every row has exited, the layers above run for the cache only: no further check and no
    final head. The checks counted are those that ran, and the lesson's speed note says so."""
    model = tiny_model()
    calls = count_head_calls(model)
    forced = torch.randint(0, 11, (1, 30), generator=torch.Generator().manual_seed(4))
    out = m.generate(model, torch.zeros(1, 1, dtype=torch.long), 30, exit_threshold=0.6, forced=forced)
    exits = out.exited_at[0]
    assert 0 < (exits < 3).sum() < 30, "the test needs early and full-depth tokens"
    # a token that exits at e ran the checks at exits 0..e; one at full depth ran all three
    assert calls["exit"] == out.exit_checks == int(torch.clamp(exits + 1, max=3).sum())
    assert calls["final"] == int((exits == 3).sum())  # the final head only for tokens that went full depth
    assert out.layers_run == 30 * 4  # the cache still got every layer
    samples = {"early-exit": (out, 1.0), "full-depth": (out, 2.0)}
    assert f"plus {out.exit_checks / 30:.2f} exit checks" in m.speed_note(samples, 4)


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
        c = m.confidence(logits, m.EXIT_RULES[measure])
        assert ((0 <= c) & (c <= 1)).all()
        assert c[0] > c[1]
    assert set(m.CONFIDENCE_MEASURES) == {"top1"}, "Part I's table is left as it is: the lab's is a dict of its own"


def test_exit_statistics_in_the_original_format():
    out = m.format_exit_stats([42, 0, 158])
    assert "Layer 0:" in out and "42 tokens ( 21.0%)" in out and "Layer 2 (full):" in out
    assert "mean exit depth: 2.58 of 3" in out


def test_draw_samples_each_row_from_its_own_distribution():
    probs = torch.tensor([[0.1, 0.0, 0.2, 0.3, 0.0, 0.4], [0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    draws = m.draw(probs.repeat(20000, 1), gen).view(20000, 2)  # 20,000 independent draws of each row
    for row in range(2):
        emp = torch.bincount(draws[:, row], minlength=6).float() / len(draws)
        assert 0.5 * (emp - probs[row]).abs().sum() < 0.01
        assert emp[probs[row] == 0].sum() == 0, "a zero-probability token was drawn"


def test_temperature_and_top_k_shape_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    for t in (0.7, 1.0, 1.5):
        expected = torch.softmax(logits / t, -1)
        assert torch.allclose(m.probs_from_logits(logits, t, 0), expected, atol=1e-6)
    top2 = m.probs_from_logits(logits, 0.7, 2)
    expected = torch.softmax(logits[:, :2] / 0.7, -1)
    assert torch.allclose(top2[:, :2], expected, atol=1e-6) and top2[0, 2:].sum() == 0
    assert torch.equal(m.sample(logits, 0.0, 0, None), torch.tensor([0])), "temperature 0 is greedy"


def test_training_runs_in_bf16_autocast_on_cuda_and_decoding_in_fp32(monkeypatch):
    """bf16 autocast is for training and evaluation on CUDA only; no decoder enters it, so decoding runs in
    the weights' fp32 on every device."""
    import contextlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no GPU here: torch disables the autocast it makes, and says so
        on_gpu = m.autocast_context("cuda:0")
    assert isinstance(on_gpu, torch.autocast) and (on_gpu.device, on_gpu.fast_dtype) == ("cuda", torch.bfloat16)
    assert isinstance(m.autocast_context("cpu"), contextlib.nullcontext)
    entered = []
    monkeypatch.setattr(m, "autocast_context", lambda device: entered.append(str(device)) or contextlib.nullcontext())
    model, idx = tiny_model(), torch.randint(0, 11, (2, 3))
    out = m.generate(model, idx, 20, exit_threshold=0.6, forced=torch.randint(0, 11, (2, 20)))
    m.generate_speculative(model, idx, 20, 0, 4)
    m.record_exits(model, torch.randint(0, 11, (100,)), 60, m.exit_rules())
    assert entered == [] and out.logits.dtype == torch.float32
    with torch.enable_grad():
        m.train_step(model.train(), m.configure_optimizer(model, model.config), idx, idx, model.config)
    assert entered == ["cpu"]
