"""Graph-ready decoding: the row cache with fixed shapes gives the decoders' tokens and logits (CUDA graphs record
its steps on a GPU; here it runs eagerly)."""

import pytest
import torch

from conftest import m, tiny_model

pytestmark = pytest.mark.usefixtures("no_grad")


@pytest.mark.parametrize("batch", [1, 3])
def test_static_full_depth_equals_generate_past_block_size(batch):
    model = tiny_model()
    idx = torch.randint(0, 11, (batch, 3), generator=torch.Generator().manual_seed(batch))
    for temperature in (0.0, 1.0):  # greedy, and sampled with the same draws
        a = m.generate(model, idx, 40, temperature=temperature, generator=torch.Generator().manual_seed(0))
        b = m.generate_static(model, idx, 40, temperature=temperature, generator=torch.Generator().manual_seed(0))
        assert torch.equal(a.tokens, b.tokens), temperature
        assert a.prefill_runs == b.prefill_runs and a.layers_run == b.layers_run
    forced = torch.randint(0, 11, (batch, 40), generator=torch.Generator().manual_seed(9))  # two window slides
    a, b = m.generate(model, idx, 40, forced=forced), m.generate_static(model, idx, 40, forced=forced)
    assert torch.allclose(a.logits, b.logits, atol=1e-5)


def test_a_static_step_reads_every_slot_whatever_its_position():
    """Shapes that never change: every block call of a step attends over all the slots, at any position."""
    model = tiny_model()
    cache = m.RowKVCache(model.config, 2, "cpu", static=True)
    shapes = set()
    for block in model.transformer.h:
        block.attn.register_forward_hook(lambda mod, args, out: shapes.add(tuple(cache.layout[2].shape)))
    for pos in (0, 5, 15):
        m.static_step(model, cache, torch.tensor([1, 2]), torch.tensor([pos, pos]))
    assert shapes == {(2, 1, 1, cache.k.size(3))}
