"""Self-speculative decoding: its output is the full model's, greedy and sampled, and no layer runs twice."""

import pytest
import torch

from conftest import m, tiny_model

pytestmark = pytest.mark.usefixtures("no_grad")


@pytest.mark.parametrize("draft_exit,num_draft", [(0, 1), (0, 3), (1, 4), (2, 2), (2, 6)])
def test_greedy_equals_full_depth_past_block_size(trained, draft_exit, num_draft):
    model, data = trained
    accepted = 0
    for p in range(3):
        idx = data[None, 1000 * p : 1000 * p + 5]
        full = m.generate(model, idx, 100, temperature=0.0)  # 100 > 3 x block_size (32)
        spec = m.generate_self_speculative(model, idx, 100, draft_exit, num_draft, temperature=0.0)
        assert torch.equal(spec.tokens, full.tokens), f"prompt {p}"
        accepted += spec.stats["accepted"]
    assert accepted > 0, "the test needs accepted drafts"


def test_rejections_happen_and_roll_back(trained):
    """Over several prompts some drafts are rejected (a greedy loop alone could accept them all) and the
    rolled-back cache still gives the full model's tokens."""
    model, data = trained
    accepted = drafted = 0
    for p in range(6):
        idx = data[None, 2000 * p : 2000 * p + 5]
        spec = m.generate_self_speculative(model, idx, 100, 0, 4, temperature=0.0)
        assert torch.equal(spec.tokens, m.generate(model, idx, 100, temperature=0.0).tokens)
        accepted, drafted = accepted + spec.stats["accepted"], drafted + spec.stats["drafted"]
    assert 0 < accepted < drafted, "need both accepted and rejected drafts"


def test_each_layer_runs_once_per_fed_position(trained):
    model, data = trained
    positions = [0] * model.config.n_layer
    for l, block in enumerate(model.transformer.h):
        block.register_forward_hook(lambda mod, args, out, l=l: positions.__setitem__(l, positions[l] + out.size(1)))
    spec = m.generate_self_speculative(model, data[None, :5], 80, 1, 4, temperature=0.0)
    L = model.config.n_layer
    # every drafted position ran every layer exactly once: 0..E in the draft, the rest in the verify pass
    assert positions == [spec.stats["drafted"] + spec.prefill_runs // L] * L
    assert spec.layers_run == L * spec.stats["drafted"]


def test_bad_draft_settings_are_a_clear_error(trained):
    model, data = trained
    with pytest.raises(ValueError, match="draft_exit"):
        m.generate_self_speculative(model, data[None, :5], 10, 3, 4)


def accept_distribution(p, q, rule, n=20000, seed=0):
    """Empirical distribution of the token emitted by one draft (k = 1) under an accept rule."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros_like(p)
    for _ in range(n):
        d = torch.multinomial(q, 1, generator=gen)
        a, nxt = rule(d, q[None], p[None], 1.0, gen)  # one draft (k = 1)
        counts[int(d) if a == 1 else nxt] += 1
    return counts / n


def accept_one(drafts, q, p, temperature, generator):
    """speculative_accept on one row: (kept drafts, the full model's token after them or None)."""
    q = None if q is None else q[None]
    a, nxt, has_next = m.speculative_accept(drafts[None], q, p[None], torch.tensor([len(drafts)]), temperature, generator)
    return int(a), (int(nxt) if bool(has_next) else None)


def wrong_rule(drafts, q, p, temperature, generator):
    """A plausible mistake: on rejection, draw from p itself rather than from max(p - q, 0)."""
    a, _ = accept_one(drafts, q, p, temperature, generator)
    return a, (None if a == 1 else int(torch.multinomial(p[0], 1, generator=generator)))


def test_accept_rule_is_exact_and_a_wrong_rule_is_caught():
    p = torch.tensor([0.5, 0.3, 0.1, 0.1])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    tv = lambda a, b: 0.5 * (a - b).abs().sum().item()  # noqa: E731
    assert tv(accept_distribution(p, q, accept_one), p) < 0.015
    assert tv(accept_distribution(p, q, wrong_rule), p) > 0.1  # the test has the power to fail


def test_sampled_generation_matches_the_full_model_distribution():
    """Many 2-token self-speculative draws from a fixed context vs the full model's exact probabilities."""
    model = tiny_model(n_layer=3)
    idx = torch.tensor([[3, 1, 4]])
    probs1 = m.probs_from_logits(model(idx)[0][0, -1], 1.0, 0)  # (V,)
    joint = torch.stack([probs1[a] * m.probs_from_logits(model(torch.cat([idx, torch.tensor([[a]])], 1))[0][0, -1],
                                                         1.0, 0) for a in range(11)])  # (V, V): p(a, b)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(11, 11)
    n = 3000
    for _ in range(n):
        out = m.generate_self_speculative(model, idx, 2, 0, 2, temperature=1.0, generator=gen)
        a, b = out.tokens[0, 3:].tolist()
        counts[a, b] += 1
    emp = counts / n
    assert 0.5 * (emp.sum(1) - joint.sum(1)).abs().sum() < 0.04  # first token
    assert 0.5 * (emp - joint).abs().sum() < 0.12  # both tokens jointly (121 cells)
    draft_only = m.probs_from_logits(model.exit_heads[0](model.hidden_states(idx)[0][0, -1]), 1.0, 0)
    assert 0.5 * (draft_only - probs1).abs().sum() > 0.2, "the draft must differ from the full model"
