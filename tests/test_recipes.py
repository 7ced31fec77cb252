"""Training recipes: each option changes the loss exactly as it claims; all off is the joint-loss recipe."""

import pytest
import torch
import torch.nn.functional as F

from conftest import JOINT_LOSS_RECIPE, m, tiny_model

V = 11


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (3, 9), generator=gen), torch.randint(0, V, (3, 9), generator=gen)


def ce(logits, y):
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))


def per_exit_ce(model, idx, y):
    states = model.hidden_states(idx)
    final = ce(model.lm_head(model.transformer.ln_f(states[-1])), y)
    return final, [ce(model.exit_logits(states[l], l), y) for l in range(3)]


def loss_with(model, **fields):
    for k, v in fields.items():
        setattr(model.config, k, v)
    idx, y = batch()
    return model(idx, y)[1]


def test_all_options_off_is_the_seed_recipe_exactly():
    model = tiny_model(**JOINT_LOSS_RECIPE)
    seed = loss_with(model)
    final, exits = per_exit_ce(model, *batch())
    assert torch.allclose(seed, final + 0.3 * sum(exits), atol=1e-6)
    model.train()  # in training too: with layer_dropout 0 nothing is random
    assert torch.equal(loss_with(model), seed)


def test_the_default_recipe_differs_from_the_seed_only_where_it_says():
    default = m.LabConfig()
    changed = {k for k, v in JOINT_LOSS_RECIPE.items() if getattr(default, k) != v}
    assert changed == {"layer_dropout", "distill_weight"}


def test_self_distillation_term():
    model = tiny_model()
    loss = loss_with(model, distill_weight=0.5, distill_temperature=2.0)
    idx, y = batch()
    states = model.hidden_states(idx)
    final_logits = model.lm_head(model.transformer.ln_f(states[-1]))
    teacher = (final_logits / 2).softmax(-1)
    kl = 0
    for l in range(3):
        student = (model.exit_logits(states[l], l) / 2).log_softmax(-1)
        kl = kl + (teacher * (teacher.log() - student)).sum(-1).mean()
    final, exits = per_exit_ce(model, idx, y)
    assert torch.allclose(loss, final + 0.3 * sum(exits) + 0.5 * 4 * kl, atol=1e-5)


def test_distillation_does_not_pull_the_final_head():
    grads = []
    for distill in (0.0, 1.0):
        model = tiny_model(alpha=0.0, distill_weight=distill)
        model.train()
        idx, y = batch()
        model(idx, y)[1].backward()
        grads.append(model.transformer.ln_f.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1])  # the teacher is detached


def test_a_one_layer_model_has_no_layer_dropout_to_divide_by():
    """A pruned model may keep one block: its rate is 0, not a division by zero."""
    assert m.layer_dropout_prob(0, m.LabConfig(n_layer=1)) == 0.0


def test_layer_dropout_skips_blocks_in_training_only():
    assert [m.layer_dropout_prob(l, m.LabConfig(n_layer=4, layer_dropout=0.9)) for l in range(4)] == pytest.approx(
        [0.0, 0.9 * (2 ** (1 / 3) - 1), 0.9 * (2 ** (2 / 3) - 1), 0.9])
    model = tiny_model(layer_dropout=0.99)
    idx, _ = batch()
    torch.manual_seed(0)
    model.train()
    states = model.hidden_states(idx)
    skipped_top = (states[3] == states[2]).all(-1).all(-1)  # (B,): sequences whose top block was skipped
    assert skipped_top.sum() >= 2
    assert not (states[0] == model.embed(idx)).all(-1).all(-1).any()  # block 0 is never skipped
    model.eval()
    plain = tiny_model(layer_dropout=0.0)
    for a, b in zip(model.hidden_states(idx), plain.hidden_states(idx)):
        assert torch.equal(a, b)


def test_evaluation_leaves_the_model_in_the_mode_it_found():
    model = tiny_model(layer_dropout=0.5)
    data = torch.randint(0, V, (500,))
    cfg = model.config
    cfg.eval_iters, cfg.batch_size = 1, 2
    for mode in (False, True):
        model.train(mode)
        m.estimate_loss(model, {"train": data, "val": data}, cfg, "cpu")
        assert model.training is mode
