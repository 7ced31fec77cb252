"""Self-speculative decoding: its output is the full model's, greedy and sampled, no layer runs
twice, and it records which tokens were kept drafts."""

import math

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
        spec = m.generate_speculative(model, idx, 100, draft_exit, num_draft, temperature=0.0)
        assert torch.equal(spec.tokens, full.tokens), f"prompt {p}"
        accepted += spec.stats["accepted"]
    assert accepted > 0, "the test needs accepted drafts"


def test_greedy_equals_full_depth_from_a_prompt_longer_than_the_window(trained):
    model, data = trained
    idx = data[None, 300:370]  # 70 characters > block_size 32
    full = m.generate(model, idx, 60, temperature=0.0)
    spec = m.generate_speculative(model, idx, 60, 0, 4, temperature=0.0)
    assert torch.equal(spec.tokens, full.tokens) and spec.stats["accepted"] > 0


def test_rejections_happen_and_roll_back(trained):
    """Over several prompts some drafts are rejected (a greedy loop alone could accept them all) and the
    rolled-back cache still gives the full model's tokens."""
    model, data = trained
    accepted = drafted = 0
    for p in range(6):
        idx = data[None, 2000 * p : 2000 * p + 5]
        spec = m.generate_speculative(model, idx, 100, 0, 4, temperature=0.0)
        assert torch.equal(spec.tokens, m.generate(model, idx, 100, temperature=0.0).tokens)
        accepted, drafted = accepted + spec.stats["accepted"], drafted + spec.stats["drafted"]
    assert 0 < accepted < drafted, "need both accepted and rejected drafts"


def layer_positions(model):
    """Hooks counting the positions each block runs, rows included."""
    positions = [0] * model.config.n_layer
    for l, block in enumerate(model.transformer.h):
        block.register_forward_hook(
            lambda mod, args, out, l=l: positions.__setitem__(l, positions[l] + out.size(0) * out.size(1)))
    return positions


@pytest.mark.parametrize("rows", [1, 6])
def test_each_layer_runs_once_per_fed_position(trained, rows):
    """Every position a round feeds runs every layer once: layers 0..E in the draft, the rest in the
    verify pass, for every row of a batch (rows with less room draft on in spare slots, still once)."""
    import copy

    model, data = copy.deepcopy(trained[0]), trained[1]
    positions = layer_positions(model)
    idx = torch.stack([data[1500 * b : 1500 * b + 5] for b in range(rows)])
    spec = m.generate_speculative(model, idx, 80, 1, 4, temperature=0.0)
    L = model.config.n_layer
    assert len(set(positions)) == 1 and positions[0] > 80 * rows, positions  # every layer alike
    if rows == 1:  # one row has no spare slots: it feeds exactly the drafts it could keep
        prefill = round(spec.prefill_runs / L)  # positions re-prefilled, every layer once
        assert positions == [spec.stats["drafted"] + prefill] * L
        assert spec.layers_run == L * spec.stats["drafted"]


def test_bad_draft_settings_are_a_clear_error(trained):
    model, data = trained
    with pytest.raises(ValueError, match="draft_exit"):
        m.generate_speculative(model, data[None, :5], 10, 3, 4)


def test_kept_drafts_are_marked_round_by_round(monkeypatch):
    """A hand-built run: rounds that keep 2, 0 and 3 drafts of 4. The tokens a round keeps left at the
    draft's exit; the full model's token after them, and every token of a round that kept none, at the
    top."""
    model = tiny_model()
    kept = iter([2, 0, 3])

    def accept(drafts, q, p, room, temperature, generator):
        a = torch.tensor([next(kept)])
        return a, torch.tensor([5]), a < room

    monkeypatch.setattr(m, "speculative_accept", accept)
    out = m.generate_speculative(model, torch.tensor([[1, 2]]), 8, 1, 4, temperature=0.0)
    assert out.exited_at[0].tolist() == [1, 1, 3, 3, 1, 1, 1, 3]
    assert out.stats == {"rounds": 3, "drafted": 12, "accepted": 5, "num_draft": 4}


def accept_distribution(p, q, rule, n=20000, seed=0):
    """The distribution of the token one draft (k = 1) emits under an accept rule, n rows at once."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)[:, None]  # (n, 1)
    P, Q = p.expand(n, 1, -1), q.expand(n, 1, -1)
    accepted, nxt, has_next = rule(drafts, Q, P, torch.ones(n, dtype=torch.long), 1.0, gen)
    emitted = torch.where(accepted == 1, drafts[:, 0], nxt)
    return torch.bincount(emitted, minlength=len(p)).float() / n


def wrong_rule(drafts, q, p, room, temperature, generator):
    """A plausible mistake: on rejection, draw from p itself rather than from max(p - q, 0)."""
    accepted, _, has_next = m.speculative_accept(drafts, q, p, room, temperature, generator)
    return accepted, torch.multinomial(p[:, 0], 1, generator=generator)[:, 0], has_next


def tv_bound(cells, n, delta=1e-6):
    """Total variation an exact sampler stays under with probability 1 - delta, from n draws over
    `cells` outcomes (Weissman et al. 2003: P(|emp - p|_1 >= t) <= (2^cells - 2) exp(-n t^2 / 2))."""
    return math.sqrt(2 * (cells * math.log(2) - math.log(delta)) / n) / 2


def test_accept_rule_is_exact_and_a_wrong_rule_is_caught():
    p = torch.tensor([0.5, 0.3, 0.1, 0.1])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])

    def tv(a, b):
        return 0.5 * (a - b).abs().sum().item()
    assert tv(accept_distribution(p, q, m.speculative_accept), p) < tv_bound(4, 20000)
    assert tv(accept_distribution(p, q, wrong_rule), p) > 0.1  # the test has the power to fail


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (1.0, 3)])
def test_sampled_speculation_has_the_full_model_distribution(temperature, top_k):
    """n independent rows in one batch (one decoder for any batch size), each a draw of two tokens
    from a fixed context, against the full model's exact distribution computed here from its logits;
    the draft differs from it, so the accept rule matters."""
    model = tiny_model(n_layer=3)
    with torch.no_grad():
        model.lm_head.weight.div_(10)  # a flatter final head: top-k and temperature change it a lot
    idx, V, n = torch.tensor([[3, 1, 4]]), 11, 20000

    def dist(ctx, layer=2):
        logits = model.all_exit_logits(ctx)[layer, 0, -1] / temperature  # written out: not probs_from_logits
        if top_k:
            logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
        return logits.softmax(-1)

    probs1 = dist(idx)
    joint = torch.stack([probs1[a] * dist(torch.cat([idx, torch.tensor([[a]])], 1)) for a in range(V)])
    gen = torch.Generator().manual_seed(0)
    pairs = m.generate_speculative(model, idx.repeat(n, 1), 2, 0, 2, temperature, top_k, gen).tokens[:, 3:]
    emp = torch.zeros(V * V).index_add_(0, pairs[:, 0] * V + pairs[:, 1], torch.ones(n)).view(V, V) / n
    assert 0.5 * (emp.sum(1) - joint.sum(1)).abs().sum() < tv_bound(V, n)  # the first token
    assert 0.5 * (emp - joint).abs().sum() < tv_bound(V * V, n)  # both tokens jointly
    assert emp[joint == 0].sum() == 0, "no token outside the top k may ever be emitted"
    assert 0.5 * (dist(idx, 0) - probs1).abs().sum() > 0.1, "the draft must differ from the full model"
