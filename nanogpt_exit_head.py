"""nanogpt_exit_head.py: a character-level GPT with an exit head after every layer, decoded with
confidence-gated early exit, and an honest measurement of what that buys.

    python nanogpt_exit_head.py                     # train, sample, measure (a few minutes)
    python nanogpt_exit_head.py --lesson_only=true  # Part I alone: train, two samples, exit stats
    python nanogpt_exit_head.py --help              # every field, each overridable as --name=value

Part I, the lesson: the original design end to end (exit heads and the joint loss, the per-layer
KV cache, gated decoding with backfill, exit statistics, training). It is a program of its own: the
text above the Part II banner imports alone, and its run_lesson is what --lesson_only runs. Part II,
the ideas, one a section, each returning plain data: the training recipe; the KV strategies
(deferred recompute, state copy after CALM arXiv:2207.07061, holes, SkipDecode); speculative
decoding, drafted by early layers (LayerSkip, arXiv:2404.16710) or a small model; the exit rules;
recording, calibration and the oracle; the cost model; the tail; smaller models; depth pruning;
the frontier. Part III, the harness: the workload and timing, the tables, the analyses, the page,
checkpoints, the command line, main.

Left out on purpose: BPE, rotary embeddings, mixed precision in decoding, and dependencies beyond
torch, numpy and tqdm. CUDA graphs too (gpt-fast's torch.compile of the decode
step): full depth is timed by one eager decoder on every device, so every speed-up and every
prediction is measured against the same baseline."""

import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F
from tqdm import tqdm

# =============================================================================
# Part I: the lesson, the original design end to end

# -----------------------------------------------------------------------------
# Config: every hyperparameter, one per line; override any as --name=value

@dataclass
class Config:
    """The lesson's hyperparameters; Part II's LabConfig adds the lab's (recipes, decoders, ...)."""
    # data and model
    input_path: str = "input.txt"  # the training text, one character per token
    seed: int = 1337  # one random seed for batches, init and sampling: same command, same numbers
    n_layer: int = 6  # how many transformer blocks (and exits) are stacked?
    n_head: int = 4  # attention heads per block; must divide n_embd
    n_embd: int = 128  # width of the residual stream
    block_size: int = 64  # the longest context the model ever sees, in characters
    dropout: float = 0.0  # dropout in training; raise it for bigger models on this small corpus
    bias: bool = False  # biases in Linear and LayerNorm layers? (nanoGPT's CPU recipe: no)
    vocab_size: int = 0  # set from the distinct characters of input_path; not an override
    alpha: float = 0.3  # weight of each exit head's loss; 0 trains a plain GPT and skips the heads
    # training
    batch_size: int = 12  # how many independent sequences per optimizer step
    max_iters: int = 1500  # total optimizer steps
    learning_rate: float = 2e-3  # peak learning rate after warmup
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
    exit_threshold: float = 0.9  # exit above this confidence (1: never); Part II calibrates it
    confidence_measure: str = "top1"  # how sure a head is: top1; Part II adds more rules

# -----------------------------------------------------------------------------
# Data: characters in, integers out; three contiguous splits

class CharTokenizer:
    """A vocabulary of the distinct characters of a text."""
    def __init__(self, chars):
        self.chars = "".join(sorted(set(chars)))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.vocab_size = len(self.chars)

    def encode(self, s):
        return [self.stoi[c] for c in s]  # a character outside the vocabulary is a KeyError

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)

def split_data(data):
    """Contiguous train 90% / val 5% / test 5%: val chooses things, test reports them."""
    a, b = int(0.9 * len(data)), int(0.95 * len(data))
    return {"train": data[:a], "val": data[a:b], "test": data[b:]}

def get_batch(data, block_size, batch_size, generator, device):
    """Random windows of block_size characters and the same windows shifted by one."""
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    xy = torch.stack([data[i : i + block_size + 1] for i in ix])  # (B, T + 1)
    return xy[:, :-1].to(device), xy[:, 1:].to(device)  # (B, T) inputs, (B, T) targets

def load_data(config):
    """The text, its vocabulary (which also sets config.vocab_size), and the three splits."""
    with open(config.input_path, encoding="utf-8") as f:
        text = f.read()
    tokenizer = CharTokenizer(text)
    config.vocab_size = tokenizer.vocab_size
    return tokenizer, split_data(torch.tensor(tokenizer.encode(text)))

# -----------------------------------------------------------------------------
# Model: nanoGPT's GPT, plus an ExitHead after every block but the last

class CausalSelfAttention(nn.Module):
    """All heads in one fused QKV projection and one scaled_dot_product_attention call."""
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def heads(self, t):
        return t.unflatten(2, (self.n_head, -1)).transpose(1, 2)  # (B, T, C) -> (B, nh, T, hs)

    def forward(self, x, cache, layer):
        q, k, v = map(self.heads, self.c_attn(x).chunk(3, dim=2))  # (B, nh, T, hs) each
        if cache is None:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.attn_dropout if self.training else 0.0, is_causal=True)
        else:
            # new queries see every cached key of this layer plus the new keys, causally
            k, v, mask = cache.append(layer, k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        # (B, nh, T, hs) -> (B, T, C): the heads side by side again
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).flatten(2)))

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
        # every (position, layer) block run is counted: the honest cost of a strategy
        if cache is not None:
            cache.layer_evals[layer] += x.size(1)
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

def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())  # over all positions

class GPT(nn.Module):
    """nanoGPT with exit_heads[l] after block l < n_layer - 1; the last exit is ln_f + lm_head."""
    def __init__(self, config):
        super().__init__()
        # Part II's recipes read more fields (distill_*, layer_dropout)
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        self.exit_heads = nn.ModuleList([ExitHead(config) for _ in range(config.n_layer - 1)])
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def embed(self, idx, pos0=0):
        """Token + position embeddings of idx, whose first token sits at window position pos0."""
        T = idx.size(1)
        assert pos0 + T <= self.config.block_size, f"position {pos0 + T - 1} is past block_size"
        pos = torch.arange(pos0, pos0 + T, device=idx.device)  # (T,)
        return self.transformer.drop(
            self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)

    def exit_logits(self, x, layer):
        """Logits of hidden state x read at `layer`: its exit head, or ln_f + lm_head at the top."""
        if layer == self.config.n_layer - 1:
            return self.lm_head(self.transformer.ln_f(x))
        return self.exit_heads[layer](x)

    def hidden_states(self, idx):
        """The output of every block for a whole sequence, no cache: a list of (B, T, C)."""
        x, states = self.embed(idx), []
        for block in self.transformer.h:
            x = block(x)
            states.append(x)
        return states

    def all_exit_logits(self, idx):
        """(n_layer, B, T, V): what every exit, the final one last, predicts at every position."""
        return torch.stack([self.exit_logits(h, l) for l, h in enumerate(self.hidden_states(idx))])

    def forward(self, idx, targets=None):
        """nanoGPT's contract: (logits, loss); without targets only the last position's logits."""
        states = self.hidden_states(idx)
        if targets is None:
            return self.exit_logits(states[-1][:, [-1]], self.config.n_layer - 1), None
        logits = self.exit_logits(states[-1], self.config.n_layer - 1)
        return logits, self.joint_loss(states, logits, targets)

    def joint_loss(self, states, logits, targets):
        """Part I's joint loss CE(final) + alpha * sum_l CE(exit_l); alpha = 0 runs no exit."""
        loss = cross_entropy(logits, targets)
        for l in range(self.config.n_layer - 1) if self.config.alpha > 0 else ():
            loss = loss + self.config.alpha * cross_entropy(self.exit_logits(states[l], l), targets)
        return loss

# -----------------------------------------------------------------------------
# The KV cache: one per-layer mechanism that every decoding strategy uses

class KVCache:
    """Preallocated keys and values for every layer, each layer with its own filled length.

    Invariant: layer l holds entries for window positions [0, lengths[l]) and nothing else,
    written in place; full depth keeps all lengths equal. A token that exits early leaves the
    layers above behind, and what a KV strategy does about it is all that tells strategies apart."""
    def __init__(self, config, batch_size, device):
        shape = (config.n_layer, batch_size, config.n_head, config.block_size,
                 config.n_embd // config.n_head)
        self.k = torch.zeros(shape, device=device)  # (L, B, nh, block_size, hs)
        self.v = torch.zeros(shape, device=device)
        self.layer_evals = [0] * config.n_layer  # how many (position, layer) block runs, per layer
        self.reset(0)

    def reset(self, start):
        """Empty every layer; window position 0 becomes absolute position `start`."""
        self.lengths = [0] * len(self.k)  # each layer's filled length
        self.start = start

    def append(self, layer, k, v):
        """Write k, v (B, nh, T, hs) after this layer's entries; return all entries and the mask."""
        n, T = self.lengths[layer], k.size(2)
        end = n + T
        assert end <= self.k.size(3), f"layer {layer} cache is full ({n} + {T} > block_size)"
        self.k[layer, :, :, n:end] = k
        self.v[layer, :, :, n:end] = v
        self.lengths[layer] = end
        # one new query needs no mask; a chunk of T queries sees the n old keys and its own past
        mask = None if T == 1 else torch.ones(T, end, dtype=torch.bool, device=k.device).tril(n)
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end], mask

# -----------------------------------------------------------------------------
# Decoding: confidence, sampling, the context window, and the gated step with backfill

def top1(probs, state):
    """The top-1 probability: (..., V) -> (...)."""
    return probs.amax(-1)

# name -> a rule: (B, V) probabilities and the step's state -> (B,) confidences. The state holds
# the layer, its output h and input below, and what a rule keeps from the exits below (the lab's
# rules read it: margin, entropy, patience, saturation and a learned rule)
CONFIDENCE_MEASURES = {"top1": top1}

def confidence(logits, measure="top1", state=None):
    """How sure a head is, higher is surer: (B, V) logits -> (B,). measure: a name, or a rule."""
    rule = CONFIDENCE_MEASURES[measure] if isinstance(measure, str) else measure
    return rule(logits.float().softmax(-1), {} if state is None else state)

def probs_from_logits(logits, temperature, top_k):
    """The distribution a sampler draws from: temperature, then the top_k most likely only."""
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.size(-1))).values[..., [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.softmax(-1)

def draw(probs, generator):
    """(B, V) probabilities -> (B,) tokens by inverse CDF: cheaper than multinomial for one draw."""
    cdf = probs.cumsum(-1)  # (B, V)
    u = torch.rand(len(probs), 1, generator=generator, device=probs.device) * cdf[:, -1:]
    # right=True: a token of probability zero is never drawn
    return torch.searchsorted(cdf, u, right=True)[:, 0]

def sample(logits, temperature, top_k, generator):
    """(B, V) logits -> (B,) tokens; temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(-1)
    return draw(probs_from_logits(logits, temperature, top_k), generator)

def window_start(start, n, block_size):
    """Where the context window begins when the sequence holds n tokens and token n-1 is fed next.
    Positions never pass block_size: a full window keeps its newest half, re-prefilled at full depth
    in one parallel pass."""
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
    """Place the window for feeding token n-1, re-prefilling if it moved: (start, block runs)."""
    s = window_start(start, n, model.config.block_size)
    if s == start:
        return start, 0
    prefill(model, cache, tokens[:, s : n - 1], s)
    return s, (n - 1 - s) * model.config.n_layer

class Backfill:
    """Part I's KV strategy: a token that exits early still runs the layers above, for the cache.

    Part II's strategies subclass it: exit_checks says which exits a token checks, run_layer runs a
    block for the newest token, and skip_layers what the layers above get once every row has
    left; a watched one moves its exit_threshold by what each step emitted."""
    def exit_threshold(self, threshold):
        """The threshold this step's tokens leave at: the run's."""
        return threshold

    def emitted(self, logits, exit_layer):
        """What a step emitted: each row's logits and exit layer."""

    def exit_checks(self, pos, checked_exits):
        """The exits checked for a token at window position pos."""
        return checked_exits

    def run_layer(self, block, cache, layer, x, pos):
        return block(x, cache, layer)

    def skip_layers(self, model, cache, x, pos, layer):
        """Every row left at `layer`: the blocks above run for the cache only (no check, no
        head)."""
        for l in range(layer + 1, model.config.n_layer):
            x = self.run_layer(model.transformer.h[l], cache, l, x, pos)

def decode_step(model, cache, idx, pos, strategy, exit_threshold, checked_exits, measure="top1"):
    """Feed one token per row, idx (B, 1), at window position pos: (emitted logits (B, V), exit
    layers (B,), exit checks run). Each row exits on its own confidence; the step runs as deep as
    its deepest row, and once every row has left, the strategy decides what the layers above get."""
    L, B = model.config.n_layer, len(idx)
    # a confidence never exceeds 1: at threshold 1 no exit is checked
    checks = strategy.exit_checks(pos, checked_exits) if exit_threshold < 1 else ()
    x = model.embed(idx, pos)  # (B, 1, C)
    emitted = x.new_zeros(B, model.config.vocab_size)  # (B, V): each row's, once it exits
    exit_layer = torch.full((B,), L - 1, device=idx.device)  # (B,) int64; L - 1: not exited
    state, n_checks, n_exited = {}, 0, 0  # state: what the rule sees of this step
    for l, block in enumerate(model.transformer.h):
        below = x[:, 0]
        x = strategy.run_layer(block, cache, l, x, pos)
        if l == L - 1 or l not in checks:
            continue
        head_logits = model.exit_logits(x[:, 0], l)  # (B, V): the newest position only
        state.update(layer=l, below=below, h=x[:, 0])
        newly = (confidence(head_logits, measure, state) > exit_threshold) & (exit_layer == L - 1)
        n_checks += 1
        count = int(newly.sum())  # the one host sync of a check; most often nobody is sure
        if count == 0:
            continue
        emitted = torch.where(newly[:, None], head_logits, emitted)
        exit_layer.masked_fill_(newly, l)
        n_exited += count
        if n_exited == B:
            strategy.skip_layers(model, cache, x, pos, l)
            return emitted, exit_layer, n_checks
    final = model.exit_logits(x[:, 0], L - 1)  # (B, V)
    return torch.where((exit_layer < L - 1)[:, None], emitted, final), exit_layer, n_checks

@dataclass
class Generation:
    tokens: torch.Tensor  # (B, T0 + N): prompt and generated tokens
    exited_at: torch.Tensor  # (B, N): the layer each new token left at
    logits: torch.Tensor  # (B, N, V) emitted logits when teacher-forced, else None
    layers_run: int  # block runs per row over all decode steps, catch-up included, prefill excluded
    prefill_runs: float = 0.0  # block runs per row spent re-prefilling the window at full depth
    clock: list = None  # (seconds, row 0's length) at the start and after each step
    exit_checks: int = 0  # exit checks run (a head, a confidence, a host sync), over all steps
    cache_bytes: float = 0.0  # bytes of keys and values held for one row, at the window's length

def tick(device, length):
    """A clock entry of a Generation: (seconds, row 0's length) once the device is done."""
    synchronize(device)
    return time.perf_counter(), length

@torch.inference_mode()
def generate(model, idx, max_new_tokens, strategy=Backfill, exit_threshold=1.0, checked_exits=None,
             measure="top1", temperature=1.0, top_k=0, generator=None, forced=None):
    """Decode max_new_tokens after idx (B, T0) with the KV cache; forced (B, N) teacher-forces them.
    strategy makes a fresh KV strategy for this generation (one may keep state: deferred's parked
    states)."""
    cfg, (B, T0) = model.config, idx.shape
    checked_exits = range(cfg.n_layer - 1) if checked_exits is None else checked_exits
    kv = strategy()  # this generation's KV strategy
    tokens = F.pad(idx, (0, max_new_tokens))  # (B, T0 + N): the prompt, then room for the rest
    exits, emitted, prefilled, checks = idx.new_zeros(B, max_new_tokens), [], 0, 0
    cache, start = KVCache(cfg, B, idx.device), None
    clock = [tick(idx.device, T0)]
    for i in range(max_new_tokens):
        n = T0 + i
        start, runs = slide_window(model, cache, tokens, start, n)
        prefilled += runs
        logits, exits[:, i], ran = decode_step(model, cache, tokens[:, n - 1 : n], n - 1 - start,
                                               kv, kv.exit_threshold(exit_threshold),
                                               checked_exits, measure)
        kv.emitted(logits, exits[:, i])
        checks += ran
        if forced is not None:
            tokens[:, n] = forced[:, i]
            emitted.append(logits.float())
        else:
            tokens[:, n] = sample(logits, temperature, top_k, generator)
        clock.append(tick(idx.device, n + 1))
    logits = torch.stack(emitted, dim=1) if emitted else None
    return Generation(tokens, exits, logits, sum(cache.layer_evals) - prefilled, prefilled, clock,
                      checks, (cache.k.nbytes + cache.v.nbytes) / B)

# -----------------------------------------------------------------------------
# Exit statistics: where the tokens left, as Part I prints them

def format_exit_stats(counts):
    """Part I's per-layer lines, 'Layer 0:   42 tokens (21.0%)', with a bar each."""
    total, last = sum(counts), len(counts) - 1
    names = [f"Layer {l}:" for l in range(last)] + [f"Layer {last} (full):"]
    lines = [f"{name:<16}{c:>6} tokens ({100 * c / total:5.1f}%) {'#' * round(30 * c / total)}"
             for name, c in zip(names, counts)]
    mean = sum((l + 1) * c for l, c in enumerate(counts)) / total
    lines.append(f"mean exit depth: {mean:.2f} of {len(counts)} layers per token")
    return "\n".join(lines)

# -----------------------------------------------------------------------------
# Training: AdamW, warmup then cosine decay, the joint loss

def synchronize(device):
    """Wait for queued kernels, so a timer reads finished work (CUDA and MPS return at once)."""
    kind = torch.device(device).type
    if kind in ("cuda", "mps"):
        getattr(torch, kind).synchronize()  # torch.cuda or torch.mps

def autocast_context(device):
    """bf16 autocast for training and evaluation on CUDA; plain fp32 elsewhere and in decoding."""
    if str(device).startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()

def get_lr(it, config):
    if it < config.warmup_iters:
        return config.learning_rate * (it + 1) / config.warmup_iters
    # warmup_iters <= it < max_iters here, so the ratio runs over [0, 1)
    ratio = (it - config.warmup_iters) / (config.max_iters - config.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return config.min_lr + coeff * (config.learning_rate - config.min_lr)

def configure_optimizer(model, config):
    """AdamW with weight decay on matrices only, as nanoGPT does; fused: a parameter group stepped
    in one kernel call (torch 2.5 has it on the CPU, CUDA and MPS)."""
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2],
               "weight_decay": config.weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.beta1, config.beta2),
                             fused=True)

@torch.inference_mode()
def estimate_loss(model, splits, config, device):
    """Mean loss of every exit (the final one last) on eval_iters fixed batches per split."""
    was_training, out = model.training, {}
    model.eval()
    for name in ("train", "val"):
        gen = torch.Generator().manual_seed(config.seed + 1)  # the same batches at every evaluation
        losses = torch.zeros(config.n_layer)
        for _ in range(config.eval_iters):
            x, y = get_batch(splits[name], config.block_size, config.batch_size, gen, device)
            with autocast_context(device):
                logits = model.all_exit_logits(x)  # (L, B, T, V)
            losses += torch.stack([cross_entropy(lg, y) for lg in logits]).cpu()
        out[name] = (losses / config.eval_iters).tolist()
    model.train(was_training)  # back to the mode it came in (evaluation ran without dropout)
    return out

def format_eval(it, losses):
    """An evaluation's line; a val loss that is not finite stops the run: training diverged."""
    if not math.isfinite(losses["val"][-1]):
        raise ValueError(f"training diverged: val loss {losses['val'][-1]} at step {it}; lower "
                         "--learning_rate")
    return (f"step {it}: train loss {losses['train'][-1]:.4f}, val loss {losses['val'][-1]:.4f} | "
            f"val loss per exit: {' '.join(f'{l:.3f}' for l in losses['val'][:-1])}")

def train_step(model, optimizer, x, y, config):
    with autocast_context(x.device):
        _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if config.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    return loss

def train(model, optimizer, splits, config, device, start_iter=0, generator=None, on_step=None,
          step_model=None, evaluate=True):
    """The training loop, evaluating every eval_interval steps: (seconds, median ms per step, log).

    Part II's hooks: generator draws the batches (a resumed run's); on_step(it, log) runs before
    every step (checkpoints, Ctrl-C); step_model takes the steps (compiled); evaluate=False trains
    silently (the other models)."""
    generator = generator or torch.Generator().manual_seed(config.seed)
    step_model = step_model or model
    t_start, step_ms, log = time.time(), [], []
    # a log (stdout or stderr not a terminal) gets the evaluation lines and no progress bar
    with tqdm(range(start_iter, config.max_iters), initial=start_iter, total=config.max_iters,
              disable=not (evaluate and sys.stdout.isatty() and sys.stderr.isatty()),
              desc="training") as progress:
        for it in progress:
            if evaluate and it % config.eval_interval == 0 and it > start_iter:
                losses = estimate_loss(model, splits, config, device)
                tqdm.write(format_eval(it, losses))
                log.append({"iter": it, "val_loss": losses["val"][-1]})
            if on_step:
                on_step(it, log)
            for group in optimizer.param_groups:
                group["lr"] = get_lr(it, config)
            t0 = time.time()
            x, y = get_batch(splits["train"], config.block_size, config.batch_size, generator,
                             device)
            loss = train_step(step_model, optimizer, x, y, config)
            synchronize(device)
            step_ms.append(1000 * (time.time() - t0))
            if it % 10 == 0:  # .item() waits for the device, so read the loss only now and then
                log.append({"iter": it, "loss": loss.item()})
                progress.set_postfix_str(f"joint loss {log[-1]['loss']:.3f} | {step_ms[-1]:.0f} ms",
                                         refresh=False)
    return time.time() - t_start, float(np.median(step_ms)) if step_ms else 0.0, log

# -----------------------------------------------------------------------------
# The lesson's run: data, a trained model, two samples, and where the tokens left

def train_new_model(config, splits, device, evaluate=True):
    """A new model trained for max_iters steps: (the model, its losses, seconds). evaluate=False
    trains and evaluates silently (Part II's plain GPTs; its train_or_resume adds checkpoints)."""
    torch.manual_seed(config.seed)
    model = GPT(config).to(device)
    seconds = train(model, configure_optimizer(model, config), splits, config, device,
                    evaluate=evaluate)[0]
    losses = estimate_loss(model, splits, config, device)
    line = format_eval(config.max_iters, losses)  # a diverged model stops the run here
    if evaluate:
        print(line)
    return model.eval(), losses, seconds

def speed_note(samples, n_layer):
    """Why the early-exit sample ran faster or slower than full depth: the work it did per token."""
    (out, speed), (_, full) = samples["early-exit"], samples["full-depth"]
    N = out.exited_at.size(1)
    return (f"{speed / full:.2f}x full depth's speed: {out.layers_run / N:.2f} layer runs per "
            f"token (of {n_layer}), plus {out.exit_checks / N:.2f} exit checks (each a head, a "
            "softmax and a host sync)")

def show_samples(model, tokenizer, config, device, early_exit, label):
    """A full-depth and an early-exit sample from one prompt and seed, their speeds, and where the
    tokens left. early_exit(idx, n, generator=, temperature=, top_k=) -> Generation draws the second
    sample, and label names it. Returns the samples: name -> (Generation, tokens per second)."""
    idx = torch.tensor([tokenizer.encode(config.prompt)], device=device)  # (1, T0)
    print("\n=== What does early exit look like? Two samples from the same prompt and seed ===")
    samples = {}
    for name, how, decode in (("full-depth", "", partial(generate, model)),
                              ("early-exit", f": {label}", early_exit)):
        gen = torch.Generator(device=device).manual_seed(config.seed)
        t0 = time.perf_counter()
        out = decode(idx, config.max_new_tokens, generator=gen, temperature=config.temperature,
                     top_k=config.top_k)
        synchronize(device)
        samples[name] = out, config.max_new_tokens / (time.perf_counter() - t0)
        text = tokenizer.decode(out.tokens[0, idx.size(1) :].tolist())
        print(f"\n--- {name} sample{how} ({samples[name][1]:,.0f} tok/s) ---\n{text}")
    print(f"({speed_note(samples, config.n_layer)})")
    counts = torch.bincount(out.exited_at[0], minlength=config.n_layer).tolist()
    print("\nper-layer exit statistics:\n" + format_exit_stats(counts))
    return samples

def run_lesson(config, device):
    """Part I end to end: train, then a full-depth and an early-exit sample (backfill, the config's
    threshold), and where the tokens left. Returns the model and the samples."""
    tokenizer, splits = load_data(config)
    model = train_new_model(config, splits, device)[0]
    early_exit = partial(generate, model, exit_threshold=config.exit_threshold,
                         measure=config.confidence_measure)
    label = f"backfill, {config.confidence_measure} > {config.exit_threshold:g}"
    return model, show_samples(model, tokenizer, config, device, early_exit, label)

# =============================================================================
# Part II: the ideas, one a section, each returning plain data and printing nothing

import copy
import itertools
from dataclasses import replace
from typing import NamedTuple

@dataclass
class LabConfig(Config):
    """The lab's settings on top of the lesson's; the command line takes every field of both as
    --name=value."""
    exit_threshold: float = -1.0  # -1 calibrates it on val (Learn then Test); [0, 1] is used as is
    # runs
    out_dir: str = "out"  # where ckpt.pt, report.json and report.html go
    init_from: str = "scratch"  # 'scratch' trains a new model, 'resume' continues out_dir/ckpt.pt
    device: str = "auto"  # 'auto' picks cuda, then cpu; mps only when named (--device=mps)
    compile: bool = False  # torch.compile the model for training (slow to start, faster on GPU)
    lesson_only: bool = False  # run Part I alone: its GPT, training, threshold (-1: 0.9), backfill
    sample_only: bool = False  # with --init_from=resume: samples and exit statistics; no training
    # the training recipe (the joint-loss recipe, Part I's: distill_weight 0, layer_dropout 0)
    distill_weight: float = 0.1  # self-distillation: weight of KL(final || exit), final detached
    distill_temperature: float = 1.0  # of distillation; higher matches more of the distribution
    layer_dropout: float = 0.2  # LayerSkip's p_max: training skips block l w.p. p_max 2^(l/(L-1))-1
    # decoders
    kv_strategy: str = "backfill"  # early-exit sample's decoder: a KV strategy or self_speculative
    exit_layers: str = "auto"  # exits checked: 'auto' (cost-aware; all in samples), 'all', '1,3'
    draft_exit: int = 0  # self-speculative: the last layer of the draft (its exit head drafts)
    num_draft: int = 8  # speculative: drafts a round (tables: the faster on val of it and /2)
    draft_layers: int = 1  # draft_model: the layers of the plain GPT trained in the run to draft
    # measurement
    quality_positions: int = 5000  # test positions teacher-forced per decoder, spread over test
    bench_prompts: int = 16  # timed workload: prompts evenly spaced in test (and in val)
    bench_prompt_len: int = 32  # characters per workload prompt
    bench_tokens: int = 50  # characters generated per prompt per timed run
    bench_repeats: int = 2  # timed passes per decoder, interleaved; their calls pooled, paired
    shift_path: str = "shift.txt"  # text of another kind, read at val's threshold ('' skips it)
    epsilon: float = 0.01  # calibration: tolerated disagreement with full depth; lower is cautious
    delta: float = 0.05  # calibration: allowed chance that the chosen threshold breaks epsilon
    sweep_positions: int = 20000  # val and test positions recorded for the sweep and calibration
    schedule_disagreement: float = 0.03  # SkipDecode: most disagreement with full depth it may cost
    adapt_credit: int = 15  # a moving threshold: disagreements over target before it moves
    adapt_horizon: int = 20000  # and the positions after which its disagreement is <= epsilon
    spot_share: float = 0.5  # of steps a watched decoder that skips layers runs at full depth
    # (of windows, for state copy and holes: a shadow runs them); chosen on val (docs/RESULTS.md)
    # studies beyond the default run
    depths: str = ""  # more plain GPTs (besides the draft model's and n_layer's): '', 'all', '2,3'
    continued: float = 0.0  # > 0: a plain GPT, then this share of steps with the recipe (a study)

# cautious first: 1.000, 0.999, ..., 0.951 (the learned rule's scores crowd there), 0.95, ..., 0.00
THRESHOLDS = (*(round(1 - i / 1000, 3) for i in range(50)),
              *(round(i / 100, 2) for i in range(95, -1, -1)))
MODES = ("greedy", "sampled")  # sampled draws with config.temperature and config.top_k

def average(t):
    """A tensor's mean as a float (a mask's: the share that is true); None if it is empty."""
    return t.float().mean().item() if t.numel() else None

# -----------------------------------------------------------------------------
# The training recipe: exits that agree with the final head (layer dropout, self-distillation)

def layer_dropout_prob(layer, config):
    """LayerSkip's rate for block `layer`: 0 at the bottom, rising exponentially to layer_dropout
    at the top."""
    return config.layer_dropout * (2 ** (layer / max(1, config.n_layer - 1)) - 1)

def distillation(logits, teacher_log_probs, temperature):
    """T^2 * KL(teacher || student) per position, the usual scaling so gradients match across T."""
    student = (logits.float() / temperature).log_softmax(-1)
    # batchmean over positions, not sequences: (B, T, V) -> (B * T, V)
    return temperature**2 * F.kl_div(student.flatten(0, -2), teacher_log_probs.flatten(0, -2),
                                     log_target=True, reduction="batchmean")

class RecipeGPT(GPT):
    """The lesson's GPT trained with a recipe of LabConfig: self-distillation toward the final head
    and LayerSkip's layer dropout. The joint-loss recipe (distill_weight 0, layer_dropout 0)
    computes exactly GPT's loss; the default (layer dropout 0.2, distillation 0.1) won a
    comparison of recipes that docs/RESULTS.md keeps, with those that lost: CALM's and LayerSkip's
    depth-weighted exit losses, one shared head, the final head at every exit."""
    def hidden_states(self, idx):
        """GPT's, with LayerSkip's layer dropout in training: each sequence skips block l with its
        rate."""
        x, states = self.embed(idx), []
        for l, block in enumerate(self.transformer.h):
            y = block(x)
            p = layer_dropout_prob(l, self.config)
            if self.training and p > 0:  # each sequence skips block l with probability p
                y = torch.where(torch.rand(len(x), 1, 1, device=x.device) >= p, y, x)
            x = y
            states.append(x)
        return states

    def joint_loss(self, states, logits, targets):
        """Part I's joint loss, plus KL toward the detached final head when distilling. Exits with
        nothing to learn (alpha = 0, no distillation) are not computed."""
        cfg = self.config
        if cfg.distill_weight == 0:  # the joint loss alone: Part I's
            return super().joint_loss(states, logits, targets)
        loss = cross_entropy(logits, targets)
        # the final head's distribution, detached: the exits chase it
        teacher = (logits.detach().float() / cfg.distill_temperature).log_softmax(-1)
        for l in range(cfg.n_layer - 1):
            exit_logits = self.exit_logits(states[l], l)
            loss = loss + cfg.alpha * cross_entropy(exit_logits, targets)
            loss = loss + cfg.distill_weight * distillation(exit_logits, teacher,
                                                            cfg.distill_temperature)
        return loss

def recipe_from(plain, config, splits, frozen=False):
    """A RecipeGPT from a trained plain GPT's weights, trained under config (its steps, its batch,
    its recipe, its seed's batches): the whole model, or (frozen) its exit heads alone. Returns
    (the model, seconds)."""
    device = splits["train"].device
    model = RecipeGPT(config).to(device)
    model.load_state_dict(plain.state_dict())
    model.requires_grad_(not frozen)
    model.exit_heads.requires_grad_(True)
    optimizer = configure_optimizer(model.exit_heads if frozen else model, config)
    seconds = train(model, optimizer, splits, config, device, evaluate=False)[0]
    return model.eval(), seconds

def frozen_exit_model(plain, config, splits):
    """Exit heads trained after, on a trained plain GPT's frozen trunk (EE-Tuning, arXiv:2402.00518;
    Kangaroo, arXiv:2404.18911): the heads learn from the targets (at alpha 1 where the run has no
    exit loss at all) and, distilling, from the final head, which nothing changes, so full depth's
    output is the plain GPT's bit for bit. No dropout: the heads read the states a decoder sees; the
    plain GPT's batch, for half its steps: heads on a trunk that stays put
    learn sooner (at 500 steps of 1,500 top-1 skipped 15.6% of test's layer runs at the guarantee,
    at 1,500 16.8%). Returns (the model, seconds)."""
    return recipe_from(plain, replace(config, dropout=0.0, layer_dropout=0.0, alpha=config.alpha or
                                      float(not config.distill_weight),
                                      max_iters=config.max_iters // 2), splits, frozen=True)

def continued_exit_model(config, splits):
    """LayerSkip's continual setting (arXiv:2404.16710) at the run's budget: a plain GPT of the exit
    model's shape for (1 - continued) of the steps, then the whole model with the recipe's exit
    losses for the rest, on a learning-rate schedule of its own (warmup, then decay). Returns (the
    model, its training in words)."""
    first = round(config.max_iters * (1 - config.continued))
    plain, _, trunk = train_plain_gpt(replace(config, max_iters=first), splits, config.n_layer)
    # batches of their own (seed + 1): the plain stage's seed would replay its first batches
    rest = replace(config, max_iters=config.max_iters - first, seed=config.seed + 1)
    model, seconds = recipe_from(plain, rest, splits)
    return model, (f"a plain GPT for {first} steps ({trunk:.0f} s), then the whole model with "
                   f"the recipe for {rest.max_iters} ({seconds:.0f} s)")

def count_params(model):
    """(base model, exit heads) parameter counts; unlike nanoGPT's, position embeddings are
    counted."""
    heads = sum(map(torch.numel, model.exit_heads.parameters()))
    return sum(map(torch.numel, model.parameters())) - heads, heads

# -----------------------------------------------------------------------------
# Deferred recompute: fill the holes later, in one chunk with the next token that needs them

class Deferred(Backfill):
    """An exit parks its state; the next token that needs a layer runs the parked positions and
    itself there as one causal chunk. Exact, like backfill, with the work postponed and batched."""
    parked = None  # (B, block_size, C): the state each position reached, for the layers it skipped

    def park(self, cache, x, pos):
        if self.parked is None:
            self.parked = x.new_zeros(len(x), cache.k.size(3), x.size(2))
        self.parked[:, pos] = x[:, 0]

    def run_layer(self, block, cache, layer, x, pos):
        n = cache.lengths[layer]
        if n == pos:  # nothing parked below this position
            return block(x, cache, layer)
        self.park(cache, x, pos)
        # (B, pos + 1 - n, C): the parked positions and this one, as one causal chunk
        self.parked[:, n : pos + 1] = block(self.parked[:, n : pos + 1], cache, layer)
        return self.parked[:, pos : pos + 1].clone()  # not a view: a rule reads it after the next

    def skip_layers(self, model, cache, x, pos, layer):
        self.park(cache, x, pos)  # the state the skipped layers will start from

# -----------------------------------------------------------------------------
# State copy (CALM): the skipped layers' keys and values computed from the exit state

def kv_projection(block):
    """A block's x -> (K, V) map with ln_1's gain and bias folded in: (2C, C) weight, (2C,) bias.

    K and V of a state x are W_kv (g * norm(x) + beta) + b_kv
    = (W_kv g) norm(x) + (W_kv beta + b_kv): one matrix per layer, applied to one shared norm(x)."""
    ln_1, c_attn = block.ln_1, block.attn.c_attn
    C = len(ln_1.weight)
    w = c_attn.weight[C:]  # (2C, C): the K and V rows of the fused projection
    # config.bias gives ln_1 and c_attn their biases together
    bias = w.new_zeros(2 * C) if ln_1.bias is None else w @ ln_1.bias + c_attn.bias[C:]
    return w * ln_1.weight, bias

def state_copy_projections(model):
    """Every layer's folded K/V projection, stacked: (L, 2C, C) and (L, 2C)."""
    return tuple(map(torch.stack, zip(*map(kv_projection, model.transformer.h))))

def write_state_copy(cache, first_layer, x, weight, bias):
    """CALM's state propagation: the K and V of layers first_layer.. computed from the exit state
    x (B, 1, C), written at the next position of a level cache. One batched matmul serves every
    skipped layer."""
    n = cache.lengths[first_layer]  # the J skipped layers' length
    assert set(cache.lengths[first_layer:]) == {n}, "state copy needs level skipped layers"
    xn = F.layer_norm(x[:, 0], x.shape[-1:])  # (B, C): the normalisation shared by every ln_1
    # (J, B, 2C): every skipped layer's K and V at once
    kv = xn @ weight[first_layer:].mT + bias[first_layer:, None]
    # (J, B, 2C) -> K and V, (J, B, nh, hs) each
    cache.k[first_layer:, :, :, n], cache.v[first_layer:, :, :, n] = kv.unflatten(
        -1, (2, cache.k.size(2), -1)).unbind(2)
    cache.lengths[first_layer:] = [n + 1] * (len(cache.lengths) - first_layer)

class StateCopy(Backfill):
    """Approximate: the skipped layers see the exit state where their own input would have been."""
    projections = None  # state_copy_projections(model), once per generation

    def skip_layers(self, model, cache, x, pos, layer):
        if self.projections is None:
            self.projections = state_copy_projections(model)
        write_state_copy(cache, layer + 1, x, *self.projections)

# -----------------------------------------------------------------------------
# Holes: the failure case, where the skipped layers write nothing

class Holes(Backfill):
    """Later tokens attend only to the entries that exist: skipped layers' caches have fewer."""
    def skip_layers(self, model, cache, x, pos, layer):
        pass

# -----------------------------------------------------------------------------
# SkipDecode: an exit layer fixed by window position, never rising, so no hole is ever read

class SkipDecode(Holes):
    """After SkipDecode (arXiv:2307.02628): the token at window position pos exits at layer
    schedule[pos], a depth that never rises along the window, so a later token never reads a layer
    an earlier one skipped: no hole is ever read, and a batch saves what a row saves. Its plan's
    checked_exits is that schedule, and its threshold 0: the scheduled exit always fires."""
    def exit_checks(self, pos, checked_exits):
        return [checked_exits[pos]]  # at the last layer: no check, full depth

def window_positions(n_positions, block_size):
    """(N,): the window position at which sequential decoding feeds the token predicting each
    position."""
    return torch.cat([torch.arange(first - start, end - start)
                      for start, end, first in decoder_windows(n_positions, block_size)])

def choose_schedule(records, n_layer, block_size, budget):
    """SkipDecode's plan, chosen on val: the schedule saving the most within `budget` disagreement
    with full depth, full depth before window position a and exit layer e from there on (a, e on
    a grid)."""
    last = n_layer - 1
    wpos = window_positions(len(records.targets), block_size).to(records.pred.device)
    best = {"checked_exits": [last] * block_size, "compute_saved": 0.0, "disagreement": 0.0,
            "label": "-"}
    for a in range(0, block_size, max(1, block_size // 16)):
        for e in range(last):
            figures = exit_summary(records, torch.where(wpos >= a, e, last))
            if (figures["disagreement"] <= budget
                    and figures["compute_saved"] > best["compute_saved"]):
                best = {"checked_exits": [last] * a + [e] * (block_size - a), "from_position": a,
                        "exit_layer": e, "compute_saved": figures["compute_saved"],
                        "disagreement": figures["disagreement"], "label": f"{e} from {a}"}
    return best | {"measure": "top1", "threshold": 0.0}

# -----------------------------------------------------------------------------
# Speculative decoding: early layers draft (LayerSkip) or a small model; one decoder, any batch

class RowKVCache(KVCache):
    """The KV cache with a length per row, for a batch whose rows accept different numbers of
    drafts, roll back and slide their windows on their own.

    A round starts with every layer of row b holding its window positions [0, pos[b]); each block
    call of the round appends the same number of positions T to every row, at the row's own slots
    from pos[b] + fed, where fed counts what this round already gave that layer. Rolling a row back
    is starting its next round at a smaller pos: the entries past it are stale, masked, then
    overwritten. Attention reads the slots any row has filled by then (the width W), through one
    mask. Made with a block_size num_draft larger: those spare slots take the drafts of rows with
    less room than others, and are always rolled back."""
    counted = 0.0  # block runs per row of the batch, by the calls before the last keep_rows

    def start_round(self, pos, furthest):
        """A round begins at each row's window position pos (B,); furthest = max(pos), read once."""
        self.pos, self.furthest = pos, furthest
        self.fed = [0] * len(self.lengths)  # positions appended this round, per layer
        self.layouts = {}  # (fed, T) -> its layout: the block calls of a round share a few

    def layout(self, fed, k):
        """Where new entries k (B, nh, T, hs) of every row go after `fed` this round: (slots (B, T),
        the index append writes them with, the mask of what each query may see, W). One row's
        slots are the last T of its W: a single query needs no mask, a chunk a causal one (and
        append writes a slice, no index)."""
        T = k.size(2)
        width = self.furthest + fed + T
        slots = self.pos[:, None] + fed + torch.arange(T, device=self.pos.device)  # (B, T)
        if slots.numel() == 1:  # one query of one row sees every slot: no mask
            return slots, None, None, width
        seen = torch.arange(width, device=slots.device) <= slots[:, :, None]  # (B, T, W)
        if len(slots) == 1:  # a chunk of one row: a causal mask, (T, W)
            return slots, None, seen[0], width
        mask = torch.where(seen, 0.0, float("-inf"))[:, None]  # (B, 1, T, W)
        # one entry a row: its scatter index (B, nh, 1, hs); a chunk: the rows to index, (B, 1)
        index = (slots[:, None, :, None].expand_as(k) if T == 1
                 else torch.arange(len(slots), device=slots.device)[:, None])
        return slots, index, mask, width

    def __init__(self, config, batch_size, device):
        super().__init__(config, batch_size, device)
        self.batch_size = batch_size
        self.row_bytes = (self.k.nbytes + self.v.nbytes) / batch_size  # a row's keys and values

    def block_runs(self):
        """Block runs per row of the batch: each call counts at the share of the rows it ran."""
        return self.counted + sum(self.layer_evals) * self.k.size(1) / self.batch_size

    def keep_rows(self, keep):
        """Drop the rows of a batch that are done: keep (B,) bool; the rest become rows 0..R-1."""
        self.counted, self.layer_evals = self.block_runs(), [0] * len(self.layer_evals)
        self.k, self.v = self.k[:, keep], self.v[:, keep]

    def append(self, layer, k, v):
        """Write k, v (B, nh, T, hs) at each row's slots; return the first W slots and the mask."""
        fed, T = self.fed[layer], k.size(2)
        if (fed, T) not in self.layouts:
            self.layouts[fed, T] = self.layout(fed, k)
        slots, index, mask, width = self.layouts[fed, T]
        self.fed[layer] += T
        for buffer, new in ((self.k, k), (self.v, v)):
            if index is None:  # one row: its T new entries are the last T of its W slots
                buffer[layer, :, :, width - T : width] = new
            elif T == 1:  # (B, nh, 1, hs): each row's new entry at its own slot
                buffer[layer].scatter_(2, index, new)
            else:  # a chunk: indexing writes it faster than scatter
                buffer[layer][index, :, slots] = new.transpose(1, 2)  # (B, T, nh, hs)
        return self.k[layer, :, :, :width], self.v[layer, :, :, :width], mask

def prefill_rows(model, cache, tokens, rows, starts, n):
    """Re-prefill the windows of `rows`, each tokens[b, starts[b] : n[b] - 1], at full depth (equal
    lengths). Returns the block runs per row; they are not counted in cache.layer_evals."""
    m = int((n - 1 - starts)[rows[0]])  # the rows' window length
    idx = tokens[rows[:, None], starts[rows, None] + torch.arange(m, device=tokens.device)]
    # a plain cache for just these rows (no per-row mask: they are level), then copied into place
    level = KVCache(replace(model.config, block_size=m), len(rows), tokens.device)
    prefill(model, level, idx, 0)
    cache.k[:, rows, :, :m] = level.k
    cache.v[:, rows, :, :m] = level.v
    return m * model.config.n_layer

def slide_rows(models, tokens, starts, n, block_size):
    """Each row slides its window by window_start's rule; rows that moved re-prefill together,
    grouped by window length, in each (model, cache) of models. Returns the block runs summed over
    rows."""
    if not (n - starts > block_size).any():  # a host sync; most rounds: no row moves
        return 0
    moved = {}  # window length -> the rows that moved to a window of that length
    for b, (start, length) in enumerate(zip(starts.tolist(), n.tolist())):
        s = window_start(None if start < 0 else start, length, block_size)
        if s != start:
            starts[b] = s
            moved.setdefault(length - 1 - s, []).append(b)
    return sum(len(group) * prefill_rows(model, cache, tokens, torch.tensor(group, device=n.device),
                                         starts, n)
               for group in moved.values() for model, cache in models)

def draft(model, cache, token, slots, draft_exit, temperature, top_k, generator):
    """Every row drafts with layers 0..draft_exit, one token at each of its window positions slots
    (B, k), the first after its last token, token (B,). Returns the draft logits (B, k, V), the
    drafts (B, k) and their states (B, k, C), which the verify pass takes up from."""
    steps = []
    for wpe_j in model.transformer.wpe(slots).unbind(1):  # (B, k, C) -> k x (B, C)
        x = (model.transformer.wte(token) + wpe_j)[:, None]  # (B, 1, C); never dropped out
        for l in range(draft_exit + 1):
            x = model.transformer.h[l](x, cache, l)
        h = x[:, 0]  # (B, C): the draft's state
        logits = model.exit_logits(h, draft_exit)  # (B, V)
        token = sample(logits, temperature, top_k, generator)
        steps.append((logits, token, h))
    # k x ((B, V), (B,), (B, C)) -> the logits (B, k, V), the drafts (B, k), the states (B, k, C)
    return tuple(torch.stack(t, dim=1) for t in zip(*steps))

def speculative_accept(drafts, q, p, room, temperature, generator):
    """How many drafts each row keeps (at most room[b]), and the full model's token after them.

    Greedy (q, p logits): keep the longest prefix that matches the full model's argmax, then take
    the full model's choice. Sampled (q, p probabilities): keep draft d with probability
    min(1, p(d) / q(d)); at the first rejection draw from max(p - q, 0), renormalised. Either way
    each emitted token has exactly the full model's distribution (speculative sampling: Leviathan
    et al. 2023, Chen et al. 2023). drafts (B, k), q, p (B, k, V), room (B,): how many drafts each
    row may keep. Returns (accepted (B,), next token (B,), has_next (B,)): has_next is false where
    a row kept all it could."""
    B, k = drafts.shape
    rows = torch.arange(B, device=drafts.device)
    if temperature == 0:
        target = p.argmax(-1)  # (B, k)
        keep = target == drafts
    else:
        ratio = (p / q).gather(-1, drafts[..., None])[..., 0]  # (B, k): p(d) / q(d), q(d) > 0
        keep = torch.rand(B, k, generator=generator, device=drafts.device) < ratio
    keep &= torch.arange(k, device=drafts.device) < room[:, None]  # (B, k)
    accepted = keep.long().cumprod(1).sum(1)  # (B,)
    has_next = accepted < room
    at = accepted.clamp(max=k - 1)
    if temperature == 0:
        return accepted, target[rows, at], has_next
    if not has_next.any():  # (a host sync) no row rejected: nothing to draw
        return accepted, drafts[:, -1], has_next
    # + 1 on rows without a rejection: their draw is unused, but must not divide by zero
    residual = (p - q)[rows, at].clamp_min(0) + (~has_next)[:, None]
    return accepted, draw(residual / residual.sum(-1, keepdim=True), generator), has_next

def speculative_round(models, tokens, exited, n, pos, room, draft_exit, temperature, top_k,
                      generator):
    """One round of every row: draft up to room[b] tokens from window position pos[b], verify them
    in one pass, keep each row's accepted prefix, write the full model's token after it, and mark
    in exited the layer each of the round's tokens left at. models: (the model, its cache), then a
    draft model's, if any. Returns (accepted (B,), each row's new length (B,))."""
    (model, cache), (drafter, draft_cache) = models[0], models[-1]
    L = model.config.n_layer
    k, furthest = torch.stack((room.max(), pos.max())).tolist()  # one read of the device a round
    for _, c in models:
        c.start_round(pos, furthest)
    steps = torch.arange(k, device=n.device)
    at = n[:, None] + steps  # (B, k): where the drafts go in tokens
    # (B, k): their window positions; a row with less room than k drafts on at the last position,
    # in spare slots; those drafts are never kept
    slots = (pos[:, None] + steps).clamp(max=model.config.block_size - 1)
    last = tokens.gather(1, at - 1)[:, 0]  # (B,): each row's last token, before its first draft
    q, drafts, x = draft(drafter, draft_cache, last, slots, draft_exit, temperature, top_k,
                         generator)
    tokens.scatter_(1, at, drafts)
    first = draft_exit + 1
    if drafter is not model:  # a draft model: the model verifies from its own embedding
        fed = tokens.gather(1, at - 1)  # (B, k): the last token, the drafts but one
        x, first = model.transformer.wte(fed) + model.transformer.wpe(slots), 0
    for l in range(first, L):  # verify: the layers above the draft, once over every draft
        x = model.transformer.h[l](x, cache, l)
    p = model.exit_logits(x, L - 1)  # (B, k, V)
    if temperature > 0:
        q = probs_from_logits(q, temperature, top_k)
        p = probs_from_logits(p, temperature, top_k)
    accepted, nxt, has_next = speculative_accept(drafts, q, p, room, temperature, generator)
    # a row that kept all it could writes a slot its next round overwrites
    tokens[torch.arange(len(n), device=n.device), n + accepted] = nxt
    # kept drafts left at the draft's exit, the full model's token at the top (later rounds
    # overwrite the marks past it)
    marks = torch.where(steps < accepted[:, None], draft_exit, L - 1)  # (B, k)
    exited.scatter_(1, at, marks)
    # back past a rejected draft: the row's cache rolls back, its next round starts there
    return accepted, n + accepted + has_next

def leave(keep, rows, models):
    """Only the rows still decoding (keep (R,) bool) stay in the batch: rows' tensors and every
    cache keep those."""
    for _, cache in models:
        cache.keep_rows(keep)
    return [t[keep] for t in rows]

@dataclass
class SpeculativeGeneration(Generation):
    stats: dict = None  # rounds (verify passes), drafted (keepable drafts), accepted, num_draft

@torch.inference_mode()
def generate_speculative(model, idx, max_new_tokens, draft_exit=0, num_draft=8, temperature=0.0,
                         top_k=0, generator=None, draft_model=None):
    """Speculative decoding of B rows: each round a row drafts up to num_draft tokens (layers
    0..draft_exit, or draft_model, cache and all), the layers above (after a draft model, all)
    verify them in one pass, and the row keeps its accepted prefix, rolls back, slides, and leaves
    when done. Tokens: full depth's (greedy), or its distribution (sampled)."""
    cfg, (B, T0), dev = model.config, idx.shape, idx.device
    if num_draft < 1 or draft_model is None and not 0 <= draft_exit < cfg.n_layer - 1:
        raise ValueError(f"need 0 <= draft_exit < {cfg.n_layer - 1} and num_draft >= 1, "
                         f"got draft_exit={draft_exit}, num_draft={num_draft}")
    draft_exit = draft_exit if draft_model is None else draft_model.config.n_layer - 1
    end = T0 + max_new_tokens
    tokens = F.pad(idx, (0, max_new_tokens + num_draft))  # zeros: room for the tokens and drafts
    exited = torch.full_like(tokens, cfg.n_layer - 1)  # exit layers (kept drafts: the draft's last)
    out_tokens, out_exited = tokens.clone(), exited.clone()  # each row's, once it is done
    models = [(m, RowKVCache(replace(m.config, block_size=cfg.block_size + num_draft), B, dev))
              for m in dict.fromkeys([model, draft_model or model])]  # the model's, a drafter's
    ids, drafted, kept, prefilled = torch.arange(B, device=dev), 0, 0, 0.0
    n = torch.full_like(ids, T0)  # (R,) each row's length
    starts = -n - cfg.block_size  # (R,) each row's window start (none yet: far back, negative)
    clock = [tick(dev, T0)]  # then one a round
    while max_new_tokens > 0 and len(ids):  # ids (R,): the rows still in the batch
        prefilled += slide_rows(models, tokens, starts, n, cfg.block_size) / B
        pos = n - 1 - starts  # (R,) window position of each row's first token fed this round
        # (R,) how many drafts each row may keep: none past end, no position past block_size
        room = torch.minimum(end - n, cfg.block_size - pos).clamp(max=num_draft)
        accepted, n = speculative_round(models, tokens, exited, n, pos, room, draft_exit,
                                        temperature, top_k, generator)
        drafted += room.sum()
        kept += accepted.sum()
        clock.append(tick(dev, int(n[0])))  # row 0's length (never past end): the tail at batch 1
        done = n >= end  # rows that are done leave: the next rounds run on the rest only
        if done.any():  # a host sync
            out_tokens[ids[done]], out_exited[ids[done]] = tokens[done], exited[done]
            tokens, exited, n, starts, ids = leave(~done, (tokens, exited, n, starts, ids), models)
    return SpeculativeGeneration(out_tokens[:, :end], out_exited[:, T0:end], None,
                                 sum(c.block_runs() for _, c in models), prefilled, clock,
                                 cache_bytes=sum(c.row_bytes for _, c in models),  # a drafter's too
                                 stats=dict(rounds=len(clock) - 1, drafted=int(drafted),
                                            accepted=int(kept), num_draft=num_draft))

def spec_stats(outputs, full_outputs, mode):
    """Acceptance (drafts kept over drafts a row could keep), tokens per verify pass, the draft
    that ran, and (greedy) whether every row's output equals full depth's. Outputs of full depth
    count no drafts."""
    runs = [o.stats for o in outputs if isinstance(o, SpeculativeGeneration)]
    same = {"identical_to_full": all(torch.equal(a.tokens, b.tokens) for a, b in zip(
        outputs, full_outputs)) if mode == "greedy" else None}  # sampled: tested, not compared
    if not runs:
        return same
    rounds, drafted, accepted = (sum(s[k] for s in runs) for k in "rounds drafted accepted".split())
    return {"acceptance_rate": accepted / drafted, "rounds": rounds,
            "tokens_per_verify": sum(o.exited_at.numel() for o in outputs) / rounds,
            "num_draft": runs[0]["num_draft"]} | same

# -----------------------------------------------------------------------------
# The exit rules: how sure an exit is, five ways beyond top-1, and a rule learned from data

def margin(probs, state):
    """Top-1 minus top-2 probability: (..., V) -> (...)."""
    top2 = probs.topk(2).values  # (..., 2)
    return top2[..., 0] - top2[..., 1]

def normalised_entropy(probs, state):
    """1 - H / log V: 1 for a one-hot distribution, 0 for a uniform one. (..., V) -> (...)."""
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
    return 1.0 - entropy / math.log(probs.size(-1))

def patience(probs, state):
    """PABEE's patience: 1 - 2^-run, where the exits so far agree on the top-1 run times in a row;
    above 1 - 2^-(k-1) means at least k agree (exact in floating point). It keeps the top-1 and
    the run in the state."""
    pred = probs.argmax(-1)
    run = 1 + state.get("run", 0) * (pred == state.get("pred", -1))
    state.update(pred=pred, run=run)
    return 1 - 0.5 ** run.float()

def saturation(probs, state):
    """CALM's hidden-state saturation: the cosine between the layer's output and its input."""
    return F.cosine_similarity(state["h"], state["below"], dim=-1).clamp(max=1.0)

# the lab's rules: Part I's, and four more (a dict of its own: Part I's is left as it is)
EXIT_RULES = CONFIDENCE_MEASURES | {"margin": margin, "entropy": normalised_entropy,
                                    "patience": patience, "saturation": saturation}

def exit_features(probs, state):
    """The learned rule's features (..., F): four rules' confidences, agreement with the exit
    below, a bias, and which character this exit predicts (one-hot)."""
    pred = probs.argmax(-1)
    agree = (pred == state.get("pred", -1)).float()
    state["pred"] = pred
    cheap = [EXIT_RULES[m](probs, state) for m in "top1 margin entropy saturation".split()]
    one_hot = F.one_hot(pred, probs.size(-1)).to(probs.dtype)
    return torch.cat([torch.stack([*cheap, agree, torch.ones_like(agree)], -1), one_hot], -1)

def learned(weights, probs, state):
    """The learned rule: per exit, a logistic model's P(this exit's top-1 is full depth's)."""
    return torch.sigmoid(exit_features(probs, state) @ weights[state["layer"]])

def exit_rules(weights=None):
    """name -> rule: EXIT_RULES, and the learned rule with its weights (L, F) when given them."""
    return EXIT_RULES | ({} if weights is None else {"learned": partial(learned, weights)})

# -----------------------------------------------------------------------------
# Recording, the sweep, calibration and the oracle: every exit read once, then no model needed

@dataclass
class ExitRecords:
    """What every exit says at each position of a text, read in the decoder's own windows."""
    confidences: dict  # rule -> (L, N): how sure each exit is, by that rule
    pred: torch.Tensor  # (L, N): each exit's top prediction
    nll: torch.Tensor  # (L, N): -log p(true next character) at each exit
    targets: torch.Tensor  # (N,): the true next characters

def decoder_windows(n_positions, block_size):
    """Yields (start, end, first) of each window sequential decoding uses to predict positions
    first..end-1."""
    start, i = None, 0
    while i < n_positions:
        start = window_start(start, i + 1, block_size)
        end = min(start + block_size, n_positions)
        yield start, end, i
        i = end

def read_exits(model, x, rules):
    """Every exit's logits on x (b, W): (L, b, W, V), then each rule's confidences (L, b, W) in the
    order of rules, each rule reading the exits bottom up with a state of its own, as decode_step
    does when it checks every exit (patience and the learned rule read the exit below: they need
    them all)."""
    states = [model.embed(x), *model.hidden_states(x)]  # L + 1 x (b, W, C)
    logits = torch.stack([model.exit_logits(h, l) for l, h in enumerate(states[1:])]).float()
    probs, read = logits.softmax(-1), [logits]  # what confidence() gives a rule, once for them all
    for rule in rules.values():
        state, confidences = {}, []
        for l, layer_probs in enumerate(probs):
            state.update(layer=l, below=states[l], h=states[l + 1])
            confidences.append(rule(layer_probs, state))
        read.append(torch.stack(confidences))
    return read

@torch.inference_mode()
def record_exits(model, data, n_positions, rules, batch_size=64):
    """One parallel pass: what every exit predicts for data[1 : n_positions + 1], and how sure it
    is by each rule.

    The windows are exactly those of sequential decoding fed data[0], data[1], ...
    (window_start), so a decoder that keeps its cache exact (backfill, deferred) makes exactly
    these predictions; that is tested. Windows of equal length run together, batch_size at a
    time."""
    n_positions = min(n_positions, len(data) - 1)
    # every window is block_size long but perhaps the last: run the others batch_size at a time
    *full, last = decoder_windows(n_positions, model.config.block_size)
    parts = []
    for group in [full[b : b + batch_size] for b in range(0, len(full), batch_size)] + [[last]]:
        x = torch.stack([data[s:e] for s, e, _ in group])  # (b, W)
        read = read_exits(model, x, rules)  # logits (L, b, W, V), then (L, b, W) per rule
        parts += [[t[:, r, first - s :] for t in read] for r, (s, _, first) in enumerate(group)]
    logits, *confidences = [torch.cat(p, dim=1) for p in zip(*parts)]  # (L, N, V), (L, N) each
    targets = data[1 : n_positions + 1]  # on the model's device, as the windows were
    nll = -logits.log_softmax(-1).take_along_dim(targets[None, :, None], -1)[..., 0]  # (L, N)
    return ExitRecords(dict(zip(rules, confidences)), logits.argmax(-1), nll, targets)

def fit_exit_predictor(model, data, n_positions):
    """The learned rule's weights (L, F): per exit, a logistic model of whether its top-1 is full
    depth's, fitted by Newton's method on the exits recorded on data (the train split). The last
    exit's row is 0: it always exits."""
    records = record_exits(model, data, n_positions, {"features": exit_features})
    X = records.confidences["features"][:-1].cpu().double()  # (L - 1, N, F); MPS has no float64
    # (L - 1, N, 1): whether each exit's top-1 is full depth's
    y = (records.pred[:-1] == records.pred[-1]).cpu().double()[..., None]
    n_exits, _, n_features = X.shape
    w = X.new_zeros(n_exits, n_features, 1)  # (L - 1, F, 1)
    ridge = 0.01 * torch.eye(n_features, dtype=X.dtype)  # a weak L2 penalty, 0.01 |w|^2 / 2
    for _ in range(20):  # Newton's steps; a logistic fit settles in fewer
        p = torch.sigmoid(X @ w)  # (L - 1, N, 1)
        grad = X.mT @ (p - y) + ridge @ w  # (L - 1, F, 1)
        hess = X.mT @ (X * (p * (1 - p))) + ridge  # (L - 1, F, F)
        w -= torch.linalg.solve(hess, grad)
    return F.pad(w[..., 0], (0, 0, 0, 1)).float().to(records.pred.device)

def fit_on_pieces(model, train, n_positions, pieces=10):
    """The learned rule's weights, fitted on `pieces` pieces from across train that never overlap,
    n_positions in all (one play alone fits it worse)."""
    step = len(train) // pieces
    n = min(n_positions // pieces, step - 1)
    return fit_exit_predictor(model, train.unfold(0, n + 1, step)[:pieces].flatten(), pieces * n)

def first_exit(leaves, checked_exits):
    """(N,): the layer each position exits at: the first checked exit where leaves (L, N) is true,
    else the last."""
    layers = torch.tensor([*checked_exits, len(leaves) - 1], device=leaves.device)
    hit = leaves[layers]  # (E + 1, N)
    hit[-1] = True  # the last layer always exits
    return layers[hit.float().argmax(0)]  # the first exit that may leave

def exits_at_threshold(records, measure, threshold, checked_exits):
    """(N,): the first checked exit above threshold, else the last. A confidence never exceeds 1,
    so at a threshold of 1 every position goes full depth."""
    return first_exit(records.confidences[measure] > threshold, checked_exits)

def exit_summary(records, exits):
    """Quality and compute of emitting each position from its exit layer."""
    L, N = records.pred.shape
    cols = torch.arange(N, device=exits.device)
    pred, nll = records.pred[exits, cols], records.nll[exits, cols]  # (N,) each, at each exit
    mean_layers = average(exits + 1)
    return {
        "exit_fractions": (torch.bincount(exits, minlength=L) / N).tolist(),
        "mean_layers": mean_layers,
        "compute_saved": 1.0 - mean_layers / L,
        "loss": average(nll),
        "full_loss": average(records.nll[-1]),  # full depth's
        "accuracy": average(pred == records.targets),
        "disagreement": average(pred != records.pred[-1]),
    }

def sweep(records, measure, checked_exits):
    """One entry per threshold: where positions exit, compute saved, loss and disagreement with
    full depth."""
    return [{"threshold": t,
             **exit_summary(records, exits_at_threshold(records, measure, t, checked_exits))}
            for t in THRESHOLDS]

def binomial_tail(k, n, epsilon):
    """P(Binomial(n, epsilon) <= k): the p-value of 'risk > epsilon' after k failures in n
    trials."""
    i = torch.arange(k + 1, dtype=torch.float64)
    log_pmf = (math.lgamma(n + 1) - torch.lgamma(i + 1) - torch.lgamma(n - i + 1)
               + i * math.log(epsilon) + (n - i) * math.log1p(-epsilon))
    return float(torch.logsumexp(log_pmf, 0).exp())

def fixed_sequence_test(failures, n, epsilon, delta):
    """Learn then Test with fixed-sequence testing (CALM, arXiv:2207.07061, section 4).

    failures[i] is the number of the n calibration positions that disagree with full depth at the
    i-th threshold, ordered most cautious first. Test H0: 'risk > epsilon' at each threshold in
    that order with the exact binomial p-value; stop at the first that is not rejected at level
    delta. Returns the index of the last rejected one (-1: none, so full depth). Because the order
    is fixed in advance, the chance that the returned threshold's true risk exceeds epsilon is at
    most delta (for i.i.d. positions)."""
    chosen = -1
    for i, k in enumerate(failures):
        if binomial_tail(k, n, epsilon) > delta:
            break
        chosen = i
    return chosen

def calibrate(records, measure, checked_exits, epsilon, delta):
    """The threshold fixed-sequence testing certifies: walking THRESHOLDS from cautious (1.0)
    down, the last one before the first whose disagreement with full depth is not certified below
    epsilon; 1.0 if none is."""
    disagree = records.pred != records.pred[-1]  # (L, N): each exit against full depth
    exits = [exits_at_threshold(records, measure, t, checked_exits) for t in THRESHOLDS]  # (N,)s
    failures = [int(disagree.gather(0, e[None]).sum()) for e in exits]  # counted exactly
    # THRESHOLDS[0] is 1.0: full depth when none is certified (the test returns -1)
    return THRESHOLDS[max(fixed_sequence_test(failures, disagree.size(1), epsilon, delta), 0)]

def oracle(records, checked_exits, epsilon):
    """The most any rule could skip at disagreement <= epsilon: each position leaves at the first
    checked exit whose top-1 is full depth's, and the epsilon * N that would run deepest leave at
    the first checked exit anyway, wrong but cheapest."""
    agree = records.pred == records.pred[-1]  # (L, N): the last row is all True
    deepest = first_exit(agree, checked_exits).float().topk(int(epsilon * agree.size(1))).indices
    agree[:, deepest] = True  # so they leave at the first checked exit
    return exit_summary(records, first_exit(agree, checked_exits))

def calibration_report(records, measure, checked_exits, epsilon, delta):
    """Calibrate on records["val"], then report the threshold's figures on every text recorded
    (test and the shifted text are never used to choose), whether epsilon held there, and test's
    saving as a share of the oracle's."""
    threshold = calibrate(records["val"], measure, checked_exits, epsilon, delta)
    report = {"measure": measure, "epsilon": epsilon, "delta": delta, "threshold": threshold}
    for name, split in records.items():
        figures = exit_summary(split, exits_at_threshold(split, measure, threshold, checked_exits))
        report[name] = figures | {"held": figures["disagreement"] <= epsilon}
    best = oracle(records["test"], checked_exits, epsilon)["compute_saved"]
    report["test"]["oracle_share"] = report["test"]["compute_saved"] / max(best, 1e-9)
    return report

def choose_rule(records, rules, checked_exits, epsilon, delta):
    """The rule chosen on val: each of `rules` calibrated at delta / len(rules) (Bonferroni), so the
    chance that any of them, and so the chosen one, breaks epsilon stays under delta; the one that
    saves the most on val wins. Its test figures are reported, never used to choose."""
    return max((calibration_report(records, m, checked_exits, epsilon, delta / len(rules))
                for m in rules), key=lambda r: r["val"]["compute_saved"])

def rule_table(records, calibrations, rules, config, model="joint"):
    """An exit model's rule table on test, every exit checked: each rule at its threshold
    calibrated on val, the rule chosen on val, the oracle; and the chosen rule's report."""
    checked = range(config.n_layer - 1)
    chosen = choose_rule(records, rules, checked, config.epsilon, config.delta)
    best = oracle(records["test"], checked, config.epsilon) | {"oracle_share": 1.0}
    rows = [*calibrations.values(), chosen | {"measure": f"{chosen['measure']}, chosen"},
            {"measure": "oracle", "test": best}]
    return [{"model": model, **row} for row in rows], chosen

def calibrate_exits(model, splits, config):
    """Fit the learned rule on train, read every exit of the other texts once, calibrate every
    rule on val (every exit checked) and choose SkipDecode's schedule there: (records,
    calibrations, what sampling needs: the learned rule's weights, each rule's threshold, the
    schedule)."""
    weights = fit_on_pieces(model, splits["train"], config.sweep_positions)
    rules = exit_rules(weights)
    records = {s: record_exits(model, text, config.sweep_positions, rules)
               for s, text in splits.items() if s != "train"}
    # every rule calibrated with every exit checked
    calibrations = {m: calibration_report(records, m, range(config.n_layer - 1), config.epsilon,
                                          config.delta) for m in rules}
    return records, calibrations, {"weights": weights, "schedule": choose_schedule(
        records["val"], config.n_layer, config.block_size, config.schedule_disagreement),
        "thresholds": {m: c["threshold"] for m, c in calibrations.items()}}

# -----------------------------------------------------------------------------
# A threshold that moves: Learn then Test certifies text like val. Given each position's label
# (full depth's top-1: backfill has it at once, the others from spot checks), a decoder can move
# its threshold when its disagreement runs high, and watch its rate with a bound valid at any token

class Monitor:
    """Adaptive conformal inference (Gibbs and Candes, arXiv:2106.00170) on THRESHOLDS' grid: a
    threshold that moves, and what a watched decoder has seen (wrong of seen labelled positions
    disagreed; heads: the final heads it ran for labels).

    update(k, n): n positions were decoded, and k disagreements with full depth's top-1 came to
    light (leaving at the thresholds index() gave). u counts disagreements over a target rate,
    epsilon - (credit + climb + batch) / horizon: it starts at -credit, and u <- max(u + k -
    n target, -2 credit). index() is start (the calibrated threshold's) while u <= 0, and falls
    linearly to 0 (1.0: full depth) as u rises to climb. So it moves once credit disagreements
    more than the target are seen, and comes back as the text runs under it.

    The guarantee, for any text, shifted or not, when every label comes at once: at u >= climb
    nothing leaves early, so u stays below climb + batch (batch: the most one update brings),
    and the floor only raises u; so of T positions at most target * T + credit + climb + batch
    disagree: at most epsilon once T >= horizon. Labels on a random share r of positions, each
    disagreement counted 1 / r, keep it in expectation."""
    def __init__(self, start, config, batch=1, climb=4):
        self.start, self.climb, self.credit = start, climb, config.adapt_credit
        self.target = config.epsilon - (self.credit + climb + batch) / config.adapt_horizon
        self.u, self.wrong, self.seen, self.heads = -self.credit, 0, 0, 0

    def index(self):
        return round(self.start * (1 - min(max(self.u, 0) / self.climb, 1)))

    def update(self, k, n=1):
        self.u = max(self.u + k - n * self.target, -2 * self.credit)

class Watched:
    """A monitor on an exit decoder with an exact cache, put before its KV strategy: on a random
    share of steps, spot checks, the layers above an exit run as backfill runs them, and the final
    head on their state gives each row's label, full depth's top-1. Each disagreement found is
    counted 1 / share by a Monitor shared by every generation it watches, which sets the threshold
    each step leaves at. Backfill runs those layers anyway: its share is 1, every exit labelled."""
    def __init__(self, model, monitor, share, generator):
        self.model, self.monitor, self.share, self.generator = model, monitor, share, generator

    def exit_threshold(self, threshold):
        self.spot = torch.rand(1, generator=self.generator).item() < self.share
        return THRESHOLDS[self.monitor.index()]

    def skip_layers(self, model, cache, x, pos, layer):
        if self.spot:  # the layers above run, as backfill's do (deferred's: its parked chunk too)
            return Backfill.skip_layers(self, model, cache, x, pos, layer)
        super().skip_layers(model, cache, x, pos, layer)

    def run_layer(self, block, cache, layer, x, pos):
        x = super().run_layer(block, cache, layer, x, pos)
        # (B, C): the last layer run's state (on a spot check the top's: full depth's head reads it)
        self.last = x[:, 0]
        return x

    def emitted(self, logits, exit_layer):
        m, L, k = self.monitor, self.model.config.n_layer, 0
        left = exit_layer < L - 1  # (B,)
        if self.spot and left.any():
            label = self.model.exit_logits(self.last, L - 1).argmax(-1)
            k, m.heads = int((left & (logits.argmax(-1) != label)).sum()), m.heads + 1
        m.wrong, m.seen = m.wrong + k, m.seen + self.spot * len(left)
        m.update(k / (self.share or 1), len(left))  # share 0: nothing labelled

class Shadowed(Watched):
    """State copy's and holes' deep layers read their own cache, not full depth's, so a spot check
    there shadows a window: the window's prefill leaves an exact cache, and a copy of it, fed each
    new token through every layer, gives full depth's label at each step till the window moves.
    On a random share of windows; n_layer more layer runs a step of one, counted as the decoder's.
    The threshold is set as a window begins and held through it: whether a window is labelled
    then says nothing of where it leaves (the counts stay unbiased), and a window that begins at
    full depth, its cache exact, disagrees nowhere: the room is a window's steps / share (it
    decodes a piece a call)."""
    pos = None  # the window position the last step fed

    def exit_threshold(self, threshold):
        if self.pos in (None, self.model.config.block_size - 1):  # the window moves this step
            # Watched's: a new threshold and a new draw of spot, held through the window
            self.threshold, self.shadow = super().exit_threshold(threshold), None
        return self.threshold

    def skip_layers(self, model, cache, x, pos, layer):
        super(Watched, self).skip_layers(model, cache, x, pos, layer)  # its own strategy's

    def run_layer(self, block, cache, layer, x, pos):
        if layer == 0 and self.spot:
            self.shadow = self.shadow or copy.deepcopy(cache)  # the window's, just prefilled
            self.shadow.layer_evals, self.top = cache.layer_evals, x
            for l, b in enumerate(self.model.transformer.h):
                self.top = b(self.top, self.shadow, l)
        self.pos = pos
        return super(Watched, self).run_layer(block, cache, layer, x, pos)

    def emitted(self, logits, exit_layer):
        self.last = self.spot and self.top[:, 0]
        # every row is judged, none left early or not: its cache is not full depth's
        super().emitted(logits, torch.zeros_like(exit_layer))

STREAMS = 32  # the pieces of the watched decoders' table, one Monitor for them (exact caches
# decode them together, the others a piece a call)

def watched(name, model, plan, config, rows=1):
    """Exit decoder `name` at its plan, watched by a new Monitor for `rows` rows a step (one where
    its cache is not full depth's: it decodes a piece a call), from the grid's threshold at or
    above the plan's: (the plan with its watched strategy, which build decodes; the monitor).
    Spot checks on config.spot_share of steps, where the decoder skips the layers above an exit
    (of windows, where its cache is not full depth's: a window of bench_prompt_len's prompts
    holds T steps)."""
    d = DECODERS[name]
    share = config.spot_share if d.skips else 1.0
    T = model.config.block_size - min(config.bench_prompt_len, model.config.block_size // 2) + 1
    watch, steps = (Watched, rows) if d.cache == "exact" else (Shadowed, T)
    # an update may bring rows / share a step held; the grid's threshold at or above the plan's
    monitor = Monitor(max(i for i, t in enumerate(THRESHOLDS) if t >= plan["threshold"]), config,
                      steps / (share or 1))
    kv = partial(type("Watched" + d.strategy.__name__, (watch, d.strategy), {}), model, monitor,
                 share, torch.Generator().manual_seed(config.seed))
    return plan | {"strategy": kv}, monitor

def watched_models(sources, config):
    """The exit models whose decoders a run watches (sources: prefix -> (model, ...)): the exit
    model's, first; with --continued (a study) every exit model's."""
    return list(sources.items())[: None if config.continued else 1]

def watchable(names, config):
    """The exit decoders of names that a run watches: backfill and deferred, and with --continued
    (a study) state copy and holes (SkipDecode's schedule has no threshold to move)."""
    return [n for n in names if DECODERS[n].strategy and not DECODERS[n].schedule and (
        DECODERS[n].cache == "exact" or config.continued)]

def rate_bound(k, n, alpha, bets=(0.1, 0.3, 1.0, 3.0)):
    """A confidence sequence for the mean chance of disagreeing over n positions, k of which
    disagreed: an upper bound valid at every n at once with probability >= 1 - alpha, for any
    shift (each position's chance may differ). For a bet b, exp((1 - e^-b) P - b k), P the sum of
    the chances, is a supermartingale; Ville's inequality bounds it, alpha split among the bets."""
    a = math.log(len(bets) / alpha)
    return (torch.stack([(b * k + a) / -math.expm1(-b) for b in bets]).amin(0) / n).clamp(0, 1)

# -----------------------------------------------------------------------------
# The cost model: measured unit costs, and the blocks each exit plan saves

def typical_position(prompt_len, n_tokens, block_size):
    """The median window position a workload's decode step feeds at: what a timed block reads."""
    start, at = None, []
    for n in range(prompt_len, prompt_len + n_tokens):
        start = window_start(start, n, block_size)
        at.append(n - 1 - start)
    return int(np.median(at))

def exit_check(model, x, rule):
    """What decode_step does at a checked exit: the head, the rule's confidence and the host sync
    that decides."""
    state = {"layer": 0, "below": x[:, 0], "h": x[:, 0]}
    return int((confidence(model.exit_logits(x[:, 0], 0), rule, state) > 0.9).sum())

@torch.inference_mode()
def decode_costs(model, prompt_len, n_tokens, rules, repeats=200):
    """The unit costs, in seconds at batch 1 (medians): a block attending to a cache of the
    workload's typical length, an exit check by each rule, a state-copy write and the final
    head."""
    cfg, device = model.config, model.lm_head.weight.device
    typical = typical_position(prompt_len, n_tokens, cfg.block_size)
    cache, x = KVCache(cfg, 1, device), torch.zeros(1, 1, cfg.n_embd, device=device)
    stages = {"block": partial(model.transformer.h[0], x, cache, 0),
              **{f"check {name}": partial(exit_check, model, x, rule)
                 for name, rule in rules.items()},
              "state_copy": partial(write_state_copy, cache, 1, x, *state_copy_projections(model)),
              "final_head": partial(model.exit_logits, x[:, 0], cfg.n_layer - 1)}
    t = {key: [] for key in stages}
    for _ in range(repeats):
        for key, stage in stages.items():
            cache.lengths = [typical] * cfg.n_layer  # their contents do not change the time
            t0 = time.perf_counter()
            stage()
            synchronize(device)  # each timer reads finished work
            t[key].append(time.perf_counter() - t0)
    return {key: float(np.median(v)) for key, v in t.items()} | {"cache_length": typical}

def plan_counts(records, plan):
    """What an exit plan's decode steps do at a threshold on recorded positions (teacher-forced),
    as the unit costs price them: the share that leave before the last layer, the blocks a step
    skips, and the exit checks a step (every exit a position passes; at threshold 1 none)."""
    last = len(records.pred) - 1
    exits = exits_at_threshold(records, plan["measure"], plan["threshold"], plan["checked_exits"])
    checks = sum(average(exits >= l) for l in plan["checked_exits"] if plan["threshold"] < 1)
    return {"early": average(exits < last), "skipped": average(last - exits), "checks": checks}

def priced_saving(decoder, counts, measure, costs):
    """The seconds a token a decoder's step counts save against full depth, at the unit costs.
    Leaving early skips the final head and (but under backfill, which runs the blocks above for the
    cache) the blocks above; every check costs a head, a confidence and a host sync, and state_copy
    a write when it leaves early. Deferred's catch-up rides in the next token's block call."""
    saved = (counts["early"] * costs["final_head"]
             + decoder.skips * counts["skipped"] * costs["block"])
    return saved - (counts["checks"] * costs[f"check {measure}"]
                    + counts["early"] * costs.get(decoder.exit_cost, 0.0))

def best_plan(records, decoder, measure, threshold, costs, checked=None):
    """The exits an exit decoder checks, chosen on val at the threshold: `checked`, or else the
    plan the unit costs price fastest of those met adding one exit at a time, each time the one
    that saves most (n_layer^2 / 2 plans; every subset would be 2^n_layer). The threshold's
    guarantee is for every exit checked: a subset can leave later, at an exit that disagrees, so
    it is not covered. At threshold 1 nothing leaves: no exit is checked."""
    def priced(exits):
        plan = {"measure": measure, "threshold": threshold, "checked_exits": exits,
                "label": ",".join(map(str, exits)) or "-"}
        counts = plan_counts(records, plan)  # on val: the watched table sets a text's beside
        return plan | counts | {"saved_blocks": priced_saving(decoder, counts, measure, costs)
                                / costs["block"]}
    if threshold >= 1 or checked is not None:
        return priced([] if threshold >= 1 else checked)
    exits, path = [], []
    for _ in range(len(records.pred) - 1):
        path.append(max((priced(sorted({*exits, e})) for e in range(len(records.pred) - 1)
                         if e not in exits), key=lambda plan: plan["saved_blocks"]))
        exits = path[-1]["checked_exits"]
    return max(path, key=lambda plan: plan["saved_blocks"])

def exit_plans(records, costs, config, threshold, schedule, checked=None):
    """Every exit decoder's plan, chosen on val: its checked exits at the threshold (None: the
    fastest the search finds), or the schedule SkipDecode's decoders follow."""
    return {name: schedule if d.schedule else best_plan(records, d, config.confidence_measure,
                                                        threshold, costs, checked)
            for name, d in DECODERS.items() if d.strategy}

# -----------------------------------------------------------------------------
# The tail: latency as a streaming reader sees it, a speculation round's tokens at once

def tail(outputs):
    """Batch 1's latency as a streaming reader sees it, in ms, from its Generations' clocks: the
    wait for the first token (p50 over prompts), the gaps between tokens at p50, p95 and p99 (a
    round's tokens arrive together when it ends: its first waits the round, the rest 0), the mean
    time a token, and p95 of a prompt's whole continuation."""
    first, gaps, whole, tokens = [], [], [], 0
    for out in outputs:
        t0, arrivals = out.clock[0][0], []
        for (_, m), (t, n) in itertools.pairwise(out.clock):  # a step's tokens arrive as it ends
            arrivals += [1e3 * (t - t0)] * (n - m)
        first.append(arrivals[0])
        gaps += np.diff(arrivals).tolist()
        whole.append(arrivals[-1])
        tokens += len(arrivals)
    p50, p95, p99 = np.percentile(gaps, [50, 95, 99]).tolist()
    return {"first_ms": float(np.median(first)), "gap_p50": p50, "gap_p95": p95, "gap_p99": p99,
            "ms_mean": sum(whole) / tokens, "prompt_ms_p95": float(np.percentile(whole, 95))}

# -----------------------------------------------------------------------------
# Smaller models: plain GPTs of fewer layers, trained alike, as points of the frontier

def train_plain_gpt(config, splits, n_layer):
    """A plain GPT (alpha 0, Part I's model) of n_layer blocks with the same width, steps and data,
    on the splits' device, at the main model's batch: (the model, its val loss on random windows,
    seconds). A diverged one stops the run,
    as format_eval says."""
    model, losses, seconds = train_new_model(replace(config, n_layer=n_layer, alpha=0.0), splits,
                                             splits["train"].device, evaluate=False)
    return model, losses["val"][-1], seconds

# -----------------------------------------------------------------------------
# Depth pruning: the blocks that change the residual stream least, removed for every input

@torch.inference_mode()
def block_distances(model, x):
    """Each block's angular distance between its input and its output, arccos(cosine) / pi,
    averaged over the positions of x (b, T): a list of n_layer, 0 where a block changes nothing
    (Gromov et al. 2024, arXiv:2403.17887, for one block)."""
    return [average(torch.arccos(F.cosine_similarity(a, b, dim=-1).clamp(-1, 1)) / math.pi)
            for a, b in itertools.pairwise([model.embed(x), *model.hidden_states(x)])]

def pruned(model, distances, k):
    """A copy of the model without its k blocks of least angular distance, no retraining: decoded
    at full depth over the blocks left (its exit heads unused)."""
    keep = sorted(sorted(range(len(distances)), key=distances.__getitem__)[k:])
    small = copy.deepcopy(model)
    small.transformer.h = nn.ModuleList(small.transformer.h[i] for i in keep)
    small.config = replace(model.config, n_layer=len(keep))
    return small

def pruned_models(model, val):
    """k -> the model without its k most-alike blocks, k = 1 .. n_layer - 1, the distances
    measured on up to 64 back-to-back windows of val."""
    T = model.config.block_size
    distances = block_distances(model, val[:-1].unfold(0, T, T)[:64])
    return {k: pruned(model, distances, k) for k in range(1, model.config.n_layer)}

# -----------------------------------------------------------------------------
# The decoders: each declared once, and looked up by every table, prediction, sample and chart

class Decoder(NamedTuple):
    """A decoder, declared once. Full depth has no strategy and drafts nothing; an exit decoder
    has a KV strategy, and its output is not full depth's; a speculative decoder drafts, and its
    output is full depth's (the same tokens greedy, the same distribution sampled)."""
    cache: str = "exact"  # the keys and values a later token reads: exact, approx. or holes
    strategy: type = None  # an exit decoder's KV strategy: tokens leave at its plan's exits
    schedule: bool = False  # its plan is an exit layer by window position (SkipDecode's)
    skips: bool = True  # an exit skips the blocks above it (backfill runs them, for the cache)
    exit_cost: str = None  # the unit cost an early exit adds (state_copy's write)
    derived: object = None  # model -> the tensors it derives and reads (state_copy's projections)
    drafter: str = None  # speculation: 'exit' (the model's own early layers) or 'model' drafts
    samples: bool = True  # may draw the early-exit sample from a checkpoint alone

# the decoders, in the tables' order: full depth, the answers to the holes, speculation
DECODERS = {
    "full": Decoder(samples=False),
    "backfill": Decoder(strategy=Backfill, skips=False),
    "deferred": Decoder(strategy=Deferred),
    "state_copy": Decoder("approx.", StateCopy, exit_cost="state_copy",
                          derived=state_copy_projections),
    "holes": Decoder("holes", Holes),
    "skipdecode": Decoder(strategy=SkipDecode, schedule=True),
    "self_speculative": Decoder(drafter="exit"),
    "draft_model": Decoder(drafter="model", samples=False),
}

def build(name, model, plan, rules=EXIT_RULES):
    """The decoder `name` of a model at its plan, for any batch size: decode(idx (B, T0), n,
    generator=, temperature=, top_k=, forced=) -> Generation. plan: an exit decoder's measure,
    threshold and checked_exits (its rule read from rules; a watched one's strategy: watched's);
    a drafter's draft_exit, num_draft and draft (a draft model; None: the model's own layers).
    Full depth is one decoder on every device: the predictions and the speed-ups divide by the
    same baseline."""
    d = DECODERS[name]
    if d.strategy:
        # a watched plan brings its own strategy: the decoder's, under a Monitor
        return partial(generate, model, strategy=plan.get("strategy", d.strategy),
                       exit_threshold=plan["threshold"], checked_exits=plan["checked_exits"],
                       measure=rules[plan["measure"]])
    if d.drafter:
        return partial(generate_speculative, model, draft_exit=plan["draft_exit"],
                       num_draft=plan["num_draft"], draft_model=plan["draft"])
    return partial(generate, model)

def draft_plan(name, config, k, draft):
    """A drafter's plan at k drafts a round: the model's layers up to draft_exit (whose exit head
    it reads), or the draft model."""
    own = DECODERS[name].drafter == "exit"
    last = config.draft_exit if own else draft.config.n_layer - 1
    return {"draft_exit": last, "num_draft": k, "draft": None if own else draft,
            "checked_exits": [last] * own}

def weight_bytes(model, name="full", plan=None):
    """The bytes of weights decoder `name` of model reads: every parameter but the exit heads (the
    tied head once), the exit heads its plan checks, a draft model's, and what it derives."""
    plan, d = plan or {}, DECODERS[name]
    heads = plan.get("checked_exits", ())
    unread = [p for l, h in enumerate(model.exit_heads) if l not in heads for p in h.parameters()]
    read = [*model.parameters(), *(d.derived(model) if d.derived else ())]
    draft = weight_bytes(plan["draft"]) if plan.get("draft") else 0
    return sum(p.nbytes for p in read) - sum(p.nbytes for p in unread) + draft

def speedup(s, full):
    """Full depth's speed over a decoder's (s, full: their speed_pass figures): 1 / the mean of the
    middle half of its calls' times over full depth's on the same prompts in the same pass, so
    that a burst of load on a few calls moves it little."""
    ratios = np.sort(s["seconds"] / full["seconds"], axis=None)
    cut = len(ratios) // 4
    return 1 / float(ratios[cut:len(ratios) - cut].mean())

def decoder_plans(name, plans, config, draft):
    """The plans a decoder may run on test: an exit decoder's one, chosen on val; a drafter's at
    num_draft and its half drafts a round, of which on_val keeps the faster on val; full depth's
    None."""
    if name in plans:
        return [plans[name]]
    if not DECODERS[name].drafter:
        return [None]
    lengths = [config.num_draft >> i for i in range(2)]  # its half: 0 where num_draft is 1
    return [draft_plan(name, config, k, draft) for k in lengths if k]

def run_plans(sources, config, draft):
    """(prefix + name, mode) -> the plans each decoder of each source may run on test (sources:
    prefix -> (model, rules, plans, decoder names, ref); its points are named prefix + name)."""
    return {(prefix + name, mode): decoder_plans(name, plans, config, draft)
            for prefix, (_, _, plans, names, _) in sources.items() for name in names
            for mode in MODES}

def prediction(row, plan, val):
    """The forecast beside a decoder-table row, made on val: the speed-up the same decoder at the
    same plan, or the same model, ran at on val's workload in the same mode (val: (name, mode) ->
    speed-up); an exit decoder's plan, a drafter's draft_exit."""
    d, figures = DECODERS[row["decoder"]], {"predicted_speedup": val[row["name"], row["mode"]]}
    if d.drafter:
        figures.update(draft_exit=plan["draft_exit"])
    if d.strategy:
        figures.update(exit_at=plan["label"], threshold=plan["threshold"])
    return figures

def table_row(name, decoder, ref, mode, speed, quality):
    """One row of a decoder table: speed over full depth in the same mode, and
    quality beside it, teacher-forced, against ref's, the point whose output its model's is at
    full depth (a drafter's quality is ref's by construction; no quality: none measured)."""
    d, s = DECODERS[decoder], speed[name, mode]
    row = {"name": name, "decoder": decoder, "mode": mode, **s,
           "speedup": speedup(s, speed["full", mode]), "cache": d.cache}
    outputs = row.pop("outputs")
    del row["seconds"]
    row.update(tail(outputs))
    q = quality.get(name, quality.get(ref))
    if q:
        row.update(test_loss=q["test_loss"], test_accuracy=q["test_accuracy"], nll=q["nll"],
                   agreement=average(q["pred"] == quality[ref]["pred"]))
        row["output"] = f"agree {row['agreement']:.3f}"
    if d.drafter:  # speculation: acceptance, and the output it equals
        row.update(spec_stats(outputs, speed[ref, mode]["outputs"], mode))
    if not d.strategy and q is quality.get(ref):  # ref's output (sampled: tested)
        same = row.get("identical_to_full", mode == "greedy" or None)
        row["output"] = {True: "same tokens", None: "same dist.", False: "NOT same"}[same]
    return row

def paired_se(nll, piece):
    """(a, b) -> the standard error of a's test loss minus b's, paired position by position (nll:
    name -> each position's loss, the same positions, in pieces of `piece`), over the pieces'
    means: a piece's characters are not independent of each other, its pieces nearly are."""
    return {(a, b): float((x - y).view(-1, piece).mean(1).std() / (len(x) // piece) ** 0.5)
            for a, x in nll.items() for b, y in nll.items()}

# -----------------------------------------------------------------------------
# The frontier: the points nothing beats on both loss and speed

def beats(o, r, mode, se):
    """Whether point o beats r in a mode: at least as fast, and lower in test loss by over twice the
    paired standard error of the difference (se); or faster, at the same predictions' loss
    (speculation's, full depth's: the difference and its error together under 1e-6, float rounding
    where one computes it in another order). Within twice the error the two are tied in loss."""
    margin, error = r["test_loss"] - o["test_loss"], se[o["name"], r["name"]]
    faster = o[f"speedup_{mode}"] - r[f"speedup_{mode}"]
    return faster >= 0 and margin > 2 * error or faster > 0 and abs(margin) + error < 1e-6

def dominated_by(rows, mode, se):
    """Each row's better point in one mode: the fastest of those that beat it; None where there is
    none, on the frontier."""
    # a stable sort: of equal speed-ups the earlier row comes first, as max would pick it
    fastest_first = sorted(rows, key=lambda o: o[f"speedup_{mode}"], reverse=True)
    return [next((o["name"] for o in fastest_first if beats(o, r, mode, se)), None) for r in rows]

def frontier_points(rows, se):
    """Decoder-table rows of both modes, one point a name: its first row's figures, its speed-up
    in each mode (speedup_<mode>) and, in each, the point that beats it (dominated_<mode>; se:
    the paired standard errors of the loss differences)."""
    points = {}
    for r in rows:  # a name's first row, with its speed-up in each mode
        points.setdefault(r["name"], dict(r))[f"speedup_{r['mode']}"] = r["speedup"]
    points = list(points.values())
    for mode in MODES:
        for point, better in zip(points, dominated_by(points, mode, se)):
            point[f"dominated_{mode}"] = better
    return points

def frontier_names(points):
    """The points nothing beats in each mode, by name: {mode: "name, name"}."""
    return {mode: ", ".join(p["name"] for p in points if p[f"dominated_{mode}"] is None)
            for mode in MODES}

def quality_pass(decode, data, n_positions, rows, prompt_len, piece):
    """Teacher-forced decoding of n_positions // piece pieces spread evenly over data, each of
    `piece` positions after a prompt of prompt_len, `rows` pieces a call: every decoder sees the
    same text, and its own cache's effects (with the workload's prompt length and tokens, its
    positions where the workload's are). Each position's loss too (nll), to pair decoders by."""
    starts = torch.linspace(0, len(data) - prompt_len - piece, n_positions // piece).long()
    windows = data.unfold(0, prompt_len + piece, 1)[starts]  # (pieces, P + piece)
    outs = [decode(w[:, :prompt_len], piece, forced=w[:, prompt_len:]) for w in windows.split(rows)]
    logits = torch.cat([o.logits for o in outs]).flatten(0, 1)  # (pieces * piece, V)
    targets = windows[:, prompt_len:].flatten()
    nll, pred = F.cross_entropy(logits, targets, reduction="none"), logits.argmax(-1)
    return {"pred": pred, "nll": nll, "test_loss": average(nll),
            "exits": torch.cat([o.exited_at for o in outs]).flatten(),
            "mean_layers": sum(o.layers_run * len(o.tokens) for o in outs) / len(targets),
            "test_accuracy": average(pred == targets)}

def in_mode(decode, config, mode):
    """A decoder that draws in a mode: greedy (temperature 0), or with the config's sampling."""
    return partial(decode, top_k=config.top_k,
                   temperature=config.temperature if mode == "sampled" else 0.0)

# a frontier point's family: its legend and its class on the chart
FAMILIES = {"exit model": ("the exit models' decoders", "decoder"),
            "speculation": ("speculation (exact)", "speculation"),
            "plain GPT": ("plain GPTs", "gpt"), "pruned": ("pruned models", "pruned")}

# =============================================================================
# Part III: the harness; the workload and timing, the tables, the page, checkpoints, main

import argparse
import difflib
import gc
import html
import inspect
import json
import os
import pickle
import random
import re
import signal
import tempfile
import textwrap
import zipfile
from dataclasses import asdict, fields
from pathlib import Path

# -----------------------------------------------------------------------------
# The workload and timing: every decoder on the same prompts, interleaved; quality teacher-forced

def workload(data, n_prompts, prompt_len):
    """n_prompts prompts of prompt_len characters from evenly spaced places of a split:
    (n_prompts, prompt_len). One prompt proves nothing: a greedy character model soon loops
    ("the the the"), and a loop is easy to draft. Timed figures continue every prompt of test's
    workload; forecasts, val's."""
    starts = torch.linspace(0, len(data) - prompt_len - 1, n_prompts).long()  # (n_prompts,)
    return data[:-1].unfold(0, prompt_len, 1)[starts]  # windows followed by one more character

def repetition(tokens):
    """1 - distinct 4-grams / 4-grams of one generated sequence: 0 never repeats itself, near 1 a
    loop."""
    grams = list(zip(*(tokens[i:] for i in range(4))))
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0

def speed_pass(decoders, prompts, config):
    """Every decoder continues the workload by bench_tokens, a prompt a call, bench_repeats times,
    interleaved a call at a time (a burst of load on the machine falls on every decoder alike);
    decoders: key -> decode. Per decoder: median over the passes of tokens/s of all prompts, each
    call's seconds (passes, calls), block runs per token while decoding (catch-up included) and
    re-prefilling, the keys and values it holds a row, how repetitive the text is, and the last
    pass's Generations."""
    batches, device = prompts.split(1), prompts.device  # each (1, T0)
    n_tokens = config.bench_tokens
    # a call's time, each pass and prompt
    seconds = {key: np.zeros((config.bench_repeats, len(batches))) for key in decoders}
    order = random.Random(config.seed)
    gc.disable()  # no garbage collection while timing: it would land on whichever decoder runs
    try:
        for r in range(config.bench_repeats):
            outputs = {key: [] for key in decoders}
            for i, batch in enumerate(batches):
                # the decoders in a new random order each time: none always runs after the same
                # one (a model whose weights the one before left in the CPU's cache runs faster)
                for key, decode in order.sample(list(decoders.items()), len(decoders)):
                    # prompt i samples from seed + i, whichever decoder and pass runs it
                    generator = torch.Generator(device).manual_seed(config.seed + i)
                    synchronize(device)
                    t0 = time.perf_counter()
                    outputs[key].append(decode(batch, n_tokens, generator=generator))
                    synchronize(device)
                    seconds[key][r, i] = time.perf_counter() - t0
    finally:
        gc.enable()
    steps = len(batches) * n_tokens  # a pass's tokens; layers_run and prefill_runs count per row
    return {key: {"tokens_per_second": steps / float(np.median(seconds[key].sum(1))),
                  "seconds": seconds[key],
                  "mean_layers": sum(o.layers_run for o in outs) / steps,
                  "prefill_layers": sum(o.prefill_runs for o in outs) / steps,
                  "cache_bytes": outs[0].cache_bytes,
                  "repetition": float(np.mean([repetition(r[-n_tokens:].tolist())
                                               for o in outs for r in o.tokens])),
                  "outputs": outs} for key, outs in outputs.items()}

def measure_decoders(decoders, test, prompts, config):
    """The rows of a decoder table, a prompt a call, both modes: speed on the workload,
    interleaved, and quality teacher-forced on test. decoders: name -> (its declared decoder,
    {mode: decode}, the point its output is compared with); "full" is the baseline."""
    # an exact cache decodes a row alike in any batch: then STREAMS pieces a call, as the watched
    # table decodes them (a watched one's Monitor leaves room for as many rows a step)
    quality = {name: quality_pass(modes["greedy"], test, config.quality_positions, 1 if
                                  DECODERS[decoder].cache != "exact" else STREAMS,
                                  config.bench_prompt_len, config.bench_tokens)
               for name, (decoder, modes, _) in decoders.items() if not DECODERS[decoder].drafter}
    runs = {(name, mode): in_mode(modes[mode], config, mode)
            for mode in MODES for name, (_, modes, _) in decoders.items()}
    speed = speed_pass(runs, prompts, config)
    return [table_row(name, decoders[name][0], decoders[name][2], mode, speed, quality)
            for name, mode in speed]

# -----------------------------------------------------------------------------
# Tables: each defined once, printed on the console and drawn on the page from that definition

WIDTH = 120  # console tables and their notes fit this many columns: a point is named by model
# and decoder ("frozen self_speculative"; watched: "watched frozen deferred"), and a frontier row
# names two more (a study's longest names run past it)

def table(text):
    """A table, defined once: its question on the first line, then a line a column, 'report key |
    header | format | help'. print_table prints it, html_table renders it, and both write its
    legend from the help."""
    question, *columns = text.strip().split("\n")
    return question, [re.split(r"\s*\|\s*", column) for column in columns]

SWEEP_TABLE = table("""Which threshold?
threshold      | threshold         | {:.2f}  | a position leaves at the first exit this sure
exit_fractions | exiting at layer 0.. | {:6.1%} | where the positions leave
mean_layers    | layers            | {:.2f}  | mean layers run per position
compute_saved  | val saved         | {:.1%}  | the share of layer runs skipped
loss           | val loss          | {:.4f}  | the loss of the head each position leaves at
disagreement   | disagree          | {:.2%}  | the share whose top-1 is not full depth's""")
CALIBRATION_TABLE = table("""Which exit rule, with a guarantee, and how near the best possible?
model              | model        | {}     | joint: the exit model; frozen: heads on a plain GPT; \
continued: a plain GPT, then the recipe
measure            | rule         | {}     | how sure an exit is (oracle: knows full depth's top-1)
delta              | delta        | {:.3g} | the chance allowed that its threshold breaks epsilon
threshold          | thr          | {:.3g} | the threshold Learn then Test chooses on val
test.compute_saved | test saved   | {:.1%} | the share of layer runs it skips on test
test.oracle_share  | of oracle    | {:.0%} | that share over the oracle's at the same epsilon
test.disagreement  | disagree     | {:.2%} | the share whose top-1 is not full depth's
test.loss          | test loss    | {:.4f} | the loss of the heads the positions leave at
test.full_loss     | full loss    | {:.4f} | full depth's loss on the same positions
test.accuracy      | acc.         | {:.3f} | how often the exit's top-1 is the next character""")
SHIFT_TABLE = table("""Does the guarantee hold on text of another kind?
measure             | rule        | {}     | the rule, at its threshold calibrated on val
test.compute_saved  | test saved  | {:.1%} | the share of layer runs skipped on test
shift.compute_saved | shift saved | {:.1%} | and on the shifted text
test.disagreement   | test dis.   | {:.2%} | the share whose top-1 is not full depth's, on test
shift.disagreement  | shift dis.  | {:.2%} | and on the shifted text
shift.held          | held        | {}     | shift dis. within epsilon
shift.loss          | shift loss  | {:.4f} | the loss of the exits on the shifted text
shift.full_loss     | full depth's| {:.4f} | full depth's loss there""")
MOVING_TABLE = table("""Does a decoder that watches itself keep epsilon where the fixed one broke?
model                | model        | {}     | as in the rule table
decoder              | decoder      | {}     | an exit decoder at its plan
text                 | text         | {}     | test, or the shifted text
fixed.disagreement   | fixed dis.   | {:.2%} | at its calibrated threshold: positions whose \
top-1 is not full depth's
fixed.compute_saved  | fixed saved  | {:.1%} | the share of layer runs its exits skip, a row \
at a time, as in the rule table (backfill runs them anyway; a batch as deep as its deepest row)
val_early            | val early    | {:.0%} | positions that leave before the last layer on \
val at the plan: calibration's exits, to compare the text's with
fixed.early          | early        | {:.0%} | the same on the text, at the fixed threshold
moving.disagreement  | watched dis. | {:.2%} | watched, its threshold moved by its monitor
moving.compute_saved | saved        | {:.1%} | and less the layers its spot checks run again \
(in expectation) or its shadow runs
labelled             | labelled     | {:.0%} | positions whose label it saw (spot checks, shadows)
heads                | heads        | {:.2f} | final heads it ran for labels, a step
target               | target       | {:.3%} | the rate its monitor aims at: epsilon - \
(credit + 4 + b) / horizon
upper                | bound        | {:.2%} | the monitor's upper bound on its labelled \
positions' disagreement""")
STRATEGY_TABLE = table("""What does each KV strategy buy?
mode              | mode      | {}      | greedy, or sampled
name              | decoder   | {}      | how the skipped layers' cache is filled (watched X: X \
under a Monitor sized as the watched table's, one carried from val's workload through test's \
positions and workload; thr: the plan's, its start the grid's threshold at or above it)
exit_at           | exit at   | {}      | the exits checked ('-': none; skipdecode: its layer \
from a window position on)
threshold         | thr       | {:.3g}  | their threshold
speedup           | speed-up  | {:.2f}x | over full depth in the same mode: 1 / the mean of the \
middle half of its calls' times over full depth's on the same prompts
predicted_speedup | predicted | {:.2f}x | its speed-up on val's workload, the forecast
mean_layers       | layers    | {:.2f}  | blocks run per token while decoding, catch-up included \
(above the model's depth for self_speculative: the draft's layers, then the verify pass over \
every draft, kept or not)
repetition        | repeats   | {:.2f}  | the share of 4-grams repeating an earlier one
cache             | cache     | {}      | the skipped layers' keys and values: exact, approximate \
(approx.), or missing (holes)
output            | output    | {}      | same tokens as full depth (greedy), same distribution \
(sampled), or differs: how often its top-1 is full depth's (agree), teacher-forced on \
quality_positions test positions""")
TAIL_TABLE = table("""Average or tail, as a streaming reader sees it?
mode          | mode       | {}     | greedy, or sampled
name          | decoder    | {}     | as in the strategies table
ms_mean       | mean       | {:.2f} | ms a token
first_ms      | first      | {:.2f} | ms to a prompt's first token (the prefill's step), median
gap_p50       | gap p50    | {:.2f} | the median gap in ms between a token and the one before
gap_p95       | gap p95    | {:.2f} | 95% of gaps are at most this (a round's tokens arrive at \
once: its first waits the round, the rest 0)
gap_p99       | gap p99    | {:.2f} | and 99%
prompt_ms_p95 | prompt p95 | {:.0f} | ms for a prompt's whole continuation, 95th percentile""")
FRONTIER_TABLE = table("""When does early exit pay?
name              | point     | {}      | a decoder of the exit model (frozen: of heads on the \
plain GPT of its shape; continued: of that GPT continued with the recipe; watched: under its \
Monitor), a pruned model, a plain GPT
test_loss         | test loss | {:.4f}  | teacher-forced on the same test positions for every point
speedup_greedy    | greedy    | {:.2f}x | speed-up over full depth, greedy (as the strategies \
table's)
dominated_greedy  | beaten by | {}      | a point at least as fast and lower in test loss by over \
twice the paired standard error of the difference, or faster at the same predictions' loss
speedup_sampled   | sampled   | {:.2f}x | and sampled
dominated_sampled | beaten by | {}      | sampled ('-': on the frontier)
weights_mb        | weights   | {:.2f}  | MiB of weights read
kv_kb             | KV        | {:,.0f} | KiB of keys and values held a sequence""")

def legend(columns):
    """A table's legend: each column's header and help."""
    return "; ".join(f"{header}: {text}" for _, header, _, text in columns if text) + "."

def field(row, key):
    """A row's figure under its report key, dotted where nested ('test.loss'); None if absent."""
    for part in key.split("."):
        row = (row or {}).get(part)
    return row

def format_cell(value, fmt):
    """A table cell as text: '-' where a row has no such figure; a list, each item formatted."""
    if isinstance(value, list):
        return " ".join(map(fmt.format, value))
    return "-" if value is None else fmt.format(value)

def print_table(table, rows, conditions="", notes=()):
    """A table under its question and the conditions it was measured in, then legend and notes."""
    question, columns = table
    cells = [[header, *(format_cell(field(row, key), fmt) for row in rows)]  # a column each
             for key, header, fmt, _ in columns]
    widths = [max(map(len, column)) for column in cells]
    # the question as the title, '=== ... ===', wrapped to WIDTH
    print("\n=== " + "\n    ".join(textwrap.wrap(f"{question} {conditions}", WIDTH - 8)) + " ===")
    for line in zip(*cells):
        print("  ".join(f"{v:>{w}}" for v, w in zip(line, widths)))
    for note in (legend(columns), *notes):
        print(textwrap.fill(note, WIDTH, subsequent_indent="  ", break_on_hyphens=False))

# -----------------------------------------------------------------------------
# The analyses: what the run computes for each question, with the notes under its table

def run_threshold(config, sampling):
    """The run's exit threshold: exit_threshold, or (-1) the one a calibration (sampling) gives the
    run's rule; without a calibration, Part I's."""
    if config.exit_threshold >= 0:
        return config.exit_threshold
    return (sampling or {}).get("thresholds", {}).get(config.confidence_measure,
                                                      Config.exit_threshold)

class Lab:
    """What the analyses share. Built cheaply: the model, its data on its device, the workloads.
    run_lab's steps add the rest where a reader sees them: the records and calibrations
    (calibrate_exits), use (a calibration's rules and threshold), plan (the unit costs and the
    exit plans), measure (a decoder table)."""
    def __init__(self, model, tokenizer, splits, config, device, train_seconds=0.0):
        # train_seconds: the exit model's
        self.model, self.tokenizer, self.config, self.device, self.train_seconds = (
            model, tokenizer, config, device, train_seconds)
        self.splits = {name: text.to(device) for name, text in splits.items()}
        if config.shift_path:  # text of another kind, beside the splits
            self.splits["shift"] = torch.tensor(tokenizer.encode(read_text(config, "shift_path")),
                                                device=device)
        # the val workload (to choose draft lengths and forecast by) and the test one (to report)
        self.workloads = [workload(self.splits[s], config.bench_prompts, config.bench_prompt_len)
                          for s in ("val", "test")]
        self.plain_gpts = {}  # depth -> (a plain GPT trained alike, its training seconds)
        self.exit_models = {}  # freeze()'s and the continued one's
        self.nll = {}  # point -> each test position's loss, measure()'s

    def use(self, sampling):
        """The rules, threshold and schedule of a calibration (None: none; then Part I's
        threshold, and neither the learned rule nor a schedule)."""
        self.rules = exit_rules(sampling["weights"].to(self.device) if sampling else None)
        self.schedule = sampling and sampling["schedule"]
        self.threshold = run_threshold(self.config, sampling)
        if self.config.confidence_measure not in self.rules:
            raise ValueError("the checkpoint holds no learned rule: run without --sample_only")

    def plan(self):
        """Time the unit costs, and choose every exit decoder's plan on val with them (patience
        and the learned rule read the exit below, so they check every exit)."""
        cfg = self.config
        self.costs = decode_costs(self.model, cfg.bench_prompt_len, cfg.bench_tokens, self.rules)
        self.plans = self.plans_for(self.records, self.threshold, self.schedule)

    def plans_for(self, records, threshold, schedule):
        """Every exit decoder's plan for an exit model's records, threshold and schedule."""
        cfg, checked = self.config, None
        if cfg.exit_layers != "auto" or cfg.confidence_measure in ("patience", "learned"):
            checked = parse_exit_layers(cfg)
        return exit_plans(records["val"], self.costs, cfg, threshold, schedule, checked)

    def plain(self, d):
        """A plain GPT of d layers trained alike (once: the smaller models and the draft model
        share them)."""
        if d not in self.plain_gpts:
            model, loss, seconds = train_plain_gpt(lesson_config(self.config), self.splits, d)
            print(f"\n--- a {d}-layer GPT trained as a plain model (alpha 0) with the same width, "
                  f"steps, data and batch: val loss {loss:.4f}, {seconds:.1f} s ---")
            self.plain_gpts[d] = model, seconds
        return self.plain_gpts[d][0]

    def freeze(self, names):
        """The plain GPT of the exit model's depth with exit heads trained on its frozen trunk: its
        decoders of names, each beside that GPT's output (its full depth, bit for bit: its
        draft_model drafts for the plain GPT)."""
        cfg = self.config
        model, seconds = frozen_exit_model(self.plain(cfg.n_layer), cfg, self.splits)
        about = (f"the plain {cfg.n_layer}-layer GPT ({self.plain_gpts[cfg.n_layer][1]:.0f} s of "
                 f"training), exit heads trained after on its frozen trunk for {cfg.max_iters // 2}"
                 f" steps ({seconds:.0f} s); its full depth is that GPT's, bit for bit")
        return self.exit_model("frozen", model, about, names, f"{cfg.n_layer}-layer GPT")

    def exit_model(self, name, model, about, names, ref):
        """An exit model besides the joint one, its exits read, calibrated and planned as the joint
        one's (self.exit_models[name]: model, records, calibrations, rules, about: what it is and
        its training's seconds). Returns the source measure() adds: its decoders of names ("name
        decoder"), each beside ref's output."""
        records, calibrations, sampling = calibrate_exits(model, self.splits, self.config)
        rules = exit_rules(sampling["weights"])
        self.exit_models[name] = model, records, calibrations, rules, about
        plans = self.plans_for(records, run_threshold(self.config, sampling), sampling["schedule"])
        return {name + " ": (model, rules, plans, names, ref)}

    def other_models(self):
        """The models decoded at full depth beside the exit model: name -> (model, family), every
        plain GPT the run trains (the draft model among them), then the pruned models."""
        cfg = self.config
        return {f"{d}-layer GPT": (self.plain(d), "plain GPT")
                for d in plain_depths(cfg.depths, cfg.draft_layers, cfg.n_layer)} | {
            f"pruned {k}": (p, "pruned")
            for k, p in pruned_models(self.model, self.splits["val"]).items()}

    def watching(self, sources):
        """The watched models' watchable decoders, watched: a source of their own ("watched " +
        prefix), each decoder's one Monitor (for the quality pass's STREAMS rows) carried from
        val's workload through test's positions to test's workload, as a deployed decoder keeps
        its threshold."""
        twins = {}
        for prefix, (model, rules, plans, names, ref) in watched_models(sources, self.config):
            kept = watchable(names, self.config)
            plans = {n: watched(n, model, plans[n], self.config, STREAMS)[0] for n in kept}
            twins["watched " + prefix] = model, rules, plans, kept, ref
        return twins

    def on_val(self, sources, more):
        """Val's workload, a prompt a call, timed in one pass: each source's exit decoders at
        their plans and its drafters at each draft length run_plans gives (sources: prefix ->
        (model, rules, plans, decoder names, the point its output is compared with)), and the
        models of more at full depth, beside full depth. Returns (name, mode) -> the speed-up over
        full depth (a drafter's at its fastest length), and (name, mode) -> the plan each exit
        decoder and drafter runs on test (a drafter's: that fastest length)."""
        cfg = self.config
        tries = run_plans(sources, cfg, self.plain(cfg.draft_layers))
        # full depth, the baseline, first: the exit model's source names it first
        runs = {(prefix + name, mode, i): in_mode(build(name, model, plan, rules), cfg, mode)
                for prefix, (model, rules, _, points, _) in sources.items() for name in points
                for mode in MODES
                for i, plan in enumerate(tries[prefix + name, mode])}
        runs |= {(name, mode, 0): in_mode(build("full", model, None), cfg, mode) for name, (
            model, family) in more.items() if family != "pruned" for mode in MODES}
        speed = speed_pass(runs, self.workloads[0], replace(cfg, bench_repeats=1))
        val = {key: speedup(s, speed["full", key[1], 0]) for key, s in speed.items()}
        best = {key[:2]: key for key in sorted(val, key=val.get)}  # a point's fastest: its last
        return ({key: val[k] for key, k in best.items()},
                {key: tries[key][k[2]] for key, k in best.items() if key in tries})

    def measure(self, names, more, others):
        """The rows of a decoder table on the test workload, a prompt a call, both modes, quality
        teacher-forced on test, each beside its forecast from val and the bytes of weights it
        reads: each source's decoders at their plans, and the models of more (name -> (model,
        family)) at full depth, and the watchable exit decoders watched. Val's workload runs first
        (on_val): the forecasts are its speed-ups (a pruned model has none)."""
        # the exit model's decoders of names (no prefix), then others' (frozen, continued): the
        # exit models the watched table walks; here their watched decoders too, timed and scored
        self.sources = {"": (self.model, self.rules, self.plans, names, "full")} | others
        sources = self.sources | self.watching(self.sources)
        val, plans = self.on_val(sources, more)
        decoders, models = {}, dict(more)
        for prefix, (model, rules, _, points, ref) in sources.items():
            for name in points:
                models[prefix + name] = model, "exit model"
                decoders[prefix + name] = name, {mode: build(name, model, plans.get((
                    prefix + name, mode)), rules) for mode in MODES}, ref
        decoders |= {name: ("full", dict.fromkeys(MODES, build("full", small, None)), "full")
                     for name, (small, _) in more.items()}
        rows = measure_decoders(decoders, self.splits["test"], self.workloads[1], self.config)
        for r in rows:
            plan, (model, family) = plans.get((r["name"], r["mode"]), {}), models[r["name"]]
            r.update(family=family, weight_bytes=weight_bytes(model, r["decoder"], plan))
            if family != "pruned":
                r.update(prediction(r, plan, val))
            self.nll[r["name"]] = r.pop("nll", None)
        return rows

def threshold_sweep(lab):
    """Every tenth threshold on val."""
    m, n = lab.config.confidence_measure, recorded(lab, "val")
    val = sweep(lab.records["val"], m, range(lab.config.n_layer - 1))  # every exit
    return {"sweep": [e for e in val if round(10 * e["threshold"], 6) % 1 == 0],
            "notes": [f"The sweep on {n} val positions, teacher-forced ({m}): compute saved "
                      "against quality", f"full depth's val loss on the {n} val positions: "
                      f"{val[0]['full_loss']:.4f}"]}

def recorded(lab, split):
    """How many positions of a split were recorded: sweep_positions, or all the split holds."""
    return f"{lab.records[split].targets.numel():,}"

def rule_calibrations(lab):
    """Every rule calibrated on val and reported on test, the rule chosen on val, the oracle: the
    exit model's, then the frozen model's."""
    cfg = lab.config
    cal = lab.calibrations[cfg.confidence_measure]
    rows, chosen = rule_table(lab.records, lab.calibrations, lab.rules, cfg)
    notes = [
        f"Learn then Test: disagreement <= {100 * cal['epsilon']:g}% with probability >= "
        f"{100 * (1 - cal['delta']):g}%, chosen on val, reported on {recorded(lab, 'test')} "
        "test positions", "Teacher-forced, with an exact cache, every exit checked. The oracle "
        "leaves at the first exit whose top-1 is full depth's, and spends epsilon where that "
        "saves most: no rule saves more at the same disagreement.",
        f"The chosen rule, {chosen['measure']}: of the {len(lab.rules)}, the one that saves the "
        f"most on val when each is calibrated at delta / {len(lab.rules)} (Bonferroni), so that "
        "the choice keeps the guarantee; a rule picked by its test figures would not."]
    for name, (_, records, calibrations, rules, about) in lab.exit_models.items():
        rows += rule_table(records, calibrations, rules, cfg, name)[0]
        notes.append(f"{name}: {about}")
    return {"calibration_by_measure": rows, "calibration": cal, "chosen_rule": chosen,
            "notes": notes}

def shifted_text(lab):
    """Did epsilon hold on the shifted text? Every rule at its threshold calibrated on val."""
    if "shift" not in lab.records:
        return {}
    cal = lab.calibrations[lab.config.confidence_measure]
    return {"shift": list(lab.calibrations.values()), "notes": [
        f"{lab.config.shift_path}, {recorded(lab, 'shift')} positions",
        f"share leaving at layer 0 ({cal['measure']}): test {cal['test']['exit_fractions'][0]:.1%}"
        f", shifted {cal['shift']['exit_fractions'][0]:.1%}",
        f"On {lab.config.shift_path}, epsilon {'held' if cal['shift']['held'] else 'was BROKEN'} "
        f"for {cal['measure']}: {cal['shift']['disagreement']:.2%} disagreement against "
        f"{100 * cal['epsilon']:g}%. The "
        "guarantee covers text like val, and nothing else."]}

def exit_figures(q, full, n_layer, spot=0.0, shadow=0.0):
    """A quality_pass's disagreement with full depth's top-1 (full), the share of layer runs its
    exits skip (less `spot`, the share of them run again, and `shadow`, the share of positions a
    shadow ran at full depth), and the share that leave early."""
    return {"disagreement": average(q["pred"] != full), "early": average(q["exits"] < n_layer - 1),
            "compute_saved": (1 - spot) * (1 - average(q["exits"] + 1) / n_layer) - shadow}

def watched_decoders(lab):
    """Backfill and deferred, fixed and watched, on STREAMS pieces of test and shift a call; with
    --continued every exit model's, and state copy and holes a piece a call (rows run as deep)."""
    cfg, found = lab.config, []
    rows = min(STREAMS, cfg.sweep_positions)  # a piece a position at least
    for text, (prefix, (model, rules, plans, names, _)) in itertools.product(
            [t for t in ("test", "shift") if t in lab.splits], watched_models(lab.sources, cfg)):
        piece = min(cfg.sweep_positions // rows, len(lab.splits[text]) - cfg.bench_prompt_len)
        if piece < 1:  # a text shorter than a prompt and a position
            continue
        def run(decode, batch=rows):  # teacher-forced on `rows` pieces, `batch` a call
            return quality_pass(decode, lab.splits[text], piece * rows, batch,
                                cfg.bench_prompt_len, piece)
        full = run(build("full", model, None))["pred"]
        for name in watchable(names, cfg):
            exact = DECODERS[name].cache == "exact"
            batch = rows if exact else 1
            plan, monitor = watched(name, model, plans[name], cfg, batch)
            fixed = run(build(name, model, plans[name], rules), batch)
            moving = run(build(name, model, plan, rules), batch)
            seen = monitor.seen / len(full)
            # spot checks run a share of what exits skip again; a shadow, each labelled position
            cost = (cfg.spot_share * DECODERS[name].skips, 0) if exact else (0, seen)
            found.append({"model": prefix.strip() or "joint", "decoder": name, "text": text,
                "fixed": exit_figures(fixed, full, cfg.n_layer), "moving": exit_figures(
                    moving, full, cfg.n_layer, *cost), "val_early": plans[name]["early"],
                "labelled": seen, "heads": monitor.heads * batch / len(full),
                "target": monitor.target, "upper": float(rate_bound(
                    torch.tensor(monitor.wrong + 0.0), max(monitor.seen, 1), cfg.delta))})
    return {"moving": found, "notes": [
        f"{cfg.sweep_positions:,} positions of each text, in {rows} pieces spread over it",
        f"Watched: a Monitor a decoder for its {rows} pieces, from the calibrated threshold, "
        f"credit {cfg.adapt_credit}, horizon {cfg.adapt_horizon:,}: of T positions at most target "
        "T + credit + 4 + b disagree (b: the most one update may bring), at most epsilon once T "
        f"reaches the horizon. Backfill labels every exit (b: rows); deferred spot-checks "
        f"{cfg.spot_share:.0%} of steps, state copy and holes (--continued, a piece a call) of "
        "windows, by a shadow (the window's exact cache copied, running every layer; b: a "
        "window's steps / share), each disagreement found counted 1 / share: epsilon in expected "
        "value. Speed: the strategies table's watched rows. Self-speculation needs none of this: "
        "a shift costs it speed, never its output."]}

def strategies(lab):
    """The strategies table, and under it what it rests on: the drafts, the measured costs."""
    cfg = lab.config
    rows = [r for r in lab.measured if r["family"] != "pruned"]
    notes = [f"{e['name']} {e['mode']}: drafts to layer {e['draft_exit']}, num_draft="
             f"{e['num_draft']}, acceptance {e['acceptance_rate']:.3f} (drafts kept over drafts a "
             f"row could keep), {e['tokens_per_verify']:.2f} tokens a verify pass, output: "
             f"{e['output']}" for e in rows if DECODERS[e["decoder"]].drafter]
    # the full model's decoders: a smaller GPT or a draft model re-prefills fewer layers
    prefill = sorted({round(e["prefill_layers"], 2) for e in rows if e["family"] == "exit model"
                      and DECODERS[e["decoder"]].drafter != "model"})
    return {"strategies": rows, "decode_costs": lab.costs, "plans": lab.plans, "notes": [
        f"{cfg.bench_prompts} test prompts of {cfg.bench_prompt_len} characters, "
        f"{cfg.bench_tokens} more each, batch 1, {cfg.bench_repeats} interleaved passes",
        *notes, f"Chosen on val: exits (exit_layers={cfg.exit_layers!r}) at the run's threshold "
        f"({lab.threshold:g}), priced from the unit costs (report.json's decode_costs), the "
        "schedule, and each drafter's draft length in each mode: the faster on val of num_draft "
        "and its half, if 1 or more (another exit model's rows: its own threshold "
        "and plans; the frozen model's output against the plain GPT's). predicted: each row's "
        "speed-up on val's workload, timed before test's (the same decoder, plan and k, or the "
        "same model, in the same mode; per round: a round's time over the tokens it emits; a "
        "drafter's, the better of its two, leans high). Prefilling the "
        "prompt and re-prefilling the window every block_size/2 tokens adds "
        f"{' to '.join(f'{p:.2f}' for p in prefill)} per token for every decoder. Sampled: "
        f"temperature {cfg.temperature:g}, top_k {cfg.top_k}.",
        f"output's agreement: on {len(lab.nll['full']):,} test positions, teacher-forced. The "
        "guarantee of a calibrated threshold covers every exit checked with an exact cache: not "
        "a subset of exits, nor an approximate cache or holes."]}

def tails(lab):
    """Average or tail: the strategies rows' latency."""
    return {"tail": [{k: row[k] for k, *_ in TAIL_TABLE[1]} for row in lab.measured
                     if row["family"] != "pruned"], "notes": [
        "Batch 1, the test workload, every step or round timed with the device synchronised, in "
        "the last timed pass", "A prompt's first step prefills it, and a step that slides the "
        "window re-prefills it: those steps are the tail of every decoder; a round's tokens "
        "arrive at once, so speculation's gaps p95 and p99 are its rounds."]}

def frontier(lab):
    """When does early exit pay? Every point by test loss, teacher-forced on the same test
    positions, against its speed-up in each mode, marked with the point that beats it on both
    beyond the loss's error bar; and what each holds in memory."""
    cfg, rows = lab.config, []
    se = paired_se(lab.nll, cfg.bench_tokens)  # every point's, measure()'s
    for p in frontier_points(lab.measured, se):
        p.update(weights_mb=p["weight_bytes"] / 2**20, kv_kb=p["cache_bytes"] / 1024)
        rows.append({key: p[key] for key, *_ in FRONTIER_TABLE[1]} | {"decoder": p["decoder"],
            "family": "speculation" if DECODERS[p["decoder"]].drafter else p["family"]})
    # the joint recipe's cost at full depth: against the plain GPT of its shape
    on, deep, loss = frontier_names(rows), f"{cfg.n_layer}-layer GPT", {
        r["name"]: r["test_loss"] for r in rows}
    seconds = ", ".join(f"{d}-layer GPT {t:.0f} s" for d, (_, t) in sorted(lab.plain_gpts.items()))
    # what would beat each point without the error bar (an error of 0)
    tied = {mode: ", ".join(f"{r['name']} ({o}'s loss)" for r, o in zip(rows, dominated_by(
        rows, mode, dict.fromkeys(se, 0.0))) if o and not r[f"dominated_{mode}"]) or "none"
            for mode in MODES}
    return {"frontier": rows, "recipe_cost": loss["full"] - loss[deep], "notes": [
        f"Test loss on {len(lab.nll['full']):,} test positions in pieces of {cfg.bench_tokens} "
        "spread over test, teacher-forced through each decoder (speculation: full depth's, by "
        "construction); speed-ups on the strategies table's workload",
        f"On the frontier, greedy: {on['greedy']}; sampled: {on['sampled']}. Every other point is "
        "beaten by the one named: at least as fast, and lower in test loss by over twice the "
        "paired standard error of the difference (or faster at the same predictions' loss).",
        "Within twice that error of the loss of a point at least as fast, so tied in loss and on "
        f"the frontier: greedy, {tied['greedy']}; sampled, {tied['sampled']}.",
        "Memory: weights a decoder reads (the exit heads it checks; a draft model's too), keys and "
        "values it holds a sequence at the window's full length (speculation: "
        "its draft length's spare slots; a watched state copy's or holes' shadow holds a copy "
        f"more, not counted). Training: the exit model {lab.train_seconds:.0f} s, "
        f"{seconds}; pruned models, none.", "The exit recipe's cost at full depth: "
        f"{loss['full'] - loss[deep]:+.4f} (paired standard error {se['full', deep]:.4f}) in test "
        f"loss against the plain {deep} of the same shape, steps and data"],
        "paired_se": {f"{a} - {b}": e for (a, b), e in se.items() if a < b}}

# -----------------------------------------------------------------------------
# The page: out_dir/report.html, one self-contained page (inline CSS and SVG, no script)

# viridis, dark to light: the layers' order reads without hue (colour-blind safe)
VIRIDIS = ("#440154 #411c66 #3e3779 #3b528b #32678b #2a7c8c #21918c #35a47e #4ab670 #5ec962 "
           "#93d34e #c8dd39 #fde725").split()

def layer_colour(layer, n_layer):
    """The first layer's colour is viridis' darkest, the last one's its lightest."""
    return VIRIDIS[round(layer * (len(VIRIDIS) - 1) / max(1, n_layer - 1))]

def swatch(layer, n_layer):
    """A layer's colour as a background, under text that reads on it."""
    colour = layer_colour(layer, n_layer)
    ink = "#000" if colour in VIRIDIS[8:] else "#fff"  # dark ink on viridis' lighter colours
    return f'style="background:{colour};color:{ink}"'

esc = html.escape  # text made safe inside HTML and its attributes

def datum(key, value):
    """The attributes that tie a number on the page to its place in report.json (a test checks)."""
    return f'data-key="{esc(key)}" data-value="{value!r}"'

# a chart series' class (its mode, the sweep's figure, a frontier point's family) picks its colour
HTML_STYLE = """
:root { --bg: #fff; --fg: #1d1d1f; --muted: #6e6e73; --grid: #d2d2d7; --a: #2a788e; --b: #e66101;
  --c: #762a83; }
@media (prefers-color-scheme: dark) { :root { --bg: #161618; --fg: #f2f2f7; --muted: #a1a1a6;
  --grid: #3a3a3c; --a: #5ec9c9; --b: #fdb863;
  --c: #c2a5cf; } }
body { background: var(--bg); color: var(--fg); font: 15px/1.5 system-ui, sans-serif;
  max-width: 1180px; margin: 0 auto; padding: 1em; }
h2 { border-bottom: 1px solid var(--grid); padding-bottom: .2em; margin-top: 2em; }
.muted { color: var(--muted); } a { color: var(--a); }
.row { display: flex; gap: 2em; flex-wrap: wrap; } .row > div { flex: 1 1 20em; }
pre.sample { white-space: pre-wrap; font: 14px/1.7 ui-monospace, monospace; }
pre.sample span, .legend span { border-radius: 2px; }
.legend span { padding: 0 .5em; margin-right: .3em; white-space: nowrap; display: inline-block; }
.scroll { overflow-x: auto; } .scroll svg { min-width: 560px; max-width: 800px; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
td, th { padding: .2em .6em; border-bottom: 1px solid var(--grid); text-align: right;
  white-space: nowrap; }
th { color: var(--muted); font-weight: 500; }
svg text { fill: var(--fg); font: 13px system-ui, sans-serif; } svg .grid { stroke: var(--grid); }
svg .decoder { fill: var(--a); } svg .speculation { fill: var(--b); } svg .gpt { fill: var(--c); }
svg .pruned { fill: var(--bg); stroke: var(--fg); } svg .path { stroke: var(--fg); }
svg .line { fill: none; stroke-width: 2; }
#summary { border: 1px solid var(--grid); border-radius: 6px; padding: 0 1em; }
"""

def nice_ticks(top, bottom=0):
    """Round ticks from bottom (0, or a tick under a negative bottom) up to top or just past it:
    steps of 1, 2 or 5 times a power of ten, about five of them."""
    span = max(top - bottom, 1e-9)
    power = 10 ** math.floor(math.log10(span / 5))
    step = next(m for m in (1, 2, 5, 10) if m * power * 5 >= span) * power
    first = math.floor(bottom / step + 1e-9)
    return [i * step for i in range(first, max(first + 1, math.ceil(top / step - 1e-9)) + 1)]

# a chart is 640 SVG units wide and shrinks no narrower than 560 px (it scrolls sideways on a
# phone), so its 13-unit text stays over 11 px
PLOT_WIDTH = 550  # SVG units from the y axis to the right edge
PLOT_HEIGHT = 240  # SVG units from the top to the x axis; the labels and the legend go below it

def plot_x(x):
    """Where x in [0, 1] sits across a chart, right of the y axis's labels."""
    return 70 + PLOT_WIDTH * x

def plot_y(y, ticks):
    """Where y sits up a chart: the first tick on the x axis, the last a tenth under the top edge;
    a y over the last tick at the last tick."""
    return PLOT_HEIGHT * (1 - 0.9 * (min(y, ticks[-1]) - ticks[0]) / (ticks[-1] - ticks[0]))

def svg_path(path, ticks):
    """A line through points (x in [0, 1], y, name), each named under it on its right and at least
    a line under the name on its right (a higher point, on a frontier), so that no two overlap:
    its SVG elements, a list."""
    coords = " ".join(f"{plot_x(x):.1f},{plot_y(y, ticks):.1f}" for x, y, _ in sorted(path))
    parts, base = [f'<polyline class="path line" points="{coords}"/>'], 0
    for x, y, name in sorted(path, reverse=True):
        base = max(plot_y(y, ticks) + 14, base + 14)  # 13-unit text
        parts.append(f'<text x="{plot_x(x) + 5:.1f}" y="{base:.1f}">{esc(name)}</text>')
    return parts

def svg_chart(series, x_ticks, titles, y_fmt, path):
    """Dots with a path. series: (name, class, points), a point (x in [0, 1], y, report key, hover
    text); x_ticks: {label: x}; titles: the axes'; path: (x, y, name)s joined, each named."""
    ys = [p[1] for _, _, points in series for p in points]
    # an axis from a quarter of the points' span under the lowest, to name it
    ticks, H = nice_ticks(max(ys), min(ys) - (max(ys) - min(ys)) / 4), PLOT_HEIGHT
    parts = [f'<div class="scroll"><svg viewBox="0 0 640 {H + 64 + 18 * len(series)}" '
             f'width="100%" role="img"><text transform="translate(14 {H / 2}) rotate(-90)" '
             f'text-anchor="middle">{esc(titles[1])}</text><text x="345" y="{H + 52}" '
             f'text-anchor="middle">{esc(titles[0])}</text>']
    parts += [f'<line class="grid" x1="64" x2="630" y1="{plot_y(t, ticks):.1f}" '
              f'y2="{plot_y(t, ticks):.1f}"/><text x="58" y="{plot_y(t, ticks) + 4:.1f}" '
              f'text-anchor="end">{y_fmt.format(t)}</text>' for t in ticks]
    parts += [f'<text x="{plot_x(x):.1f}" y="{H + 18}" text-anchor="middle">{esc(label)}</text>'
              for label, x in x_ticks.items()]
    parts += svg_path(path, ticks)
    for s, (name, cls, points) in enumerate(series):
        parts += [f'<circle cx="{plot_x(x):.1f}" cy="{plot_y(y, ticks):.1f}" r="3" '
                  f'class="{cls}" {datum(key, y)}><title>{esc(tip)}</title></circle>'
                  for x, y, key, tip in points]
        parts.append(f'<rect class="{cls}" x="70" y="{H + 66 + 18 * s}" width="12" height="12"/>'
                     f'<text x="88" y="{H + 77 + 18 * s}">{esc(name)}</text>')
    return "".join(parts) + "</svg></div>"

def html_table(columns, rows, key, notes):
    """A table's columns and rows in a box that scrolls sideways on a narrow screen, then its
    legend and notes; the rows are report.json's list under key."""
    out = ["<div class='scroll'><table><tr>"]
    out += [f"<th>{esc(header)}</th>" for _, header, _, _ in columns]
    for i, row in enumerate(rows):
        out.append("</tr><tr>")
        for k, _, fmt, _ in columns:
            value = field(row, k)
            # a number (not a bool): tie it to report.json
            tie = f" {datum(f'{key}.{i}.{k}', value)}" if type(value) in (int, float) else ""
            out.append(f"<td{tie}>{esc(format_cell(value, fmt))}</td>")
    out += ["</tr></table></div>"] + [f"<p class='muted'>{esc(note)}</p>"
                                      for note in (legend(columns), *notes)]
    return "".join(out)

def section(anchor, question, *body):
    """One section of the page under its question; the summary links to it by its anchor."""
    return f"<section id='{anchor}'><h2>{esc(question)}</h2>{''.join(body)}</section>"

def html_summary(report, body):
    """What was trained on what, the run's summary (the console's last lines), links to every
    section of the body."""
    cfg = report["config"]
    # a --sample_only page has no summary
    lines = "".join(f"<li>{esc(line)}</li>" for line in report.get("summary", ()))
    links = " · ".join(f"<a href='#{a}'>{q}</a>"  # q: escaped already
                       for a, q in re.findall(r"<section id='([^']+)'><h2>([^<]+)</h2>", body))
    return (f"<div id='summary'><p>A {cfg['n_layer']}-layer GPT ({cfg['n_head']} heads, "
            f"{cfg['n_embd']} wide, context {cfg['block_size']} characters) with an exit head "
            f"after every layer but the last, trained on {esc(cfg['input_path'])}.</p><ul>{lines}"
            "</ul><p class='muted'>Speed-ups pair each call with full depth's, interleaved, on "
            "the machine that wrote this page, and move with its load; every number here is in "
            f"report.json.</p><p>{links}</p></div>")

def html_generation(report):
    """The early-exit sample on the colours of its exit layers, full depth's beside it; the legend
    counts the characters that left at each layer."""
    g, L = report["generation"], report["config"]["n_layer"]
    # a character each on the colour of its layer, which its title names
    spans = "".join(f'<span {swatch(l, L)} data-layer="{l}" title="layer {l}">{esc(ch)}</span>'
                    for ch, l in zip(g["sample"], g["exited_at"]))
    spans = spans.replace("\n</span>", "&#8629;</span>\n")  # a newline shows a mark, then breaks
    legend = "".join(f"<span {swatch(l, L)}>layer {l}: <b {datum(f'generation.exit_counts.{l}', c)}"
                     f">{c}</b></span>" for l, c in enumerate(g["exit_counts"]))
    return section(
        "sample", "What does early exit look like?", f"<p class='legend'>{legend}</p><p "
        f"class='muted'>Each character of the early-exit sample ({esc(g['decoder'])}) sits on "
        "the colour of the layer it left at, dark "
        f"(layer 0) to light (layer {L - 1}, full depth); the legend counts the characters that "
        "left at each layer; hover for a character's layer.</p><div "
        "class='row'><div><h3>early exit</h3><pre class='sample'>\n"
        f"{spans}</pre></div><div><h3>full depth</h3><pre "
        f"class='sample'>\n{esc(g['full_depth_sample'])}</pre></div></div>")

def frontier_chart(report):
    """A chart a mode: every point's test loss against its speed-up, coloured by its family; a line
    joins the frontier (the points nothing beats, ties in loss among them) and names its points."""
    rows, charts = report["frontier"], ""
    for mode in MODES:
        # the fastest point at most 4/5 of the way across, so that its name fits on its right
        top = nice_ticks(1.25 * max(r[f"speedup_{mode}"] for r in rows))[-1]
        families = {}  # (legend, class): points, in the rows' order
        for i, r in enumerate(rows):
            families.setdefault(FAMILIES[r["family"]], []).append((
                r[f"speedup_{mode}"] / top, r["test_loss"], f"frontier.{i}.test_loss",
                f"{r['name']}, {mode}: {r[f'speedup_{mode}']:.2f}x, {r['test_loss']:.4f}"))
        path = [(r[f"speedup_{mode}"] / top, r["test_loss"], r["name"])
                for r in rows if r[f"dominated_{mode}"] is None]  # the points nothing beats
        charts += svg_chart([(*kind, points) for kind, points in families.items()],
                            {f"{t:g}x": t / top for t in nice_ticks(top)},
                            (f"speed-up over full depth, {mode} (line: the frontier)", "test loss"),
                            "{:.3f}", path)
    return charts

def html_report(report):
    """report.html: report.json's numbers on a page that reads on a phone: the summary, the
    sample, then every analysis of the run in the list's order."""
    body = html_generation(report)
    for key, (question, columns), _, chart in ANALYSES:
        if key in report:  # an analysis's section: its conditions, its chart, its table and notes
            conditions, *notes = report["notes"][key]
            body += section(key, question, f"<p>{esc(conditions)}</p>",
                            chart(report) if chart else "",
                            html_table(columns, report[key], key, notes))
    return ('<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            'content="width=device-width, initial-scale=1"><meta name="color-scheme" '
            'content="light dark"><title>nanogpt_exit_head report</title>'
            f"<style>{HTML_STYLE}</style></head><body><h1>Early exit in a character-level GPT"
            f"</h1>{html_summary(report, body)}{body}</body></html>")

# -----------------------------------------------------------------------------
# Checkpoints: written to a temporary file, then renamed; resume, Ctrl-C

ARCH_FIELDS = "n_layer n_head n_embd block_size bias".split()  # forced on resume
# the recipe a run trains with: a resume takes these from its checkpoint, unless given anew
TRAINING_FIELDS = ("seed dropout alpha batch_size max_iters learning_rate min_lr warmup_iters "
                   "weight_decay beta1 beta2 grad_clip eval_interval eval_iters distill_weight "
                   "distill_temperature layer_dropout").split()
PROGRESS = "vocab iter_num train_seconds train_log".split()  # a run's plain data
CHECKPOINT_KEYS = set("model optimizer config rng".split() + PROGRESS)

def checkpoint_path(config):
    """Where a run's checkpoint lives: out_dir/ckpt.pt."""
    return os.path.join(config.out_dir, "ckpt.pt")

def read_checkpoint(path):
    """A checkpoint's dict, on the CPU; weights_only: a checkpoint is data, never code to run."""
    return torch.load(path, map_location="cpu", weights_only=True)

def write_text(text, path):
    """Written to path.tmp, then renamed: a crash leaves the old file or the new, never half."""
    Path(path + ".tmp").write_text(text, encoding="utf-8")
    os.replace(path + ".tmp", path)  # atomic on POSIX and Windows

def random_states():
    """torch's random states (dropout, layer dropout): the CPU's and every GPU's (none on a
    machine without)."""
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all()}

def set_random_states(states):
    torch.set_rng_state(states["torch"])
    torch.cuda.set_rng_state_all(states["cuda"])

def save_checkpoint(path, model, optimizer, config, progress):
    """Tensors and plain data only, so torch.load(weights_only=True) reads it back. progress: the
    vocabulary, iter_num (steps done), train_seconds and train_log. Atomic, as in write_text."""
    torch.save(progress | {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                           "config": asdict(config), "rng": random_states()}, path + ".tmp")
    os.replace(path + ".tmp", path)

def add_to_checkpoint(path, **entries):
    """The checkpoint at path with entries added (the calibration that sampling reads), written
    as save_checkpoint writes."""
    torch.save(read_checkpoint(path) | entries, path + ".tmp")
    os.replace(path + ".tmp", path)

def load_checkpoint(path, config, overridden, tokenizer):
    """Load ckpt.pt into (checkpoint, overrides). The architecture comes from it and must agree
    with the command line; so does the recipe, unless given anew: overrides names each field the
    command line changes."""
    if not zipfile.is_zipfile(path):  # torch.save writes a zip; a truncated one lost its directory
        raise ValueError(f"no readable checkpoint at {path!r} (none, truncated, or not a zip); "
                         "train one with --init_from=scratch")
    try:
        ckpt = read_checkpoint(path)
    except (RuntimeError, pickle.UnpicklingError) as e:  # a zip not torch's, or objects not data
        raise ValueError(f"{path!r} is not a readable checkpoint: {type(e).__name__}") from None
    if not isinstance(ckpt, dict) or not CHECKPOINT_KEYS <= set(ckpt):
        raise ValueError(f"{path!r} is not a checkpoint of this script: it needs "
                         f"{', '.join(sorted(CHECKPOINT_KEYS))}")
    if ckpt["vocab"] != tokenizer.chars:
        raise ValueError(f"checkpoint vocabulary ({len(ckpt['vocab'])} chars) does not match "
                         f"{config.input_path!r}")
    overrides = []
    for name in ARCH_FIELDS + TRAINING_FIELDS:
        given = getattr(config, name)
        saved = ckpt["config"].get(name, given)  # a field newer than the checkpoint: as given
        if name not in overridden:
            setattr(config, name, saved)
        elif given != saved:
            if name in ARCH_FIELDS:
                raise ValueError(f"checkpoint has {name}={saved}, but --{name}={given} was given")
            overrides.append(f"--{name}={given} (the checkpoint's: {saved})")
    validate(config)  # the rules that tie fields together, with the checkpoint's architecture
    return ckpt, overrides

class Interrupted(Exception):
    """Ctrl-C stopped training; the checkpoint at `path` holds every step done."""

def new_or_resumed(config, tokenizer, device, overridden):
    """(model, optimizer, progress): new, or the checkpoint's with its random states back. On
    resume, it prints what the command line changes of the checkpoint's recipe."""
    ckpt = {"vocab": tokenizer.chars, "iter_num": 0, "train_seconds": 0.0, "train_log": []}
    if config.init_from == "resume":  # before the model is built: it sets the architecture
        ckpt, overrides = load_checkpoint(checkpoint_path(config), config, overridden, tokenizer)
        if overrides:
            print(f"resumed with the checkpoint's recipe but {', '.join(overrides)}")
    torch.manual_seed(config.seed)
    model = RecipeGPT(config).to(device)
    optimizer = configure_optimizer(model, config)
    if config.init_from == "resume":
        try:  # strict: every name and shape must match
            model.load_state_dict(ckpt["model"])
        except RuntimeError as e:
            raise ValueError("checkpoint does not fit the model: "
                             + " ".join(str(e).split())[:300]) from None
        # the saved state with the recipe's hyperparameters, given anew or not
        for saved, group in zip(ckpt["optimizer"]["param_groups"], optimizer.param_groups):
            saved.update(weight_decay=group["weight_decay"], betas=group["betas"],
                         fused=group["fused"])
        optimizer.load_state_dict(ckpt["optimizer"])  # a ValueError where its groups do not fit
        set_random_states(ckpt["rng"])
    return model, optimizer, {key: ckpt[key] for key in PROGRESS}

def train_with_checkpoints(model, optimizer, splits, config, device, progress):
    """Train from progress's step to max_iters, with a checkpoint at every evaluation and
    on Ctrl-C, which then raises Interrupted. Updates progress; returns (seconds, ms a step)."""
    path = checkpoint_path(config)
    done = progress["iter_num"]
    seconds = progress["train_seconds"]
    log = progress["train_log"]
    # batches seeded from seed; the steps done draw theirs again (one a step, cheap), so that a
    # resumed run draws what it would have
    generator = torch.Generator().manual_seed(config.seed)
    for _ in range(done):
        get_batch(splits["train"], config.block_size, config.batch_size, generator, "cpu")
    stop = []  # Ctrl-C's flag
    t0 = time.time()

    def on_step(it, new_log):  # before every step
        if stop or (it % config.eval_interval == 0 and it > done):
            progress.update(iter_num=it, train_seconds=seconds + time.time() - t0,
                            train_log=log + new_log)
            save_checkpoint(path, model, optimizer, config, progress)
        if stop:
            raise Interrupted(path)

    # Ctrl-C only sets a flag: the step under way finishes, so the checkpoint holds whole steps
    handler = signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    try:
        took, ms, new_log = train(model, optimizer, splits, config, device, done, generator,
                                  on_step, torch.compile(model) if config.compile else model)
    finally:
        signal.signal(signal.SIGINT, handler)
    progress.update(iter_num=max(done, config.max_iters), train_seconds=seconds + took,
                    train_log=log + new_log)
    return took, ms

def train_or_resume(config, tokenizer, splits, device, overridden, report):
    """A new model or the checkpoint's, trained up to max_iters with a checkpoint at every
    evaluation and on Ctrl-C. The training figures go into report."""
    model, optimizer, progress = new_or_resumed(config, tokenizer, device, overridden)
    done = progress["iter_num"]
    path = checkpoint_path(config)
    base, heads = count_params(model)
    os.makedirs(config.out_dir, exist_ok=True)
    # three lines: the run, the parameters, what the losses while training are
    sizes = "/".join(f"{len(split):,}" for split in splits.values())
    print(f"device: {device} | vocabulary: {tokenizer.vocab_size} characters | train/val/test: "
          f"{sizes} characters\n"
          f"parameters: {base / 1e6:.3f} M base model, {heads / 1e6:.3f} M in "
          f"{config.n_layer - 1} exit heads ({100 * heads / base:.2f}% overhead)\n"
          f"losses while training: each split's mean over {config.eval_iters} batches of "
          f"{config.batch_size} random windows of {config.block_size} characters; 'val loss' "
          "is full depth's")
    took, ms = train_with_checkpoints(model, optimizer, splits, config, device, progress)
    losses = estimate_loss(model, splits, config, device)
    print(format_eval(progress["iter_num"], losses))
    save_checkpoint(path, model, optimizer, config, progress)
    if done < config.max_iters:
        print(f"trained steps {done}..{config.max_iters} in {took:.1f} s, median {ms:.1f} ms a "
              f"step; checkpoint: {path}")
    else:
        ms = None
        start = (f"resumed from {path} at step {done}" if config.init_from == "resume"
                 else "a new model")
        print(f"{start}, max_iters={config.max_iters}: no training this run")
    report.update(config=asdict(config), n_params=base, n_params_exit_heads=heads,
                  train_seconds=progress["train_seconds"], ms_per_iter=ms,
                  val_loss={"final": losses["val"][-1], "exits": losses["val"][:-1]},
                  train_loss=losses["train"][-1], train_log=progress["train_log"])
    return model.eval()

# -----------------------------------------------------------------------------
# Command line: every Config field as --name=value (argparse), and the rules it checks

RANGES = {  # the numbers each field takes: [ or ] includes that end, ( or ) leaves it out
    "[0, inf)": "max_iters warmup_iters top_k draft_exit alpha min_lr weight_decay grad_clip "
                "temperature distill_weight adapt_credit",
    "[0, 4294967295]": "seed",  # numpy's range of seeds
    "[1, inf)": "n_head n_embd batch_size eval_interval eval_iters max_new_tokens num_draft "
                "quality_positions bench_prompts bench_prompt_len bench_repeats draft_layers "
                "adapt_horizon",
    "[10, inf)": "sweep_positions",  # the learned rule is fitted on ten pieces of train
    "[2, inf)": "n_layer block_size bench_tokens",  # bench_tokens: a gap between two tokens
    "(0, inf)": "learning_rate distill_temperature",
    "[0, 1)": "dropout beta1 beta2 layer_dropout continued",
    "[0, 1]": "schedule_disagreement spot_share",
    "(0, 1)": "epsilon delta",
    "[-1, 1]": "exit_threshold",  # -1 calibrates on val; not in (-1, 0)
}
CHOICES = {"init_from": ("scratch", "resume"),
           "kv_strategy": tuple(name for name, d in DECODERS.items() if d.samples),
           "confidence_measure": (*EXIT_RULES, "learned")}

def boolean(text):
    """An argparse type: true/false or 1/0."""
    if text.lower() not in "true false 1 0".split():
        raise ValueError(text)
    return text.lower() in ("true", "1")

def in_range(value, rule):
    """Whether value lies in an interval of RANGES, e.g. '[0, 1)'."""
    low, high = map(float, rule[1:-1].split(","))
    return (low < value < high or value == low and rule[0] == "["
            or value == high and rule[-1] == "]")

class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a bad argument raised as a ValueError: main prints one line, exits with 2."""
    def error(self, message):
        raise ValueError(message)

def build_parser():
    """One --name for every field of LabConfig but vocab_size; its help is the field's comment.
    A field not given stays out of what it parses (SUPPRESS), so LabConfig's default holds."""
    source = inspect.getsource(Config) + inspect.getsource(LabConfig)
    comments = dict(re.findall(r"^ +(\w+): .*?  # (.*)$", source.replace("%", "%%"), re.M))
    # argparse lists the choices
    rules = dict.fromkeys(CHOICES, " one of %(choices)s") | {
        name: f" in {rule}" for rule, names in RANGES.items() for name in names.split()}
    parser = ArgumentParser(
        usage="nanogpt_exit_head.py [--name=value ...]", allow_abbrev=False,
        argument_default=argparse.SUPPRESS)
    for f in fields(LabConfig):
        if f.name != "vocab_size":
            parser.add_argument(
                f"--{f.name}", type=boolean if f.type is bool else f.type,
                choices=CHOICES.get(f.name), metavar="",
                help=f"{comments.get(f.name, '')} (default {f.default!r}){rules.get(f.name, '')}")
    return parser

def parse_args(argv):
    """--name=value for any field; returns (config, the names given)."""
    known, unknown = build_parser().parse_known_args(argv)
    if unknown:
        names = [f"--{f.name}" for f in fields(LabConfig)]
        close = difflib.get_close_matches(unknown[0].split("=")[0], names) or ["a name of --help"]
        raise ValueError(f"unknown argument {unknown[0]!r}: arguments are --name=value; did you "
                         f"mean {close[0]}?")
    config = LabConfig(**vars(known))
    # a resume's architecture is the checkpoint's: load_checkpoint checks the rules again with it
    validate(config, math.inf if config.init_from == "resume" else None)
    return config, set(vars(known))

def plain_depths(text, draft_layers, n_layer):
    """The plain GPTs a run trains: the draft model's depth, the exit model's (the undamaged deep
    model: the recipe's cost; the frozen model's trunk) and --depths: none (''), all below n_layer,
    or a comma list."""
    depths = range(1, n_layer) if text == "all" else [int(d) for d in text.split(",") if d]
    return sorted({draft_layers, n_layer, *depths})

def field_rules(config, L):
    """The rules that tie fields together, for a model of L layers: (broken, its message) each."""
    return (
        (config.n_embd % config.n_head,
         f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}"),
        (config.min_lr > config.learning_rate,
         f"min_lr={config.min_lr} is above learning_rate={config.learning_rate}"),
        (-1 < config.exit_threshold < 0, "exit_threshold: -1 (calibrate on val) or in [0, 1]"),
        (config.draft_exit >= L - 1, f"draft_exit={config.draft_exit}: below the last, 0..{L - 2}"),
        (not config.prompt, "--prompt must hold at least one character"),
        (config.quality_positions < config.bench_tokens,
         f"--quality_positions={config.quality_positions}: at least bench_tokens"),
        (not re.fullmatch(r"(all|(\d+,)*\d+)?", config.depths),
         f"--depths={config.depths!r}: '', 'all' or a comma list of layers"),
        (any(not 0 < int(d) <= L for d in re.findall(r"\d+", config.depths)),
         f"--depths={config.depths!r}: plain GPTs of 1..{L} layers"),
        (config.num_draft > config.block_size and L < math.inf,
         f"--num_draft={config.num_draft}: at most block_size={config.block_size} (the window)"),
        (0 < config.temperature < 1e-6,
         f"--temperature={config.temperature}: 0 (greedy) or at least 1e-6 (logits / it overflow)"),
        (config.draft_layers >= L,
         f"--draft_layers={config.draft_layers}: a draft model smaller than the model, 1..{L - 1}"),
        (config.confidence_measure in ("patience", "learned") and (
            config.lesson_only or config.exit_layers not in ("auto", "all")),
         "patience and the learned rule read every exit, in the lab: no --lesson_only, and "
         "--exit_layers=auto"),
        (config.lesson_only and any(getattr(config, name) != getattr(LabConfig, name) for name in
            "init_from sample_only confidence_measure kv_strategy exit_layers depths "
            "continued".split()),
         "--lesson_only is Part I alone: no --init_from=resume, --sample_only, --kv_strategy, "
         "--confidence_measure, --exit_layers, --depths or --continued"),
        (config.epsilon * config.adapt_horizon <= config.adapt_credit + 4 + STREAMS / (
            config.spot_share or 1), f"--adapt_horizon={config.adapt_horizon}: over (adapt_credit"
         f" + 4 + {STREAMS} / spot_share) / epsilon"),
        (config.continued and not 0 < round(config.max_iters * (1 - config.continued))
         < config.max_iters, f"--continued={config.continued}: a step or more in each stage "
         f"of max_iters={config.max_iters}"),
        (config.sample_only and config.init_from != "resume",
         "--sample_only=1 samples from a checkpoint: add --init_from=resume"))

def validate(config, n_layer=None):
    """The ranges, the rules that tie fields together, the files and the folder. n_layer: the
    depth the rules check against, config.n_layer unless given (inf: none yet, before a resume)."""
    n_layer = n_layer or config.n_layer
    for rule, names in RANGES.items():
        for name in names.split():
            if not in_range(getattr(config, name), rule):
                raise ValueError(f"--{name}={getattr(config, name)} is outside {rule}")
    for broken, message in field_rules(config, n_layer):
        if broken:
            raise ValueError(message)
    if n_layer < math.inf:
        parse_exit_layers(config)
    check_text(config)
    if config.lesson_only:  # Part I alone writes nothing
        return
    try:  # say now, not after training, that out_dir cannot be a folder this run writes in
        os.makedirs(config.out_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=config.out_dir).close()
    except OSError as e:
        raise ValueError(f"--out_dir={config.out_dir!r} cannot be a folder: {e.strerror}") from None

def read_text(config, name):
    """The UTF-8 text of the file a field names (no such file, or not UTF-8: iconv -t UTF-8 it)."""
    try:
        return Path(getattr(config, name)).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--{name}={getattr(config, name)!r}: {e}") from None

def check_text(config):
    """The input file is UTF-8 text long enough for every split; the prompt's and the shifted
    text's characters are in its vocabulary."""
    text = read_text(config, "input_path")
    if len(set(text)) < 2:
        raise ValueError(f"--input_path={config.input_path!r} holds {len(set(text))} distinct "
                         "characters: a model needs at least 2 to choose between")
    # + 2: a character to predict after a window; quality: a prompt and a piece
    need = max(config.block_size, config.bench_prompt_len + config.bench_tokens) + 2
    if min(map(len, split_data(text).values())) < need:
        raise ValueError(f"--input_path={config.input_path!r} ({len(text):,} characters) is too "
                         f"short: each split needs {need} for block_size, bench_prompt_len and "
                         "bench_tokens")
    others = {"--prompt": config.prompt}
    if config.shift_path:
        shift = others["--shift_path ('' skips it)"] = read_text(config, "shift_path")
        if len(shift) < 2:  # a character to read, one to predict
            raise ValueError(f"--shift_path={config.shift_path!r} holds under 2 characters")
    for name, other in others.items():
        unknown = "".join(sorted(set(other) - set(text)))
        if unknown:
            raise ValueError(f"{name} has characters not in the vocabulary of "
                             f"{config.input_path!r}: {unknown!r}")

def parse_exit_layers(config):
    """exit_layers, 'all' or '0,2' -> the sorted layers (below the last) whose exit head is checked;
    'auto' is resolved per strategy by the exit plan, and checks all elsewhere."""
    text, n_layer = config.exit_layers, config.n_layer
    if text in ("all", "auto"):
        return list(range(n_layer - 1))
    layers = sorted(set(map(int, re.findall(r"\d+", text))))
    if not re.fullmatch(r"\d+(,\d+)*", text) or layers[-1] > n_layer - 2:
        raise ValueError(f"exit_layers={text!r}: 'all', 'auto' or a comma list of layers "
                         f"0..{n_layer - 2} (the last layer always exits)")
    return layers

def pick_device(name):
    """'auto' picks CUDA, then the CPU; Apple's MPS runs only when named. A named device must be
    on this machine; a named GPU becomes the current one (timers and memory counters read it)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    offered = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.cuda.is_available():
        offered.append("cuda")
    if torch.backends.mps.is_available():
        offered.append("mps")
    if name not in offered:
        raise ValueError(f"--device={name!r} is not on this machine: it offers auto, "
                         f"{', '.join(offered)}")
    if name.startswith("cuda:"):
        torch.cuda.set_device(name)
    return name

# -----------------------------------------------------------------------------
# Main: the lesson's samples, then every analysis of the one list, the summary and the page

class Analysis(NamedTuple):
    """One question the run answers: compute(lab) -> the report entries it adds, "notes" among
    them (the conditions it was measured in, then the notes under its table), or nothing where the
    run does not ask it; key: the entry its table shows; chart(report) -> its SVG on the page."""
    key: str
    table: tuple
    compute: object
    chart: object = None

# the run's questions, in the order the console prints them and the page shows them
ANALYSES = (
    Analysis("sweep", SWEEP_TABLE, threshold_sweep),
    Analysis("calibration_by_measure", CALIBRATION_TABLE, rule_calibrations),
    Analysis("shift", SHIFT_TABLE, shifted_text),
    Analysis("moving", MOVING_TABLE, watched_decoders),
    Analysis("strategies", STRATEGY_TABLE, strategies),
    Analysis("tail", TAIL_TABLE, tails),
    Analysis("frontier", FRONTIER_TABLE, frontier, frontier_chart),
)

def sample_decoder(lab):
    """The early-exit sample's decoder (--kv_strategy): an exit decoder at the run's threshold or
    its schedule, or a drafter at num_draft; its label, and the threshold it runs at (none for a
    drafter, 0 for a schedule)."""
    cfg, name = lab.config, lab.config.kv_strategy
    d = DECODERS[name]
    plan = {"measure": cfg.confidence_measure, "threshold": lab.threshold,
            "checked_exits": parse_exit_layers(cfg)}
    label = f"{name}, {plan['measure']} > {plan['threshold']:g}"
    if d.drafter:
        plan = draft_plan(name, cfg, cfg.num_draft, None)
        label = (f"{name}, layer {cfg.draft_exit} drafts up to {cfg.num_draft} a round, the rest "
                 "verify")
    if d.schedule:
        if not lab.schedule:
            raise ValueError(f"--kv_strategy={name}: the checkpoint holds no schedule")
        plan, label = lab.schedule, f"{name}, layer {lab.schedule['label']}"
    return build(name, lab.model, plan, lab.rules), label, plan.get("threshold")

def generation_report(lab):
    """Part I's samples from the lab's model, threshold and decoder; returns the report.json entry
    of both (report.html colours each character by its exit)."""
    cfg = lab.config
    decode, label, threshold = sample_decoder(lab)
    samples = show_samples(lab.model, lab.tokenizer, cfg, lab.device, decode, label)
    full, full_speed = samples["full-depth"]
    early, speed = samples["early-exit"]
    text = lab.tokenizer.decode
    T0 = len(cfg.prompt)
    exited_at = early.exited_at[0].tolist()
    return {"exit_threshold": threshold, "decoder": label,
            "exit_counts": [exited_at.count(l) for l in range(cfg.n_layer)],
            "tokens_per_second": speed, "full_depth_tokens_per_second": full_speed,
            "sample": text(early.tokens[0, T0:].tolist()), "exited_at": exited_at,
            "full_depth_sample": text(full.tokens[0, T0:].tolist())}

def summary(report):
    """The run's answers in four lines: the model's loss, what early exit skips with a guarantee
    (or that the guarantee did not hold on test), the fastest decoder with an exact cache in each
    mode, and the points on the frontier, early exit's among them, and the recipe's cost."""
    cal = report["calibration"]
    chosen = report["chosen_rule"]
    exact = [e for e in report["strategies"]  # the exit model's decoders, no hole, no copy
             if e["cache"] == "exact" and e["name"] in DECODERS]
    # each mode's fastest: the last of its rows sorted by speed (full depth: none is faster)
    fastest = {e["mode"]: e for e in sorted(exact, key=lambda e: e["speedup"])}
    saved = (f"saved at the guarantee (disagreement <= {100 * cal['epsilon']:g}% with probability "
             f"{100 * (1 - cal['delta']):g}%)" if cal["test"]["held"] else
             f"saved, but the guarantee did not hold on test (disagreement "
             f"{cal['test']['disagreement']:.2%}, over epsilon {100 * cal['epsilon']:g}%)")
    broken = {True: "", False: ", over epsilon: the guarantee did not hold"}
    on = frontier_names(report["frontier"])
    # early exit's points (an exit decoder, self-speculation) that nothing beats in a mode
    early = [p["name"] for p in report["frontier"] if (DECODERS[p["decoder"]].strategy or DECODERS[
        p["decoder"]].drafter == "exit") and None in (p["dominated_greedy"],
                                                      p["dominated_sampled"])]
    return [f"val loss {report['val_loss']['final']:.4f}: full depth, on random windows of val",
            f"{saved}: {cal['test']['compute_saved']:.1%} of layer runs on test "
            f"({cal['measure']} > {cal['threshold']:g}); the rule chosen on val, "
            f"{chosen['measure']} (each rule at delta / {round(cal['delta'] / chosen['delta'])}"
            f"): {chosen['test']['compute_saved']:.1%} (test disagreement "
            f"{chosen['test']['disagreement']:.2%}{broken[chosen['test']['held']]})",
            "fastest with an exact cache: " + ", ".join(
                f"{fastest[m]['name']} {fastest[m]['speedup']:.2f}x {m}" for m in MODES),
            f"when does early exit pay? On the frontier, greedy: {on['greedy']}; "
            f"sampled: {on['sampled']}; early exit among them: {', '.join(early) or 'none'} (the "
            f"exit recipe's cost at full depth: {report['recipe_cost']:+.4f})"]

def lesson_config(config):
    """Part I's Config from the lab's fields, with Part I's own threshold where the lab's says
    'calibrate'."""
    lesson = Config(**{f.name: getattr(config, f.name) for f in fields(Config)})
    if lesson.exit_threshold < 0:
        lesson.exit_threshold = Config.exit_threshold
    return lesson

def write_report(report, config, name):
    """name.json and its page, both made before either is written: one that fails writes neither."""
    path = os.path.join(config.out_dir, name)
    page = html_report(report)  # first: a page that fails to render writes neither file
    write_text(json.dumps(report, indent=2), path + ".json")
    write_text(page, path + ".html")
    print(f"page: {path}.html (its numbers: {name}.json beside it)")

def run_lab(lab, report, sampling):
    """The lab's steps, in order: the calibration on val (--sample_only: the checkpoint's,
    sampling), Part I's samples from the lab's model, threshold and decoder, the unit costs and
    the plans, the other exit models (minutes: the plain GPT of the model's shape, heads on its
    frozen trunk, and with --continued a continued model, each trained and calibrated), the
    decoder table at batch 1 (other_models trains the smaller plain GPTs first), then every
    analysis of the list in its order, the summary and the page (--sample_only: the samples)."""
    cfg = lab.config
    if not cfg.sample_only:
        # the learned rule fitted, every exit read once, every rule calibrated on val
        lab.records, lab.calibrations, sampling = calibrate_exits(lab.model, lab.splits, cfg)
        add_to_checkpoint(checkpoint_path(cfg), sampling=sampling)
    lab.use(sampling)
    if cfg.sample_only and sampling is None and cfg.exit_threshold < 0:
        print("the checkpoint holds no calibration (its run stopped before one): an exit decoder "
              f"samples at Part I's threshold, {lab.threshold:g}")
    report.update(config=asdict(cfg), notes={}, generation=generation_report(lab))
    if cfg.sample_only:  # sampling leaves the trained run's report alone: samples.*
        return write_report(report, cfg, "samples")
    lab.plan()  # the unit costs, timed; every exit decoder's plan, chosen on val
    names = list(DECODERS)
    # heads on the plain GPT of the exit model's depth: its full depth is that GPT's point; with
    # --continued (the study's runs) every decoder, else (the run's time) those with an exact
    # cache and no schedule but backfill, which runs every block: deferred and both drafters
    others = lab.freeze([name for name in names[1:] if cfg.continued or DECODERS[name].cache
                         == "exact" and DECODERS[name].skips and not DECODERS[name].schedule])
    if cfg.continued:
        others |= lab.exit_model("continued", *continued_exit_model(  # (model, about): its
            cfg, lab.splits), names, "continued full")  # decoders beside its full depth
    lab.measured = lab.measure(names, lab.other_models(), others)  # every decoder and model
    for analysis in ANALYSES:
        found = analysis.compute(lab)
        if found:
            conditions, *notes = report["notes"][analysis.key] = found.pop("notes")
            report.update(found)
            print_table(analysis.table, report[analysis.key], conditions, notes)
    report["summary"] = summary(report)
    print("\nsummary:\n  " + "\n  ".join(report["summary"]))
    write_report(report, cfg, "report")

def run(config, overridden):
    """The default job: the lab's model (trained, resumed, or loaded by --sample_only), its
    samples and every analysis; --lesson_only runs Part I alone."""
    device = pick_device(config.device)
    if config.lesson_only:
        return run_lesson(lesson_config(config), device)
    tokenizer, splits = load_data(config)
    report, sampling = {}, None
    if config.sample_only:  # no training, no calibration: the checkpoint's
        model = new_or_resumed(config, tokenizer, device, overridden)[0]
        sampling = read_checkpoint(checkpoint_path(config)).get("sampling")
    else:
        model = train_or_resume(config, tokenizer, splits, device, overridden, report)
    run_lab(Lab(model.eval(), tokenizer, splits, config, device, report.get("train_seconds", 0.0)),
            report, sampling)

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        build_parser().print_help()
        return 0
    try:
        run(*parse_args(argv))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"\ninterrupted: every finished step is in {e} (continue with --init_from=resume)",
              file=sys.stderr)
        return 130
    return 0

if __name__ == "__main__":
    sys.exit(main())
