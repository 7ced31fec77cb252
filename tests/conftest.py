import contextlib
import io
import os
import shutil
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import nanogpt_exit_head as m  # noqa: E402

torch.set_num_threads(1)  # tiny models: threads only add overhead and noise


# the joint-loss recipe: the joint loss alone, as Part I's GPT computes it
JOINT_LOSS_RECIPE = {"alpha": 0.3, "distill_weight": 0.0, "distill_temperature": 1.0, "layer_dropout": 0.0}


def tiny_config(**overrides):
    """A model small enough that every test runs in well under a second."""
    cfg = m.LabConfig(n_layer=4, n_head=2, n_embd=16, block_size=16, vocab_size=11, **JOINT_LOSS_RECIPE)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = m.RecipeGPT(tiny_config(**overrides))
    # random init gives near-uniform heads; sharpen them so thresholds bite at every layer
    with torch.no_grad():
        for head in model.exit_heads:
            head.lm_head.weight.mul_(40)
        model.lm_head.weight.mul_(20)
    return model.eval()


@pytest.fixture
def model():
    return tiny_model()


def reference_generate(model, idx, n_new, temperature=0.0, generator=None):
    """Uncached full-depth decoding: the whole window through model() at every step."""
    tokens, start = idx.clone(), None
    for _ in range(n_new):
        start = m.window_start(start, tokens.size(1), model.config.block_size)
        logits, _ = model(tokens[:, start:])
        nxt = m.sample(logits[:, -1], temperature, 0, generator)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
    return tokens


@pytest.fixture
def no_grad():
    """Tests compare outputs of inference-mode decoding with plain forward passes."""
    with torch.no_grad():
        yield


@pytest.fixture(scope="session")
def trained():
    """A tiny model trained for a few seconds on input.txt, so its exit heads mostly agree with the final one."""
    with open(os.path.join(ROOT, "input.txt")) as f:
        text = f.read()[:200_000]
    tok = m.CharTokenizer(text)
    cfg = tiny_config(vocab_size=tok.vocab_size, n_embd=32, block_size=32, learning_rate=3e-3)
    torch.manual_seed(0)
    model = m.GPT(cfg)
    opt = m.configure_optimizer(model, cfg)
    data = torch.tensor(tok.encode(text))
    gen = torch.Generator().manual_seed(0)
    with torch.enable_grad():
        for _ in range(300):
            x, y = m.get_batch(data, cfg.block_size, 16, gen, "cpu")
            _, loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval(), data


# the exit decoders' KV strategies by name, as their declarations give them
KV_STRATEGIES = {name: d.strategy for name, d in m.DECODERS.items() if d.strategy}


def strategy(name):
    """The KV strategy class of a name, as generate() takes it."""
    return KV_STRATEGIES[name]


def generate_with_cache(model, idx, n_new, strategy=m.Backfill, **kw):
    """m.generate, plus the KV cache it decoded with and the strategy instance it used."""
    made = {}

    class Recorded(m.KVCache):
        def __init__(self, *args):
            super().__init__(*args)
            made["cache"] = self

    def make():
        made["strategy"] = strategy()
        return made["strategy"]

    original = m.KVCache
    m.KVCache = Recorded
    try:
        out = m.generate(model, idx, n_new, strategy=make, **kw)
    finally:
        m.KVCache = original
    return out, made["cache"], made["strategy"]


def flush(model, cache, deferred):
    """Run what deferred recompute left parked at the end, so its cache can be compared with backfill's."""
    with torch.inference_mode():
        for l, block in enumerate(model.transformer.h):
            n, end = cache.lengths[l], cache.lengths[0]  # layer 0 always holds every position
            if n < end:
                deferred.parked[:, n:end] = block(deferred.parked[:, n:end], cache, l)
    return cache


class LabRuns:
    """Whole runs of m.main, each made once a session and shared by every test that reads it.

    A test calls it in its body (not as a fixture), so a run that breaks fails each test that reads it,
    with the run's stderr, and is not cached: the next reader runs it again. Readers only read the run's
    folder and output; a test that writes there (a resume, a broken checkpoint) works on a copy (copy_to).
    """

    def __init__(self, tmp_path_factory):
        self.factory, self.done = tmp_path_factory, {}

    def __call__(self, args):
        """m.main(args + --out_dir) with grad enabled (as a test calls it): (stdout, stderr, out_dir)."""
        key = tuple(args)
        if key not in self.done:
            out = self.factory.mktemp("lab_run")
            stdout, stderr = io.StringIO(), io.StringIO()
            with torch.enable_grad(), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                rc = m.main(list(args) + [f"--out_dir={out}"])
            assert rc == 0, stderr.getvalue()[-2000:]
            self.done[key] = (stdout.getvalue(), stderr.getvalue(), out)
        return self.done[key]

    def copy_to(self, args, folder):
        """The run's files (ckpt.pt, report.json, report.html) copied into folder, for a test to change."""
        shutil.copytree(self(args)[2], folder, dirs_exist_ok=True)
        return folder


@pytest.fixture(scope="session")
def lab_runs(tmp_path_factory):
    return LabRuns(tmp_path_factory)


# a tiny run of the whole lab, 3 layers, with the continued exit model (test_report_html's page, test_cli's
# report and story)
THREE_LAYER_RUN = ["--n_layer=3", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4", "--eval_iters=1",
                   "--max_iters=2", "--max_new_tokens=40", "--device=cpu", "--quality_positions=48",
                   "--bench_tokens=12", "--bench_repeats=1", "--bench_prompts=2", "--bench_prompt_len=8",
                   "--sweep_positions=500", "--continued=0.5"]

# a tiny run of the whole lab (test_newcomer's default run)
DEFAULT_RUN = ["--n_layer=3", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=4", "--eval_iters=1",
                   "--max_iters=4", "--eval_interval=2", "--max_new_tokens=40", "--device=cpu",
                   "--quality_positions=192", "--bench_tokens=12", "--bench_repeats=1", "--bench_prompts=4",
                   "--bench_prompt_len=8", "--sweep_positions=500"]
