"""
nanogpt_exit_head.py: a character-level GPT with an exit head after every layer, decoded with
confidence-gated early exit, and an honest measurement of what that buys. Run: `python
nanogpt_exit_head.py` (train, sample, measure), `--help` (every field), `python -m pytest -q tests`.

Part I, the seed end to end: exit heads and the joint loss, the per-layer KV cache, gated decoding
with backfill, exit statistics, training. Part II, one idea a section: deferred recompute, state copy
(CALM, arXiv:2207.07061), holes, self-speculative decoding (LayerSkip, arXiv:2404.16710), choosing the
threshold, measurement, batches, reports, checkpoints, the command line. Left out on purpose: BPE,
rotary embeddings, mixed precision in decoding, PABEE patience, dependencies beyond torch, numpy, tqdm.
"""

import inspect
import pickle
import signal
import threading
import zipfile
import itertools
import json
import math
import os
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F
from tqdm import tqdm

# =============================================================================
# Part I: the seed, end to end
# =============================================================================

# -----------------------------------------------------------------------------
# Config: every hyperparameter, one per line; override any as --name=value

@dataclass
class Config:
    # I/O
    out_dir: str = "out"  # where ckpt.pt and report.json go
    init_from: str = "scratch"  # 'scratch' trains a new model, 'resume' continues from out_dir/ckpt.pt
    input_path: str = "input.txt"  # the training text, one character per token
    seed: int = 1337  # one seed for batches, init and sampling: same command, same numbers
    device: str = "auto"  # 'auto' picks cuda, then mps, then cpu; or name one
    compile: bool = False  # torch.compile the model for training (slow to start, faster on GPU)
    sample_only: bool = False  # with --init_from=resume: print the early-exit sample, exit map and statistics only
    # model
    n_layer: int = 6  # how many transformer blocks (and exits) are stacked?
    n_head: int = 4  # attention heads per block; must divide n_embd
    n_embd: int = 128  # width of the residual stream
    block_size: int = 64  # the longest context the model ever sees, in characters
    dropout: float = 0.0  # dropout in training; raise it for bigger models on this small corpus
    bias: bool = False  # biases in Linear and LayerNorm layers? (nanoGPT's CPU recipe: no)
    vocab_size: int = 0  # set from the distinct characters of input_path; not an override
    # exit heads
    alpha: float = 0.3  # weight of each exit head's loss; 0 trains a plain GPT and skips the heads
    exit_weights: str = "constant"  # per-exit loss weights: constant (alpha each), linear or geometric in depth, layerskip
    exit_head: str = "separate"  # 'separate' heads, one 'shared' head, or 'final': ln_f + lm_head read at every exit
    distill_weight: float = 0.1  # self-distillation: weight of KL(final || exit), the final head detached (seed: 0)
    distill_temperature: float = 1.0  # temperature of that distillation; higher matches more of the distribution
    layer_dropout: float = 0.2  # LayerSkip's p_max: in training skip block l with p_max * (2^(l / (L-1)) - 1) (seed: 0)
    # training
    batch_size: int = 12  # how many independent sequences per optimizer step, per process (torchrun: x processes)?
    max_iters: int = 2000  # total optimizer steps
    learning_rate: float = 1e-3  # peak learning rate after warmup
    min_lr: float = 1e-4  # learning rate at the end of the cosine decay
    warmup_iters: int = 100  # steps of linear warmup from 0 to learning_rate
    weight_decay: float = 0.1  # AdamW weight decay on matrices (not on biases or norms)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.99  # AdamW beta2; 0.99 suits small batches of characters
    grad_clip: float = 1.0  # clip the gradient norm to this; 0 turns clipping off
    eval_interval: int = 500  # evaluate train/val loss every this many steps
    eval_iters: int = 20  # batches per evaluation; more is steadier and slower
    # generation
    prompt: str = "\n"  # text the samples start from; every character must be in the vocabulary
    max_new_tokens: int = 500  # characters generated per sample
    temperature: float = 0.8  # sampling temperature; 0 means greedy
    top_k: int = 0  # sample only from the k most likely characters; 0 means all
    exit_threshold: float = 0.9  # exit when confidence exceeds this (1 never, 0 always); unless given, the run calibrates one
    exit_layers: str = "auto"  # exits checked: 'auto' (per KV strategy, the cost-aware plan; all in sample and sweep), 'all', or '1,3'
    kv_strategy: str = "backfill"  # how skipped layers' KV entries are filled: backfill, deferred, state_copy, holes
    confidence: str = "top1"  # confidence measure: top1, margin (top1 - top2) or entropy (1 - H / log V)
    draft_exit: int = 0  # self-speculative: the last layer of the draft (its exit head drafts); set by --spec_sweep
    num_draft: int = 8  # self-speculative: the most tokens drafted per verify pass; set by --spec_sweep
    draft_stop: float = 0.0  # self-speculative: stop drafting when the draft's probability falls below this (0: never)
    # evaluation and benchmarks
    quality_positions: int = 2000  # test positions decoded teacher-forced per strategy; more is steadier and slower
    bench_prompts: int = 16  # timed workload: prompts from evenly spaced places of test (val, when choosing)
    bench_prompt_len: int = 32  # characters per workload prompt
    bench_tokens: int = 100  # characters generated per prompt per timed run
    bench_repeats: int = 3  # timed passes over the workload per strategy, interleaved; the median is reported
    epsilon: float = 0.01  # calibration: tolerated rate of disagreement with full depth; lower is more cautious
    delta: float = 0.05  # calibration: allowed chance that the chosen threshold breaks epsilon
    sweep_positions: int = 20000  # val and test positions recorded for the sweep and calibration
    bench_train: bool = False  # time training steps with exit heads on and off, interleaved, then stop
    compare_recipes: bool = False  # train every recipe in RECIPES at this budget and compare them (long: ~2 min each)
    spec_sweep: bool = False  # also time self-speculative decoding on every (draft_exit, num_draft, draft_stop) (minutes)
    strategies_threshold: float = -1.0  # threshold of the strategies table; -1 picks on val the highest with >= 30% early exits
    bench_batch: bool = False  # also measure every batch design at batch 1, 4 and 16 (a few minutes)
    schedule_disagreement: float = 0.03  # SkipDecode: the most disagreement with full depth on val its schedule may cost

CONFIDENCE_MEASURES = ("top1", "margin", "entropy")

# -----------------------------------------------------------------------------
# Data: characters in, integers out; three contiguous splits

class CharTokenizer:
    """A vocabulary of the distinct characters of a text."""

    def __init__(self, chars):
        self.chars = "".join(sorted(set(chars)))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.vocab_size = len(self.chars)

    def encode(self, s):
        unknown = sorted(set(s) - set(self.stoi))
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {', '.join(repr(c) for c in unknown)}")
        return [self.stoi[c] for c in s]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)

def split_data(data):
    """Contiguous train 90% / val 5% / test 5%: val chooses things, test reports them."""
    n = len(data)
    a, b = int(0.9 * n), int(0.95 * n)
    return {"train": data[:a], "val": data[a:b], "test": data[b:]}

def get_batch(data, block_size, batch_size, generator, device):
    """Random windows of block_size characters and the same windows shifted by one."""
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[i : i + block_size] for i in ix])  # (B, T)
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])  # (B, T)
    return x.to(device), y.to(device)

# -----------------------------------------------------------------------------
# Model: nanoGPT's GPT, plus an ExitHead after every block but the last

class CausalSelfAttention(nn.Module):
    """All heads in one fused QKV projection and one scaled_dot_product_attention call."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def heads(self, t):
        B, T, C = t.size()
        return t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

    def forward(self, x, cache=None, layer=0):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = self.heads(q), self.heads(k), self.heads(v)  # (B, nh, T, hs)
        if cache is None:
            p = self.attn_dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            # new queries see every cached key of this layer plus the new keys, causally
            k, v, mask = cache.append(layer, k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))

class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

class Block(nn.Module):
    """Pre-LayerNorm transformer block; with a cache it appends this layer's K/V for x."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cache=None, layer=0):
        if cache is not None:
            cache.count(layer, x.size(1))
        x = x + self.attn(self.ln_1(x), cache, layer)
        return x + self.mlp(self.ln_2(x))

class ExitHead(nn.Module):
    """LayerNorm + Linear to the vocabulary: reads a middle layer's hidden state as logits."""

    def __init__(self, config):
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln(x))

def exit_head_modules(config):
    """The exit heads below the last layer: one each, one shared by all, or none (ln_f + lm_head serve)."""
    if config.exit_head == "final":
        return []
    if config.exit_head == "shared":
        return [ExitHead(config)] * (config.n_layer - 1)  # one module: its parameters count once
    return [ExitHead(config) for _ in range(config.n_layer - 1)]

def exit_loss_weights(config):
    """(weight of each exit's CE, weight of the final CE) under config.exit_weights.

    constant: alpha each (the seed); linear / geometric: alpha * (L - 1) spread as l + 1 or 2^l; layerskip:
    alpha * sum_{i<=l} i per exit, (L - 1) + sum_{i<L-1} i for the last, normalised (LayerSkip eq. 5)."""
    L, alpha = config.n_layer, config.alpha
    if config.exit_weights == "constant":
        return [alpha] * (L - 1), 1.0
    if config.exit_weights == "layerskip":
        e = [alpha * l * (l + 1) / 2 for l in range(L - 1)] + [(L - 1) + (L - 2) * (L - 1) / 2]
        return [w / sum(e) for w in e[:-1]], e[-1] / sum(e)
    shape = [l + 1 for l in range(L - 1)] if config.exit_weights == "linear" else [2.0**l for l in range(L - 1)]
    return [alpha * (L - 1) * s / sum(shape) for s in shape], 1.0

def layer_dropout_prob(layer, config):
    """LayerSkip's rate for block `layer`: 0 at the bottom, rising exponentially to layer_dropout at the top."""
    return config.layer_dropout * (math.exp(layer * math.log(2) / (config.n_layer - 1)) - 1)

def cross_entropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

def distillation(logits, teacher_log_probs, temperature):
    """T^2 * KL(teacher || student) per position, the usual scaling so gradients match across T."""
    student = (logits.float() / temperature).log_softmax(-1)
    kl = F.kl_div(student.reshape(-1, student.size(-1)), teacher_log_probs.reshape(-1, student.size(-1)),
                  log_target=True, reduction="batchmean")
    return temperature**2 * kl

class GPT(nn.Module):
    """nanoGPT with exit_heads[l] after block l for l < n_layer - 1; the last exit is ln_f + lm_head."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        self.exit_heads = nn.ModuleList(exit_head_modules(config))
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self):
        """(base model, exit heads) parameter counts; unlike nanoGPT's, position embeddings are counted."""
        heads = sum(p.numel() for p in self.exit_heads.parameters())
        return sum(p.numel() for p in self.parameters()) - heads, heads

    def embed(self, idx, pos0=0):
        """Token + position embeddings of idx, whose first token sits at window position pos0."""
        T = idx.size(1)
        assert pos0 + T <= self.config.block_size, f"position {pos0 + T - 1} is past block_size"
        pos = torch.arange(pos0, pos0 + T, dtype=torch.long, device=idx.device)  # (T,)
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)

    def exit_logits(self, x, layer):
        """Logits of hidden state x read at `layer`: its exit head, or ln_f + lm_head at the top."""
        if layer == self.config.n_layer - 1 or self.config.exit_head == "final":
            return self.lm_head(self.transformer.ln_f(x))
        return self.exit_heads[layer](x)

    def hidden_states(self, idx):
        """The output of every block for a whole sequence, no cache: a list of (B, T, C)."""
        x, states = self.embed(idx), []
        for l, block in enumerate(self.transformer.h):
            p = layer_dropout_prob(l, self.config) if self.training else 0.0
            y = block(x)
            if p > 0:  # LayerSkip's layer dropout: each sequence skips this block with probability p
                keep = torch.rand(x.size(0), 1, 1, device=x.device) >= p  # (B, 1, 1)
                y = torch.where(keep, y, x)
            x = y
            states.append(x)
        return states

    def all_exit_logits(self, idx):
        """(n_layer, B, T, V): what every exit, the final one last, predicts at every position."""
        states = self.hidden_states(idx)
        return torch.stack([self.exit_logits(h, l) for l, h in enumerate(states)])

    def forward(self, idx, targets=None):
        """nanoGPT's contract: (logits, loss); without targets only the last position's logits."""
        states = self.hidden_states(idx)
        if targets is None:
            return self.exit_logits(states[-1][:, [-1]], self.config.n_layer - 1), None
        logits = self.exit_logits(states[-1], self.config.n_layer - 1)
        return logits, self.joint_loss(states, logits, targets)

    def joint_loss(self, states, logits, targets):
        """The joint loss. The seed's: CE(final) + alpha * sum_l CE(exit_l), which is exit_weights='constant';
        the other weightings and the distillation term are the recipes Part II compares. Exits with nothing to
        learn (alpha = 0, no distillation) are not computed at all."""
        cfg = self.config
        w_exits, w_final = exit_loss_weights(cfg)
        loss = w_final * cross_entropy(logits, targets)
        teacher = None
        if cfg.distill_weight > 0:  # the final head's distribution, detached: the exits chase it, not vice versa
            teacher = (logits.detach().float() / cfg.distill_temperature).log_softmax(-1)
        for l, w in enumerate(w_exits):
            if w == 0 and teacher is None:
                continue
            exit_logits = self.exit_logits(states[l], l)
            loss = loss + w * cross_entropy(exit_logits, targets)
            if teacher is not None:
                loss = loss + cfg.distill_weight * distillation(exit_logits, teacher, cfg.distill_temperature)
        return loss

# -----------------------------------------------------------------------------
# The KV cache: one per-layer mechanism that every decoding strategy uses

class KVCache:
    """Preallocated keys and values for every layer, each layer with its own filled length.

    Invariant: layer l holds entries for window positions [0, lengths[l]) and nothing else, written in
    place; full depth keeps all lengths equal. A token that exits early leaves the layers above behind,
    and what a KVStrategy does about it is all that tells strategies apart. pending_states holds the state
    each position reached, for layers above that have not run it yet (deferred, the speculative verify).
    """

    def __init__(self, config, batch_size, device, dtype=torch.float32):
        shape = (config.n_layer, batch_size, config.n_head, config.block_size, config.n_embd // config.n_head)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, nh, block_size, hs)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pending_states = torch.zeros(batch_size, config.block_size, config.n_embd, device=device, dtype=dtype)
        self.lengths = [0] * config.n_layer
        self.layer_evals = [0] * config.n_layer  # how many (position, layer) block runs, per layer
        self.start = 0  # absolute position of window position 0

    def reset(self, start=0):
        self.lengths = [0] * len(self.lengths)
        self.start = start

    def count(self, layer, T):
        self.layer_evals[layer] += T

    def append(self, layer, k, v):
        """Write k, v (B, nh, T, hs) after this layer's entries; return all entries and the mask."""
        n, T = self.lengths[layer], k.size(2)
        assert n + T <= self.k.size(3), f"layer {layer} cache is full ({n} + {T} > block_size)"
        self.k[layer, :, :, n : n + T] = k
        self.v[layer, :, :, n : n + T] = v
        self.lengths[layer] = n + T
        # one new query needs no mask; a chunk of T queries sees the n old keys and its own past
        mask = None if T == 1 else torch.ones(T, n + T, dtype=torch.bool, device=k.device).tril(n)
        return self.k[layer, :, :, : n + T], self.v[layer, :, :, : n + T], mask

# -----------------------------------------------------------------------------
# Decoding: confidence, sampling, the context window, and the gated step with backfill

def confidence(logits, measure="top1"):
    """How sure a head is, in [0, 1], higher is surer: (B, V) logits -> (B,)."""
    probs = logits.float().softmax(-1)
    if measure == "top1":
        return probs.amax(-1)
    if measure == "margin":
        top2 = probs.topk(2, dim=-1).values  # (B, 2)
        return top2[:, 0] - top2[:, 1]
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
    return 1.0 - entropy / math.log(probs.size(-1))

def probs_from_logits(logits, temperature, top_k):
    """The distribution a sampler draws from: temperature, then the top_k most likely only."""
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.softmax(-1)

def draw(probs, generator):
    """(B, V) probabilities -> (B,) tokens by inverse CDF: cheaper than torch.multinomial for one draw."""
    cdf = probs.cumsum(-1)  # (B, V)
    u = torch.rand(probs.size(0), 1, generator=generator, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0]  # right=True: a zero-probability token is never drawn

def sample(logits, temperature, top_k, generator):
    """(B, V) logits -> (B,) tokens; temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(-1)
    return draw(probs_from_logits(logits, temperature, top_k), generator)

def window_start(start, n, block_size):
    """Where the context window begins when the sequence holds n tokens and token n-1 is fed next.

    Positions never pass block_size: when the window is full, keep its newest half and re-prefill it at full
    depth, one parallel pass every block_size/2 tokens (the uncached reference follows the same rule)."""
    if start is None:
        return max(0, n - block_size)
    if n - start > block_size:
        return n - block_size // 2
    return start

def prefill(model, cache, idx, start):
    """Run the window's tokens (B, T) through every layer; all lengths become T."""
    cache.reset(start)
    if idx.size(1) == 0:
        return
    x = model.embed(idx)  # (B, T, C)
    for l, block in enumerate(model.transformer.h):
        x = block(x, cache, l)

def slide_window(model, cache, tokens, start, n):
    """Place the window for feeding token n-1, re-prefilling if it moved; returns (start, block runs spent)."""
    s = window_start(start, n, model.config.block_size)
    if s == start:
        return start, 0
    prefill(model, cache, tokens[:, s : n - 1], s)
    return s, (n - 1 - s) * model.config.n_layer

KV_STRATEGY_CLASSES = {}  # name -> class: backfill below; deferred, state_copy and holes in Part II

def register_strategy(cls):
    """Class decorator: generate() finds a KV strategy by its name."""
    KV_STRATEGY_CLASSES[cls.name] = cls
    return cls

@register_strategy
class KVStrategy:
    """Backfill, and the hook Part II's strategies override: run_layer runs a block for the newest token;
    skip_layers handles the layers above once every row exited. Backfill runs them all: exact, saves nothing."""

    name, skips, leaves = "backfill", False, False  # stop once every row exited? let exited rows leave at once?

    def __init__(self, model):
        pass

    def new_cache(self, config, batch_size, device):
        return KVCache(config, batch_size, device)

    def exit_checks(self, pos, checked_exits):
        return checked_exits

    def run_layer(self, block, cache, layer, x, pos, exited):
        return block(x, cache, layer)

    def skip_layers(self, model, cache, x, pos, layer, rows):
        raise AssertionError("backfill never skips a layer")

def decode_step(model, cache, idx, pos, strategy, exit_threshold=1.0, checked_exits=(), measure="top1"):
    """Feed one token per row, idx (B, 1), at window position pos; returns emitted logits (B, V) and exit layers
    (B,). Each row exits on its own confidence; the step runs as deep as its deepest row (backfill: every layer)."""
    L = model.config.n_layer
    checks = strategy.exit_checks(pos, checked_exits) if exit_threshold < 1 else ()  # a confidence never exceeds 1
    x = model.embed(idx, pos)  # (B, 1, C)
    logits, exited = None, None
    exit_layer = torch.full((idx.size(0),), L - 1, dtype=torch.long, device=idx.device)
    for l, block in enumerate(model.transformer.h):
        x = strategy.run_layer(block, cache, l, x, pos, exited)
        if l == L - 1 or l not in checks:
            continue
        head_logits = model.exit_logits(x[:, 0], l)  # (B, V): the newest position only
        conf = confidence(head_logits, measure)  # (B,)
        if exit_threshold > 0 and conf.max().item() <= exit_threshold:  # the common case: nobody is sure, one sync
            continue
        newly = conf > exit_threshold if exited is None else (conf > exit_threshold) & ~exited
        logits = head_logits if logits is None else torch.where(newly[:, None], head_logits, logits)
        exit_layer.masked_fill_(newly, l)
        exited = newly if exited is None else exited | newly
        if strategy.leaves or (strategy.skips and bool(exited.all())):
            strategy.skip_layers(model, cache, x, pos, l, newly)
            if bool(exited.all()):
                return logits, exit_layer
    final = model.exit_logits(x[:, 0], L - 1)  # (B, V)
    return (final if exited is None else torch.where(exited[:, None], logits, final)), exit_layer

@dataclass
class Generation:
    tokens: torch.Tensor  # (B, T0 + N): prompt and generated tokens
    exited_at: torch.Tensor  # (B, N): the layer each new token left at
    logits: torch.Tensor  # (B, N, V) emitted logits when teacher-forced, else None
    layers_run: int  # block runs per row over all decode steps, catch-up included, prefill excluded
    cache: "KVCache"
    stats: dict = None  # self-speculative counts: rounds, drafted, accepted
    prefill_runs: int = 0  # block runs spent re-prefilling the window at full depth, per row

@torch.inference_mode()
def generate(model, idx, max_new_tokens, strategy="backfill", exit_threshold=1.0, checked_exits=None,
             measure="top1", temperature=1.0, top_k=0, generator=None, forced=None):
    """Decode max_new_tokens after idx (B, T0) with the KV cache; forced (B, N) teacher-forces the tokens."""
    cfg = model.config
    B, T0 = idx.shape
    checked_exits = range(cfg.n_layer - 1) if checked_exits is None else checked_exits
    kv_strategy = strategy if isinstance(strategy, KVStrategy) else KV_STRATEGY_CLASSES[strategy](model)
    tokens = torch.cat([idx, idx.new_zeros(B, max_new_tokens)], dim=1)  # (B, T0 + N)
    exits = idx.new_zeros(B, max_new_tokens)
    emitted, prefilled = [], 0
    cache, start = kv_strategy.new_cache(cfg, B, idx.device), None
    for i in range(max_new_tokens):
        n = T0 + i
        start, runs = slide_window(model, cache, tokens, start, n)
        prefilled += runs
        logits, exits[:, i] = decode_step(model, cache, tokens[:, n - 1 : n], n - 1 - start, kv_strategy,
                                          exit_threshold, checked_exits, measure)
        if forced is not None:
            tokens[:, n] = forced[:, i]
            emitted.append(logits.float())
        else:
            tokens[:, n] = sample(logits, temperature, top_k, generator)
    logits = torch.stack(emitted, dim=1) if emitted else None
    return Generation(tokens, exits, logits, sum(cache.layer_evals) - prefilled, cache, None, prefilled)

# -----------------------------------------------------------------------------
# Exit statistics: where the tokens left, as the seed prints them

def bar(fraction, width=30):
    return "#" * round(fraction * width)

def format_exit_stats(counts):
    """The seed's per-layer lines, 'Layer 0:   42 tokens (21.0%)', with a bar each."""
    total, last = sum(counts), len(counts) - 1
    lines = []
    for l, c in enumerate(counts):
        name = f"Layer {l}{' (full)' if l == last else ''}:"
        lines.append(f"{name:<16}{c:>6} tokens ({100 * c / total:5.1f}%) {bar(c / total)}")
    mean = sum((l + 1) * c for l, c in enumerate(counts)) / total
    lines.append(f"mean exit depth: {mean:.2f} of {len(counts)} layers per token")
    return "\n".join(lines)

# -----------------------------------------------------------------------------
# Training: AdamW, warmup then cosine decay, the joint loss

def synchronize(device):
    """Wait for queued kernels, so a timer reads finished work (CUDA launches return at once)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()

def get_lr(it, config):
    if it < config.warmup_iters:
        return config.learning_rate * (it + 1) / config.warmup_iters
    ratio = (it - config.warmup_iters) / max(1, config.max_iters - config.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(1.0, ratio)))  # 1 -> 0
    return config.min_lr + coeff * (config.learning_rate - config.min_lr)

def configure_optimizer(model, config):
    """AdamW with weight decay on matrices only, as nanoGPT does."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.beta1, config.beta2))

@torch.inference_mode()
def estimate_loss(model, splits, config, device, ctx):
    """Mean loss of every exit (the final one last) on eval_iters fixed batches per split."""
    was_training = model.training
    model.eval()
    out = {}
    for name in ("train", "val"):
        gen = torch.Generator().manual_seed(config.seed + 1)  # the same batches at every evaluation
        losses = torch.zeros(config.n_layer)
        for _ in range(config.eval_iters):
            x, y = get_batch(splits[name], config.block_size, config.batch_size, gen, device)
            with ctx:
                logits = model.all_exit_logits(x)  # (L, B, T, V)
            losses += torch.stack([cross_entropy(lg, y) for lg in logits]).cpu()
        out[name] = (losses / config.eval_iters).tolist()
    model.train(was_training)  # back to the mode it came in: evaluation never leaves layer dropout on
    return out

def format_eval(it, losses):
    exits = " ".join(f"{l:.3f}" for l in losses["val"][:-1])
    return f"step {it}: train loss {losses['train'][-1]:.4f}, val loss {losses['val'][-1]:.4f} | val loss per exit: {exits}"

def train_step(model, optimizer, x, y, config, ctx):
    with ctx:
        _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if config.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    return loss

def train(model, optimizer, splits, config, device, ctx, start_iter=0, rng=None, save=None, step_model=None, rank=0):
    """The training loop; returns (seconds, median ms per step, log, rng). Evaluates every eval_interval steps.

    rng resumes the sampler's and torch's random states (a resumed run repeats an uninterrupted one); save(it,
    rng, log) runs at each evaluation and when Ctrl-C stops the loop between steps. Only rank 0 evaluates."""
    gen = torch.Generator().manual_seed(config.seed + rank)
    if rng is not None:
        gen.set_state(rng["batches"]), torch.set_rng_state(rng["torch"])
    step_model = step_model or (torch.compile(model) if config.compile else model)
    t_start, step_ms, log, stop = time.time(), [], [], []
    on_main = threading.current_thread() is threading.main_thread()  # signal handlers live in the main thread
    handler = signal.signal(signal.SIGINT, lambda *_: stop.append(1)) if on_main else None
    bar = tqdm(range(start_iter, config.max_iters), initial=start_iter, total=config.max_iters, disable=rank > 0,
               mininterval=1.0 if sys.stderr.isatty() else 30.0, desc="training")
    try:
        for it in bar:
            rng = {"batches": gen.get_state(), "torch": torch.get_rng_state()}
            if stop:  # Ctrl-C: the last step is whole; save it and stop
                save and save(it, rng, log)
                raise KeyboardInterrupt
            if it % config.eval_interval == 0 and it > start_iter and rank == 0:
                losses = estimate_loss(model, splits, config, device, ctx)
                tqdm.write(format_eval(it, losses))
                log.append({"iter": it, "val_loss": losses["val"][-1]})
                save and save(it, rng, log)
            for group in optimizer.param_groups:
                group["lr"] = get_lr(it, config)
            t0 = time.time()
            x, y = get_batch(splits["train"], config.block_size, config.batch_size, gen, device)
            loss = train_step(step_model, optimizer, x, y, config, ctx)
            synchronize(device)
            step_ms.append(1000 * (time.time() - t0))
            if it % 10 == 0:  # .item() waits for the device, so read the loss only now and then
                log.append({"iter": it, "loss": loss.item()})
                bar.set_postfix_str(f"joint loss {log[-1]['loss']:.3f} | {step_ms[-1]:.0f} ms", refresh=False)
    finally:
        bar.close()
        handler and signal.signal(signal.SIGINT, handler)
    rng = {"batches": gen.get_state(), "torch": torch.get_rng_state()}  # where a longer run would go on from
    return time.time() - t_start, float(np.median(step_ms)) if step_ms else 0.0, log, rng

# -----------------------------------------------------------------------------
# Part II: beyond the seed, one idea per section
# =============================================================================

# -----------------------------------------------------------------------------
# Deferred recompute: fill the holes later, in one chunk with the next token that needs them

def catch_up_layer(block, cache, layer, end):
    """Deferred recompute: positions [lengths[layer], end) run this layer now, as one causal chunk."""
    n = cache.lengths[layer]
    cache.pending_states[:, n:end] = block(cache.pending_states[:, n:end], cache, layer)  # (B, end - n, C)

def catch_up(model, cache, end):
    """Fill every layer's holes up to window position `end` (a flush, or a speculative verify)."""
    for l, block in enumerate(model.transformer.h):
        if cache.lengths[l] < end:
            catch_up_layer(block, cache, l, end)

@torch.inference_mode()
def flush(model, cache):
    """Run all pending deferred work now; generation itself drops what is pending at the end."""
    catch_up(model, cache, cache.lengths[0])  # layer 0 always holds every position

@register_strategy
class Deferred(KVStrategy):
    """An exit parks its state in pending_states; the next token that needs a layer runs the pending
    positions and itself there as one causal chunk. Exact, like backfill, with the work postponed."""

    name, skips = "deferred", True

    def run_layer(self, block, cache, layer, x, pos, exited):
        if cache.lengths[layer] == pos:  # nothing pending here
            return block(x, cache, layer)
        cache.pending_states[:, pos] = x[:, 0]
        catch_up_layer(block, cache, layer, pos + 1)
        return cache.pending_states[:, pos : pos + 1]

    def skip_layers(self, model, cache, x, pos, layer, rows):
        cache.pending_states[:, pos] = x[:, 0]  # the state the pending layers will start from


# -----------------------------------------------------------------------------
# State copy (CALM): the skipped layers' keys and values computed from the exit state

def kv_projection(block):
    """A block's x -> (K, V) map with ln_1's gain and bias folded in: (2C, C) weight, (2C,) bias.

    K and V of a state x are W_kv (g * norm(x) + beta) + b_kv = (W_kv g) norm(x)
    + (W_kv beta + b_kv): one matrix per layer, applied to one shared norm(x).
    """
    C = block.ln_1.normalized_shape[0]
    w = block.attn.c_attn.weight[C:]  # (2C, C): the K and V rows of the fused projection
    bias = torch.zeros(2 * C, device=w.device, dtype=w.dtype)
    if block.ln_1.bias is not None:
        bias = bias + w @ block.ln_1.bias
    if block.attn.c_attn.bias is not None:
        bias = bias + block.attn.c_attn.bias[C:]
    return w * block.ln_1.weight, bias

def state_copy_projections(model):
    """Every layer's folded K/V projection, stacked: (L, 2C, C) and (L, 2C), once per generation."""
    projections = [kv_projection(block) for block in model.transformer.h]
    return tuple(torch.stack(t) for t in zip(*projections))

def state_copy_kv(x, first_layer, weight, bias, nh):
    """CALM's state propagation: the K and V of layers first_layer.. computed from the exit state x (B, 1, C).

    weight (L, 2C, C) and bias (L, 2C) are every layer's folded K/V projection: one batched matmul gives
    all skipped layers at once, instead of one small projection each. Returns k, v (J, B, nh, hs).
    """
    xn = F.layer_norm(x[:, 0], x.shape[-1:])  # (B, C): the normalisation shared by every ln_1
    kv = torch.matmul(xn, weight[first_layer:].transpose(1, 2)) + bias[first_layer:, None]  # (J, B, 2C)
    J, B, C2 = kv.shape
    return (t.view(J, B, nh, C2 // (2 * nh)) for t in kv.split(C2 // 2, dim=-1))

def write_state_copy(cache, first_layer, x, weight, bias):
    """Write the skipped layers' entries at the next position of a level cache (every row exited)."""
    n = cache.lengths[first_layer]
    assert all(m == n for m in cache.lengths[first_layer:]), "state copy needs the skipped layers level"
    cache.k[first_layer:, :, :, n], cache.v[first_layer:, :, :, n] = state_copy_kv(x, first_layer, weight, bias,
                                                                                   cache.k.size(2))
    for layer in range(first_layer, len(cache.lengths)):
        cache.lengths[layer] = n + 1

@register_strategy
class StateCopy(KVStrategy):
    """Approximate: the skipped layers see the exit state where their own input would have been."""

    name, skips = "state_copy", True

    def __init__(self, model):
        self.weight, self.bias = state_copy_projections(model)

    def skip_layers(self, model, cache, x, pos, layer, rows):
        write_state_copy(cache, layer + 1, x, self.weight, self.bias)


# -----------------------------------------------------------------------------
# Holes: the failure case, where the skipped layers write nothing

@register_strategy
class Holes(KVStrategy):
    """Later tokens attend only to the entries that exist: the skipped layers' caches just have fewer."""

    name, skips = "holes", True

    def skip_layers(self, model, cache, x, pos, layer, rows):
        pass

KV_STRATEGIES = tuple(KV_STRATEGY_CLASSES)  # backfill, deferred, state_copy, holes


# -----------------------------------------------------------------------------
# Self-speculative decoding (LayerSkip): the early layers draft, the rest verify

def speculative_accept(drafts, q, p, temperature, generator):
    """How many of the k drafted tokens to keep, and the full model's token after them.

    Greedy (q, p are logits): keep the longest prefix that matches the full
    model's argmax, then take the full model's choice. Sampling (q, p are
    probabilities): keep draft d with probability min(1, p(d) / q(d)); at the
    first rejection draw from max(p - q, 0), renormalised. Either way each
    emitted token has exactly the full model's distribution (speculative
    sampling, Leviathan et al. 2023 and Chen et al. 2023). drafts (k,), q and
    p (k, V). Returns (accepted, next token), next token None when all k were kept.
    """
    k = drafts.size(0)
    if temperature == 0:
        target = p.argmax(-1)  # (k,)
        accepted = int((target == drafts).long().cumprod(0).sum())
        return accepted, (int(target[accepted]) if accepted < k else None)
    rows = torch.arange(k, device=drafts.device)
    ratio = p[rows, drafts] / q[rows, drafts]  # (k,)
    u = torch.rand(k, generator=generator, device=drafts.device)
    accepted = int((u < ratio).long().cumprod(0).sum())
    if accepted == k:
        return k, None
    residual = (p[accepted] - q[accepted]).clamp_min(0)  # (V,): where the full model wants more mass
    return accepted, int(draw(residual[None] / residual.sum(), generator)[0])

def draft(model, cache, tokens, n, pos, k, draft_exit, temperature, top_k, generator, draft_stop=0.0):
    """Feed tokens[n-1] and then each new draft through layers 0..draft_exit only; returns (k', V) draft logits.

    Adaptive length (Draft & Verify, arXiv:2309.08168; Kangaroo, arXiv:2404.18911): once the draft head
    is less than draft_stop sure of its top token, stop and verify what is drafted (k' <= k). The
    decision reads only the draft, so the accept rule keeps every emitted token exact.
    """
    q = []
    for j in range(k):
        x = model.embed(tokens[:, n - 1 + j : n + j], pos + j)  # (1, 1, C)
        for l in range(draft_exit + 1):
            x = model.transformer.h[l](x, cache, l)
        cache.pending_states[:, pos + j] = x[:, 0]  # the layers above pick up from here in the verify pass
        logits = model.exit_logits(x[:, 0], draft_exit)  # (1, V)
        q.append(logits[0])
        if draft_stop == 0:
            tokens[:, n + j] = sample(logits, temperature, top_k, generator)
            continue
        # one softmax serves the draw and the stopping rule (greedy: the top-1 probability)
        probs = logits.float().softmax(-1) if temperature == 0 else probs_from_logits(logits, temperature, top_k)
        tokens[:, n + j] = probs.argmax(-1) if temperature == 0 else draw(probs, generator)
        if j < k - 1 and float(probs.amax()) < draft_stop:  # Kangaroo's rule: the draft head's top-1 confidence
            break
    return torch.stack(q)  # (k', V)

def truncate(cache, length):
    """Roll every layer back to at most `length` entries: a rejected draft's entries are gone."""
    cache.lengths = [min(n, length) for n in cache.lengths]

def verify(model, cache, pos, k):
    """The remaining layers run once over the k drafted positions, from their saved states."""
    catch_up(model, cache, pos + k)
    return model.exit_logits(cache.pending_states[0, pos : pos + k], model.config.n_layer - 1)  # (k, V)

@torch.inference_mode()
def generate_self_speculative(model, idx, max_new_tokens, draft_exit, num_draft, temperature=0.0, top_k=0,
                              generator=None, draft_stop=0.0):
    """Draft num_draft tokens with layers 0..draft_exit, verify them with the rest; output as the full model's."""
    cfg = model.config
    if idx.size(0) != 1:
        raise ValueError("self-speculative decoding runs one sequence at a time (batch size 1)")
    if not 0 <= draft_exit < cfg.n_layer - 1 or num_draft < 1:
        raise ValueError(f"need 0 <= draft_exit < {cfg.n_layer - 1} and num_draft >= 1, "
                         f"got draft_exit={draft_exit}, num_draft={num_draft}")
    T0, end = idx.size(1), idx.size(1) + max_new_tokens
    tokens = torch.cat([idx, idx.new_zeros(1, max_new_tokens + num_draft)], dim=1)
    exits = idx.new_full((1, end), cfg.n_layer - 1)
    cache, start, n, prefilled = KVCache(cfg, 1, idx.device), None, T0, 0
    stats = {"rounds": 0, "drafted": 0, "accepted": 0}
    while n < end:
        start, runs = slide_window(model, cache, tokens, start, n)
        prefilled += runs
        pos = n - 1 - start  # window position of the first token fed this round
        k = min(num_draft, cfg.block_size - pos, end - n)  # no fed position may pass block_size
        q = draft(model, cache, tokens, n, pos, k, draft_exit, temperature, top_k, generator, draft_stop)
        k = q.size(0)  # an adaptive draft may stop early
        p = verify(model, cache, pos, k)
        if temperature > 0:
            q, p = probs_from_logits(q, temperature, top_k), probs_from_logits(p, temperature, top_k)
        accepted, nxt = speculative_accept(tokens[0, n : n + k], q, p, temperature, generator)
        exits[0, n : n + accepted] = draft_exit
        if nxt is not None:
            tokens[0, n + accepted] = nxt
            truncate(cache, pos + accepted + 1)  # roll back every layer past the first rejected draft
        n += accepted + (nxt is not None)
        stats = {"rounds": stats["rounds"] + 1, "drafted": stats["drafted"] + k, "accepted": stats["accepted"] + accepted}
    return Generation(tokens[:, :end], exits[:, T0:], None, sum(cache.layer_evals) - prefilled, cache, stats, prefilled)


# -----------------------------------------------------------------------------
# Choosing the exit rule, 1: record every exit once, teacher-forced, then sweep without the model

@dataclass
class ExitRecords:
    """What every exit says at each position of a text, read in the decoder's own windows."""

    confidence: dict  # measure -> (L, N): each exit's confidence in its top prediction
    pred: torch.Tensor  # (L, N): each exit's top prediction
    nll: torch.Tensor  # (L, N): -log p(true next character) at each exit
    targets: torch.Tensor  # (N,): the true next characters

def decoder_windows(n_positions, block_size):
    """(start, end, first) of each window sequential decoding uses to predict positions first..end-1."""
    windows, start, i = [], None, 0
    while i < n_positions:
        start = window_start(start, i + 1, block_size)
        end = min(start + block_size, n_positions)
        windows.append((start, end, i))
        i = end
    return windows

def summarise_logits(logits, targets):
    """(L, N, V) exit logits -> what ExitRecords keeps of them."""
    conf = {m: torch.stack([confidence(lg, m) for lg in logits]) for m in CONFIDENCE_MEASURES}
    nll = -logits.log_softmax(-1).gather(-1, targets[None, :, None].expand(len(logits), -1, 1))[..., 0]
    return conf, logits.argmax(-1), nll

@torch.inference_mode()
def record_exits(model, data, n_positions, batch_size=64):
    """One parallel pass: what every exit predicts for data[1 : n_positions + 1].

    The windows are exactly those of sequential decoding fed data[0], data[1],
    ... (window_start), so a decoder that keeps its cache exact (backfill,
    deferred) makes exactly these predictions; that is tested. Windows of equal
    length run together, batch_size at a time.
    """
    n_positions = min(n_positions, len(data) - 1)
    windows = decoder_windows(n_positions, model.config.block_size)
    # every window is block_size long but perhaps the last: run the others batch_size at a time
    full = windows[:-1]
    groups = [full[b : b + batch_size] for b in range(0, len(full), batch_size)] + [windows[-1:]]
    parts = []
    for group in groups:
        x = torch.stack([data[s:e] for s, e, _ in group])  # (b, W)
        logits = model.all_exit_logits(x).float()  # (L, b, W, V)
        parts += [logits[:, r, first - s :] for r, (s, _, first) in enumerate(group)]
    logits = torch.cat(parts, dim=1)  # (L, N, V)
    targets = data[1 : n_positions + 1].to(logits.device)
    return ExitRecords(*summarise_logits(logits, targets), targets)

def exits_at_threshold(records, measure, threshold, checked_exits):
    """(N,): the layer each position exits at: the first checked exit above threshold, else the last."""
    conf = records.confidence[measure]
    L = conf.size(0)
    if threshold >= 1 or not checked_exits:
        return torch.full((conf.size(1),), L - 1, dtype=torch.long, device=conf.device)
    layers = torch.tensor(checked_exits, device=conf.device)
    hit = conf[layers] > threshold  # (E, N)
    first = hit.float().argmax(0)  # the first checked exit that is confident enough
    return torch.where(hit.any(0), layers[first], L - 1)

def exit_summary(records, exits):
    """Quality and compute of emitting each position from its exit layer."""
    L, N = records.pred.shape
    cols = torch.arange(N, device=exits.device)
    pred = records.pred[exits, cols]
    counts = torch.bincount(exits, minlength=L)
    mean_layers = (exits + 1).float().mean().item()
    return {
        "exit_fractions": (counts.float() / N).tolist(),
        "mean_layers": mean_layers,
        "compute_saved": 1.0 - mean_layers / L,
        "loss": records.nll[exits, cols].mean().item(),
        "full_loss": records.nll[-1].mean().item(),
        "accuracy": (pred == records.targets).float().mean().item(),
        "disagreement": (pred != records.pred[-1]).float().mean().item(),
    }

def threshold_for_exit_fraction(records, measure, checked_exits, fraction, grid):
    """The highest threshold of grid at which at least `fraction` of positions exit early."""
    L = records.pred.size(0)
    for t in sorted(grid, reverse=True):
        if (exits_at_threshold(records, measure, t, checked_exits) < L - 1).float().mean() >= fraction:
            return t
    return min(grid)


# -----------------------------------------------------------------------------
# Choosing the exit rule, 2: the threshold sweep on val, and a threshold calibrated with a guarantee

CALIBRATION_GRID = tuple(round(1 - 0.01 * i, 2) for i in range(101))  # 1.00, 0.99, ..., 0.00: cautious first

def sweep(records, measure, checked_exits, grid):
    """One row per threshold: where positions exit, compute saved, loss and disagreement with full depth."""
    return [{"threshold": t, **exit_summary(records, exits_at_threshold(records, measure, t, checked_exits))} for t in grid]

def binomial_tail(k, n, epsilon):
    """P(Binomial(n, epsilon) <= k): the p-value of 'risk > epsilon' after k failures in n trials."""
    i = torch.arange(k + 1, dtype=torch.float64)
    log_pmf = (math.lgamma(n + 1) - torch.lgamma(i + 1) - torch.lgamma(n - i + 1)
               + i * math.log(epsilon) + (n - i) * math.log1p(-epsilon))
    return float(torch.logsumexp(log_pmf, 0).exp())

def fixed_sequence_test(failures, n, epsilon, delta):
    """Learn then Test with fixed-sequence testing (CALM, arXiv:2207.07061, section 4).

    failures[i] is the number of the n calibration positions that disagree
    with full depth at the i-th threshold, ordered most cautious first. Test
    H0: 'risk > epsilon' at each threshold in that order with the exact
    binomial p-value; stop at the first that is not rejected at level delta.
    Returns the index of the last rejected one (-1: none, so full depth).
    Because the order is fixed in advance, the chance that the returned
    threshold's true risk exceeds epsilon is at most delta (for i.i.d. positions).
    """
    chosen = -1
    for i, k in enumerate(failures):
        if binomial_tail(k, n, epsilon) > delta:
            break
        chosen = i
    return chosen

def calibrate(records, measure, checked_exits, epsilon, delta, grid=CALIBRATION_GRID):
    """The threshold fixed-sequence testing certifies: walking the grid from cautious (1.0) down, the last one
    before the first whose disagreement with full depth is not certified below epsilon; 1.0 if none is."""
    N = records.targets.numel()
    failures = []
    for t in grid:
        exits = exits_at_threshold(records, measure, t, checked_exits)
        failures.append(int((records.pred[exits, torch.arange(N, device=exits.device)] != records.pred[-1]).sum()))
    chosen = fixed_sequence_test(failures, N, epsilon, delta)
    return 1.0 if chosen < 0 else grid[chosen]

def calibration_report(val, test, measure, checked_exits, epsilon, delta):
    """Calibrate on val, then report the chosen threshold's figures on test (never used to choose)."""
    threshold = calibrate(val, measure, checked_exits, epsilon, delta)
    figures = lambda r: exit_summary(r, exits_at_threshold(r, measure, threshold, checked_exits))  # noqa: E731
    keys = ("disagreement", "loss", "full_loss", "accuracy", "compute_saved", "mean_layers")
    return {"measure": measure, "epsilon": epsilon, "delta": delta, "threshold": threshold,
            "val": {k: figures(val)[k] for k in keys}, "test": {k: figures(test)[k] for k in keys}}


# -----------------------------------------------------------------------------
# Choosing the exit rule, 3: the logit lens, and what "easy" means for this model

@torch.inference_mode()
def logit_lens(model, x):
    """Each layer read through ln_f + lm_head (never trained for it) and through its own exit head."""
    states = model.hidden_states(x)  # L x (B, T, C)
    final = model.exit_logits(states[-1], model.config.n_layer - 1).float()
    target = final.argmax(-1)  # (B, T): the final prediction
    rows = []
    for l, h in enumerate(states[:-1]):
        for readout, logits in (("ln_f + lm_head", model.exit_logits(h, model.config.n_layer - 1)),
                                ("exit head", model.exit_logits(h, l))):
            logits = logits.float()
            rank = (logits > logits.gather(-1, target[..., None])).sum(-1)  # 0 when it agrees
            rows.append({"layer": l, "readout": readout,
                         "agreement": (logits.argmax(-1) == target).float().mean().item(),
                         "median_rank": rank.float().median().item(),
                         "confidence": logits.softmax(-1).amax(-1).mean().item()})
    return rows

def exit_slices(records, exits, tokenizer, data, n_top=10):
    """Accuracy of the tokens leaving at each layer, and the characters that leave at the first exit most."""
    L, N = records.pred.shape
    cols = torch.arange(N, device=exits.device)
    correct = records.pred[exits, cols] == records.targets
    per_layer = [{"layer": l, "tokens": int((exits == l).sum()),
                  "accuracy": correct[exits == l].float().mean().item() if (exits == l).any() else None}
                 for l in range(L)]
    first = int(exits.min()) if N else 0
    early = (exits == first).nonzero().flatten().tolist()
    counts = {}
    for i in early:  # position i predicts data[i + 1] from the context ending at data[i]
        ch = tokenizer.decode([int(records.targets[i])])
        counts.setdefault(ch, []).append(tokenizer.decode(data[max(0, i - 3) : i + 1].tolist()))
    top = sorted(counts.items(), key=lambda kv: -len(kv[1]))[:n_top]
    chars = [{"char": ch, "exits": len(ctx), "example_context": Counter(ctx).most_common(1)[0][0]} for ch, ctx in top]
    return {"per_layer": per_layer, "first_exit_layer": first, "earliest_chars": chars}


# -----------------------------------------------------------------------------
# Measurement, 1: the KV-cache strategies side by side on a workload, quality then wall-clock

def workload(data, n_prompts, prompt_len):
    """n_prompts prompts of prompt_len characters from evenly spaced places of a split: (n_prompts, prompt_len).

    One prompt proves nothing: a greedy character model soon loops ("the the the"), and a loop is easy to
    draft. Timed figures continue every prompt of the test split's workload; choices use val's.
    """
    if len(data) < prompt_len + 2:
        raise ValueError(f"a split of {len(data)} characters is too short for prompts of {prompt_len}")
    starts = torch.linspace(0, len(data) - prompt_len - 1, n_prompts).long().tolist()
    return torch.stack([data[s : s + prompt_len] for s in starts])

def repetition(tokens, n=4):
    """1 - distinct n-grams / n-grams of one generated sequence: 0 never repeats itself, near 1 is a loop."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0

MODES = ("greedy", "sampled")  # sampled draws with config.temperature and config.top_k

def mode_temperature(mode, config):
    return 0.0 if mode == "greedy" else config.temperature

STRATEGY_NAMES = ("full",) + KV_STRATEGIES + ("self_speculative",)

def strategy_runner(model, name, threshold=1.0, checked_exits=(), measure="top1", spec=(0, 1, 0.0)):
    """A function (idx, n, generator, temperature, top_k, forced) -> Generation for one table row."""
    if name == "self_speculative":
        draft_exit, num_draft, draft_stop = spec

        def run(idx, n, generator=None, temperature=0.0, top_k=0, forced=None):
            return generate_self_speculative(model, idx, n, draft_exit, num_draft, temperature, top_k, generator,
                                             draft_stop)

        return run
    if name == "full":
        kw = dict(strategy="backfill", exit_threshold=1.0)
    else:
        kw = dict(strategy=name, exit_threshold=threshold, checked_exits=checked_exits, measure=measure)

    def run(idx, n, generator=None, temperature=0.0, top_k=0, forced=None):
        return generate(model, idx, n, temperature=temperature, top_k=top_k, generator=generator, forced=forced, **kw)

    return run

def quality_pass(run, data, n_positions, n_layer):
    """Teacher-forced sequential decoding of data: every strategy sees the same text and cache effects."""
    out = run(data[None, :1], n_positions, forced=data[None, 1 : n_positions + 1])
    logits, targets = out.logits[0], data[1 : n_positions + 1].to(out.logits.device)  # (N, V), (N,)
    counts = torch.bincount(out.exited_at[0].cpu(), minlength=n_layer)
    return {
        "pred": logits.argmax(-1),
        "exited_at": out.exited_at[0].cpu(),
        "exit_fractions": (counts.float() / n_positions).tolist(),
        "mean_layers": out.layers_run / n_positions,
        "test_loss": F.cross_entropy(logits, targets).item(),
        "test_accuracy": (logits.argmax(-1) == targets).float().mean().item(),
    }

def speed_pass(runs, prompts, n_tokens, repeats, seed, top_k):
    """Every run continues every prompt (batch 1) in turn, repeats times, interleaved; runs: name -> (run, temperature).

    Per run: median tokens/s over the whole workload, block runs per token while decoding (catch-up
    included) and re-prefilling, how repetitive the generated text is, and the last Generations.
    """
    times, outputs = {name: [] for name in runs}, {}
    for _ in range(repeats):
        for name, (run, temperature) in runs.items():
            synchronize(prompts.device)
            t0, outs = time.perf_counter(), []
            for i, prompt in enumerate(prompts):
                gen = torch.Generator(device=prompts.device).manual_seed(seed + i)
                outs.append(run(prompt[None], n_tokens, generator=gen, temperature=temperature, top_k=top_k))
            synchronize(prompts.device)
            times[name].append(time.perf_counter() - t0)
            outputs[name] = outs
    total = len(prompts) * n_tokens
    return {name: {"tokens_per_second": total / float(np.median(times[name])),
                   "mean_layers": sum(o.layers_run for o in outs) / total,
                   "prefill_layers": sum(o.prefill_runs for o in outs) / total,
                   "repetition": float(np.mean([repetition(row[-n_tokens:].tolist()) for o in outs for row in o.tokens])),
                   "outputs": outs} for name, outs in outputs.items()}

def expected_batch_depth(exited_at, batch_sizes, n_layer):
    """Mean of the deepest exit among B independent draws from the recorded per-token exit layers."""
    cdf = torch.bincount(exited_at, minlength=n_layer).double().cumsum(0) / len(exited_at)  # P(exit <= l)
    out = {}
    for B in batch_sizes:
        p_max = cdf**B - torch.cat([cdf.new_zeros(1), cdf[:-1] ** B])  # P(deepest row exits at l)
        out[B] = float((p_max * torch.arange(1, n_layer + 1, dtype=torch.float64)).sum())
    return out

@torch.inference_mode()
def decode_costs(model, prompts, n_tokens, repeats=200):
    """Seconds, one new token at batch 1 (medians): a block, an exit check (head, confidence and the host
    sync that decides), a state-copy write, the final head, and a whole full-depth token on these prompts."""
    cfg, device = model.config, prompts.device
    cache, x = KVCache(cfg, 1, device), torch.zeros(1, 1, cfg.n_embd, device=device)
    weight, bias = state_copy_projections(model)
    t = {"block": [], "check": [], "state_copy": [], "final_head": []}
    for _ in range(repeats):
        cache.reset()
        stamps = [time.perf_counter()]
        model.transformer.h[0](x, cache, 0)
        stamps.append(time.perf_counter())
        bool((confidence(model.exit_logits(x[:, 0], 0)) > 0.9).any())
        stamps.append(time.perf_counter())
        write_state_copy(cache, 1, x, weight, bias)
        synchronize(device)
        stamps.append(time.perf_counter())
        model.exit_logits(x[:, 0], cfg.n_layer - 1).argmax(-1).tolist()
        stamps.append(time.perf_counter())
        for key, a, b in zip(t, stamps, stamps[1:]):
            t[key].append(b - a)
    costs = {key: float(np.median(v)) for key, v in t.items()}
    full = speed_pass({"full": (strategy_runner(model, "full"), 0.0)}, prompts, n_tokens, 1, 0, 0)["full"]
    return {**costs, "token": 1.0 / full["tokens_per_second"]}

def predict_speedup(records, measure, threshold, checked_exits, costs, strategy, n_layer):
    """Full depth's measured time per token over the predicted time of a strategy checking these exits.

    Exiting at layer e skips n_layer - 1 - e blocks and the final head (not under backfill, which runs
    them all) and costs a state-copy write under state_copy; every checked exit at or below e costs a
    check. Deferred's catch-up rides in the next token's block call, so it is counted as no extra call.
    """
    exits = exits_at_threshold(records, measure, threshold, checked_exits).float()  # (N,)
    L = n_layer
    checks = sum((exits >= l).float() for l in checked_exits).mean().item()
    early = (exits < L - 1).float().mean().item()
    saved = 0.0 if strategy == "backfill" else (L - 1 - exits).mean().item() * costs["block"] + early * costs["final_head"]
    extra = checks * costs["check"] + (early * costs["state_copy"] if strategy == "state_copy" else 0.0)
    return costs["token"] / (costs["token"] - saved + extra)

def plan_exits(records, measure, costs, strategy, n_layer, threshold=None, fraction=0.3):
    """The cost-aware exit plan: every subset of exits, each at its threshold (given, or the highest on the
    grid with >= fraction of val positions exiting early), ranked by predicted speed-up; best first."""
    plans = []
    for r in range(1, n_layer):
        for subset in itertools.combinations(range(n_layer - 1), r):
            t = threshold if threshold is not None else threshold_for_exit_fraction(
                records, measure, list(subset), fraction, THRESHOLD_GRID)
            plans.append({"checked_exits": list(subset), "threshold": t,
                          "predicted_speedup": predict_speedup(records, measure, t, list(subset), costs, strategy, n_layer)})
    return sorted(plans, key=lambda p: -p["predicted_speedup"])

THRESHOLD_GRID = tuple(round(0.05 * i, 2) for i in range(20, 0, -1)) + (0.0,)  # 1.0, 0.95, ..., 0.05, 0

def strategy_plans(model, val_records, costs, config):
    """Per KV strategy: which exits it checks and at what threshold, with the predicted speed-up (chosen on val)."""
    L, measure = config.n_layer, config.confidence
    fixed = None if config.strategies_threshold < 0 else config.strategies_threshold
    plans = {}
    for name in KV_STRATEGIES:
        if config.exit_layers == "auto":
            plans[name] = plan_exits(val_records, measure, costs, name, L, fixed)[0]
            continue
        checked = parse_exit_layers(config.exit_layers, L)
        t = fixed if fixed is not None else threshold_for_exit_fraction(val_records, measure, checked, 0.3, THRESHOLD_GRID)
        plans[name] = {"checked_exits": checked, "threshold": t,
                       "predicted_speedup": predict_speedup(val_records, measure, t, checked, costs, name, L)}
    return plans

def compare_strategies(model, splits, config, device):
    """The strategies table: quality teacher-forced on test, speed on the test workload, greedy and sampled."""
    L, measure, spec = config.n_layer, config.confidence, (config.draft_exit, config.num_draft, config.draft_stop)
    val_prompts = workload(splits["val"], config.bench_prompts, config.bench_prompt_len).to(device)
    test_prompts = workload(splits["test"], config.bench_prompts, config.bench_prompt_len).to(device)
    val_records = record_exits(model, splits["val"].to(device), config.quality_positions)
    costs = decode_costs(model, val_prompts[:4], config.bench_tokens)
    plans = strategy_plans(model, val_records, costs, config)
    runs = {name: strategy_runner(model, name, p["threshold"], p["checked_exits"], measure) for name, p in plans.items()}
    runs = {"full": strategy_runner(model, "full"), **runs, "self_speculative": strategy_runner(model, "self_speculative", spec=spec)}
    test = splits["test"].to(device)
    quality = {name: quality_pass(runs[name], test, config.quality_positions, L) for name in ("full",) + KV_STRATEGIES}
    timed = {(name, mode): (run, mode_temperature(mode, config)) for mode in MODES for name, run in runs.items()}
    speed = speed_pass(timed, test_prompts, config.bench_tokens, config.bench_repeats, config.seed, config.top_k)
    rows = [strategy_row(name, mode, speed, quality, plans, config) for mode in MODES for name in STRATEGY_NAMES]
    return rows, quality, plans, costs, val_records

def strategy_row(name, mode, speed, quality, plans, config):
    """One row of the strategies table; self_speculative's quality is full depth's by construction."""
    s, full = speed[name, mode], speed["full", mode]
    q = quality.get(name, quality["full"])
    row = {"name": name, "mode": mode, "tokens_per_second": s["tokens_per_second"],
           "speedup": s["tokens_per_second"] / full["tokens_per_second"], "ideal_speedup": config.n_layer / s["mean_layers"],
           "mean_layers": s["mean_layers"], "prefill_layers": s["prefill_layers"], "repetition": s["repetition"],
           "test_loss": q["test_loss"], "test_accuracy": q["test_accuracy"],
           "agreement": (q["pred"] == quality["full"]["pred"]).float().mean().item(),
           "quality_from": "teacher-forced test positions" if name in quality else "full depth (exact by construction)"}
    if name in plans:
        row.update(plans[name], checked_exits=",".join(map(str, plans[name]["checked_exits"])))
    if name == "self_speculative":
        row.update(spec_stats(s["outputs"], full["outputs"], mode, config))
    return row

def spec_stats(outputs, full_outputs, mode, config):
    """Acceptance, tokens per verify pass and (greedy) whether every prompt's output equals full depth's."""
    stats = {k: sum(o.stats[k] for o in outputs) for k in ("rounds", "drafted", "accepted")}
    same = all(torch.equal(a.tokens, b.tokens) for a, b in zip(outputs, full_outputs)) if mode == "greedy" else None
    return {"acceptance_rate": stats["accepted"] / stats["drafted"],
            "tokens_per_verify": len(outputs) * config.bench_tokens / stats["rounds"],
            "draft_exit": config.draft_exit, "num_draft": config.num_draft, "draft_stop": config.draft_stop,
            "identical_to_full": same}

def time_speculative(model, prompts, config, cells):
    """Self-speculative decoding for every (draft_exit, num_draft, draft_stop) cell beside full depth, both
    modes, all interleaved in one pass over the workload; one row per cell and mode."""
    runs = {}
    for mode in MODES:
        temperature = mode_temperature(mode, config)
        runs["full", mode] = (strategy_runner(model, "full"), temperature)
        for cell in cells:
            runs[cell, mode] = (strategy_runner(model, "self_speculative", spec=cell), temperature)
    speed = speed_pass(runs, prompts, config.bench_tokens, config.bench_repeats, config.seed, config.top_k)
    rows = []
    for (cell, mode), s in speed.items():
        if cell == "full":
            continue
        full = speed["full", mode]
        stats = spec_stats(s["outputs"], full["outputs"], mode, config)
        rows.append({**stats, "draft_exit": cell[0], "num_draft": cell[1], "draft_stop": cell[2], "mode": mode,
                     "speedup": s["tokens_per_second"] / full["tokens_per_second"], "repetition": s["repetition"]})
    return rows

SPEC_GRID = dict(draft_exits=(0, 1, 2), num_drafts=(4, 6, 8, 12), draft_stops=(0.0, 0.1, 0.2, 0.3))

def sweep_speculative(model, prompts, config, grid=SPEC_GRID):
    """--spec_sweep: every (draft_exit, num_draft, draft_stop) on the val workload, greedy and sampled."""
    cells = [(E, k, s) for E in grid["draft_exits"] if E < config.n_layer - 1
             for k in grid["num_drafts"] for s in grid["draft_stops"]]
    return time_speculative(model, prompts, config, cells)


# -----------------------------------------------------------------------------
# Batches: per-row cache lengths, batched self-speculative decoding, and per-token exits that can save

class RowKVCache(KVCache):
    """The KV cache with per-row lengths: row b of layer l holds its window positions [0, row_lengths[l, b]).

    Rows of a batch may advance by different amounts, roll back on their own and slide their windows at
    different steps. Writes go to each row's own next slots; attention reads each row's own entries
    through one mask. `rows` selects the rows the next block calls read and write. `spare` slots
    past block_size hold the drafts of rows with less room than others; those are always rolled back.
    """

    def __init__(self, config, batch_size, device, spare=0):
        super().__init__(config, batch_size, device)
        L, B, nh, S, hs = self.k.shape
        self.k = torch.zeros(L, B, nh, S + spare, hs, device=device)
        self.v = torch.zeros_like(self.k)
        self.row_lengths = torch.zeros(L, B, dtype=torch.long, device=device)
        self.all_rows = self.rows = torch.arange(B, device=device)
        self.planned = None  # plan(): what every layer of one step shares

    def plan_writes(self, start, T):
        """The next block calls write T entries for every row from its slot start[b] (B,) on: work out the
        slots and the mask once for all the layers of a step, instead of once per layer."""
        self.planned = self.plan(start[:, None] + torch.arange(T, device=start.device))

    def plan(self, slots, width=None):
        """What the block calls of one step share: (slots (B, T), their scatter index, the additive mask
        (B, 1, T, W) of what each query may see, new lengths (B,), W), W the slots any row has filled by then:
        attention reads no empty slot past the furthest row."""
        B, T = slots.shape
        nh, hs = self.k.shape[2], self.k.shape[4]
        width = int(slots.max()) + 1 if width is None else width
        seen = torch.arange(width, device=slots.device)[None, None, :] <= slots[:, :, None]  # (B, T, W)
        mask = torch.zeros(seen.shape, device=slots.device).masked_fill_(~seen, float("-inf"))
        return slots, slots[:, None, :, None].expand(B, nh, T, hs), mask[:, None], slots[:, -1] + 1, width

    def plan_steps(self, start, k):
        """plan_writes for k one-token steps at once, from slot start[b] (B,) on: a list of k plans."""
        slots = start[:, None] + torch.arange(k, device=start.device)  # (B, k)
        _, index, mask, _, width = self.plan(slots)
        w = width - k + 1  # the width of the first step; each step reads one slot more
        return [(slots[:, j : j + 1], index[:, :, j : j + 1], mask[:, :, j : j + 1, : w + j], slots[:, j] + 1, w + j)
                for j in range(k)]

    def keep_rows(self, keep):
        """Drop the rows of a batch that are done: keep (B,) bool; the rest become rows 0..R-1."""
        self.k, self.v, self.pending_states = self.k[:, keep], self.v[:, keep], self.pending_states[keep]
        self.row_lengths = self.row_lengths[:, keep]
        self.all_rows = self.rows = torch.arange(self.k.size(1), device=self.k.device)

    def reset(self, start=0):
        super().reset(start)
        self.row_lengths[:, self.rows] = 0

    def append(self, layer, k, v):
        """Write k, v (R, nh, T, hs) after each selected row's own entries; return its slots (R, nh, S, hs)
        and the mask (R, 1, T, S) of what each new query may see: its row's past and its own chunk, causally.
        A planned step of every row reads only the first W slots (plan()); other calls, all S."""
        T, rows = k.size(2), self.rows
        if self.planned is not None and rows is self.all_rows:  # the fast path: slots and mask worked out
            slots, index, mask, end, width = self.planned
            if T == 1:  # (B, nh, S, hs): each row's new entry at its own slot
                self.k[layer].scatter_(2, index, k)
                self.v[layer].scatter_(2, index, v)
            else:  # a chunk: indexing writes it faster than scatter
                self.k[layer][rows[:, None], :, slots] = k.transpose(1, 2)  # (B, T, nh, hs)
                self.v[layer][rows[:, None], :, slots] = v.transpose(1, 2)
            self.row_lengths[layer] = end
            return self.k[layer, :, :, :width], self.v[layer, :, :, :width], mask
        n = self.row_lengths[layer, rows]  # (R,)
        pos = n[:, None] + torch.arange(T, device=k.device)  # (R, T): each row's next slots
        keys, values = self.k[layer], self.v[layer]  # (B, nh, S, hs)
        keys[rows[:, None], :, pos] = k.transpose(1, 2)  # (R, T, nh, hs)
        values[rows[:, None], :, pos] = v.transpose(1, 2)
        self.row_lengths[layer, rows] = n + T
        mask = torch.arange(keys.size(2), device=k.device)[None, None, :] <= pos[:, :, None]  # (R, T, S)
        if rows is self.all_rows:
            return keys, values, mask[:, None]
        return keys[rows], values[rows], mask[:, None]

def prefill_rows(model, cache, tokens, rows, starts, n):
    """Re-prefill the windows of `rows`, each tokens[b, starts[b] : n[b] - 1], at full depth (equal lengths)."""
    m = int(n[rows[0]] - 1 - starts[rows[0]])
    cache.row_lengths[:, rows] = m
    if m == 0:
        return 0
    # a plain cache for just these rows (no per-row mask needed: they are level), then copied into place
    level = KVCache(model.config, len(rows), tokens.device)
    prefill(model, level, tokens[rows[:, None], starts[rows][:, None] + torch.arange(m, device=tokens.device)], 0)
    cache.k[:, rows, :, :m], cache.v[:, rows, :, :m] = level.k[:, :, :, :m], level.v[:, :, :, :m]
    cache.layer_evals = [a + b for a, b in zip(cache.layer_evals, level.layer_evals)]
    return m * model.config.n_layer  # block runs counted in layer_evals (one call serves all these rows)

def slide_rows(model, cache, tokens, starts, n):
    """Each row slides its window by the single-sequence rule (window_start); rows that moved re-prefill
    together, grouped by window length. Returns (block runs counted in layer_evals, block runs x rows)."""
    if not bool(((starts < 0) | (n - starts > model.config.block_size)).any()):  # most rounds: no row moves
        return 0, 0
    moved = {}
    for b in range(len(n)):
        s = window_start(None if starts[b] < 0 else int(starts[b]), int(n[b]), model.config.block_size)
        if s != starts[b]:
            starts[b] = s
            moved.setdefault(int(n[b]) - 1 - s, []).append(b)
    evals = row_runs = 0
    for group in moved.values():
        runs = prefill_rows(model, cache, tokens, torch.tensor(group, device=tokens.device), starts, n)
        evals, row_runs = evals + runs, row_runs + runs * len(group)
    return evals, row_runs

def draft_rows(model, cache, tokens, n, pos, k, draft_exit, temperature, top_k, generator):
    """Every row drafts k tokens with layers 0..draft_exit, from its own position. Returns the draft logits
    (B, k, V), the drafts (B, k) and their states (B, k, C), which the verify pass takes up from. Slots, masks
    and position embeddings of all k steps are worked out once, before the first."""
    rows, steps = cache.all_rows, torch.arange(k, device=n.device)
    plans = cache.plan_steps(pos, k)
    # a row with less room than k drafts on in spare slots at the last position; those drafts are never kept
    wpe = model.transformer.wpe((pos[:, None] + steps).clamp(max=model.config.block_size - 1)).unbind(1)  # k x (B, C)
    token, q, states, drafts = tokens[rows, n - 1], [], [], []
    for j in range(k):
        x = model.transformer.drop(model.transformer.wte(token) + wpe[j])[:, None]  # (B, 1, C)
        cache.planned = plans[j]
        for l in range(draft_exit + 1):
            x = model.transformer.h[l](x, cache, l)
        state = x[:, 0]  # (B, C)
        logits = model.exit_logits(state, draft_exit)  # (B, V)
        token = sample(logits, temperature, top_k, generator)
        q.append(logits), states.append(state), drafts.append(token)
    cache.planned = None
    drafts = torch.stack(drafts, dim=1)
    tokens[rows[:, None], n[:, None] + steps] = drafts
    return torch.stack(q, dim=1), drafts, torch.stack(states, dim=1)  # (B, k, V)

def verify_rows(model, cache, pos, x, draft_exit):
    """The layers above the draft run once over every row's k drafted states x (B, k, C): (B, k, V) logits."""
    cache.plan_writes(pos, x.size(1))
    for l in range(draft_exit + 1, model.config.n_layer):
        x = model.transformer.h[l](x, cache, l)
    cache.planned = None
    return model.exit_logits(x, model.config.n_layer - 1)  # (B, k, V)

def accept_rows(drafts, q, p, room, temperature, generator):
    """speculative_accept for every row at once: each row keeps its own accepted prefix, at most room[b].

    Returns (accepted (B,), next token (B,), has_next (B,)): a row whose first rejection falls inside its
    room takes the full model's token there (greedy: its argmax; sampled: from max(p - q, 0))."""
    B, k = drafts.shape
    inside = torch.arange(k, device=drafts.device)[None] < room[:, None]  # (B, k)
    rows = torch.arange(B, device=drafts.device)
    if temperature == 0:
        target = p.argmax(-1)  # (B, k)
        keep = (target == drafts) & inside
    else:
        ratio = p.gather(-1, drafts[..., None])[..., 0] / q.gather(-1, drafts[..., None])[..., 0]  # (B, k)
        keep = (torch.rand(B, k, generator=generator, device=drafts.device) < ratio) & inside
    accepted = keep.long().cumprod(1).sum(1)  # (B,)
    has_next = accepted < room
    at = accepted.clamp(max=k - 1)
    if temperature == 0:
        return accepted, target[rows, at], has_next
    residual = (p[rows, at] - q[rows, at]).clamp_min(0) + (~has_next)[:, None]  # rows without a rejection: unused
    return accepted, draw(residual / residual.sum(-1, keepdim=True), generator), has_next

def advance_rows(tokens, exits, n, k, accepted, nxt, has_next, draft_exit, full_exit):
    """After a round of k drafts (accepted, nxt, has_next: (B,)): each row's kept drafts are marked as exiting
    at draft_exit and the positions after them at full_exit, and the full model's next token goes in after the
    kept drafts (a row that kept all it could writes it into a slot its next round overwrites). Returns the new n."""
    rows, steps = torch.arange(len(n), device=n.device), torch.arange(k, device=n.device)
    exits[rows[:, None], n[:, None] + steps] = torch.where(steps < accepted[:, None], draft_exit, full_exit)  # (B, k)
    tokens[rows, n + accepted] = nxt
    return n + accepted + has_next.long()

def lap(clock, phase, since, device):
    """Add the seconds since `since` to clock[phase] and return now; without a clock, time nothing."""
    if clock is None:
        return None
    synchronize(device)
    now = time.perf_counter()
    if phase is not None:
        clock[phase] = clock.get(phase, 0.0) + now - since
    return now

@torch.inference_mode()
def generate_self_speculative_batch(model, idx, max_new_tokens, draft_exit, num_draft, temperature=0.0, top_k=0,
                                    generator=None, clock=None):
    """Self-speculative decoding of B rows at once: one draft and one verify pass a round for all rows, each
    row accepting its own prefix, rolling back and sliding its window on its own; a row that is done leaves
    the batch. Every row's tokens are the ones it would get alone at full depth (greedy), or have their
    distribution (sampled). A clock dict, if given, adds up the seconds spent in each phase of a round."""
    cfg, (B, T0) = model.config, idx.shape
    end, dev = T0 + max_new_tokens, idx.device
    tokens = torch.cat([idx, idx.new_zeros(B, max_new_tokens + num_draft)], dim=1)
    exits = torch.full_like(tokens, cfg.n_layer - 1)  # (B, end + num_draft): the layer each token left at
    cache = RowKVCache(cfg, B, dev, spare=num_draft)
    n, starts = torch.full((B,), T0, device=dev), torch.full((B,), -1, device=dev)
    stats = {"rounds": 0, "drafted": 0, "accepted": 0, "draft_steps": 0, "num_draft": num_draft}
    ids, out_tokens, out_exits = torch.arange(B, device=dev), tokens[:, :end].clone(), exits[:, :end].clone()
    evals, prefilled, t = 0, 0.0, lap(clock, None, None, dev)
    while max_new_tokens > 0 and len(ids):  # the rows still in the batch: ids (R,) of the B
        e, row_runs = slide_rows(model, cache, tokens, starts, n)
        t = lap(clock, "re-prefill", t, dev)
        evals, prefilled = evals + e, prefilled + row_runs / B
        pos = n - 1 - starts  # (R,) window position of each row's first token fed this round
        room = torch.minimum(end - n, cfg.block_size - pos).clamp(max=num_draft)  # (R,)
        k = int(room.max())
        q, drafts, states = draft_rows(model, cache, tokens, n, pos, k, draft_exit, temperature, top_k, generator)
        t = lap(clock, "draft", t, dev)
        p = verify_rows(model, cache, pos, states, draft_exit)
        t = lap(clock, "verify", t, dev)
        if temperature > 0:
            q, p = probs_from_logits(q, temperature, top_k), probs_from_logits(p, temperature, top_k)
        accepted, nxt, has_next = accept_rows(drafts, q, p, room, temperature, generator)
        cache.row_lengths = torch.minimum(cache.row_lengths, (pos + accepted + has_next.long())[None])  # roll back
        n = advance_rows(tokens, exits, n, k, accepted, nxt, has_next, draft_exit, cfg.n_layer - 1)
        stats.update(rounds=stats["rounds"] + 1, drafted=stats["drafted"] + int(room.sum()),
                     accepted=stats["accepted"] + int(accepted.sum()), draft_steps=stats["draft_steps"] + k)
        done = n >= end  # rows that are done leave: the next rounds run on the rest only
        if bool(done.any()):
            out_tokens[ids[done]], out_exits[ids[done]] = tokens[done, :end], exits[done, :end]
            tokens, exits, n, starts, ids = tokens[~done], exits[~done], n[~done], starts[~done], ids[~done]
            cache.keep_rows(~done)
        t = lap(clock, "accept and the rest", t, dev)
    return Generation(out_tokens, out_exits[:, T0:], None, sum(cache.layer_evals) - evals, cache, stats, prefilled)

def write_state_copy_rows(cache, first_layer, x, rows, pos, weight, bias):
    """CALM's state copy for some rows only: their entries at window position pos of layers first_layer.."""
    k, v = state_copy_kv(x, first_layer, weight, bias, cache.k.size(2))  # (J, R, nh, hs)
    cache.k[first_layer:, :, :, pos][:, rows] = k  # a (J, B, nh, hs) view, these rows
    cache.v[first_layer:, :, :, pos][:, rows] = v
    cache.row_lengths[first_layer:, rows] = pos + 1

class StateCopyLeave(StateCopy):
    """Design (a): a row that exits leaves the batch at once (state copy fills its layers above), and the
    layers above run on the rows still in it; at batch 1 it is state_copy."""

    name, leaves = "state_copy_leave", True

    def new_cache(self, config, batch_size, device):
        return RowKVCache(config, batch_size, device)

    def run_layer(self, block, cache, layer, x, pos, exited):
        if exited is None or not bool(exited.any()):
            return block(x, cache, layer)
        rows = (~exited).nonzero()[:, 0]  # the rows still in the batch
        cache.rows, y = rows, x.clone()
        y[rows] = block(x[rows], cache, layer)
        cache.rows = cache.all_rows
        return y

    def skip_layers(self, model, cache, x, pos, layer, rows):
        left = rows.nonzero()[:, 0]
        write_state_copy_rows(cache, layer + 1, x[left], left, pos, self.weight, self.bias)

class SkipDecode(Holes):
    """Design (b), after SkipDecode (arXiv:2307.02628): every row at window position pos exits at
    schedule[pos], a depth that never rises along the window, so a later token never reads a layer an
    earlier one skipped: no holes are ever read, no exit check is needed, and a batch saves what a row saves."""

    name = "skipdecode"

    def __init__(self, model, schedule):
        self.schedule, self.last = schedule, model.config.n_layer - 1

    def exit_checks(self, pos, checked_exits):
        return [self.schedule[pos]] if self.schedule[pos] < self.last else []

def window_positions(n_positions, block_size):
    """(N,): the window position at which sequential decoding feeds the token predicting each position."""
    wpos = torch.empty(n_positions, dtype=torch.long)
    for start, end, first in decoder_windows(n_positions, block_size):
        wpos[first:end] = torch.arange(first - start, end - start)
    return wpos

def choose_schedule(records, n_layer, block_size, budget):
    """The SkipDecode schedule saving the most on val within `budget` disagreement with full depth: full
    depth before window position a, exit layer e from there on (a, e on a grid)."""
    wpos = window_positions(records.targets.numel(), block_size).to(records.pred.device)
    best = {"schedule": [n_layer - 1] * block_size, "compute_saved": 0.0, "disagreement": 0.0}
    for a in range(0, block_size, max(1, block_size // 16)):
        for e in range(n_layer - 1):
            figures = exit_summary(records, torch.where(wpos >= a, e, n_layer - 1))
            if figures["disagreement"] <= budget and figures["compute_saved"] > best["compute_saved"]:
                best = {"schedule": [n_layer - 1] * a + [e] * (block_size - a), "from_position": a, "exit_layer": e,
                        "compute_saved": figures["compute_saved"], "disagreement": figures["disagreement"]}
    return best

BATCH_SIZES = (1, 4, 16)
BATCH_DESIGNS = ("full", "state_copy", "state_copy_leave", "skipdecode", "self_speculative")

def batch_runner(model, name, plan, schedule, spec):
    """A function (idx (B, T0), n, generator, temperature, top_k, forced) -> Generation for one batch-table row."""
    if name == "self_speculative":
        def run(idx, n, generator=None, temperature=0.0, top_k=0, forced=None):
            return generate_self_speculative_batch(model, idx, n, spec[0], spec[1], temperature, top_k, generator)

        return run
    kw = {"full": dict(exit_threshold=1.0),
          "state_copy": dict(strategy="state_copy", exit_threshold=plan["threshold"], checked_exits=plan["checked_exits"]),
          "state_copy_leave": dict(strategy=StateCopyLeave(model), exit_threshold=plan["threshold"],
                                   checked_exits=plan["checked_exits"]),
          "skipdecode": dict(strategy=SkipDecode(model, schedule), exit_threshold=0.0)}[name]

    def run(idx, n, generator=None, temperature=0.0, top_k=0, forced=None):
        return generate(model, idx, n, temperature=temperature, top_k=top_k, generator=generator, forced=forced, **kw)

    return run

def batch_quality(run, data, batch_size, n_positions, full=None):
    """Teacher-forced decoding of batch_size contiguous pieces of data at once: predictions and test loss."""
    per_row = n_positions // batch_size
    pieces = data[: batch_size * (per_row + 1)].view(batch_size, per_row + 1)  # (B, per_row + 1)
    out = run(pieces[:, :1], per_row, forced=pieces[:, 1:])
    targets = pieces[:, 1:].to(out.logits.device)
    return {"pred": out.logits.argmax(-1), "test_loss": F.cross_entropy(out.logits.flatten(0, 1), targets.flatten()).item()}

def batch_speed(runs, prompts, batch_size, config):
    """speed_pass over the workload cut into batches of batch_size rows (one prompt per row)."""
    batches = prompts.view(-1, batch_size, prompts.size(1))  # (n_batches, B, T0)
    wrapped = {}
    for key, (run, temperature) in runs.items():
        def over_batches(prompt, n, generator=None, temperature=0.0, top_k=0, run=run):
            return run(prompt[0], n, generator=generator, temperature=temperature, top_k=top_k)
        wrapped[key] = (over_batches, temperature)
    speed = speed_pass(wrapped, batches, config.bench_tokens, config.bench_repeats, config.seed, config.top_k)
    for s in speed.values():  # speed_pass counted one row per batch
        s["tokens_per_second"] *= batch_size
    return speed

BATCH_DRAFTS = (4, 8, 11, 16)  # num_draft tried for batched speculation; 11 fills a window's 33 new tokens in 3 rounds

def choose_batch_drafts(model, config, val_prompts, batch_size):
    """num_draft per mode for batched self-speculative decoding at batch_size: the fastest on the val workload.

    A batch runs as many rounds as its slowest row needs, and a window takes block_size / 2 + 1 new tokens
    before it slides, so the best draft length moves with the batch size. At batch 1 the spec sweep's stands.
    Returns ({mode: num_draft}, {"mode num_draft": val tokens/s})."""
    if batch_size == 1:
        return {mode: config.num_draft for mode in MODES}, {}
    grid = sorted(set(BATCH_DRAFTS) | {config.num_draft})
    runs = {(k, mode): (batch_runner(model, "self_speculative", None, None, (config.draft_exit, k)),
                        mode_temperature(mode, config)) for k in grid for mode in MODES}
    speed = batch_speed(runs, val_prompts, batch_size, config)
    best = {mode: max(grid, key=lambda k: speed[k, mode]["tokens_per_second"]) for mode in MODES}
    return best, {f"{mode} {k}": speed[k, mode]["tokens_per_second"] for k, mode in runs}

def speculation_costs(model, prompts, batch_size, config, num_draft, full_tokens_per_second):
    """Where batched greedy speculation spends its time at batch_size (one timed pass over the workload), and
    how many rounds it takes beside what its rows would take alone: a batch lasts as long as its slowest row."""
    clock, rounds, steps = {}, 0, 0
    for batch in prompts.split(batch_size):
        stats = generate_self_speculative_batch(model, batch, config.bench_tokens, config.draft_exit, num_draft,
                                                clock=clock).stats
        rounds, steps = rounds + stats["rounds"], steps + stats["draft_steps"]
    alone = torch.tensor([generate_self_speculative_batch(model, p[None], config.bench_tokens, config.draft_exit,
                                                          num_draft).stats["rounds"] for p in prompts])
    per_batch, total = alone.view(-1, batch_size).float(), sum(clock.values())
    return {"batch_size": batch_size, "num_draft": num_draft, "rounds": rounds,
            "slowest_row_rounds": int(per_batch.max(1).values.sum()), "mean_row_rounds": float(per_batch.mean(1).sum()),
            "shares": {phase: t / total for phase, t in clock.items()}, "draft_step_ms": 1e3 * clock["draft"] / steps,
            "verify_ms": 1e3 * clock["verify"] / rounds, "full_step_ms": 1e3 * batch_size / full_tokens_per_second}

def batch_rows(B, speed, quality, depth):
    """The batch table's rows for one batch size, both modes: speed beside quality, over full depth."""
    rows = []
    for mode in MODES:
        full = speed["full", mode]
        for name in BATCH_DESIGNS:
            s, q = speed[name, mode], quality.get(name, quality["full"])
            same = None
            if name == "self_speculative" and mode == "greedy":
                same = all(torch.equal(a.tokens, b.tokens) for a, b in zip(s["outputs"], full["outputs"]))
            rows.append({"batch_size": B, "name": name, "mode": mode, "tokens_per_second": s["tokens_per_second"],
                         "speedup": s["tokens_per_second"] / full["tokens_per_second"],
                         "num_draft": s["outputs"][0].stats["num_draft"] if name == "self_speculative" else None,
                         "mean_layers": s["mean_layers"], "expected_layers": depth if name == "state_copy" else None,
                         "test_loss": q["test_loss"], "agreement": (q["pred"] == quality["full"]["pred"]).float().mean().item(),
                         "identical_to_full": same, "repetition": s["repetition"]})
    return rows

def measure_batches(model, splits, config, device, plans, val_records):
    """The batch table: every design at every batch size, greedy and sampled, quality beside speed."""
    L, plan = config.n_layer, plans["state_copy"]
    test = splits["test"].to(device)
    test_prompts, val_prompts = (workload(splits[s], config.bench_prompts, config.bench_prompt_len).to(device)
                                 for s in ("test", "val"))
    schedule = choose_schedule(val_records, L, config.block_size, config.schedule_disagreement)
    rows, chosen, costs = [], {}, []
    for B in (b for b in BATCH_SIZES if config.bench_prompts % b == 0):
        drafts, val_speed = choose_batch_drafts(model, config, val_prompts, B)
        chosen[B] = {"num_draft": drafts, "val_tokens_per_second": val_speed}
        runs = {(name, mode): (batch_runner(model, name, plan, schedule["schedule"], (config.draft_exit, drafts[mode])),
                               mode_temperature(mode, config)) for name in BATCH_DESIGNS for mode in MODES}
        quality = {name: batch_quality(runs[name, "greedy"][0], test, B, config.quality_positions)
                   for name in BATCH_DESIGNS if name != "self_speculative"}
        speed = batch_speed(runs, test_prompts, B, config)
        depth = expected_batch_depth(exits_at_threshold(val_records, config.confidence, plan["threshold"],
                                                        plan["checked_exits"]), (B,), L)[B]
        rows += batch_rows(B, speed, quality, depth)
        costs.append(speculation_costs(model, test_prompts, B, config, drafts["greedy"],
                                       speed["full", "greedy"]["tokens_per_second"]))
    return {"rows": rows, "schedule": schedule, "plan": plan, "drafts": chosen, "speculation_costs": costs}


# -----------------------------------------------------------------------------
# Measurement, 2: training recipes compared at the same budget, and what exit heads cost to train

SEED_RECIPE = dict(alpha=0.3, exit_weights="constant", exit_head="separate", distill_weight=0.0,
                   distill_temperature=1.0, layer_dropout=0.0)
RECIPES = {  # each is the seed recipe with these fields changed
    "baseline": dict(alpha=0.0),  # a plain GPT: no exit is trained
    "seed": dict(),
    "linear": dict(exit_weights="linear"),
    "geometric": dict(exit_weights="geometric"),
    "layerskip": dict(exit_weights="layerskip", exit_head="final", layer_dropout=0.2),
    "distill": dict(distill_weight=0.2),
    "shared_head": dict(exit_head="shared"),
    "final_head": dict(exit_head="final"),
    "layer_dropout": dict(layer_dropout=0.2),
    "dropout_distill": dict(layer_dropout=0.2, distill_weight=0.1),  # the default since the comparison
}

def evaluate_recipe(name, model, splits, config, device, ctx, prompts):
    """The figures a recipe is judged on: losses, calibrated compute saved, self-speculative speed."""
    model.eval()
    losses = estimate_loss(model, splits, config, device, ctx)
    checked_exits = list(range(config.n_layer - 1))
    val = record_exits(model, splits["val"].to(device), config.sweep_positions)
    test = record_exits(model, splits["test"].to(device), config.sweep_positions)
    cal = calibration_report(val, test, "top1", checked_exits, 0.01, 0.05)
    spec = {r["mode"]: r for r in time_speculative(model, prompts, config, [(config.draft_exit, config.num_draft,
                                                                             config.draft_stop)])}
    return {"recipe": name, **RECIPES[name], "val_loss_final": losses["val"][-1], "val_loss_exits": losses["val"][:-1],
            "calibrated_threshold": cal["threshold"], "compute_saved": cal["test"]["compute_saved"],
            "test_loss": cal["test"]["loss"], "test_full_loss": cal["test"]["full_loss"],
            "spec_speedup": spec["greedy"]["speedup"], "spec_acceptance_rate": spec["greedy"]["acceptance_rate"],
            "spec_identical_to_full": spec["greedy"]["identical_to_full"],
            "spec_speedup_sampled": spec["sampled"]["speedup"],
            "spec_acceptance_rate_sampled": spec["sampled"]["acceptance_rate"]}

def compare_recipes(config, splits, device, ctx, prompts):
    """Train every recipe from scratch with the same data, seed and budget; evaluate each the same way."""
    rows = []
    for name, fields_ in RECIPES.items():
        cfg = Config(**{**asdict(config), **SEED_RECIPE, **fields_})
        print(f"\n--- recipe {name}: {fields_ or 'the seed recipe'} ---")
        torch.manual_seed(cfg.seed)
        model = GPT(cfg).to(device)
        seconds, _, _, _ = train(model, configure_optimizer(model, cfg), splits, cfg, device, ctx)
        rows.append({**evaluate_recipe(name, model, splits, cfg, device, ctx, prompts), "train_seconds": seconds})
    return rows

def benchmark_training(config, splits, device, ctx, rounds=5, steps=40):
    """Median ms per training step with this recipe's exit heads and with none (a plain GPT: alpha 0,
    no distillation, no layer dropout), in alternating blocks of steps on the same batches: one run, one ratio."""
    setups = {}
    plain = dict(alpha=0.0, distill_weight=0.0, layer_dropout=0.0)
    for name, fields_ in (("exit heads", {}), ("plain GPT", plain)):
        cfg = Config(**{**asdict(config), **fields_})
        torch.manual_seed(cfg.seed)
        model = GPT(cfg).to(device)
        setups[name] = (model, configure_optimizer(model, cfg), cfg, [])
    gen = torch.Generator().manual_seed(config.seed)
    batches = [get_batch(splits["train"], config.block_size, config.batch_size, gen, device) for _ in range(steps)]
    for _ in range(rounds + 1):  # the first round warms up and is not counted
        for model, optimizer, cfg, times in setups.values():
            for x, y in batches:
                t0 = time.perf_counter()
                train_step(model, optimizer, x, y, cfg, ctx)
                synchronize(device)
                times.append(1000 * (time.perf_counter() - t0))
    return {name: float(np.median(times[steps:])) for name, (_, _, _, times) in setups.items()}


# -----------------------------------------------------------------------------
# Reports: the exit map, tables for people, JSON for programs

LAYER_COLOURS = (31, 33, 32, 36, 34, 35, 91, 93, 92, 96, 94, 95)  # ANSI foreground codes, shallow to deep

def exit_counts(exited_at, n_layer):
    """Tokens that left at each layer: (B, N) -> [int per layer]."""
    return torch.bincount(exited_at.flatten().cpu(), minlength=n_layer).tolist()

def colour_text(text, layers, n_layer, tty):
    """Every character coloured by the layer it left at; without a terminal, digits underneath."""
    if tty:
        legend = " ".join(f"\033[{LAYER_COLOURS[l % 12]}mlayer {l}\033[0m" for l in range(n_layer))
        body = "".join(f"\033[{LAYER_COLOURS[l % 12]}m{ch}\033[0m" for ch, l in zip(text, layers))
        return f"legend: {legend}\n{body}"
    out, i = ["(the digit under each character is the layer it exited at)"], 0
    for line in text.split("\n"):
        out.append(line)
        out.append("".join(str(l % 10) for l in layers[i : i + len(line)]))
        i += len(line) + 1
    return "\n".join(out)

def print_table(rows, columns, title=None):
    """An aligned table from a list of dicts; columns are (key, header, format) triples."""
    cells = [[fmt.format(r[k]) if r.get(k) is not None else "-" for k, _, fmt in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(columns)]
    if title:
        print(title)
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))

STRATEGY_COLUMNS = (
    ("mode", "mode", "{}"),
    ("name", "strategy", "{}"),
    ("checked_exits", "exits", "{}"),
    ("threshold", "thr", "{:.2f}"),
    ("tokens_per_second", "tok/s", "{:,.0f}"),
    ("speedup", "speed-up", "{:.2f}x"),
    ("predicted_speedup", "predicted", "{:.2f}x"),
    ("ideal_speedup", "ideal L/layers", "{:.2f}x"),
    ("mean_layers", "layers/token", "{:.2f}"),
    ("prefill_layers", "+prefill", "{:.2f}"),
    ("repetition", "repetition", "{:.2f}"),
    ("test_loss", "test loss", "{:.4f}"),
    ("agreement", "agree w/ full", "{:.3f}"),
)

def print_strategies(rows, quality, config, costs, depths):
    L = config.n_layer
    print(f"\n=== What does each KV strategy buy? {config.bench_prompts} test prompts of {config.bench_prompt_len} "
          f"characters, {config.bench_tokens} more each, batch 1, median of {config.bench_repeats} interleaved runs ===")
    print(f"greedy and sampled (temperature {config.temperature:g}, top_k {config.top_k}) each against full depth in the "
          f"same mode. exits / thr: checked exits and threshold ({config.confidence}), chosen on val: "
          f"exit_layers={config.exit_layers!r}, at least 30% of val positions exiting early unless strategies_threshold.")
    print("predicted: the cost-aware plan's speed-up from measured costs and val exit rates. layers/token: blocks run "
          "while decoding, catch-up included; +prefill: the full-depth re-prefill every block_size/2 tokens, which also "
          "repairs holes and state-copy approximations, so their damage is bounded by it.")
    print(f"repetition: 1 - distinct/total 4-grams of the generated text (a loop scores near 1). test loss and "
          f"agreement: {config.quality_positions} test positions teacher-forced through each decoder; self_speculative's "
          "are full depth's by construction (its tokens are the full model's, greedy, or its distribution, sampled).")
    print_table(rows, STRATEGY_COLUMNS)
    for spec in (r for r in rows if r["name"] == "self_speculative"):
        same = {True: "identical to full depth on every prompt", False: "NOT identical to full depth",
                None: "exact in distribution (tested)"}[spec["identical_to_full"]]
        print(f"self_speculative {spec['mode']}: draft_exit={spec['draft_exit']}, num_draft={spec['num_draft']}, "
              f"draft_stop={spec['draft_stop']:g}, acceptance {spec['acceptance_rate']:.3f}, "
              f"{spec['tokens_per_verify']:.2f} tokens per verify pass, {same}")
    print("the Learn-then-Test guarantee covers argmax agreement with full depth, teacher-forced, with an exact cache "
          "(backfill, deferred) at the calibrated threshold: not these speed thresholds, sampling, state_copy or holes.")
    print("\nwhere test tokens exit (teacher-forced), and layers run per token counting catch-up work:")
    for name, q in quality.items():
        fr = " ".join(f"{100 * f:5.1f}%" for f in q["exit_fractions"])
        print(f"  {name:<11} {fr}  | {q['mean_layers']:.2f} layers/token")
    print(f"measured costs, one token at batch 1: block {1e6 * costs['block']:.0f} us, exit check "
          f"{costs['check'] / costs['block']:.2f} of a block, state-copy write {costs['state_copy'] / costs['block']:.2f}, "
          f"final head {costs['final_head'] / costs['block']:.2f}; a full-depth token {costs['token'] / costs['block']:.1f} blocks")
    print("a batch runs as deep as its deepest row: expected layers per step from the recorded exits:")
    for B, d in depths.items():
        print(f"  B = {B:>2}: {d:.2f} of {L} layers ({100 * (1 - d / L):4.1f}% saved)")

def print_spec_sweep(grid):
    """Per mode: speed-up over full depth (acceptance) for each (draft_exit, num_draft) row and draft_stop column."""
    stops = sorted({g["draft_stop"] for g in grid})
    cell = {(g["mode"], g["draft_exit"], g["num_draft"], g["draft_stop"]): g for g in grid}
    print("\n=== Which draft_exit, num_draft and draft_stop? The self-speculative sweep on the val workload: "
          "speed-up over full depth in the same mode (acceptance rate), same-run medians ===")
    for mode in MODES:
        rows = sorted({(g["draft_exit"], g["num_draft"]) for g in grid if g["mode"] == mode})
        print(f"{mode:>8} E,k " + "".join(f"{'stop=' + format(s, 'g'):>16}" for s in stops))
        for E, k in rows:
            print(f"{E:>8},{k:<3} " + "".join(f"{cell[mode, E, k, s]['speedup']:>9.2f}x ({cell[mode, E, k, s]['acceptance_rate']:.2f})"
                                         for s in stops))
        best = max((g for g in grid if g["mode"] == mode), key=lambda g: g["speedup"])
        print(f"best {mode}: draft_exit={best['draft_exit']}, num_draft={best['num_draft']}, "
              f"draft_stop={best['draft_stop']:g} ({best['speedup']:.2f}x)")
    print("greedy output identical to full depth in every cell: "
          f"{all(g['identical_to_full'] for g in grid if g['mode'] == 'greedy')}")

BATCH_COLUMNS = (("batch_size", "B", "{}"), ("mode", "mode", "{}"), ("name", "design", "{}"),
                 ("tokens_per_second", "tok/s (batch)", "{:,.0f}"), ("speedup", "speed-up", "{:.2f}x"),
                 ("num_draft", "k", "{}"),
                 ("mean_layers", "layers/token", "{:.2f}"), ("expected_layers", "expected", "{:.2f}"),
                 ("test_loss", "test loss", "{:.4f}"), ("agreement", "agree w/ full", "{:.3f}"),
                 ("identical_to_full", "identical", "{}"))

def print_batches(batched, config):
    plan, schedule = batched["plan"], batched["schedule"]
    print(f"\n=== Does early exit still save in a batch? The test workload, one prompt per row, batch 1, 4 and 16, "
          f"median of {config.bench_repeats} interleaved runs ===")
    print(f"state_copy: every row waits for the deepest (exits {plan['checked_exits']}, {config.confidence} > "
          f"{plan['threshold']:g}; expected: layers per step from val's exits); state_copy_leave: an exiting row "
          f"leaves the batch; skipdecode: every row exits at layer {schedule.get('exit_layer', config.n_layer - 1)} "
          f"from window position {schedule.get('from_position', '-')} (val: {schedule['compute_saved']:.1%} saved, "
          f"{schedule['disagreement']:.2%} disagreement); self_speculative: batched, draft_exit={config.draft_exit}, "
          f"num_draft k the fastest on val of {sorted(set(BATCH_DRAFTS) | {config.num_draft})} per batch size and mode "
          f"(batch 1: the spec sweep's). Speed-up: over full depth at the same batch size and mode.")
    print_table(batched["rows"], BATCH_COLUMNS)
    print("Where batched greedy speculation's time goes (one timed pass; a batch lasts as long as its slowest row):")
    for line in speculation_cost_lines(batched["speculation_costs"]):
        print(line)

def speculation_cost_lines(costs):
    return [f"  batch {c['batch_size']}, k={c['num_draft']}: {c['rounds']} rounds (alone, each batch's slowest row "
            f"needs {c['slowest_row_rounds']} in all, its mean row {c['mean_row_rounds']:.1f}); time: "
            + ", ".join(f"{phase} {share:.0%}" for phase, share in c["shares"].items())
            + f"; a draft step {c['draft_step_ms']:.2f} ms, a verify pass {c['verify_ms']:.2f} ms, a full-depth step "
            f"{c['full_step_ms']:.2f} ms (re-prefills included)" for c in costs]

SWEEP_SHOWN = (1.0, 0.99, 0.98, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)

def print_sweep(rows, measure, n_layer):
    print(f"\n=== Which threshold? The sweep on val ({measure}): compute saved against quality ===")
    shown = [dict(r, fractions=" ".join(f"{100 * f:4.1f}" for f in r["exit_fractions"]))
             for r in rows if r["threshold"] in SWEEP_SHOWN]
    print_table(shown, (("threshold", "threshold", "{:.2f}"), ("fractions", f"% exiting at layer 0..{n_layer - 1}", "{}"),
                        ("mean_layers", "layers", "{:.2f}"), ("compute_saved", "saved", "{:.1%}"),
                        ("loss", "val loss", "{:.4f}"), ("disagreement", "disagree", "{:.2%}")))
    print("text plot: compute saved (#) and disagreement with full depth (x, same scale), one line per threshold")
    for r in shown:
        saved, wrong = r["compute_saved"], r["disagreement"]
        print(f"  {r['threshold']:4.2f} |{bar(saved, 40):<40}| {saved:6.1%} saved |{'x' * min(10, round(wrong * 40)):<10}| "
              f"{wrong:6.2%} disagree")

def print_calibration(cals, chosen):
    print(f"\n=== Which threshold, with a guarantee? Learn then Test: disagreement <= {chosen['epsilon']:.0%} "
          f"with probability >= {1 - chosen['delta']:.0%}, chosen on val, reported on test ===")
    rows = [{"measure": c["measure"], "threshold": c["threshold"], **c["test"]} for c in cals]
    print_table(rows, (("measure", "measure", "{}"), ("threshold", "threshold", "{:.2f}"),
                       ("compute_saved", "test saved", "{:.1%}"), ("disagreement", "disagree", "{:.2%}"),
                       ("loss", "test loss", "{:.4f}"), ("full_loss", "full loss", "{:.4f}"),
                       ("accuracy", "accuracy", "{:.3f}")))
    best = max(cals, key=lambda c: c["test"]["compute_saved"])
    print(f"most compute saved at the same guarantee: {best['measure']}")

def print_logit_lens(rows):
    print("\n=== Does an exit need a trained head? The logit lens: each layer through the final head "
          "(untrained for it) and through its own exit head ===")
    print_table(rows, (("layer", "layer", "{}"), ("readout", "readout", "{}"),
                       ("agreement", "top-1 = final", "{:.3f}"), ("median_rank", "median rank", "{:.0f}"),
                       ("confidence", "mean confidence", "{:.3f}")))

def print_slices(slices):
    print("\n=== What does 'easy' mean for this model? The test tokens leaving at each layer (calibrated threshold) ===")
    for r in slices["per_layer"]:
        acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
        print(f"  layer {r['layer']}: {r['tokens']:>6} tokens, accuracy {acc}")
    print(f"characters that most often leave at layer {slices['first_exit_layer']} (with a typical preceding context):")
    for c in slices["earliest_chars"]:
        print(f"  {c['char']!r:>6}: {c['exits']:>5} times, e.g. after {c['example_context']!r}")

def print_recipes(rows, config):
    base = next(r for r in rows if r["recipe"] == "baseline")["val_loss_final"]
    print(f"\n=== Which training recipe? Every recipe at the same budget ({config.max_iters} steps, seed {config.seed}) ===")
    print("compute saved and test loss at the calibrated top-1 threshold (epsilon 1%, delta 0.05, chosen on val); "
          f"self-speculative on the val workload at draft_exit={config.draft_exit}, num_draft={config.num_draft}, "
          f"draft_stop={config.draft_stop:g}")
    shown = [dict(r, vs_base=r["val_loss_final"] / base - 1, exits=" ".join(f"{v:.2f}" for v in r["val_loss_exits"]))
             for r in rows]
    print_table(shown, (("recipe", "recipe", "{}"), ("val_loss_final", "val loss", "{:.4f}"),
                        ("vs_base", "vs baseline", "{:+.2%}"), ("exits", "val loss per exit", "{}")) + RECIPE_COLUMNS[2:])

RECIPE_COLUMNS = (("recipe", "recipe", "{}"), ("val_loss_final", "val loss", "{:.4f}"),
                  ("calibrated_threshold", "threshold", "{:.2f}"), ("compute_saved", "test saved", "{:.1%}"),
                  ("test_loss", "test loss", "{:.4f}"), ("test_full_loss", "full", "{:.4f}"),
                  ("spec_acceptance_rate", "accept", "{:.3f}"), ("spec_speedup", "spec greedy", "{:.2f}x"),
                  ("spec_speedup_sampled", "spec sampled", "{:.2f}x"))


# -----------------------------------------------------------------------------
# Reports, 2: out_dir/report.html, one self-contained page (inline CSS and SVG, no script, light and dark)

VIRIDIS = ("#440154", "#3b528b", "#21918c", "#5ec962", "#fde725")  # shallow to deep; told apart without hue

def layer_colour(layer, n_layer):
    """Viridis at layer / (n_layer - 1), linearly between its stops: a sequential, colour-blind-safe scale."""
    t = layer / max(1, n_layer - 1) * (len(VIRIDIS) - 1)
    i, f = min(int(t), len(VIRIDIS) - 2), t - min(int(t), len(VIRIDIS) - 2)
    a, b = (tuple(int(c[j : j + 2], 16) for j in (1, 3, 5)) for c in VIRIDIS[i : i + 2])
    return "#" + "".join(f"{round(x + f * (y - x)):02x}" for x, y in zip(a, b))

def ink(colour):
    """Black or white text, whichever reads on this background."""
    r, g, b = (int(colour[j : j + 2], 16) for j in (1, 3, 5))
    return "#000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#fff"

def esc(text):
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")

def datum(key, value):
    """The attributes that tie a number on the page to its place in report.json (checked by a test)."""
    return f'data-key="{esc(key)}" data-value="{value!r}"'

HTML_STYLE = """
:root { --bg: #fff; --fg: #1d1d1f; --muted: #6e6e73; --grid: #d2d2d7; --a: #2a788e; --b: #e66101; }
@media (prefers-color-scheme: dark) { :root { --bg: #161618; --fg: #f2f2f7; --muted: #a1a1a6; --grid: #3a3a3c;
  --a: #5ec9c9; --b: #fdb863; } }
body { background: var(--bg); color: var(--fg); font: 15px/1.5 system-ui, sans-serif; max-width: 1180px;
  margin: 0 auto; padding: 1.5em; }
h2 { border-bottom: 1px solid var(--grid); padding-bottom: .2em; margin-top: 2em; }
.muted { color: var(--muted); } .row { display: flex; gap: 2em; flex-wrap: wrap; } .row > div { flex: 1 1 480px; }
pre.sample { white-space: pre-wrap; font: 14px/1.7 ui-monospace, monospace; }
pre.sample span { border-radius: 2px; } .legend span { padding: 0 .5em; margin-right: .3em; border-radius: 2px; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; } td, th { padding: .2em .6em;
  border-bottom: 1px solid var(--grid); text-align: right; } th { color: var(--muted); font-weight: 500; }
svg text { fill: var(--fg); font: 12px system-ui, sans-serif; } svg .grid { stroke: var(--grid); }
svg .a { fill: var(--a); stroke: var(--a); } svg .b { fill: var(--b); stroke: var(--b); } svg .line { fill: none;
  stroke-width: 2; } svg .mark { stroke: var(--fg); stroke-dasharray: 4 3; }
"""

def html_legend(n_layer):
    return '<p class="legend">' + "".join(
        f'<span style="background:{layer_colour(l, n_layer)};color:{ink(layer_colour(l, n_layer))}">layer {l}</span>'
        for l in range(n_layer)) + "</p>"

def html_sample(text, layers, confidences, n_layer):
    """Every character on the colour of the layer it left at; hover: the layer and the head's confidence."""
    spans = []
    for ch, l, c in zip(text, layers, confidences):
        bg = layer_colour(l, n_layer)
        spans.append(f'<span style="background:{bg};color:{ink(bg)}" title="layer {l}, confidence {c:.2f}" '
                     f'data-layer="{l}">{esc(ch)}</span>')
    return '<pre class="sample">' + "".join(spans) + "</pre>"

def svg_bars(values, labels, keys, fmt, width=520, height=200, classes=None, colours=None, group=1):
    """Vertical bars with a value on each, labelled per group of `group` bars; each carries its report key."""
    top, n = max(max(values), 1e-9), len(values)
    w = (width - 40) / n
    parts = [f'<svg viewBox="0 0 {width} {height + 40}" width="{width}" role="img">']
    for i, (v, label, key) in enumerate(zip(values, labels, keys)):
        h, x = (height - 20) * v / top, 30 + i * w
        cls = (classes or ["a"] * n)[i]
        fill = f' style="fill:{colours[i]}"' if colours else ""
        parts.append(f'<rect class="{cls}"{fill} x="{x + 4:.1f}" y="{height - h:.1f}" width="{w - 8:.1f}" height="{h:.1f}" '
                     f'{datum(key, v)}><title>{esc(label)}: {fmt.format(v)}</title></rect>')
        parts.append(f'<text x="{x + w / 2:.1f}" y="{height - h - 4:.1f}" text-anchor="middle">{fmt.format(v)}</text>')
        if i % group == 0:
            parts.append(f'<text x="{x + group * w / 2:.1f}" y="{height + 16}" text-anchor="middle">{esc(label)}</text>')
    return "".join(parts) + "</svg>"

def svg_lines(series, x_label, mark=None, width=520, height=220, y_max=None, x_ticks=((0, "0"), (0.5, "0.5"), (1, "1"))):
    """Lines over x in [0, 1]: series of (name, class, xs, ys, keys); `mark` draws a dashed vertical line."""
    y_max = y_max or max(max(ys) for _, _, _, ys, _ in series) or 1.0
    X = lambda x: 40 + (width - 60) * x  # noqa: E731
    Y = lambda y: height - (height - 20) * y / y_max  # noqa: E731
    parts = [f'<svg viewBox="0 0 {width} {height + 40}" width="{width}" role="img">']
    for t in (0, 0.5, 1):
        parts.append(f'<line class="grid" x1="{X(0)}" x2="{X(1)}" y1="{Y(t * y_max):.1f}" y2="{Y(t * y_max):.1f}"/>'
                     f'<text x="{X(0) - 4}" y="{Y(t * y_max) + 4:.1f}" text-anchor="end">{t * y_max:.0%}</text>')
    for name, cls, xs, ys, keys in series:
        path = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in zip(xs, ys))
        parts.append(f'<polyline class="{cls} line" points="{path}"><title>{esc(name)}</title></polyline>')
        parts += [f'<circle class="{cls}" cx="{X(x):.1f}" cy="{Y(y):.1f}" r="2" {datum(k, y)}><title>{esc(name)} at '
                  f'{x:.2f}: {y:.2%}</title></circle>' for x, y, k in zip(xs, ys, keys) if k]
    if mark is not None:
        parts.append(f'<line class="mark" x1="{X(mark[0]):.1f}" x2="{X(mark[0]):.1f}" y1="0" y2="{height}" '
                     f'{datum(mark[1], mark[0])}><title>calibrated threshold {mark[0]:g}</title></line>')
    parts += [f'<text x="{X(x):.1f}" y="{height + 14}" text-anchor="middle">{esc(t)}</text>' for x, t in x_ticks]
    parts.append(f'<text x="{X(0.5)}" y="{height + 32}" text-anchor="middle">{esc(x_label)}</text>')
    return "".join(parts) + "</svg>"

def html_table(rows, columns, key_prefix):
    """A table whose number cells carry their report keys; columns are (key, header, format)."""
    head = "".join(f"<th>{esc(h)}</th>" for _, h, _ in columns)
    body = []
    for i, r in enumerate(rows):
        cells = []
        for key, _, fmt in columns:
            v = r.get(key)
            attr = datum(f"{key_prefix}.{i}.{key}", v) if isinstance(v, (int, float)) and not isinstance(v, bool) else ""
            cells.append(f"<td {attr}>{esc(fmt.format(v)) if v is not None else '-'}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"

def html_sections(report):
    """Every section the report has data for, each under the question it answers."""
    cfg, out = report.get("config", {}), []
    L = cfg.get("n_layer", 0)
    g = report.get("generation")
    if g:
        out.append(f"<h2>What does early exit look like?</h2>{html_legend(L)}<p class='muted'>{esc(g['kv_strategy'])}, "
                   f"threshold {g['exit_threshold']:g}; hover a character for its layer and the head's confidence."
                   f"</p><div class='row'><div><h3>early exit</h3>"
                   f"{html_sample(g['sample'], g['exited_at'], g['confidence'], L)}</div>"
                   + (f"<div><h3>full depth</h3><pre class='sample'>{esc(g['full_depth_sample'])}</pre></div>"
                      if g.get("full_depth_sample") is not None else "") + "</div>")
        out.append("<h2>Where do the tokens leave?</h2>" + svg_bars(
            g["exit_counts"], [f"layer {l}" for l in range(L)], [f"generation.exit_counts.{l}" for l in range(L)], "{:d}",
            colours=[layer_colour(l, L) for l in range(L)]))
    for i, s in enumerate(report.get("sweep_by_measure", [])):
        cal = next((c for c in report.get("calibration_by_measure", []) if c["measure"] == s["measure"]), None)
        rows = s["rows"]
        xs = [r["threshold"] for r in rows]
        series = [("compute saved", "a", xs, [r["compute_saved"] for r in rows],
                   [f"sweep_by_measure.{i}.rows.{j}.compute_saved" for j in range(len(rows))]),
                  ("disagreement with full depth", "b", xs, [r["disagreement"] for r in rows],
                   [f"sweep_by_measure.{i}.rows.{j}.disagreement" for j in range(len(rows))])]
        mark = (cal["threshold"], f"calibration_by_measure.{report['calibration_by_measure'].index(cal)}.threshold") if cal else None
        out.append(f"<h2>Which threshold? ({esc(s['measure'])})</h2><p class='muted'>val: compute saved (blue) and "
                   "disagreement with full depth (orange) against the threshold; dashed: the Learn-then-Test "
                   "threshold.</p>" + svg_lines(series, "threshold", mark))
    if report.get("strategies"):
        rows = report["strategies"]
        out.append("<h2>What does each KV strategy buy?</h2><p class='muted'>measured speed-up (blue) and the "
                   "ideal L / layers run (orange), test workload, batch 1.</p>")
        for mode in MODES:
            idx = [j for j, r in enumerate(rows) if r["mode"] == mode]
            vals = [v for j in idx for v in (rows[j]["speedup"], rows[j]["ideal_speedup"])]
            labels = [f"{rows[j]['name']}" for j in idx for w in ("measured", "ideal")]
            keys = [f"strategies.{j}.{k}" for j in idx for k in ("speedup", "ideal_speedup")]
            out.append(f"<h3>{mode}</h3>" + svg_bars(vals, labels, keys, "{:.2f}x", width=980, classes=["a", "b"] * len(idx),
                                                     group=2))
        out.append(html_table(rows, STRATEGY_COLUMNS, "strategies"))
    if report.get("batched"):
        out.append("<h2>Does early exit still save in a batch?</h2>" + html_table(report["batched"]["rows"], BATCH_COLUMNS,
                                                                                  "batched.rows")
                   + "".join(f"<p>{esc(line)}</p>" for line in speculation_cost_lines(report["batched"]["speculation_costs"])))
    if report.get("spec_sweep"):
        out.append("<h2>Which draft_exit, num_draft and draft_stop?</h2>" + html_heatmap(report["spec_sweep"]))
    if report.get("logit_lens"):
        lens = report["logit_lens"]
        series = [(name, cls, [r["layer"] / max(1, L - 2) for r in lens if r["readout"] == name],
                   [r["agreement"] for r in lens if r["readout"] == name],
                   [f"logit_lens.{j}.agreement" for j, r in enumerate(lens) if r["readout"] == name])
                  for name, cls in (("exit head", "a"), ("ln_f + lm_head", "b"))]
        out.append("<h2>Does an exit need a trained head?</h2><p class='muted'>agreement with the final prediction per "
                   "layer: its trained exit head (blue) and the final head read there, untrained for it (orange).</p>"
                   + svg_lines(series, "layer", y_max=1.0, x_ticks=[(l / max(1, L - 2), str(l)) for l in range(L - 1)]))
    if report.get("recipes"):
        out.append("<h2>Which training recipe?</h2>" + html_table(report["recipes"], RECIPE_COLUMNS, "recipes"))
    return out

def html_heatmap(grid):
    """The self-speculative grid per mode: a cell per (draft_exit, num_draft) row and draft_stop column."""
    out = []
    top = max(g["speedup"] for g in grid)
    for mode in MODES:
        cells = [(i, g) for i, g in enumerate(grid) if g["mode"] == mode]
        rows = sorted({(g["draft_exit"], g["num_draft"]) for _, g in cells})
        stops = sorted({g["draft_stop"] for _, g in cells})
        html = [f"<h3>{mode}: speed-up over full depth</h3><table><tr><th>E, k</th>"
                + "".join(f"<th>stop {s:g}</th>" for s in stops) + "</tr>"]
        for E, k in rows:
            html.append(f"<tr><th>{E}, {k}</th>")
            for s in stops:
                i, g = next((i, g) for i, g in cells if (g["draft_exit"], g["num_draft"], g["draft_stop"]) == (E, k, s))
                bg = layer_colour(g["speedup"] / top, 2)
                html.append(f'<td style="background:{bg};color:{ink(bg)}" {datum(f"spec_sweep.{i}.speedup", g["speedup"])}>'
                            f'{g["speedup"]:.2f}x</td>')
            html.append("</tr>")
        out.append("".join(html) + "</table>")
    return "".join(out)

def write_html_report(report, path):
    """out_dir/report.html: the same numbers as report.json, as pictures; written to a temporary file, then renamed."""
    body = "".join(html_sections(report))
    page = (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="color-scheme" content="light dark">'
            f"<title>nanogpt_exit_head report</title><style>{HTML_STYLE}</style></head><body>"
            f"<h1>Early exit in a character-level GPT</h1><p class='muted'>Every number here is in report.json; "
            f"this page is made by nanogpt_exit_head.py from it.</p>{body}</body></html>")

    def dump(text, p):
        with open(p, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_save(page, path, dump)


# -----------------------------------------------------------------------------
# Checkpoints: written to a temporary file, then renamed, so none is ever half-written

ARCH_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "exit_head")  # forced from a checkpoint

def atomic_save(obj, path, writer):
    tmp = path + ".tmp"
    writer(obj, tmp)
    os.replace(tmp, path)

CHECKPOINT_KEYS = {"model", "optimizer", "config", "iter_num", "vocab"}  # older ones lack rng and train_log

def save_checkpoint(path, model, optimizer, config, iter_num, tokenizer, train_seconds, rng, train_log, val_loss=None):
    """Tensors and plain Python data only, so torch.load(weights_only=True) can read it back."""
    ckpt = {
        "train_seconds": train_seconds,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "config": asdict(config),
        "iter_num": iter_num,  # steps done; training resumes at this step
        "val_loss": val_loss,  # the last full-depth val loss (None when saved mid-training)
        "vocab": tokenizer.chars,
        "rng": rng,  # the batch sampler's and torch's random states, for an exact resume
        "train_log": train_log,
    }
    atomic_save(ckpt, path, torch.save)

def write_json(obj, path):
    def dump(o, p):
        with open(p, "w") as f:
            json.dump(o, f, indent=2)

    atomic_save(obj, path, dump)

def load_checkpoint(path, config, overridden, tokenizer):
    """Load ckpt.pt; architecture fields come from it, and must agree with explicit overrides."""
    if not os.path.isfile(path):
        raise ValueError(f"--init_from=resume but there is no checkpoint at {path!r}")
    try:  # weights_only: a checkpoint is data, never code to run
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, KeyError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path!r} is not a readable checkpoint (truncated or corrupt: {type(e).__name__}); "
                         "delete it, or train anew with --init_from=scratch") from None
    if not isinstance(ckpt, dict) or not CHECKPOINT_KEYS <= set(ckpt):
        raise ValueError(f"{path!r} is not a checkpoint of this script (it lacks "
                         f"{', '.join(sorted(CHECKPOINT_KEYS - set(ckpt))) if isinstance(ckpt, dict) else 'everything'}); "
                         "delete it, or train anew with --init_from=scratch")
    if ckpt["vocab"] != tokenizer.chars:
        raise ValueError(f"checkpoint vocabulary ({len(ckpt['vocab'])} chars) does not match {config.input_path!r}")
    for name in ARCH_FIELDS:
        if name in overridden and getattr(config, name) != ckpt["config"][name]:
            raise ValueError(f"checkpoint has {name}={ckpt['config'][name]}, but --{name}={getattr(config, name)} was given")
        setattr(config, name, ckpt["config"][name])
    return ckpt

def restore_model(ckpt, config, device):
    model = GPT(config)
    try:
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, TypeError, AttributeError) as e:  # shapes or names that do not fit this model
        raise ValueError(f"checkpoint does not fit the model: {str(e).splitlines()[0]}") from None
    return model.to(device)


# -----------------------------------------------------------------------------
# Command line and main: parse, train (or resume), sample, analyse, report

EXIT_WEIGHTS = ("constant", "linear", "geometric", "layerskip")
EXIT_HEADS = ("separate", "shared", "final")

def load_text(path):
    """The training text: a UTF-8 file, or a one-line error that says what is wrong and where."""
    if not os.path.isfile(path):
        raise ValueError(f"--input_path={path!r}: no such file (the repository ships input.txt)")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(f"input file {path!r} is not UTF-8: byte {e.start} (line {line}) is {raw[e.start:e.start + 1]!r}; "
                         "convert it, e.g. iconv -t UTF-8") from None
    if not text:
        raise ValueError(f"input file {path!r} is empty")
    return text

def field_help():
    """The trailing comment of every Config field, read from this file's source."""
    helps = {}
    for line in inspect.getsource(Config).splitlines():
        name, sep, rest = line.strip().partition(":")
        if sep and "#" in rest and name.isidentifier():
            helps[name] = rest.split("#", 1)[1].strip()
    return helps

def parse_value(name, text, default):
    """Turn the text of --name=text into the type of the field's default."""
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"--{name} takes true/false (or 1/0), not {text!r}")
    try:
        return type(default)(text)
    except ValueError:
        raise ValueError(f"--{name} takes a {type(default).__name__}, not {text!r}") from None

def parse_args(argv):
    """nanoGPT-style overrides: --name=value for any Config field; --help lists them."""
    config, defaults, overridden = Config(), asdict(Config()), set()
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ValueError(f"arguments look like --name=value, got {arg!r} (see --help)")
        name, text = arg[2:].split("=", 1)
        if name not in defaults or name == "vocab_size":
            close = [f for f in defaults if f.startswith(name[:3])]
            hint = f" (did you mean {', '.join('--' + c for c in close)}?)" if close else ""
            raise ValueError(f"unknown config field --{name}{hint}")
        setattr(config, name, parse_value(name, text, defaults[name]))
        overridden.add(name)
    validate(config)
    return config, overridden

def usage():
    """Every field: its default, what it does, and the rule validate() holds it to."""
    helps = field_help()
    lines = ["usage: python nanogpt_exit_head.py [--name=value ...]",
             "       torchrun --standalone --nproc_per_node=N nanogpt_exit_head.py [...]  (one batch_size per process)",
             "", "fields (default, what it does) [the values it takes]:"]
    for f in fields(Config):
        if f.name == "vocab_size":
            continue
        rule = FIELD_RULES.get(f.name, "true/false" if f.type in (bool, "bool") else "")
        rule = "one of " + " or ".join(rule) if isinstance(rule, tuple) else f"in {rule}" if rule and rule[0] in "[(" else rule
        rule = "; ".join(r for r in (rule, FIELD_NOTES.get(f.name, "")) if r)
        lines.append(f"  --{f.name:<22} {str(f.default)!r:<14} {helps.get(f.name, '')}" + (f" [{rule}]" if rule else ""))
    return "\n".join(lines)

FIELD_RULES = {  # every field a user can set: an interval of numbers, or the names it may take
    "init_from": ("scratch", "resume"), "seed": "[0, inf)", "n_layer": "[2, inf)", "n_head": "[1, inf)",
    "n_embd": "[1, inf)", "block_size": "[2, inf)", "dropout": "[0, 1)", "alpha": "[0, inf)",
    "exit_weights": EXIT_WEIGHTS, "exit_head": EXIT_HEADS, "distill_weight": "[0, inf)",
    "distill_temperature": "(0, inf)", "layer_dropout": "[0, 1)", "batch_size": "[1, inf)", "max_iters": "[0, inf)",
    "learning_rate": "(0, inf)", "min_lr": "[0, inf)", "warmup_iters": "[0, inf)", "weight_decay": "[0, inf)",
    "beta1": "[0, 1)", "beta2": "[0, 1)", "grad_clip": "[0, inf)", "eval_interval": "[1, inf)", "eval_iters": "[1, inf)",
    "max_new_tokens": "[1, inf)", "temperature": "[0, inf)", "top_k": "[0, inf)", "exit_threshold": "[0, 1]",
    "kv_strategy": KV_STRATEGIES, "confidence": CONFIDENCE_MEASURES, "draft_exit": "[0, inf)", "num_draft": "[1, inf)",
    "draft_stop": "[0, 1)", "quality_positions": "[1, inf)", "bench_prompts": "[1, inf)", "bench_prompt_len": "[1, inf)",
    "bench_tokens": "[1, inf)", "bench_repeats": "[1, inf)", "epsilon": "(0, 1)", "delta": "(0, 1)",
    "sweep_positions": "[1, inf)", "strategies_threshold": "[-1, 1]", "schedule_disagreement": "[0, 1]",
}
FIELD_NOTES = {  # rules that involve more than one field or the machine, as --help states them
    "out_dir": "a folder this process can write (not a file)", "input_path": "a UTF-8 text file, long enough "
    "for block_size in each split", "device": "auto, cpu, cuda, cuda:N or mps, as this torch offers them",
    "n_head": "and must divide n_embd", "min_lr": "and at most learning_rate", "prompt": "at least one character, "
    "all in the vocabulary", "exit_layers": "auto, all or layers 0..n_layer-2", "draft_exit": "and below n_layer - 1",
    "strategies_threshold": "-1 (choose on val) or a threshold in [0, 1]",
}

def in_interval(x, interval):
    """Whether x lies in an interval written '[0, 1)', '(0, inf)' and the like."""
    lo, hi = (float(t) for t in interval[1:-1].split(", "))
    return (x >= lo if interval[0] == "[" else x > lo) and (x <= hi if interval[-1] == "]" else x < hi)

def validate(config):
    """Reject settings that cannot work, with a message that says what to change (the rules --help lists)."""
    for name, rule in FIELD_RULES.items():
        value = getattr(config, name)
        if isinstance(rule, tuple) and value not in rule:
            raise ValueError(f"--{name}={value!r} is not one of {', '.join(rule)}")
        if isinstance(rule, str) and not in_interval(value, rule):
            raise ValueError(f"--{name}={value} is outside {rule}")
    if config.n_embd % config.n_head:
        raise ValueError(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}")
    if config.min_lr > config.learning_rate:
        raise ValueError(f"min_lr={config.min_lr} is above learning_rate={config.learning_rate}")
    if config.strategies_threshold < 0 and config.strategies_threshold != -1:
        raise ValueError(f"strategies_threshold={config.strategies_threshold}: -1 (choose on val) or a value in [0, 1]")
    if not config.prompt:
        raise ValueError("--prompt must hold at least one character")
    parse_exit_layers(config.exit_layers, config.n_layer)
    if config.draft_exit >= config.n_layer - 1:
        raise ValueError(f"draft_exit={config.draft_exit} must be a layer below the last (0..{config.n_layer - 2})")
    check_out_dir(config.out_dir)

def check_out_dir(path):
    """out_dir must be a folder we can write: say so now, not after training."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--out_dir={path!r} is a file; name a folder")
    probe = path
    while not os.path.exists(probe):  # the nearest folder that exists must let us create what is missing
        probe = os.path.dirname(os.path.abspath(probe))
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"--out_dir={path!r} cannot be written ({probe!r} is not writable)")

def parse_exit_layers(text, n_layer):
    """'all' or '0,2' -> the sorted layers (below the last) whose exit head is checked."""
    if text in ("all", "auto"):  # 'auto' is resolved per strategy by the exit plan; elsewhere it checks all
        return list(range(n_layer - 1))
    try:
        layers = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise ValueError(f"exit_layers={text!r} must be 'all' or a comma list of layer numbers") from None
    if any(not 0 <= l < n_layer - 1 for l in layers):
        raise ValueError(f"exit_layers={text!r}: exits live on layers 0..{n_layer - 2} (the last layer always exits)")
    return layers

def pick_device(name):
    """'auto' picks cuda, then mps, then cpu; a named device must be one this torch offers."""
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if mps else "cpu"
    kind, _, index = name.partition(":")
    if kind == "cuda" and torch.cuda.is_available() and (not index or index.isdigit() and int(index) < torch.cuda.device_count()):
        return name
    if name == "cpu" or name == "mps" and mps:
        return name
    offered = ", ".join(["auto", "cpu"] + (["cuda", f"cuda:0..{torch.cuda.device_count() - 1}"] if torch.cuda.is_available()
                                            else []) + (["mps"] if mps else []))
    raise ValueError(f"--device={name!r} is not offered by this torch; use one of {offered}")

def autocast_context(device):
    """bf16 autocast for training on CUDA; plain fp32 elsewhere (and for all decoding)."""
    if device.startswith("cuda"):
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return nullcontext()

def build_model(config, overridden, tokenizer, device):
    """A new model, or the checkpoint's; returns (model, optimizer, iter_num, train_seconds, rng, train_log)."""
    ckpt_path = os.path.join(config.out_dir, "ckpt.pt")
    if config.init_from == "resume":
        ckpt = load_checkpoint(ckpt_path, config, overridden, tokenizer)
        model = restore_model(ckpt, config, device)
        optimizer = configure_optimizer(model, config)
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
        except (ValueError, KeyError) as e:
            raise ValueError(f"checkpoint's optimizer state does not fit the model: {str(e)[:100]}") from None
        return model, optimizer, ckpt["iter_num"], ckpt.get("train_seconds", 0.0), ckpt.get("rng"), ckpt.get("train_log", [])
    model = GPT(config).to(device)
    return model, configure_optimizer(model, config), 0, 0.0, None, []

def print_param_counts(model):
    base, heads = model.num_params()
    print(f"parameters: {base / 1e6:.3f} M base model, {heads / 1e6:.3f} M in "
          f"{model.config.n_layer - 1} exit heads ({model.config.exit_head}; {100 * heads / base:.2f}% overhead)")

def timed_generate(model, idx, config, seed, **kw):
    """generate() with a fresh seeded sampler; returns (Generation, tokens per second)."""
    gen = torch.Generator(device=idx.device).manual_seed(seed)
    t0 = time.perf_counter()
    out = generate(model, idx, config.max_new_tokens, temperature=config.temperature, top_k=config.top_k,
                   generator=gen, **kw)
    synchronize(idx.device)
    return out, idx.size(0) * config.max_new_tokens / (time.perf_counter() - t0)

def demo_generation(model, tokenizer, config, device, threshold, full_depth=True):
    """A full-depth sample and an early-exit sample from the same prompt and seed."""
    idx = torch.tensor([tokenizer.encode(config.prompt)], dtype=torch.long, device=device)
    checked_exits = parse_exit_layers(config.exit_layers, config.n_layer)
    full, full_tps = timed_generate(model, idx, config, config.seed) if full_depth else (None, None)
    early, tps = timed_generate(model, idx, config, config.seed, strategy=config.kv_strategy,
                                exit_threshold=threshold, checked_exits=checked_exits, measure=config.confidence)
    T0 = idx.size(1)
    if full_depth:
        print("\n=== What does early exit look like? Two samples from the same prompt and seed ===")
        print(f"\n--- full-depth sample ({full_tps:,.0f} tok/s) ---")
        print(tokenizer.decode(full.tokens[0, T0:].tolist()))
    print(f"\n--- early-exit sample: {config.kv_strategy}, {config.confidence} > {threshold:g} ({tps:,.0f} tok/s) ---")
    text = tokenizer.decode(early.tokens[0, T0:].tolist())
    print(text)
    counts = exit_counts(early.exited_at, config.n_layer)
    print("\nper-layer exit statistics:")
    print(format_exit_stats(counts))
    layers_run = early.layers_run / config.max_new_tokens
    print(f"layers actually run per token: {layers_run:.2f} of {config.n_layer} ({config.kv_strategy})")
    print("\n" + colour_text(text, early.exited_at[0].tolist(), config.n_layer, sys.stdout.isatty()))
    mean = sum((l + 1) * c for l, c in enumerate(counts)) / sum(counts)
    # the same decoder teacher-forced on its own sample: the confidence of the head each character left from
    forced = generate(model, idx, config.max_new_tokens, strategy=config.kv_strategy, exit_threshold=threshold,
                      checked_exits=checked_exits, measure=config.confidence, forced=early.tokens[:, T0:])
    return {"exit_threshold": threshold, "kv_strategy": config.kv_strategy, "exit_counts": counts,
            "mean_layers": mean, "layers_run_per_token": layers_run, "tokens_per_second": tps,
            "full_depth_tokens_per_second": full_tps, "sample": text, "exited_at": early.exited_at[0].tolist(),
            "confidence": confidence(forced.logits[0], config.confidence).tolist(),
            "full_depth_sample": tokenizer.decode(full.tokens[0, T0:].tolist()) if full_depth else None}

def run_sample_only(config, overridden, device):
    """--sample_only=1: the checkpoint's early-exit sample, exit map and per-layer statistics, nothing else."""
    if config.init_from != "resume":
        raise ValueError("--sample_only=1 samples from a checkpoint: add --init_from=resume")
    tokenizer, splits = load_data(config)
    model = restore_model(load_checkpoint(os.path.join(config.out_dir, "ckpt.pt"), config, overridden, tokenizer),
                          config, device).eval()
    threshold = config.exit_threshold
    if "exit_threshold" not in overridden:  # calibrate on val, as the default run does
        val = record_exits(model, splits["val"].to(device), config.sweep_positions)
        threshold = calibrate(val, config.confidence, parse_exit_layers(config.exit_layers, config.n_layer),
                              config.epsilon, config.delta)
    generation = demo_generation(model, tokenizer, config, device, threshold, full_depth=False)
    write_html_report({"config": asdict(config), "generation": generation}, os.path.join(config.out_dir, "report.html"))
    return generation

def run_recipe_comparison(config, device):
    """--compare_recipes=1: every recipe trained and judged alike; a table, and recipes.json in out_dir."""
    tokenizer, splits = load_data(config)
    prompts = workload(splits["val"], config.bench_prompts, config.bench_prompt_len).to(device)  # choosing: val
    rows = compare_recipes(config, splits, device, autocast_context(device), prompts)
    print_recipes(rows, config)
    os.makedirs(config.out_dir, exist_ok=True)
    write_json(rows, os.path.join(config.out_dir, "recipes.json"))
    write_html_report({"config": asdict(config), "recipes": rows}, os.path.join(config.out_dir, "report.html"))
    print(f"\nrecipes: {os.path.join(config.out_dir, 'recipes.json')}")
    return rows

def run_training_benchmark(config, device):
    """--bench_train=1: the exit heads' training overhead, measured in one run."""
    ms = benchmark_training(config, load_data(config)[1], device, autocast_context(device))
    print("median ms per training step, interleaved: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items())
          + f" | ratio {ms['exit heads'] / ms['plain GPT']:.3f}")
    return ms

def load_data(config):
    """The text, its vocabulary (which also sets config.vocab_size), and the three splits."""
    text = load_text(config.input_path)
    tokenizer = CharTokenizer(text)
    config.vocab_size = tokenizer.vocab_size
    if not config.prompt:
        raise ValueError("--prompt must hold at least one character")
    unknown = sorted(set(config.prompt) - set(tokenizer.chars))  # reject a bad prompt before any training
    if unknown:
        raise ValueError(f"--prompt has characters not in the vocabulary of {config.input_path!r}: "
                         f"{', '.join(repr(c) for c in unknown)}")
    splits = split_data(torch.tensor(tokenizer.encode(text), dtype=torch.long))
    need = max(config.block_size, config.bench_prompt_len) + 2
    short = [name for name, d in splits.items() if len(d) < need]
    if short:
        raise ValueError(f"input file {config.input_path!r} ({len(text):,} characters) is too short: the {', '.join(short)} "
                         f"split(s) need at least {need} characters for block_size={config.block_size} and "
                         f"bench_prompt_len={config.bench_prompt_len}; use a longer text or a smaller block_size")
    return tokenizer, splits

class Interrupted(Exception):
    """Ctrl-C stopped training; the checkpoint at `path` holds every step done."""

def train_or_resume(config, overridden, tokenizer, splits, device, ctx, rank=0, world=1):
    """Build or load the model, train it up to max_iters, checkpointing at every evaluation and on Ctrl-C;
    returns (model, report), or (None, None) on the ranks of a torchrun job other than 0."""
    model, optimizer, iter_num, train_seconds, rng, log = build_model(config, overridden, tokenizer, device)
    ckpt_path = os.path.join(config.out_dir, "ckpt.pt")
    if rank == 0:
        print(f"device: {device} | vocabulary: {tokenizer.vocab_size} characters | train/val/test: "
              f"{len(splits['train']):,}/{len(splits['val']):,}/{len(splits['test']):,} characters | processes: {world}")
        print_param_counts(model)
        os.makedirs(config.out_dir, exist_ok=True)
    t0, ms_per_iter = time.time(), None

    def save(it, rng, new_log):
        save_checkpoint(ckpt_path, model, optimizer, config, it, tokenizer, train_seconds + time.time() - t0, rng,
                        log + new_log)

    if iter_num < config.max_iters:
        step_model = wrap_for_processes(model, config, device) if world > 1 else None
        try:
            seconds, ms_per_iter, new_log, rng = train(model, optimizer, splits, config, device, ctx, iter_num, rng,
                                                  save if rank == 0 else None, step_model, rank)
        except KeyboardInterrupt:
            raise Interrupted(ckpt_path) from None
        train_seconds, iter_num, log = train_seconds + seconds, config.max_iters, log + new_log
    if rank > 0:
        return None, None
    if ms_per_iter is not None:
        print(f"median step time: {ms_per_iter:.1f} ms/iter")
    else:
        print(f"checkpoint already at iteration {iter_num} (max_iters={config.max_iters}): no training")
    losses = estimate_loss(model, splits, config, device, ctx)
    print(format_eval(iter_num, losses))
    save_checkpoint(ckpt_path, model, optimizer, config, iter_num, tokenizer, train_seconds, rng, log, losses["val"][-1])
    print(f"training took {train_seconds:.1f} s; checkpoint: {ckpt_path}")
    base, heads = model.num_params()
    return model.eval(), {
        "config": asdict(config), "n_params": base, "n_params_exit_heads": heads, "train_seconds": train_seconds,
        "ms_per_iter": ms_per_iter, "val_loss": {"final": losses["val"][-1], "exits": losses["val"][:-1]},
        "train_loss": losses["train"][-1], "train_log": log, "processes": world,
    }

def start_processes(config):
    """Under torchrun (RANK and WORLD_SIZE set): join the process group, gloo on CPU and nccl on CUDA.
    Returns (rank, world size, device); (0, 1, None) for a plain run."""
    if "RANK" not in os.environ:
        return 0, 1, None
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() and config.device in ("auto", "cuda")
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(local)
    return rank, world, f"cuda:{local}" if cuda else "cpu"

def wrap_for_processes(model, config, device):
    """DistributedDataParallel: every process computes its own batch's gradients, averaged in backward."""
    unused = config.alpha == 0 and config.distill_weight == 0  # then the exit heads get no gradient
    ids = [torch.device(device).index] if str(device).startswith("cuda") else None
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, find_unused_parameters=unused)
    return torch.compile(ddp) if config.compile else ddp

def choose_exit_rule(model, tokenizer, splits, config, device):
    """Sweep on val, calibrate per measure, report on test; the logit lens and the exit slices (printed later)."""
    val = record_exits(model, splits["val"].to(device), config.sweep_positions)
    test = record_exits(model, splits["test"].to(device), config.sweep_positions)
    checked_exits = parse_exit_layers(config.exit_layers, config.n_layer)
    report = {"sweep": sweep(val, config.confidence, checked_exits, CALIBRATION_GRID)}
    report["sweep_by_measure"] = [{"measure": m, "rows": report["sweep"] if m == config.confidence else
                                   sweep(val, m, checked_exits, CALIBRATION_GRID)} for m in CONFIDENCE_MEASURES]
    cals = [calibration_report(val, test, m, checked_exits, config.epsilon, config.delta) for m in CONFIDENCE_MEASURES]
    report["calibration"] = next(c for c in cals if c["measure"] == config.confidence)
    report["calibration_by_measure"] = cals
    starts = range(0, len(splits["val"]) - config.block_size, config.block_size)[:64]  # up to 64 val windows
    lens_x = torch.stack([splits["val"][i : i + config.block_size] for i in starts]).to(device)
    report["logit_lens"] = logit_lens(model, lens_x)
    exits = exits_at_threshold(test, config.confidence, report["calibration"]["threshold"], checked_exits)
    report["slices"] = exit_slices(test, exits, tokenizer, splits["test"])
    return report

def print_exit_rule(rule, config):
    """The analysis of choosing the exit rule, each part under the question it answers."""
    print_sweep(rule["sweep"], config.confidence, config.n_layer)
    print_calibration(rule["calibration_by_measure"], rule["calibration"])
    print_logit_lens(rule["logit_lens"])
    print_slices(rule["slices"])

def measure_strategies(model, splits, config, device):
    """The strategies table on the workload, costs and plans, batch depth, and (--spec_sweep) the self-speculative grid."""
    rows, quality, plans, costs, val_records = compare_strategies(model, splits, config, device)
    depths = expected_batch_depth(quality["backfill"]["exited_at"], (1, 4, 16), config.n_layer)
    print_strategies(rows, quality, config, costs, depths)
    report = {"strategies": rows, "exit_plans": plans, "decode_costs": costs,
              "exit_check_cost": costs["check"] / costs["block"], "batch_depth": {str(b): d for b, d in depths.items()},
              "workload": {"split": "test", "prompts": config.bench_prompts, "prompt_len": config.bench_prompt_len,
                           "tokens": config.bench_tokens, "repeats": config.bench_repeats, "chosen_on": "val"}}
    if config.bench_batch:
        report["batched"] = measure_batches(model, splits, config, device, plans, val_records)
        print_batches(report["batched"], config)
    if config.spec_sweep:
        val_prompts = workload(splits["val"], config.bench_prompts, config.bench_prompt_len).to(device)
        report["spec_sweep"] = sweep_speculative(model, val_prompts, config)
        print_spec_sweep(report["spec_sweep"])
    return report

def run(config, overridden):
    """The default job: every step the module docstring promises, in order."""
    torch.manual_seed(config.seed)
    rank, world, process_device = start_processes(config)
    device = process_device or pick_device(config.device)
    if config.sample_only:
        return run_sample_only(config, overridden, device)
    if config.compare_recipes:
        return run_recipe_comparison(config, device)
    if config.bench_train:
        return run_training_benchmark(config, device)
    tokenizer, splits = load_data(config)
    model, report = train_or_resume(config, overridden, tokenizer, splits, device, autocast_context(device), rank, world)
    if world > 1:
        torch.distributed.destroy_process_group()
    if rank > 0:  # only rank 0 analyses, prints and writes
        return None
    rule = choose_exit_rule(model, tokenizer, splits, config, device)  # quiet: the samples come first
    threshold = rule["calibration"]["threshold"]
    if "exit_threshold" in overridden:
        threshold = config.exit_threshold
        print(f"\n(--exit_threshold={threshold:g} overrides the calibrated threshold for the samples)")
    else:
        print(f"\nthe early-exit sample uses the threshold calibrated on val ({threshold:g}; 'Which threshold?' below)")
    report["generation"] = demo_generation(model, tokenizer, config, device, threshold)
    print_exit_rule(rule, config)
    report.update(rule)
    report.update(measure_strategies(model, splits, config, device))
    write_json(report, os.path.join(config.out_dir, "report.json"))
    write_html_report(report, os.path.join(config.out_dir, "report.html"))
    print(f"\nreport: {os.path.join(config.out_dir, 'report.json')} and report.html beside it")
    return report

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(usage())
        return 0
    try:
        config, overridden = parse_args(argv)
        run(config, overridden)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"\ninterrupted: every finished step is in {e} (continue with --init_from=resume)", file=sys.stderr)
        return 130
    return 0

if __name__ == "__main__":
    sys.exit(main())
