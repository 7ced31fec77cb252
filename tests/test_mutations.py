"""Exact values a plausible mistake would move: the window, the confidences, the accept rule, the gradients,
state copy and holes against an independent reference, deferred's catch-up."""

import math

import pytest
import torch

from conftest import KV_STRATEGIES, generate_with_cache, m, tiny_model

pytestmark = pytest.mark.usefixtures("no_grad")


# --- the context window ----------------------------------------------------------


def test_window_start_exact_values():
    """Block 16: the window slides after token 16 to keep the newest half (README, 'Context window policy')."""
    starts, start = [], None
    for n in range(1, 42):
        start = m.window_start(start, n, 16)
        starts.append(start)
    # n = 1..16 fit in [0, 16); feeding token 16 (n = 17) keeps tokens 9..16; n = 26 slides again to 18; 35 to 27
    assert starts == [0] * 16 + [9] * 9 + [18] * 9 + [27] * 7
    assert m.window_start(None, 40, 16) == 24  # no window yet: the newest block_size tokens


# --- confidence measures ---------------------------------------------------------------


def test_margin_and_entropy_exact_values():
    p = torch.tensor([[0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3]])
    logits = p.log()
    rules = m.EXIT_RULES
    assert torch.allclose(m.confidence(logits, rules["top1"]), torch.tensor([0.5, 1 / 3]), atol=1e-6)
    assert torch.allclose(m.confidence(logits, rules["margin"]), torch.tensor([0.2, 0.0]), atol=1e-6)
    h = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))
    assert torch.allclose(m.confidence(logits, rules["entropy"]), torch.tensor([1 - h / math.log(3), 0.0]), atol=1e-6)


# --- speculative decoding ------------------------------------------------------------------


def test_speculative_accept_greedy_prefix_rule():
    drafts = torch.tensor([[2, 5, 1, 7], [2, 5, 1, 7]])
    p = torch.full((2, 4, 9), -1.0)
    p[:, 0, 2] = p[:, 1, 5] = p[:, 3, 7] = 1.0  # the full model agrees at 0, 1 and 3
    p[0, 2, 3] = 1.0  # row 0: not at 2 (it wants 3)
    p[1, 2, 1] = 1.0  # row 1: everywhere, but it may keep only 3
    a, nxt, has_next = m.speculative_accept(drafts, None, p, torch.tensor([4, 3]), 0.0, None)
    assert a.tolist() == [2, 3] and nxt[0] == 3 and has_next.tolist() == [True, False]


def test_speculative_accept_sampled_prefix_and_later_residual():
    """k = 3: position 0 always accepted, position 1 with probability 1/4, position 2 always; at a rejection
    the token comes from position 1's residual max(p - q, 0), never from position 0's or 2's. One call
    decides n independent rows."""
    V, n = 4, 20000
    q = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.8, 0.05, 0.05], [0.25, 0.25, 0.25, 0.25]])
    p = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.3, 0.2, 0.4, 0.1], [0.1, 0.1, 0.1, 0.7]])
    drafts = torch.tensor([0, 1, 3]).expand(n, 3)
    gen = torch.Generator().manual_seed(0)
    a, nxt, has_next = m.speculative_accept(drafts, q.expand(n, 3, V), p.expand(n, 3, V), torch.full((n,), 3), 1.0, gen)
    assert set(a.tolist()) == {1, 3}, "a later draft is kept only if every earlier one was"
    assert (a == 3).float().mean().item() == pytest.approx(0.25, abs=0.015)
    assert torch.equal(has_next, a < 3)
    residual = (p[1] - q[1]).clamp_min(0)
    drawn = torch.bincount(nxt[has_next], minlength=V).float()
    assert torch.allclose(drawn / drawn.sum(), residual / residual.sum(), atol=0.015)


# --- gradients ----------------------------------------------------------------------------


def test_exit_loss_reaches_the_exit_heads_and_the_trunk():
    grads = {}
    for alpha in (0.0, 0.3):
        model = tiny_model(alpha=alpha, distill_weight=0.0)
        model.train()
        idx = torch.randint(0, 11, (3, 9), generator=torch.Generator().manual_seed(0))
        with torch.enable_grad():
            model(idx, idx)[1].backward()
        grads[alpha] = model
    with_exits, plain = grads[0.3], grads[0.0]
    for head in with_exits.exit_heads:
        assert head.lm_head.weight.grad is not None and head.lm_head.weight.grad.abs().sum() > 0
    assert all(h.lm_head.weight.grad is None for h in plain.exit_heads)
    # block 0's weights feel the exit losses: its gradient differs from the final loss's alone
    g = lambda mdl: mdl.transformer.h[0].mlp.c_fc.weight.grad  # noqa: E731
    assert (g(with_exits) - g(plain)).abs().max() > 1e-6


def test_distillation_reaches_the_exits_but_not_the_final_head():
    grads = []
    for distill in (0.0, 1.0):
        model = tiny_model(alpha=0.0, distill_weight=distill)
        model.train()
        idx = torch.randint(0, 11, (3, 9), generator=torch.Generator().manual_seed(0))
        with torch.enable_grad():
            model(idx, idx)[1].backward()
        grads.append(model)
    assert torch.equal(grads[0].transformer.ln_f.weight.grad, grads[1].transformer.ln_f.weight.grad)
    assert grads[1].exit_heads[0].lm_head.weight.grad.abs().sum() > 0


# --- state copy and holes against an independent reference -----------------------------------


def reference_step(model, kv, x, pos, layers):
    """Run blocks `layers` for x (B, 1, C) by hand, appending this position's K/V to the per-layer lists."""
    for l in layers:
        block = model.transformer.h[l]
        attn, C, nh = block.attn, x.size(-1), block.attn.n_head
        q, k, v = attn.c_attn(block.ln_1(x)).split(C, dim=-1)
        kv[l].append((k, v))
        K = torch.cat([a for a, _ in kv[l]], dim=1).view(x.size(0), -1, nh, C // nh)  # (B, n, nh, hs)
        Vv = torch.cat([b for _, b in kv[l]], dim=1).view(x.size(0), -1, nh, C // nh)
        qh = q.view(x.size(0), nh, C // nh)  # (B, nh, hs)
        w = torch.einsum("bhd,bnhd->bhn", qh, K).div(math.sqrt(C // nh)).softmax(-1)
        y = torch.einsum("bhn,bnhd->bhd", w, Vv).reshape(x.size(0), 1, C)
        x = x + attn.c_proj(y)
        x = x + block.mlp(block.ln_2(x))
    return x


def reference_decode(model, tokens, threshold, strategy):
    """Teacher-forced state_copy / holes decoding written independently: Python lists of K/V per layer."""
    L, bs = model.config.n_layer, model.config.block_size
    B, N = tokens.shape
    start, kv, out_logits, out_exits = None, None, [], []
    for n in range(2, N + 1):  # feed tokens[:, n - 2] ... predicting token n - 1
        s = m.window_start(start, n - 1, bs)
        if s != start:  # a fresh window: every layer re-prefilled at full depth
            start, kv = s, [[] for _ in range(L)]
            for p in range(start, n - 2):
                reference_step(model, kv, model.embed(tokens[:, p : p + 1], p - start), p - start, range(L))
        pos = n - 2 - start
        x, exits, logits = model.embed(tokens[:, n - 2 : n - 1], pos), torch.full((B,), L - 1), None
        for l in range(L):
            x = reference_step(model, kv, x, pos, [l])
            head = model.exit_logits(x[:, 0], l)
            conf = head.softmax(-1).amax(-1)
            newly = (conf > threshold) & (exits == L - 1) if l < L - 1 else exits == L - 1
            logits = head if logits is None else torch.where(newly[:, None], head, logits)
            exits = torch.where(newly & (l < L - 1), torch.full_like(exits, l), exits)
            if l < L - 1 and (exits < L - 1).all():  # every row has left: the layers above are skipped
                for j in range(l + 1, L):
                    if strategy == "state_copy":  # K/V of the skipped layer computed from the exit state
                        block, C = model.transformer.h[j], x.size(-1)
                        _, k, v = block.attn.c_attn(block.ln_1(x)).split(C, dim=-1)
                        kv[j].append((k, v))
                break
        out_logits.append(logits)
        out_exits.append(exits)
    return torch.stack(out_logits, 1), torch.stack(out_exits, 1)


@pytest.mark.parametrize("strategy", ["state_copy", "holes"])
@pytest.mark.parametrize("batch", [1, 3])
def test_state_copy_and_holes_match_an_independent_reference(strategy, batch):
    model = tiny_model()
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 11, (batch, 41), generator=gen)  # 40 steps: two window slides at block 16
    out = m.generate(model, tokens[:, :1], 40, strategy=KV_STRATEGIES[strategy], exit_threshold=0.6,
                     forced=tokens[:, 1:])
    ref_logits, ref_exits = reference_decode(model, tokens, 0.6, strategy)
    assert torch.equal(out.exited_at, ref_exits)
    assert torch.allclose(out.logits, ref_logits, atol=1e-4)
    all_left = (out.exited_at < 3).all(0)
    assert all_left.float().mean() > 0.2, "the test needs steps where every row skipped layers"
    if batch > 1:
        mixed = (out.exited_at != out.exited_at[:1]).any(0)
        assert mixed.any(), "rows should exit at different layers in some steps"


# --- deferred batches its catch-up ----------------------------------------------------------------


def test_deferred_catch_up_is_one_block_call_per_layer():
    """p positions pending at layer j run as one call of block j (inside one window: no re-prefill)."""
    model = tiny_model()
    calls = {l: [] for l in range(4)}
    for l, block in enumerate(model.transformer.h):
        block.register_forward_hook(lambda mod, args, out, l=l: calls[l].append(args[0].size(1)))
    forced = torch.randint(0, 11, (1, 15), generator=torch.Generator().manual_seed(2))
    out, cache, _ = generate_with_cache(model, torch.zeros(1, 1, dtype=torch.long), 15, m.Deferred,
                                        exit_threshold=0.6, forced=forced)
    exits = out.exited_at[0]
    for l in range(4):
        # layer l runs exactly once in every step whose token needs it, whatever is pending there
        assert len(calls[l]) == int((exits >= l).sum()), f"layer {l}"
    assert max(max(c) for c in calls.values()) >= 3, "the test needs a catch-up of two or more pending positions"
    # every position that reached layer l before the end ran it exactly once
    pending_at_end = [15 - cache.lengths[l] for l in range(4)]
    assert [sum(calls[l]) for l in range(4)] == [15 - p for p in pending_at_end]
