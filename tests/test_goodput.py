"""Goodput: the cost model, and a controller that picks full depth or a draft length and never changes the output."""

import copy

import pytest
import torch

from conftest import m, tiny_model

pytestmark = pytest.mark.usefixtures("no_grad")

COSTS = {"full_step": 1.0, "draft": [0.4, 3.2], "timed_k": [2, 16], "verify": [1.1, 1.8], "rest": [0.1, 0.1],
         "slowest": [1.0, 1.0], "prefill": 0.0, "acceptance": 0.8, "tested": 32,
         "batches": 4}  # per round: drafts 0.2 k, a verify pass 1 + 0.05 k


def test_expected_tokens_by_hand():
    assert m.expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25)
    assert m.expected_tokens(1.0, 4) == 4 and m.expected_tokens(0.0, 4) == 1


def test_the_controller_speculates_when_drafts_are_kept_and_stops_when_they_are_not():
    keen = m.GoodputController(COSTS, 1.0, 0, 16, 6)  # a draft head equal to the final head: every draft kept
    assert keen.choose() == (0, 16)
    assert keen.speedup(16) == pytest.approx(16 / (16 * 0.2 + 1.0 + 16 * 0.05 + 0.1))
    hopeless = m.GoodputController(COSTS, 0.0, 0, 16, 6)  # a draft head that always disagrees
    assert hopeless.choose() == (5, 16)  # full depth: a draft through every layer
    mid = m.GoodputController(COSTS, 0.8, 0, 16, 6, prior=10)
    k = mid.choose()[1]
    assert 1 < k < 16 and mid.speedup(k) >= max(mid.speedup(j) for j in range(1, 17))
    mid.update(200, 0)  # the rounds so far kept nothing: it stops speculating
    assert mid.choose() == (5, 16)


class Alternating:
    """A controller that changes the draft length and the draft exit from round to round (full depth included)."""

    def __init__(self, n_layer):
        self.plan, self.i, self.seen = [(0, 1), (0, 3), (n_layer - 1, 2), (1, 2)], 0, 0

    def choose(self):
        self.i += 1
        return self.plan[(self.i - 1) % len(self.plan)]

    def update(self, drafted, kept):
        self.seen += drafted


def test_a_controller_never_changes_greedy_output(trained):
    model, data = trained
    idx = torch.stack([data[1700 * b : 1700 * b + 5] for b in range(4)])
    full = m.generate(model, idx, 90, temperature=0.0)
    controller = Alternating(model.config.n_layer)
    out = m.generate_self_speculative(model, idx, 90, 0, 4, controller=controller)
    assert torch.equal(out.tokens, full.tokens) and controller.seen > 0 and out.stats["full_rounds"] > 0
    kept = out.exited_at < model.config.n_layer - 1
    assert kept.any() and set(out.exited_at[kept].tolist()) == {0, 1}, "kept drafts carry their own round's exit"


def test_auto_picks_full_depth_when_the_draft_head_disagrees(trained):
    model, data = trained
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.exit_heads[0].lm_head.weight.mul_(-1)  # the draft head now prefers what the final head does not
    prompts = m.workload(data[:20000], 4, 8)
    config = copy.copy(model.config)
    config.bench_tokens, config.num_draft, config.draft_exit = 30, 4, 0
    costs = m.goodput_costs(model, prompts, 2, config, "greedy")
    assert costs["acceptance"] < 0.1 and costs["full_step"] > 0 and min(costs["draft"]) > 0
    assert min(costs["slowest"]) > 0
    auto = m.decoder(model, "auto", spec=(0, 8, 0.0), costs={"greedy": costs})
    out = auto(prompts[:2], 30)
    assert out.stats is None, "full depth: the plain decoder, no speculation"
    assert torch.equal(out.tokens, m.generate(model, prompts[:2], 30, temperature=0.0).tokens)


def test_auto_speculates_when_the_draft_is_good_and_keeps_greedy_output(trained):
    model, data = trained
    prompts = m.workload(data[:20000], 4, 8)
    costs = dict(COSTS, acceptance=0.9)
    out = m.decoder(model, "auto", spec=(0, 8, 0.0), costs={"greedy": costs})(prompts, 60)
    assert out.stats["rounds"] > 0 and out.stats["accepted"] > 0
    assert torch.equal(out.tokens, m.generate(model, prompts, 60, temperature=0.0).tokens)


def test_sampled_output_keeps_its_distribution_under_a_changing_controller():
    model = tiny_model(n_layer=3)
    idx, V = torch.tensor([[3, 1, 4]]), 11
    dist = lambda ctx: m.probs_from_logits(model(ctx)[0][0, -1], 1.0, 0)  # noqa: E731
    joint = torch.stack([dist(idx)[a] * dist(torch.cat([idx, torch.tensor([[a]])], 1)) for a in range(V)])
    gen, counts = torch.Generator().manual_seed(0), torch.zeros(V, V)
    for _ in range(400):  # 400 batches of 8 rows, the controller's plan restarting each time
        out = m.generate_self_speculative(model, idx.repeat(8, 1), 2, 0, 3, 1.0, 0, gen, controller=Alternating(3))
        for a, b in out.tokens[:, 3:].tolist():
            counts[a, b] += 1
    emp = counts / counts.sum()
    assert 0.5 * (emp.sum(1) - joint.sum(1)).abs().sum() < 0.04
    assert 0.5 * (emp - joint).abs().sum() < 0.1


def test_acceptance_is_per_draft_tested(trained):
    """A row keeps drafts until its first rejection: kept / (kept + rejections) is the chance that a draft the
    verifier tests is kept, and expected_tokens of it predicts the tokens a round gains; kept / drafted, which also
    counts the drafts after a miss that were never tested, does not."""
    model, data = trained
    gen = torch.Generator().manual_seed(0)  # sampled: greedy text soon loops and every draft is kept
    out = m.generate_self_speculative(model, data[20000:20008][None], 240, 0, 8, 1.0, 0, gen)
    s = out.stats
    per_round = 240 / s["rounds"]
    tested = m.expected_tokens(s["accepted"] / (s["accepted"] + s["rejected"]), 8)
    naive = m.expected_tokens(s["accepted"] / s["drafted"], 8)
    assert abs(tested - per_round) < 0.15 * per_round < abs(naive - per_round), (tested, naive, per_round)


def test_the_round_factor_grows_with_the_draft_length_and_the_model_passes_through_each_timed_one(trained):
    """Window edges cut long rounds short (and a batch waits for its slowest row), so rounds outnumber what the
    acceptance alone predicts, the more so the longer the draft. The cost model times a few draft lengths and joins
    them by straight lines: at a timed k it uses that pass's figures exactly, so at val's acceptance it predicts
    the rounds that pass took, and a round's drafts cost what they cost there, not k times a pooled step."""
    model, data = trained
    prompts = m.workload(data[:20000], 4, 8)
    config = copy.copy(model.config)
    config.bench_tokens, config.num_draft, config.draft_exit = 60, 8, 0
    costs = m.goodput_costs(model, prompts, 2, config, "sampled")  # sampled: each k's pass accepts its own share
    assert costs["timed_k"] == [2, 8, 16] and costs["slowest"][0] >= 0.95 and costs["slowest"][2] > costs["slowest"][0]
    rounds = sum(m.generate_self_speculative(model, batch, 60, 0, 8, config.temperature, config.top_k,
                                             torch.Generator().manual_seed(config.seed + i)).stats["rounds"]
                 for i, batch in enumerate(prompts.split(2)))
    assert costs["slowest"][1] * 2 * 60 / m.expected_tokens(costs["acceptance"], 8) == pytest.approx(rounds)
    assert costs["draft"][0] < costs["draft"][1] < costs["draft"][2]
    bent = dict(COSTS, timed_k=[2, 8, 16], draft=[0.5, 1.7, 3.0], verify=[1.1, 1.2, 3.0], rest=[0.1, 0.1, 0.1],
                slowest=[1.0, 1.1, 1.5])
    model_of = m.GoodputController(bent, 0.9, 0, 16, 6)
    for k, draft, verify, slowest in ((8, 1.7, 1.2, 1.1), (16, 3.0, 3.0, 1.5), (12, 2.35, 2.1, 1.3)):  # 12: halfway
        seconds = slowest * (draft + verify + 0.1)
        assert model_of.speedup(k) == pytest.approx(m.expected_tokens(0.9, k) / seconds)


def test_auto_approx_chooses_skipdecode_only_where_it_is_allowed_and_predicted_to_win():
    hopeless = dict(COSTS, acceptance=0.0)  # speculation cannot pay: exact auto runs full depth
    assert m.auto_choice(dict(hopeless, skipdecode_speedup=1.3), (0, 16), 6)[:2] == ("full", 1.0)
    allowed = m.auto_choice(dict(hopeless, skipdecode_speedup=1.3), (0, 16), 6, approximate=True)
    assert allowed[:2] == ("skipdecode", 1.3)
    assert m.auto_choice(dict(hopeless, skipdecode_speedup=1.05), (0, 16), 6, approximate=True)[0] == "full", \
        "within the margin, full depth stays"
    keen = dict(COSTS, acceptance=1.0)  # speculation predicted at 3.2x: it beats a 1.3x schedule
    kind, predicted, _ = m.auto_choice(dict(keen, skipdecode_speedup=1.3), (0, 16), 6, approximate=True)
    assert kind == "speculate" and predicted > 1.3


def test_auto_approx_runs_skipdecode_when_it_chose_it_and_takes_its_quality(trained):
    model, data = trained
    L, prompts = model.config.n_layer, m.workload(data[:20000], 4, 8)
    schedule = [L - 1] * 8 + [0] * (model.config.block_size - 8)
    costs = {"greedy": dict(COSTS, acceptance=0.0, skipdecode_speedup=1.5)}
    approx = m.decoder(model, "auto_approx", spec=(0, 8, 0.0), schedule=schedule, costs=costs)(prompts, 40)
    skip = m.decoder(model, "skipdecode", schedule=schedule)(prompts, 40)
    assert approx.stats is None and torch.equal(approx.tokens, skip.tokens)
    assert not torch.equal(approx.tokens, m.generate(model, prompts, 40, temperature=0.0).tokens)
    rows = [{"name": "skipdecode", "mode": "greedy", "test_loss": 2.5, "test_accuracy": 0.3, "agreement": 0.9},
            {"name": "auto_approx", "mode": "greedy", "choice": "skipdecode", "test_loss": 2.0, "test_accuracy": 0.4,
             "agreement": 1.0}]
    row = m.approx_quality(rows[1], rows)
    assert row["approximate"] and (row["test_loss"], row["agreement"]) == (2.5, 0.9)
    assert not m.approx_quality(dict(rows[1], choice="k=4"), rows)["approximate"]


def test_once_speculating_auto_stops_only_where_full_depth_is_predicted_faster():
    """The margin decides whether to start; a dip in the acceptance below it must not switch a decoding batch to
    full-depth rounds (slower than plain full depth), only a fall below full depth's predicted speed."""
    costs = dict(COSTS, acceptance=0.8, tested=10)
    kind, _, controller = m.auto_choice(costs, (0, 16), 6)
    assert kind == "speculate" and controller.tested == 10, "val's acceptance weighs as the drafts it was measured on"
    controller.update(90, 54)  # a = (8 + 54) / 100 = 0.62: about 1.08x, under the margin but above full depth
    exit_, k = controller.choose()
    assert exit_ == 0 and 1.0 < controller.speedup(k) < 1 + m.GOODPUT_MARGIN
    controller.update(900, 400)  # a = 0.462: every k is predicted slower than full depth
    assert controller.choose()[0] == 5
    assert m.GoodputController(costs, 0.62, 0, 16, 6).choose()[0] == 5, "before decoding the margin holds"


def test_the_margin_to_speculate_grows_as_the_val_workload_has_fewer_batches():
    """A batch lasts as long as its slowest row: one batch of val prompts says less about test than four do."""
    costs = dict(COSTS, acceptance=0.68)  # about 1.17x predicted at k = 4
    assert m.auto_choice(costs, (0, 16), 6)[0] == "speculate"
    assert m.auto_choice(dict(costs, batches=1), (0, 16), 6)[0] == "full", "one batch: a 20% margin"
    assert m.auto_choice(dict(costs, batches=1, skipdecode_speedup=1.15), (0, 16), 6, approximate=True)[0] == \
        "skipdecode", "SkipDecode's prediction is no batch's timing: it keeps the 10% margin"
