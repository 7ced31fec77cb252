"""nanogpt_exit_head.py: a character-level GPT with an exit head after every layer, decoded with
confidence-gated early exit, and an honest measurement of what that buys.

    python nanogpt_exit_head.py                     # train, sample, measure (a few minutes)
    python nanogpt_exit_head.py --lesson_only=true  # Part I alone: train, two samples, exit stats
    python nanogpt_exit_head.py --help              # every field, each overridable as --name=value

Part I, the original design end to end and a program of its own: exit heads and the joint loss, the
per-layer KV cache, gated decoding with backfill, exit statistics, training. Part II, one idea a
section: deferred recompute, state copy (CALM, arXiv:2207.07061), holes, self-speculative decoding
(LayerSkip, arXiv:2404.16710), training recipes, choosing the exit rule (confidence, patience,
saturation, a learned rule, the oracle), measurement against a smaller model, reports,
checkpoints, the command line.

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
    batch_size: int = 12  # how many independent sequences per optimizer step, per process?
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

    def forward(self, x, cache=None, layer=0):
        q, k, v = map(self.heads, self.c_attn(x).chunk(3, dim=2))  # (B, nh, T, hs) each
        if cache is None:
            p = self.attn_dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
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
        self.lengths = [0] * config.n_layer
        self.layer_evals = [0] * config.n_layer  # how many (position, layer) block runs, per layer
        self.start = 0  # absolute position of window position 0

    def reset(self, start=0):
        self.lengths = [0] * len(self.lengths)
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

# name -> a rule: (B, V) probabilities and the step's state -> (B,) confidences. The state holds
# the layer, its output h and input below, and what a rule keeps from the exits below (the lab's
# rules read it; it adds margin, entropy, patience, saturation and a learned rule)
CONFIDENCE_MEASURES = {"top1": lambda probs, state: probs.amax(-1)}

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
    u = torch.rand(probs.size(0), 1, generator=generator, device=probs.device) * cdf[:, -1:]
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

    Part II's strategies subclass it: run_layer runs a block for the newest token, and once every
    row has exited, skips says whether the layers above are skipped and skip_layers what the cache
    gets instead."""
    skips = False

    def exit_checks(self, pos, checked_exits):
        """The exits checked for a token at window position pos."""
        return checked_exits

    def run_layer(self, block, cache, layer, x, pos):
        return block(x, cache, layer)

def decode_step(model, cache, idx, pos, strategy, exit_threshold=1.0, checked_exits=(),
                measure="top1"):
    """Feed one token per row, idx (B, 1), at window position pos: (emitted logits (B, V), exit
    layers (B,)). Each row exits on its own confidence; the step runs as deep as its deepest row."""
    L = model.config.n_layer
    # a confidence never exceeds 1: at threshold 1 no exit is checked
    checks = strategy.exit_checks(pos, checked_exits) if exit_threshold < 1 else ()
    x = model.embed(idx, pos)  # (B, 1, C)
    logits, exited = None, None
    exit_layer = torch.full((idx.size(0),), L - 1, device=idx.device)  # (B,) int64
    state = {}  # what the rule sees of this step (CONFIDENCE_MEASURES)
    for l, block in enumerate(model.transformer.h):
        below = x[:, 0]
        x = strategy.run_layer(block, cache, l, x, pos)
        if l == L - 1 or l not in checks:
            continue
        head_logits = model.exit_logits(x[:, 0], l)  # (B, V): the newest position only
        state.update(layer=l, below=below, h=x[:, 0])
        conf = confidence(head_logits, measure, state)  # (B,)
        # the common case: nobody is sure, known at the cost of one host sync
        if exit_threshold > 0 and conf.max().item() <= exit_threshold:
            continue
        newly = conf > exit_threshold if exited is None else (conf > exit_threshold) & ~exited
        logits = head_logits if logits is None else torch.where(newly[:, None], head_logits, logits)
        exit_layer.masked_fill_(newly, l)
        exited = newly if exited is None else exited | newly
        if strategy.skips and bool(exited.all()):
            strategy.skip_layers(model, cache, x, pos, l)
            return logits, exit_layer
    final = model.exit_logits(x[:, 0], L - 1)  # (B, V)
    return (final if exited is None else torch.where(exited[:, None], logits, final)), exit_layer

@dataclass
class Generation:
    tokens: torch.Tensor  # (B, T0 + N): prompt and generated tokens
    exited_at: torch.Tensor  # (B, N): the layer each new token left at
    logits: torch.Tensor  # (B, N, V) emitted logits when teacher-forced, else None
    layers_run: int  # block runs per row over all decode steps, catch-up included, prefill excluded
    prefill_runs: float = 0.0  # block runs per row spent re-prefilling the window at full depth
    clock: list = None  # (seconds, row 0's length) at the start and after each step

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
    exits, emitted, prefilled = idx.new_zeros(B, max_new_tokens), [], 0
    cache, start = KVCache(cfg, B, idx.device), None
    clock = [tick(idx.device, T0)]
    for i in range(max_new_tokens):
        n = T0 + i
        start, runs = slide_window(model, cache, tokens, start, n)
        prefilled += runs
        logits, exits[:, i] = decode_step(model, cache, tokens[:, n - 1 : n], n - 1 - start,
                                          kv, exit_threshold, checked_exits, measure)
        if forced is not None:
            tokens[:, n] = forced[:, i]
            emitted.append(logits.float())
        else:
            tokens[:, n] = sample(logits, temperature, top_k, generator)
        clock.append(tick(idx.device, n + 1))
    logits = torch.stack(emitted, dim=1) if emitted else None
    return Generation(tokens, exits, logits, sum(cache.layer_evals) - prefilled, prefilled, clock)

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
    """AdamW with weight decay on matrices only, as nanoGPT does."""
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2],
               "weight_decay": config.weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.beta1, config.beta2))

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

    Part II's hooks: generator draws the batches (resumed, or one per process); on_step(it, log)
    runs before every step (checkpoints, Ctrl-C); step_model takes the steps (compiled, or wrapped
    for several processes); evaluate=False trains silently (the other processes of torchrun)."""
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
            if on_step is not None:
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

def train_new_model(config, splits, device):
    """A new model trained for max_iters steps (Part II's train_or_resume adds checkpoints)."""
    torch.manual_seed(config.seed)
    model = GPT(config).to(device)
    train(model, configure_optimizer(model, config), splits, config, device)
    print(format_eval(config.max_iters, estimate_loss(model, splits, config, device)))
    return model.eval()

def speed_note(samples, checked_exits, n_layer):
    """Why the early-exit sample ran faster or slower than full depth: the work it did per token."""
    (_, full), (out, speed) = samples.values()
    N = out.exited_at.size(1)
    checks = sum(int((out.exited_at >= l).sum()) for l in checked_exits) / N
    return (f"{speed / full:.2f}x full depth's speed: {out.layers_run / N:.2f} layer runs per "
            f"token (of {n_layer}), plus {checks:.2f} exit checks (each a head, a softmax and a "
            "host sync)")

def show_samples(model, tokenizer, config, device, early_exit, label, checked_exits):
    """A full-depth and an early-exit sample from one prompt and seed, their speeds, and where the
    tokens left. early_exit(idx, n, generator=, temperature=, top_k=) -> Generation draws the second
    sample; label names it and checked_exits are the exits it checks."""
    idx = torch.tensor([tokenizer.encode(config.prompt)], device=device)  # (1, T0)
    print("\n=== What does early exit look like? Two samples from the same prompt and seed ===")
    samples = {}  # name -> (Generation, tokens per second)
    decoders = (("full-depth", "", partial(generate, model)),
                ("early-exit", f": {label}", early_exit))
    for name, how, decode in decoders:
        gen = torch.Generator(device=device).manual_seed(config.seed)
        t0 = time.perf_counter()
        out = decode(idx, config.max_new_tokens, generator=gen, temperature=config.temperature,
                     top_k=config.top_k)
        synchronize(device)
        samples[name] = out, config.max_new_tokens / (time.perf_counter() - t0)
        text = tokenizer.decode(out.tokens[0, idx.size(1) :].tolist())
        print(f"\n--- {name} sample{how} ({samples[name][1]:,.0f} tok/s) ---\n{text}")
    print(f"({speed_note(samples, checked_exits, config.n_layer)})")
    counts = torch.bincount(out.exited_at[0], minlength=config.n_layer).tolist()
    print("\nper-layer exit statistics:\n" + format_exit_stats(counts))
    return idx, samples

def run_lesson(config, device):
    """Part I end to end: train, then a full-depth and an early-exit sample (backfill, the config's
    threshold), and where the tokens left. Returns the model and the samples."""
    tokenizer, splits = load_data(config)
    model = train_new_model(config, splits, device)
    early_exit = partial(generate, model, exit_threshold=config.exit_threshold,
                         measure=config.confidence_measure)
    label = f"backfill, {config.confidence_measure} > {config.exit_threshold:g}"
    _, samples = show_samples(model, tokenizer, config, device, early_exit, label,
                              range(config.n_layer - 1))
    return model, samples

# =============================================================================
# Part II: the lab, one idea per section

import argparse
import difflib
import gc
import html
import inspect
import itertools
import json
import os
import pickle
import re
import signal
import textwrap
import zipfile
from dataclasses import asdict, fields, replace
from pathlib import Path

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
    # training recipes (the joint-loss recipe, Part I's: distill_weight 0, layer_dropout 0)
    distill_weight: float = 0.1  # self-distillation: weight of KL(final || exit), final detached
    distill_temperature: float = 1.0  # of distillation; higher matches more of the distribution
    layer_dropout: float = 0.2  # LayerSkip's p_max: training skips block l w.p. p_max 2^(l/(L-1))-1
    # decoders
    kv_strategy: str = "backfill"  # early-exit sample's decoder: a KV strategy or self_speculative
    exit_layers: str = "auto"  # exits checked: 'auto' (cost-aware; all in samples), 'all', '1,3'
    draft_exit: int = 0  # self-speculative: the last layer of the draft (its exit head drafts)
    num_draft: int = 8  # self-speculative: the most tokens drafted per verify pass
    # measurement
    quality_positions: int = 1000  # test positions teacher-forced per decoder; more is steadier
    bench_prompts: int = 16  # timed workload: prompts evenly spaced in test (val, when choosing)
    bench_prompt_len: int = 32  # characters per workload prompt
    bench_tokens: int = 50  # characters generated per prompt per timed run
    bench_repeats: int = 3  # timed passes per decoder, interleaved; the median is reported
    shift_path: str = "shift.txt"  # text of another kind, read at val's threshold ('' skips it)
    epsilon: float = 0.01  # calibration: tolerated disagreement with full depth; lower is cautious
    delta: float = 0.05  # calibration: allowed chance that the chosen threshold breaks epsilon
    sweep_positions: int = 20000  # val and test positions recorded for the sweep and calibration
    schedule_disagreement: float = 0.03  # SkipDecode: most disagreement with full depth it may cost
    # studies beyond the default run
    bench_batch: bool = False  # also measure every batch design at batch 1, 4 and 16 (minutes)
    compare_depths: bool = False  # train a plain GPT of every depth below n_layer, not only one

# cautious first: 1.000, 0.999, ..., 0.951 (the learned rule's scores crowd there), 0.95, ..., 0.00
THRESHOLDS = (*(round(1 - i / 1000, 3) for i in range(50)),
              *(round(i / 100, 2) for i in range(95, -1, -1)))
def average(t):
    """A tensor's mean as a float (a mask's: the share that is true); None if it is empty."""
    return t.float().mean().item() if t.numel() else None

MODES = ("greedy", "sampled")  # sampled draws with config.temperature and config.top_k
BATCH_SIZES = (1, 4, 16)

# -----------------------------------------------------------------------------
# Deferred recompute: fill the holes later, in one chunk with the next token that needs them

class Deferred(Backfill):
    """An exit parks its state; the next token that needs a layer runs the parked positions and
    itself there as one causal chunk. Exact, like backfill, with the work postponed and batched."""
    skips = True
    parked = None  # (B, block_size, C): the state each position reached, for the layers it skipped

    def park(self, cache, x, pos):
        if self.parked is None:
            self.parked = x.new_zeros(x.size(0), cache.k.size(3), x.size(2))
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
    C = block.ln_1.weight.numel()
    w = block.attn.c_attn.weight[C:]  # (2C, C): the K and V rows of the fused projection
    bias = w.new_zeros(2 * C)
    if block.ln_1.bias is not None:  # config.bias gives ln_1 and c_attn their biases together
        bias = w @ block.ln_1.bias + block.attn.c_attn.bias[C:]
    return w * block.ln_1.weight, bias

def state_copy_projections(model):
    """Every layer's folded K/V projection, stacked: (L, 2C, C) and (L, 2C)."""
    return tuple(map(torch.stack, zip(*map(kv_projection, model.transformer.h))))

def write_state_copy(cache, first_layer, x, weight, bias):
    """CALM's state propagation: the K and V of layers first_layer.. computed from the exit state
    x (B, 1, C), written at the next position of a level cache. One batched matmul serves every
    skipped layer."""
    n = cache.lengths[first_layer]
    assert all(m == n for m in cache.lengths[first_layer:]), "state copy needs level skipped layers"
    xn = F.layer_norm(x[:, 0], x.shape[-1:])  # (B, C): the normalisation shared by every ln_1
    # (J, B, 2C): every skipped layer's K and V at once
    kv = torch.matmul(xn, weight[first_layer:].transpose(1, 2)) + bias[first_layer:, None]
    k, v = kv.unflatten(-1, (2 * cache.k.size(2), -1)).chunk(2, dim=2)  # (J, B, nh, hs) each
    cache.k[first_layer:, :, :, n] = k
    cache.v[first_layer:, :, :, n] = v
    for layer in range(first_layer, len(cache.lengths)):
        cache.lengths[layer] = n + 1

class StateCopy(Backfill):
    """Approximate: the skipped layers see the exit state where their own input would have been."""
    skips = True

    def skip_layers(self, model, cache, x, pos, layer):
        if not hasattr(self, "projections"):  # once per generation
            self.projections = state_copy_projections(model)
        write_state_copy(cache, layer + 1, x, *self.projections)

# -----------------------------------------------------------------------------
# Holes: the failure case, where the skipped layers write nothing

class Holes(Backfill):
    """Later tokens attend only to the entries that exist: skipped layers' caches have fewer."""
    skips = True

    def skip_layers(self, model, cache, x, pos, layer):
        pass

KV_STRATEGIES = {"backfill": Backfill, "deferred": Deferred, "state_copy": StateCopy,
                 "holes": Holes}

def kv_strategy(name):
    """The KV strategy class of a name, or a one-line error."""
    if name not in KV_STRATEGIES:
        raise ValueError(f"unknown KV strategy {name!r}: one of {', '.join(KV_STRATEGIES)}")
    return KV_STRATEGIES[name]

# -----------------------------------------------------------------------------
# Self-speculative decoding (LayerSkip): early layers draft, the rest verify; one decoder, any batch

class RowKVCache(KVCache):
    """The KV cache with a length per row: at the start of a round, every layer of row b holds its
    window positions [0, pos[b]), where pos[b] = n[b] - 1 - start[b] is the row's own position in
    its window.

    The rows of a batch accept different numbers of drafts, roll back on their own and slide their
    windows at different rounds. Rolling a row back is moving its n back: the entries past its
    position are stale, masked and then overwritten. Every block call of a step writes each row's
    entries at its own slots, laid out once per step (lay_out); attention reads the slots any row
    has filled, through one mask. Made with a block_size num_draft larger: those spare slots take
    the drafts of rows with less room than others, and are always rolled back."""
    layout = None  # what the block calls of one step share: lay_out()

    def lay_out(self, slots, width):
        """(slots (B, T), their scatter index, the mask of what each query may see, W), W the slots
        any row has filled by then: attention reads no empty slot past the last. One row's slots are
        the last T of its W: a single query needs no mask, a chunk a causal one (and append writes a
        slice)."""
        B, T = slots.shape
        if B == 1:
            mask = None
            if T > 1:
                mask = torch.ones(T, width, dtype=torch.bool, device=slots.device).tril(width - T)
            return slots, None, mask, width
        seen = torch.arange(width, device=slots.device) <= slots[:, :, None]  # (B, T, W)
        mask = torch.where(seen, 0.0, float("-inf"))[:, None]  # (B, 1, T, W)
        # (B, nh, T, hs): where each entry goes
        index = slots[:, None, :, None].expand(B, self.k.size(2), T, self.k.size(4))
        return slots, index, mask, width

    def lay_out_steps(self, slots, furthest):
        """The layouts of k one-token steps at slots (B, k), furthest = max(slots[:, 0]): a list."""
        widths = [furthest + 1 + j for j in range(slots.size(1))]  # each step reads one slot more
        if len(slots) == 1:  # one row: a single query sees all of its slots
            return [(None, None, None, w) for w in widths]
        _, index, mask, _ = self.lay_out(slots, widths[-1])
        return [(slots[:, j : j + 1], index[:, :, j : j + 1], mask[:, :, j : j + 1, :w], w)
                for j, w in enumerate(widths)]

    def keep_rows(self, keep):
        """Drop the rows of a batch that are done: keep (B,) bool; the rest become rows 0..R-1."""
        self.k = self.k[:, keep]
        self.v = self.v[:, keep]

    def append(self, layer, k, v):
        """Write k, v (B, nh, T, hs) at each row's laid-out slots; return the first W slots and the
        mask."""
        slots, index, mask, width = self.layout
        if index is None:  # one row: its T new entries are the last T of its W slots
            self.k[layer, :, :, width - k.size(2) : width] = k
            self.v[layer, :, :, width - k.size(2) : width] = v
        elif k.size(2) == 1:  # (B, nh, S, hs): each row's new entry at its own slot
            self.k[layer].scatter_(2, index, k)
            self.v[layer].scatter_(2, index, v)
        else:  # a chunk: indexing writes it faster than scatter
            rows = torch.arange(k.size(0), device=k.device)[:, None]
            self.k[layer][rows, :, slots] = k.transpose(1, 2)  # (B, T, nh, hs)
            self.v[layer][rows, :, slots] = v.transpose(1, 2)
        return self.k[layer, :, :, :width], self.v[layer, :, :, :width], mask

def prefill_rows(model, cache, tokens, rows, starts, n):
    """Re-prefill the windows of `rows`, each tokens[b, starts[b] : n[b] - 1], at full depth (equal
    lengths). Returns the block runs per row; they are not counted in cache.layer_evals."""
    m = int(n[rows[0]] - 1 - starts[rows[0]])
    idx = tokens[rows[:, None], starts[rows][:, None] + torch.arange(m, device=tokens.device)]
    # a plain cache for just these rows (no per-row mask: they are level), then copied into place
    level = KVCache(replace(model.config, block_size=m), len(rows), tokens.device)
    prefill(model, level, idx, 0)
    cache.k[:, rows, :, :m] = level.k
    cache.v[:, rows, :, :m] = level.v
    return m * model.config.n_layer

def slide_rows(model, cache, tokens, starts, n):
    """Each row slides its window by window_start's rule; rows that moved re-prefill together,
    grouped by window length. Returns the block runs summed over rows."""
    if not bool((n - starts > model.config.block_size).any()):  # most rounds: no row moves
        return 0
    moved = {}
    for b in range(len(n)):
        s = window_start(None if starts[b] < 0 else int(starts[b]), int(n[b]),
                         model.config.block_size)
        if s != starts[b]:
            starts[b] = s
            moved.setdefault(int(n[b]) - 1 - s, []).append(b)
    runs = 0
    for group in moved.values():
        rows = torch.tensor(group, device=n.device)
        runs += len(group) * prefill_rows(model, cache, tokens, rows, starts, n)
    return runs

def draft(model, cache, tokens, n, pos, room, draft_exit, temperature, top_k, generator):
    """Every row drafts with layers 0..draft_exit from its own position pos[b], max(room) steps.
    Returns the draft logits (B, k, V), the drafts (B, k), their states (B, k, C), which the verify
    pass takes up from, their slots (B, k), and the slots any row has filled: the verify pass's
    width."""
    k, furthest = torch.stack((room.max(), pos.max())).tolist()  # one read of the device a round
    steps = torch.arange(k, device=n.device)
    slots = pos[:, None] + steps  # (B, k)
    layouts = cache.lay_out_steps(slots, furthest)
    # k x (B, C): a row with less room than k drafts on at the last position, in spare slots;
    # those drafts are never kept
    wpe = model.transformer.wpe(slots.clamp(max=model.config.block_size - 1)).unbind(1)
    token, q, states, drafts = tokens.gather(1, n[:, None] - 1)[:, 0], [], [], []  # token: (B,)
    for j in range(k):
        x = (model.transformer.wte(token) + wpe[j])[:, None]  # (B, 1, C); decoding never drops out
        cache.layout = layouts[j]
        for l in range(draft_exit + 1):
            x = model.transformer.h[l](x, cache, l)
        logits = model.exit_logits(x[:, 0], draft_exit)  # (B, V)
        token = sample(logits, temperature, top_k, generator)
        q.append(logits)
        states.append(x)
        drafts.append(token)
    drafts = torch.stack(drafts, dim=1)  # (B, k)
    tokens.scatter_(1, n[:, None] + steps, drafts)
    return torch.stack(q, dim=1), drafts, torch.cat(states, dim=1), slots, furthest + k

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
    if not bool(has_next.any()):  # no row rejected: nothing to draw
        return accepted, drafts[:, -1], has_next
    # + 1 on rows without a rejection: their draw is unused, but must not divide by zero
    residual = (p - q)[rows, at].clamp_min(0) + (~has_next)[:, None]
    return accepted, draw(residual / residual.sum(-1, keepdim=True), generator), has_next

def speculative_round(model, cache, tokens, n, pos, room, draft_exit, temperature, top_k,
                      generator):
    """One round of every row: draft up to room[b] tokens from window position pos[b], verify them
    in one pass, keep each row's accepted prefix and write the full model's token after it. Returns
    (accepted (B,), has_next (B,)), as speculative_accept."""
    q, drafts, x, slots, width = draft(model, cache, tokens, n, pos, room, draft_exit, temperature,
                                       top_k, generator)
    # verify: the layers above the draft run once over every row's drafted states x (B, k, C)
    cache.layout = cache.lay_out(slots, width)
    for l in range(draft_exit + 1, model.config.n_layer):
        x = model.transformer.h[l](x, cache, l)
    p = model.exit_logits(x, model.config.n_layer - 1)  # (B, k, V)
    if temperature > 0:
        q = probs_from_logits(q, temperature, top_k)
        p = probs_from_logits(p, temperature, top_k)
    accepted, nxt, has_next = speculative_accept(drafts, q, p, room, temperature, generator)
    rows = torch.arange(len(n), device=n.device)
    # a row that kept all it could writes a slot its next round overwrites
    tokens[rows, n + accepted] = nxt
    return accepted, has_next

@dataclass
class SpeculativeGeneration(Generation):
    stats: dict = None  # rounds (verify passes), drafted (keepable drafts), accepted, num_draft

@torch.inference_mode()
def generate_self_speculative(model, idx, max_new_tokens, draft_exit=0, num_draft=8,
                              temperature=0.0, top_k=0, generator=None):
    """Self-speculative decoding of B rows at once: each round every row drafts up to num_draft
    tokens with layers 0..draft_exit, the layers above verify them in one pass, and each row keeps
    its accepted prefix, rolls back and slides its window on its own; a row that is done leaves.
    Every row's tokens are those it would get alone at full depth (greedy), or have their
    distribution (sampled)."""
    cfg, (B, T0), dev = model.config, idx.shape, idx.device
    if not 0 <= draft_exit < cfg.n_layer - 1 or num_draft < 1:
        raise ValueError(f"need 0 <= draft_exit < {cfg.n_layer - 1} and num_draft >= 1, "
                         f"got draft_exit={draft_exit}, num_draft={num_draft}")
    end = T0 + max_new_tokens
    tokens = F.pad(idx, (0, max_new_tokens + num_draft))  # zeros: room for the tokens and drafts
    out_tokens = tokens[:, :end].clone()
    cache = RowKVCache(replace(cfg, block_size=cfg.block_size + num_draft), B, dev)
    n = idx.new_full((B,), T0)  # (R,): each row's length; no window yet (start far back)
    starts = torch.full_like(n, -cfg.block_size - 1)
    ids, rounds, prefilled, clock = torch.arange(B, device=dev), [], 0.0, [tick(dev, T0)]
    while max_new_tokens > 0 and len(ids):  # ids (R,): the rows still in the batch
        prefilled += slide_rows(model, cache, tokens, starts, n) / B
        pos = n - 1 - starts  # (R,) window position of each row's first token fed this round
        # (R,) how many drafts each row may keep: none past end, no position past block_size
        room = torch.minimum(end - n, cfg.block_size - pos).clamp(max=num_draft)
        accepted, has_next = speculative_round(model, cache, tokens, n, pos, room, draft_exit,
                                               temperature, top_k, generator)
        rounds.append((ids, n, accepted, room))
        n = n + accepted + has_next  # n back past a rejected draft: the row's cache rolls back
        clock.append(tick(dev, min(int(n[0]), end)))  # row 0's length: the tail at batch 1
        done = n >= end  # rows that are done leave: the next rounds run on the rest only
        if bool(done.any()):
            out_tokens[ids[done]] = tokens[done, :end]
            tokens, n, starts, ids = tokens[~done], n[~done], starts[~done], ids[~done]
            cache.keep_rows(~done)
    ids, n, accepted, room = map(torch.cat, zip(*rounds)) if rounds else [idx[0, :0]] * 4
    stats = {"rounds": len(rounds), "drafted": int(room.sum()), "accepted": int(accepted.sum()),
             "num_draft": num_draft}
    exited_at = kept_drafts(ids, n, accepted, B, end, draft_exit, cfg.n_layer - 1)[:, T0:]
    # layers run: the re-prefills ran in caches of their own, so cache.layer_evals has none of them
    return SpeculativeGeneration(out_tokens, exited_at, None, sum(cache.layer_evals), prefilled,
                                 clock, stats)

def kept_drafts(ids, n, accepted, B, end, draft_exit, full_exit):
    """(B, end): draft_exit where a token is a kept draft, full_exit elsewhere. Each round of row
    ids[i] kept accepted[i] drafts from position n[i]: +1 where kept drafts begin, -1 where they
    end, summed along (kept runs never overlap)."""
    marks = n.new_zeros(B, end + 1)
    marks.index_put_((ids, n), torch.ones_like(n), accumulate=True)
    marks.index_put_((ids, n + accepted), -torch.ones_like(n), accumulate=True)
    return torch.where(marks.cumsum(1)[:, :end] > 0, draft_exit, full_exit)

# -----------------------------------------------------------------------------
# Training recipes: exits that agree with the final head draft well (layer dropout, distillation)

def layer_dropout_prob(layer, config):
    """LayerSkip's rate for block `layer`: 0 at the bottom, rising exponentially to layer_dropout
    at the top."""
    return config.layer_dropout * (math.exp(layer * math.log(2) / (config.n_layer - 1)) - 1)

def distillation(logits, teacher_log_probs, temperature):
    """T^2 * KL(teacher || student) per position, the usual scaling so gradients match across T."""
    student = (logits.float() / temperature).log_softmax(-1)
    # batchmean over positions, not sequences: (B, T, V) -> (B * T, V)
    kl = F.kl_div(student.flatten(0, -2), teacher_log_probs.flatten(0, -2), log_target=True,
                  reduction="batchmean")
    return temperature**2 * kl

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
        loss = cross_entropy(logits, targets)
        teacher = None
        if cfg.distill_weight > 0:  # the final head's distribution, detached: the exits chase it
            teacher = (logits.detach().float() / cfg.distill_temperature).log_softmax(-1)
        for l in range(cfg.n_layer - 1):
            if cfg.alpha == 0 and teacher is None:
                continue
            exit_logits = self.exit_logits(states[l], l)
            loss = loss + cfg.alpha * cross_entropy(exit_logits, targets)
            if teacher is not None:
                kl = distillation(exit_logits, teacher, cfg.distill_temperature)
                loss = loss + cfg.distill_weight * kl
        return loss

def count_params(model):
    """(base model, exit heads) parameter counts; unlike nanoGPT's, position embeddings are
    counted."""
    heads = sum(p.numel() for p in model.exit_heads.parameters())
    return sum(p.numel() for p in model.parameters()) - heads, heads


# -----------------------------------------------------------------------------
# Choosing the exit rule, 1: record every exit once, teacher-forced, then sweep without the model

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

CONFIDENCE_MEASURES.update(margin=margin, entropy=normalised_entropy, patience=patience,
                           saturation=saturation)

def exit_features(probs, state):
    """The learned rule's features (..., F): four rules' confidences, agreement with the exit
    below, a bias, and which character this exit predicts (one-hot)."""
    pred = probs.argmax(-1)
    agree = (pred == state.get("pred", -1)).float()
    state["pred"] = pred
    cheap = [CONFIDENCE_MEASURES[m](probs, state) for m in ("top1", "margin", "entropy",
                                                             "saturation")]
    one_hot = F.one_hot(pred, probs.size(-1)).to(probs.dtype)
    return torch.cat([torch.stack([*cheap, agree, torch.ones_like(agree)], -1), one_hot], -1)

def learned(weights, probs, state):
    """The learned rule: per exit, a logistic model's P(this exit's top-1 is full depth's)."""
    return torch.sigmoid(exit_features(probs, state) @ weights[state["layer"]])

def exit_rules(model):
    """name -> rule: CONFIDENCE_MEASURES, and the learned rule once fit_exit_predictor ran."""
    weights = getattr(model, "exit_predictor", None)
    if weights is None:
        return CONFIDENCE_MEASURES
    return {**CONFIDENCE_MEASURES, "learned": partial(learned, weights)}

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
    """Every exit's logits on x (b, W): (L, b, W, V), and each rule's confidences, rule -> (L, b,
    W), each rule reading the exits bottom up with a state of its own, as decode_step does."""
    states = [model.embed(x), *model.hidden_states(x)]  # L + 1 x (b, W, C)
    logits = torch.stack([model.exit_logits(h, l) for l, h in enumerate(states[1:])]).float()
    probs, read = logits.softmax(-1), {}  # what confidence() gives a rule, once for them all
    for name, rule in rules.items():
        state, read[name] = {}, []
        for l in range(len(logits)):
            state.update(layer=l, below=states[l], h=states[l + 1])
            read[name].append(rule(probs[l], state))
    return logits, {name: torch.stack(c) for name, c in read.items()}

@torch.inference_mode()
def record_exits(model, data, n_positions, rules=None, batch_size=64):
    """One parallel pass: what every exit predicts for data[1 : n_positions + 1], and how sure it
    is by each rule (exit_rules(model) unless given).

    The windows are exactly those of sequential decoding fed data[0], data[1], ...
    (window_start), so a decoder that keeps its cache exact (backfill, deferred) makes exactly
    these predictions; that is tested. Windows of equal length run together, batch_size at a
    time."""
    rules = rules or exit_rules(model)
    n_positions = min(n_positions, len(data) - 1)
    # every window is block_size long but perhaps the last: run the others batch_size at a time
    *full, last = decoder_windows(n_positions, model.config.block_size)
    groups = [full[b : b + batch_size] for b in range(0, len(full), batch_size)] + [[last]]
    parts = []
    for group in groups:
        x = torch.stack([data[s:e] for s, e, _ in group])  # (b, W)
        read = read_exits(model, x, rules)  # logits (L, b, W, V) and rule -> (L, b, W)
        parts += [[t[:, r, first - s :] for t in (read[0], *read[1].values())]
                  for r, (s, _, first) in enumerate(group)]
    logits, *confidences = [torch.cat(p, dim=1) for p in zip(*parts)]  # (L, N, V), (L, N) each
    targets = data[1 : n_positions + 1]  # on the model's device, as the windows were
    nll = -logits.log_softmax(-1).take_along_dim(targets[None, :, None], -1)[..., 0]  # (L, N)
    return ExitRecords(dict(zip(rules, confidences)), logits.argmax(-1), nll, targets)

def fit_exit_predictor(model, data, n_positions):
    """The learned rule's weights (L, F), also kept as model.exit_predictor: per exit, a logistic
    model of whether its top-1 is full depth's, fitted by Newton's method on the exits recorded on
    data (the train split). The last exit's row is 0: it always exits."""
    records = record_exits(model, data, n_positions, {"features": exit_features})
    X = records.confidences["features"][:-1].double().cpu()  # (L - 1, N, F); MPS has no float64
    y = (records.pred[:-1] == records.pred[-1]).double().cpu()  # (L - 1, N): agrees with full
    w = X.new_zeros(X.size(0), X.size(2), 1)
    ridge = 0.01 * torch.eye(X.size(2), dtype=X.dtype)  # a weak L2 penalty, 0.01 |w|^2 / 2
    for _ in range(20):  # Newton's steps; a logistic fit settles in fewer
        p = torch.sigmoid(X @ w)[..., 0]  # (L - 1, N)
        grad = X.transpose(1, 2) @ (p - y)[..., None] + ridge @ w  # (L - 1, F, 1)
        hess = X.transpose(1, 2) @ (X * (p * (1 - p))[..., None]) + ridge  # (L - 1, F, F)
        w = w - torch.linalg.solve(hess, grad)
    model.exit_predictor = F.pad(w[..., 0], (0, 0, 0, 1)).float().to(records.pred.device)
    return model.exit_predictor

def exits_at_threshold(records, measure, threshold, checked_exits):
    """(N,): the layer each position exits at: the first checked exit above threshold, else the
    last. A confidence never exceeds 1, so at a threshold of 1 every position goes full depth."""
    conf = records.confidences[measure]
    layers = torch.tensor([*checked_exits, len(conf) - 1], device=conf.device)
    hit = conf[layers] > threshold  # (E + 1, N)
    hit[-1] = True  # the last layer always exits
    return layers[hit.float().argmax(0)]  # the first exit that is confident enough

def exit_summary(records, exits):
    """Quality and compute of emitting each position from its exit layer."""
    L, N = records.pred.shape
    cols = torch.arange(N, device=exits.device)
    pred = records.pred[exits, cols]
    mean_layers = average(exits + 1)
    return {
        "exit_fractions": (torch.bincount(exits, minlength=L).float() / N).tolist(),
        "mean_layers": mean_layers,
        "compute_saved": 1.0 - mean_layers / L,
        "loss": average(records.nll[exits, cols]),
        "full_loss": average(records.nll[-1]),
        "excess_loss": average(records.nll[exits, cols] - records.nll[-1]),
        "accuracy": average(pred == records.targets),
        "disagreement": average(pred != records.pred[-1]),
    }

# -----------------------------------------------------------------------------
# Choosing the exit rule, 2: the threshold sweep on val, and a threshold calibrated with a guarantee

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
    failures = []
    for t in THRESHOLDS:
        exits = exits_at_threshold(records, measure, t, checked_exits)  # (N,)
        failures.append(int(disagree.gather(0, exits[None]).sum()))
    chosen = fixed_sequence_test(failures, disagree.size(1), epsilon, delta)
    return THRESHOLDS[max(chosen, 0)]  # THRESHOLDS[0] is 1.0: full depth when none is certified

def oracle(records, checked_exits, epsilon):
    """The most any rule could skip at disagreement <= epsilon: each position leaves at the first
    checked exit whose top-1 is full depth's, and the epsilon * N that would run deepest leave at
    the first checked exit anyway, wrong but cheapest."""
    layers = torch.tensor([*checked_exits, len(records.pred) - 1], device=records.pred.device)
    agree = records.pred[layers] == records.pred[-1]  # (E + 1, N): the last row is all True
    exits = layers[agree.float().argmax(0)]  # (N,)
    deepest = exits.float().topk(int(epsilon * exits.numel())).indices
    return exit_summary(records, exits.index_fill(0, deepest, layers[0]))

def calibration_report(val, test, shifted, measure, checked_exits, epsilon, delta):
    """Calibrate on val, then report the chosen threshold's figures on test (never used to choose)
    and on the shifted text (None: none), whether epsilon held there, and test's saving as a
    share of the oracle's. Patience's threshold is also given as k, the exits that must agree."""
    threshold = calibrate(val, measure, checked_exits, epsilon, delta)
    report = {"measure": measure, "epsilon": epsilon, "delta": delta, "threshold": threshold}
    if measure == "patience" and threshold < 1:
        report["k"] = next(k for k in itertools.count(1) if 1 - 0.5**k > threshold)
    for name, records in (("val", val), ("test", test), ("shift", shifted)):
        if records is not None:
            figures = exit_summary(
                records, exits_at_threshold(records, measure, threshold, checked_exits))
            report[name] = {**figures, "held": figures["disagreement"] <= epsilon}
    best = oracle(test, checked_exits, epsilon)["compute_saved"]
    report["test"]["oracle_share"] = report["test"]["compute_saved"] / max(best, 1e-9)
    return report

def exit_calibration(records, bins=10):
    """Per exit: the expected calibration error (ECE) of its top-1 confidence against the data
    and against full depth's top-1 (not for full depth itself), and its reliability table: per
    confidence bin, the mean confidence, accuracy, agreement with full depth and positions."""
    conf = records.confidences["top1"]  # (L, N)
    which = (conf * bins).long().clamp(max=bins - 1)  # (L, N): each position's bin
    rows = []
    for l, pred in enumerate(records.pred):
        count = torch.bincount(which[l], minlength=bins).float()  # (bins,)
        sums = torch.stack([torch.bincount(which[l], v.float(), bins) for v in
                            (conf[l], pred == records.targets, pred == records.pred[-1])])
        mean = sums / count.clamp_min(1)  # (3, bins): confidence, accuracy, agreement
        ece = ((mean[1:] - mean[0]).abs() * count).sum(-1) / conf.size(1)  # (2,)
        table = dict(zip(("confidence", "accuracy", "agreement", "positions"), [*mean, count]))
        rows.append({"layer": l, "ece_data": ece[0].item(), "ece_full": ece[1].item(),
                     "bins": {k: v.tolist() for k, v in table.items()}, "reliability": " ".join(
                         f"{a:.2f}" if n else "-" for a, n in zip(table["accuracy"], count))})
    rows[-1]["ece_full"] = None  # full depth always agrees with itself
    return rows

# -----------------------------------------------------------------------------
# Choosing the exit rule, 3: the logit lens, and what "easy" means for this model

@torch.inference_mode()
def logit_lens(model, x):
    """Each layer read through ln_f + lm_head (never trained for it) and through its own exit
    head."""
    states = model.hidden_states(x)  # L x (B, T, C)
    top = model.config.n_layer - 1
    target = model.exit_logits(states[-1], top).argmax(-1)  # (B, T): the final prediction
    entries = []
    for l, h in enumerate(states[:-1]):
        for readout, layer in (("ln_f + lm_head", top), ("exit head", l)):
            logits = model.exit_logits(h, layer)  # (B, T, V)
            entries.append({"layer": l, "readout": readout,
                            "agreement": average(logits.argmax(-1) == target),
                            "confidence": average(confidence(logits))})
    return entries

KINDS = ("lowercase", "capital", "space", "punctuation", "newline")

def character_kind(ch):
    """lowercase, capital, space, newline, or punctuation (the rest)."""
    if ch.isalpha():
        return KINDS[ch.isupper()]
    return {" ": "space", "\n": "newline"}.get(ch, "punctuation")

def exit_slices(records, exits, tokenizer):
    """At these exits, per kind of character to predict: how deep it runs, how often it disagrees
    with full depth, and the accuracy it loses against full depth."""
    pred = records.pred[exits, torch.arange(len(exits), device=exits.device)]
    right, full_right = pred == records.targets, records.pred[-1] == records.targets
    kinds = [character_kind(ch) for ch in tokenizer.decode(records.targets.tolist())]
    rows = []
    for kind in KINDS:
        here = torch.tensor([k == kind for k in kinds], device=exits.device)
        if here.any():
            rows.append({"kind": kind, "positions": int(here.sum()),
                         "mean_layers": average(exits[here] + 1),
                         "disagreement": average((pred != records.pred[-1])[here]),
                         "accuracy_lost": average(full_right[here]) - average(right[here])})
    return rows

# -----------------------------------------------------------------------------
# Measurement, 1: every decoder on one workload, quality teacher-forced, then wall-clock

def workload(data, n_prompts, prompt_len):
    """n_prompts prompts of prompt_len characters from evenly spaced places of a split:
    (n_prompts, prompt_len). One prompt proves nothing: a greedy character model soon loops
    ("the the the"), and a loop is easy to draft. Timed figures continue every prompt of test's
    workload; choices use val's."""
    if len(data) < prompt_len + 2:
        raise ValueError(f"a {len(data)}-character split is too short for prompts of {prompt_len}")
    starts = torch.linspace(0, len(data) - prompt_len - 1, n_prompts).long()  # (n_prompts,)
    return data[starts[:, None] + torch.arange(prompt_len)]  # (n_prompts, prompt_len)

def repetition(tokens, n=4):
    """1 - distinct n-grams / n-grams of one generated sequence: 0 never repeats itself, near 1 a
    loop."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)

SPECULATIVE = ("self_speculative", "auto")  # exact by construction: no quality pass of their own

def decoder(model, name, plan=None, measure="top1", spec=(0, 8), schedule=None):
    """The decoder of one table row, for any batch size: decode(idx (B, T0), n, generator=,
    temperature=, top_k=, forced=) -> Generation. name: full, a KV strategy with its exit plan,
    skipdecode with its schedule, or self_speculative with spec = (draft_exit, num_draft). Full
    depth is one decoder on every device: the predictions and the speed-ups divide by the same
    baseline."""
    if name == "self_speculative":
        return partial(generate_self_speculative, model, draft_exit=spec[0], num_draft=spec[1])
    if name == "full":
        return partial(generate, model)
    if name == "skipdecode":
        return partial(generate, model, strategy=partial(SkipDecode, schedule), exit_threshold=0.0)
    return partial(generate, model, strategy=kv_strategy(name), exit_threshold=plan["threshold"],
                   checked_exits=plan["checked_exits"], measure=exit_rules(model)[measure])

def quality_pass(decode, data, n_positions, batch_size=1):
    """Teacher-forced decoding of batch_size contiguous pieces of data at once, n_positions in
    all: every decoder sees the same text, and its own cache's effects."""
    per_row = n_positions // batch_size
    pieces = data[: batch_size * (per_row + 1)].view(batch_size, -1)  # (B, per_row + 1)
    forced = pieces[:, 1:]  # (B, per_row)
    out = decode(pieces[:, :1], per_row, forced=forced)
    logits = out.logits.flatten(0, 1)  # (N, V)
    pred = logits.argmax(-1)  # (N,)
    targets = forced.flatten().to(logits.device)  # (N,)
    exited_at = out.exited_at.flatten().cpu()  # (N,)
    return {"pred": pred, "exited_at": exited_at,
            "mean_layers": out.layers_run / per_row,
            "test_loss": F.cross_entropy(logits, targets).item(),
            "test_accuracy": average(pred == targets)}

def speed_pass(decoders, prompts, batch_size, n_tokens, repeats, seed, top_k):
    """Every decoder continues the workload, batch_size prompts a call, repeats times, interleaved
    a call at a time (a burst of load on the machine falls on every decoder alike); decoders: key ->
    (decode, temperature). Per decoder: median over the passes of tokens/s of all rows,
    block runs per token while decoding (catch-up included) and re-prefilling, how repetitive the
    text is, and the last pass's Generations."""
    batches = prompts.view(-1, batch_size, prompts.size(1))  # (n_batches, B, T0)
    times = {key: [] for key in decoders}  # each pass's seconds
    # no garbage collection while timing: a collection lands on whichever decoder runs then
    gc.disable()
    for _ in range(repeats):
        outputs = {key: [] for key in decoders}
        for key in decoders:
            times[key].append(0.0)
        for i, batch in enumerate(batches):
            for key, (decode, temperature) in decoders.items():
                synchronize(prompts.device)
                t0 = time.perf_counter()
                # batch i samples from seed + i, whichever decoder and pass runs it
                outputs[key].append(decode(
                    batch, n_tokens, temperature=temperature, top_k=top_k,
                    generator=torch.Generator(prompts.device).manual_seed(seed + i)))
                synchronize(prompts.device)
                times[key][-1] += time.perf_counter() - t0
    gc.enable()
    steps = len(batches) * n_tokens  # layers_run and prefill_runs count per row
    return {key: {"tokens_per_second": len(prompts) * n_tokens / float(np.median(times[key])),
                  "mean_layers": sum(o.layers_run for o in outs) / steps,
                  "prefill_layers": sum(o.prefill_runs for o in outs) / steps,
                  "repetition": float(np.mean([repetition(r[-n_tokens:].tolist())
                                               for o in outs for r in o.tokens])),
                  "outputs": outs} for key, outs in outputs.items()}

def spec_stats(outputs, full_outputs, mode):
    """Acceptance (drafts kept over drafts a row could keep), tokens per verify pass, the draft
    that ran, and (greedy) whether every row's output equals full depth's. Outputs of full depth
    (auto's choice where speculation does not pay) count no drafts."""
    runs = [o.stats for o in outputs if isinstance(o, SpeculativeGeneration)]
    same = None
    if mode == "greedy":
        same = all(torch.equal(a.tokens, b.tokens) for a, b in zip(outputs, full_outputs))
    if not runs:
        return {"identical_to_full": same}
    rounds, drafted, accepted = (sum(s[k] for s in runs) for k in ("rounds", "drafted", "accepted"))
    return {"acceptance_rate": accepted / max(1, drafted), "rounds": rounds,
            "tokens_per_verify": sum(o.exited_at.numel() for o in outputs) / rounds,
            "num_draft": runs[0]["num_draft"], "identical_to_full": same}

def tail(outputs):
    """Batch 1's latency from its Generations' clocks, in ms: a token's at the mean, p50, p95 and
    p99 (a step's or round's time shared by the tokens it emitted), and p95 of a prompt's whole."""
    per_token, per_prompt = [], []
    for out in outputs:
        for (t0, n0), (t1, n1) in zip(out.clock, out.clock[1:]):
            per_token += [1e3 * (t1 - t0) / (n1 - n0)] * (n1 - n0)
        per_prompt.append(1e3 * (out.clock[-1][0] - out.clock[0][0]))
    p50, p95, p99 = np.percentile(per_token, [50, 95, 99]).tolist()
    return {"ms_mean": sum(per_token) / len(per_token), "ms_p50": p50, "ms_p95": p95, "ms_p99": p99,
            "prompt_ms_p95": float(np.percentile(per_prompt, 95))}

def table_row(name, mode, speed, quality, config, batch_size=1):
    """One row of a decoder table: speed over full depth at the same batch size and mode, quality
    beside it; a speculative decoder's quality is full depth's by construction."""
    s, full = speed[name, mode], speed["full", mode]
    q = quality.get(name, quality["full"])
    # s: tokens_per_second, mean_layers, prefill_layers, repetition (and outputs, left out)
    row = {"batch_size": batch_size, "name": name, "mode": mode, **s,
           "speedup": s["tokens_per_second"] / full["tokens_per_second"],
           "test_loss": q["test_loss"], "test_accuracy": q["test_accuracy"],
           "agreement": average(q["pred"] == quality["full"]["pred"]),
           "cache": {"state_copy": "approx.", "holes": "holes"}.get(name, "exact")}
    del row["outputs"]
    if batch_size == 1:
        row.update(tail(s["outputs"]))
    if name in SPECULATIVE:
        row.update(spec_stats(s["outputs"], full["outputs"], mode), draft_exit=config.draft_exit)
    # full depth's output: its own, and speculation's (sampled: tested; greedy: compared here)
    row["output"] = f"agree {row['agreement']:.3f}"
    if name in ("full", *SPECULATIVE):
        row["output"] = "same tokens" if mode == "greedy" else "same dist."
    if row.get("identical_to_full") is False:
        row["output"] = "NOT same"
    return row

def time_decoders(decoders, prompts, config, batch_size):
    """speed_pass of name -> {mode: decode} in both modes, interleaved: (name, mode) -> figures."""
    timed = {(name, mode): (d[mode], 0.0 if mode == "greedy" else config.temperature)
             for mode in MODES for name, d in decoders.items()}
    return speed_pass(timed, prompts, batch_size, config.bench_tokens, config.bench_repeats,
                      config.seed, config.top_k)

def measure_decoders(decoders, test, prompts, config, batch_size=1):
    """The rows of a decoder table at one batch size, both modes: quality (greedy decoders,
    teacher-forced on test) and speed on the test workload. decoders: name -> {mode: decode}."""
    quality = {name: quality_pass(d["greedy"], test, config.quality_positions, batch_size)
               for name, d in decoders.items() if name not in SPECULATIVE}
    speed = time_decoders(decoders, prompts, config, batch_size)
    rows = [table_row(name, mode, speed, quality, config, batch_size)
            for mode in MODES for name in decoders]
    return rows, quality

@torch.inference_mode()
def decode_costs(model, prompts, n_tokens, repeats=200, attempts=3):
    """Seconds, one new token at batch 1 (medians): a block, an exit check by each rule (head,
    confidence and the host sync that decides), a state-copy write, the final head, and a whole
    full-depth token on these prompts, by the same full-depth decoder the speed-ups divide by. A
    token cheaper than n_layer blocks is impossible (a busy machine): measured again, up to
    `attempts` times."""
    cfg, device = model.config, prompts.device
    cache, x = KVCache(cfg, 1, device), torch.zeros(1, 1, cfg.n_embd, device=device)
    stages = {"block": partial(model.transformer.h[0], x, cache, 0),
              **{f"check {name}": partial(exit_check, model, x, rule)
                 for name, rule in exit_rules(model).items()},
              "state_copy": partial(write_state_copy, cache, 1, x, *state_copy_projections(model)),
              "final_head": partial(model.exit_logits, x[:, 0], cfg.n_layer - 1)}
    full = {"full": (decoder(model, "full"), 0.0)}  # the full-depth token, greedy
    for attempt in range(1, attempts + 1):
        t = {key: [] for key in stages}
        for _ in range(repeats):
            cache.reset()
            for key, stage in stages.items():
                t0 = time.perf_counter()
                stage()
                synchronize(device)  # each timer reads finished work
                t[key].append(time.perf_counter() - t0)
        costs = {key: float(np.median(v)) for key, v in t.items()}
        token = 1.0 / speed_pass(full, prompts, 1, n_tokens, 1, 0, 0)["full"]["tokens_per_second"]
        costs.update(token=token, attempts=attempt)
        if token >= cfg.n_layer * costs["block"]:
            break
    return costs

def exit_check(model, x, rule):
    """What decode_step does at a checked exit: the head, the rule's confidence and the host sync
    that decides."""
    state = {"layer": 0, "below": x[:, 0], "h": x[:, 0]}
    return bool((confidence(model.exit_logits(x[:, 0], 0), rule, state) > 0.9).any())

def predict_speedup(records, measure, threshold, checked_exits, costs, strategy, n_layer):
    """Full depth's measured time per token over the predicted time of a strategy checking these
    exits.

    Exiting at layer e skips n_layer - 1 - e blocks and the final head (not under backfill, which
    runs them all) and costs a state-copy write under state_copy; every checked exit at or below e
    costs a check. Deferred's catch-up rides in the next token's block call, so it is counted as
    no extra call."""
    exits = exits_at_threshold(records, measure, threshold, checked_exits).float()  # (N,)
    checks = average(sum((exits >= l).float() for l in checked_exits))
    early = average(exits < n_layer - 1)
    saved = 0.0
    if strategy != "backfill":
        saved = average(n_layer - 1 - exits) * costs["block"] + early * costs["final_head"]
    extra = checks * costs[f"check {measure}"]
    if strategy == "state_copy":
        extra += early * costs["state_copy"]
    return costs["token"] / (costs["token"] - saved + extra)

def plan_exits(records, measure, costs, strategy, n_layer, threshold, subsets=None):
    """The cost-aware exit plan: every subset of exits (or the given subsets) at the threshold,
    ranked by predicted speed-up; best first. The threshold's guarantee is for every exit checked:
    a subset can leave later, at an exit that disagrees, so it is not covered."""
    if subsets is None:
        subsets = [list(s) for r in range(1, n_layer)
                   for s in itertools.combinations(range(n_layer - 1), r)]
    plans = [{"checked_exits": subset, "threshold": threshold, "predicted_speedup":
              predict_speedup(records, measure, threshold, subset, costs, strategy, n_layer)}
             for subset in subsets]
    return sorted(plans, key=lambda p: -p["predicted_speedup"])

def strategy_plans(val_records, costs, config, threshold):
    """Per KV strategy: the exits it checks (the best subset under exit_layers=auto) at the
    threshold, and the predicted speed-up, chosen on val. Patience and the learned rule read the
    exit below, so they check every exit."""
    subsets = None  # auto: every subset
    if config.exit_layers != "auto" or config.confidence_measure in ("patience", "learned"):
        subsets = [parse_exit_layers(config.exit_layers, config.n_layer)]
    return {name: plan_exits(val_records, config.confidence_measure, costs, name, config.n_layer,
                             threshold, subsets)[0] for name in KV_STRATEGIES}

def speculation_costs(model, prompts, config, batch_size, cells):
    """Self-speculation on a workload at batch_size, every (draft_exit, num_draft) cell beside full
    depth, both modes, interleaved: an entry per cell and mode. Speculation is costed per round:
    a round takes ms_per_round (its drafts, the verify pass, the accept rule, its share of
    re-prefills) and emits tokens_per_verify over the batch (kept drafts and the full model's
    token: fewer at window edges, and a batch waits for its slowest row); the speed-up is full
    depth's time per token over a round's time per token emitted, which is the speed-up measured
    on this workload. Timed on val, it is the prediction beside test's speed-ups (how well val's
    speed carries over to test) and what auto chooses by."""
    decoders = {cell: dict.fromkeys(MODES, decoder(model, "self_speculative", spec=cell))
                for cell in cells}
    speed = time_decoders({"full": dict.fromkeys(MODES, decoder(model, "full")), **decoders},
                          prompts, config, batch_size)
    entries = []
    for mode in MODES:
        for cell in cells:
            s, full = speed[cell, mode], speed["full", mode]
            stats = spec_stats(s["outputs"], full["outputs"], mode)
            ms_per_round = (1e3 * len(prompts) * config.bench_tokens / s["tokens_per_second"]
                            / stats["rounds"])
            # full depth's time per token of the batch, times the tokens a round emits, over a
            # round's time
            speedup = 1e3 / full["tokens_per_second"] * stats["tokens_per_verify"] / ms_per_round
            entries.append({**stats, "draft_exit": cell[0], "mode": mode,
                            "ms_per_round": ms_per_round, "speedup": speedup,
                            "repetition": s["repetition"]})
    return entries

def workloads(splits, config, device):
    """The val workload (to choose by) and the test workload (to report)."""
    return [workload(splits[s], config.bench_prompts, config.bench_prompt_len).to(device)
            for s in ("val", "test")]

def compare_strategies(model, splits, config, device, fixed, threshold):
    """The strategies table at batch 1: exit plans chosen on val, quality teacher-forced on test,
    speed on the test workload, greedy and sampled, at the sample's threshold; fixed: depth -> a
    plain GPT, timed beside."""
    val_prompts, test_prompts = workloads(splits, config, device)
    val_records = record_exits(model, splits["val"].to(device), config.quality_positions)
    costs = decode_costs(model, val_prompts[:4], config.bench_tokens)
    plans = strategy_plans(val_records, costs, config, threshold)
    spec = (config.draft_exit, config.num_draft)
    # one timed pass on val: a prediction, not a reported figure
    one_pass = replace(config, bench_repeats=1)
    predicted = dict(zip(MODES, speculation_costs(model, val_prompts, one_pass, 1, [spec])))
    decoders = {name: dict.fromkeys(MODES, decoder(model, name, plans.get(name),
                                                   config.confidence_measure, spec))
                for name in ("full", *KV_STRATEGIES, "self_speculative")}
    decoders.update({f"{d}-layer GPT": dict.fromkeys(MODES, decoder(small, "full"))
                     for d, small in fixed.items()})
    rows, quality = measure_decoders(decoders, splits["test"].to(device), test_prompts, config)
    for row in rows:
        plan = plans.get(row["name"])
        if plan:
            row.update(plan, checked_exits=",".join(map(str, plan["checked_exits"])))
        if row["name"] == "self_speculative":
            row["predicted_speedup"] = predicted[row["mode"]]["speedup"]
        if row["name"].endswith("GPT"):  # a smaller model skips its missing blocks, no checks
            skipped = (config.n_layer - row["mean_layers"]) * costs["block"]
            row["predicted_speedup"] = costs["token"] / (costs["token"] - skipped)
    return rows, quality, plans, costs, val_records

# -----------------------------------------------------------------------------
# Batches: a batch runs as deep as its deepest row, unless a schedule (SkipDecode) or drafts decide

def expected_batch_depth(exited_at, batch_sizes, n_layer):
    """Mean of the deepest exit among B independent draws from the recorded per-token exit layers:
    the deepest of B is at most l with probability P(exit <= l)^B."""
    counts = torch.bincount(exited_at.cpu(), minlength=n_layer).double()  # (L,)
    cdf = counts.cumsum(0) / len(exited_at)  # (L,): P(exit <= l)
    below = F.pad(cdf[:-1], (1, 0))  # (L,): P(exit < l)
    depth = torch.arange(1, n_layer + 1)  # (L,): blocks run when the deepest row exits at l
    return {B: float(((cdf**B - below**B) * depth).sum()) for B in batch_sizes}

class SkipDecode(Holes):
    """After SkipDecode (arXiv:2307.02628): every row at window position pos exits at
    schedule[pos], a depth that never rises along the window, so a later token never reads a layer
    an earlier one skipped: no holes are ever read, no exit check is needed, and a batch saves what
    a row saves."""
    def __init__(self, schedule):
        self.schedule = schedule

    def exit_checks(self, pos, checked_exits):
        return [self.schedule[pos]]  # the last layer is never checked: it always exits

def window_positions(n_positions, block_size):
    """(N,): the window position at which sequential decoding feeds the token predicting each
    position."""
    return torch.cat([torch.arange(first - start, end - start)
                      for start, end, first in decoder_windows(n_positions, block_size)])

def choose_schedule(records, n_layer, block_size, budget):
    """The SkipDecode schedule saving the most on val within `budget` disagreement with full
    depth: full depth before window position a, exit layer e from there on (a, e on a grid)."""
    last = n_layer - 1
    wpos = window_positions(records.targets.numel(), block_size).to(records.pred.device)
    best = {"schedule": [last] * block_size, "compute_saved": 0.0, "disagreement": 0.0}
    for a in range(0, block_size, max(1, block_size // 16)):
        for e in range(last):
            figures = exit_summary(records, torch.where(wpos >= a, e, last))
            if (figures["disagreement"] <= budget
                    and figures["compute_saved"] > best["compute_saved"]):
                best = {"schedule": [last] * a + [e] * (block_size - a), "from_position": a,
                        "exit_layer": e, "compute_saved": figures["compute_saved"],
                        "disagreement": figures["disagreement"]}
    return best

BATCH_DESIGNS = ("full", "state_copy", "skipdecode", "self_speculative", "auto")
# num_draft tried in batches (11 fills 33 new tokens: half of block 64, plus 1)
BATCH_DRAFTS = (4, 8, 11, 16)

def choose_drafts(entries):
    """From speculation_costs' entries: per mode, the k predicted fastest (self_speculative's), and
    what auto runs: that k, or None (full depth) where no k is predicted faster than full depth."""
    drafts, auto = {}, {}
    for mode in MODES:
        best = max((e for e in entries if e["mode"] == mode), key=lambda e: e["speedup"])
        drafts[mode] = best["num_draft"]
        auto[mode] = best["num_draft"] if best["speedup"] > 1 else None
    return drafts, auto

def batch_decoders(model, config, plan, schedule, drafts, auto):
    """The batch table's decoders: name -> {mode: decode}. drafts: the k of self_speculative per
    mode; auto: per mode, the k it runs, or None for full depth."""
    decoders = {name: dict.fromkeys(MODES, decoder(model, name, plan, config.confidence_measure,
                                                   schedule=schedule["schedule"]))
                for name in BATCH_DESIGNS[:3]}
    decoders["self_speculative"] = {mode: decoder(model, "self_speculative",
                                                  spec=(config.draft_exit, k))
                                    for mode, k in drafts.items()}
    decoders["auto"] = {mode: decoders["full" if k is None else "self_speculative"][mode]
                        for mode, k in auto.items()}
    return decoders

def batch_predictions(row, plan, skip, depth, spec):
    """The cost models' speed-up beside a batch-table row: state_copy at the batch's expected depth
    (every row waits for the deepest), skipdecode from the block runs it skips, speculation per
    round (on val); auto's choice is the k it ran (none: full depth)."""
    name, B, k = row["name"], row["batch_size"], row.get("num_draft")
    if name == "state_copy":
        return {"expected_layers": depth[B],
                "predicted_speedup": plan["predicted_speedup"] * depth[1] / depth[B]}
    if name == "skipdecode":
        return {"predicted_speedup": skip}
    figures = {"predicted_speedup": 1.0}  # full depth, and auto where it runs full depth
    if k is not None:
        figures["predicted_speedup"] = spec[row["mode"], k]["speedup"]
    if name == "auto":
        figures["choice"] = "full depth" if k is None else f"k={k}"
    return figures

def measure_batches(model, splits, config, device, plans, val_records, unit_costs):
    """The batch table: every design at every batch size, greedy and sampled, quality beside
    speed, and the cost models' predictions (unit_costs: decode_costs' batch-1 figures)."""
    L, plan = config.n_layer, plans["state_copy"]
    val_prompts, test_prompts = workloads(splits, config, device)
    schedule = choose_schedule(val_records, L, config.block_size, config.schedule_disagreement)
    exits = exits_at_threshold(val_records, config.confidence_measure, plan["threshold"],
                               plan["checked_exits"])
    depth = expected_batch_depth(exits, BATCH_SIZES, L)  # a step runs as deep as its deepest row
    # skipdecode skips the same share of block runs in every row, with no checks
    skip = unit_costs["token"] / (unit_costs["token"]
                                  - schedule["compute_saved"] * L * unit_costs["block"])
    cells = [(config.draft_exit, k) for k in sorted({*BATCH_DRAFTS, config.num_draft})]
    rows, chosen = [], {}
    for B in BATCH_SIZES:
        if config.bench_prompts % B:
            continue
        entries = speculation_costs(model, val_prompts, config, B, cells)
        drafts, auto = choose_drafts(entries)  # on val
        chosen[B] = {"num_draft": drafts, "auto": auto, "speculation_costs": entries}
        spec = {(e["mode"], e["num_draft"]): e for e in entries}
        decoders = batch_decoders(model, config, plan, schedule, drafts, auto)
        test = splits["test"].to(device)
        batch_rows = measure_decoders(decoders, test, test_prompts, config, B)[0]
        rows += [dict(r, **batch_predictions(r, plan, skip, depth, spec)) for r in batch_rows]
    return {"entries": rows, "schedule": schedule, "plan": plan, "drafts": chosen}

# -----------------------------------------------------------------------------
# Reports: tables for people, JSON for programs

WIDTH = 100  # console tables and their notes fit this many columns

def table(text):
    """A table, defined once: its question on the first line, then a line a column, 'report key |
    header | format | help'. print_table prints it, html_table renders it, and both write its
    legend from the help."""
    question, *columns = text.strip().split("\n")
    return question, [[part.strip() for part in column.split("|")] for column in columns]

SWEEP_TABLE = table("""Which threshold?
threshold     | threshold              | {:.2f} | a position leaves at the first exit this sure
fractions     | % exiting at layer 0.. | {}     | where the positions leave
mean_layers   | layers                 | {:.2f} | mean layers run per position
compute_saved | val saved              | {:.1%} | the share of layer runs skipped
loss          | val loss               | {:.4f} | the loss of the head each position leaves at
disagreement  | disagree               | {:.2%} | the share whose top-1 is not full depth's""")
CALIBRATION_TABLE = table("""Which exit rule, with a guarantee, and how near the best possible?
measure            | rule         | {}     | how sure an exit is (oracle: knows full depth's top-1)
k                  | k            | {}     | patience: the exits in a row that must agree
threshold          | threshold    | {:.3g} | the threshold Learn then Test chooses on val
test.compute_saved | test saved   | {:.1%} | the share of layer runs it skips on test
test.oracle_share  | of oracle    | {:.0%} | that share over the oracle's at the same epsilon
test.disagreement  | disagree     | {:.2%} | the share whose top-1 is not full depth's
test.loss          | test loss    | {:.4f} | the loss of the heads the positions leave at
test.full_loss     | full depth's | {:.4f} | full depth's loss on the same positions
test.accuracy      | accuracy     | {:.3f} | how often the exit's top-1 is the next character""")
LENS_TABLE = table("""Does an exit need a trained head?
layer      | layer         | {}     | the layer read
readout    | readout       | {}     | its own exit head, or the final one (untrained there)
agreement  | top-1 = final | {:.3f} | how often its top-1 is the final prediction
confidence | confidence    | {:.3f} | its mean top-1 probability""")
PATIENCE_TABLE = table("""How patient? (patience on val, k swept)
k             | k         | {}     | the exits in a row that must agree on the top-1
mean_layers   | layers    | {:.2f} | mean layers run per position
compute_saved | val saved | {:.1%} | the share of layer runs skipped
disagreement  | disagree  | {:.2%} | the share whose top-1 is not full depth's""")
EXIT_CALIBRATION_TABLE = table("""Does one confidence mean the same at every exit?
layer       | layer    | {:}    | the exit read (the last: full depth)
ece_data    | ECE data | {:.3f} | expected calibration error of the top-1 confidence, on the data
ece_full    | ECE full | {:.3f} | and against full depth's top-1
reliability | accuracy in the confidence bins 0-0.1, ..., 0.9-1 | {} | '-': an empty bin""")
SHIFT_TABLE = table("""Does the guarantee hold on text of another kind?
measure             | rule        | {}     | the rule, at its threshold calibrated on val
test.compute_saved  | test saved  | {:.1%} | the share of layer runs skipped on test
shift.compute_saved | shift saved | {:.1%} | and on the shifted text
test.disagreement   | test dis.   | {:.2%} | the share whose top-1 is not full depth's, on test
shift.disagreement  | shift dis.  | {:.2%} | and on the shifted text
shift.held          | held        | {}     | shift dis. within epsilon
shift.loss          | shift loss  | {:.4f} | the loss of the exits on the shifted text
shift.full_loss     | full depth's| {:.4f} | full depth's loss there""")
KINDS_TABLE = table("""What does 'easy' mean here, and who pays for the disagreement?
kind          | kind      | {}      | the kind of the character to predict
positions     | positions | {:,}    | test positions of that kind
mean_layers   | layers    | {:.2f}  | mean layers run
disagreement  | disagree  | {:.2%}  | the share whose top-1 is not full depth's
accuracy_lost | acc. lost | {:+.3f} | full depth's accuracy minus the exits', both on the same \
positions (an exit's accuracy over only the positions that leave there falls with depth: the hard \
positions are the ones that go deep, a selection effect, not worse heads)""")
TAIL_TABLE = table("""Average or tail?
mode          | mode       | {}     | greedy, or sampled
name          | decoder    | {}     | as in the strategies table
ms_mean       | mean       | {:.2f} | ms a token
ms_p50        | p50        | {:.2f} | the median token's ms
ms_p95        | p95        | {:.2f} | 95% of tokens took at most this many ms
ms_p99        | p99        | {:.2f} | and 99%
prompt_ms_p95 | prompt p95 | {:.0f} | ms for a prompt's whole continuation, 95th percentile""")
DEPTH_TABLE = table("""Would a smaller model do as well?
layers            | layers     | {}      | a plain GPT of this depth (alpha 0)
test_loss         | test loss  | {:.4f}  | on the test positions the exit rules are reported on
excess_loss       | above full | {:+.4f} | over the full model's loss there
test_accuracy     | accuracy   | {:.3f}  | how often its top-1 is the next character
tokens_per_second_greedy | tok/s | {:,.0f} | greedy, batch 1, the test workload
speedup_greedy    | greedy     | {:.2f}x | over the full model, as in the strategies table
speedup_sampled   | sampled    | {:.2f}x | and sampled""")
STRATEGY_TABLE = table("""What does each KV strategy buy?
mode              | mode      | {}      | greedy, or sampled
name              | decoder   | {}      | how the skipped layers' cache is filled
checked_exits     | exit at   | layer {} | the exits checked ('-': none)
threshold         | thr       | {:.2f}  | their threshold
speedup           | speed-up  | {:.2f}x | tokens per second over full depth's in the same mode
predicted_speedup | predicted | {:.2f}x | the cost model's speed-up, from measured costs
mean_layers       | layers    | {:.2f}  | blocks run per token while decoding, catch-up included \
(above the model's depth for self_speculative: the draft's layers, then the verify pass over \
every draft, kept or not)
repetition        | repeats   | {:.2f}  | the share of 4-grams repeating an earlier one
cache             | cache     | {}      | the skipped layers' keys and values: exact, approximate \
(approx.), or missing (holes)
output            | output    | {}      | same tokens as full depth (greedy), same distribution \
(sampled), or differs: how often its top-1 is full depth's (agree), teacher-forced on \
quality_positions test positions""")
BATCH_TABLE = table("""Does early exit still save in a batch?
batch_size        | B         | {}      | rows decoded together, a prompt each
mode              | mode      | {}      | greedy, or sampled
name              | design    | {}      | the decoder
tokens_per_second | tok/s     | {:,.0f} | characters per second of the whole batch
speedup           | speed-up  | {:.2f}x | over full depth at the same batch size and mode
predicted_speedup | predicted | {:.2f}x | the cost model's speed-up
num_draft         | k         | {}      | drafts a round
mean_layers       | layers    | {:.2f}  | blocks run per token
expected_layers   | expected  | {:.2f}  | val's exits' prediction, a step as deep as its deepest row
agreement         | agree     | {:.3f}  | teacher-forced test positions whose top-1 is full depth's
identical_to_full | identical | {}      | greedy output equal to full depth's on every row""")

def legend(columns):
    """A table's legend: each column's header and help."""
    return "; ".join(f"{header}: {text}" for _, header, _, text in columns if text) + "."

def field(row, key):
    """A row's figure under its report key, dotted where nested ('test.loss'); None if absent."""
    for part in key.split("."):
        row = (row or {}).get(part)
    return row

def format_cell(value, fmt):
    """A table cell as text: '-' where a row has no such figure."""
    if value is None:
        return "-"
    return fmt.format(value)

def print_table(table, rows, conditions="", notes=()):
    """A table under its question and the conditions it was measured in, then legend and notes."""
    question, columns = table
    lines = [[header for _, header, _, _ in columns]]
    lines += [[format_cell(field(row, key), fmt) for key, _, fmt, _ in columns] for row in rows]
    widths = [max(map(len, column)) for column in zip(*lines)]
    # the question as the title, '=== ... ===', wrapped to WIDTH
    print("\n=== " + "\n    ".join(textwrap.wrap(f"{question} {conditions}", WIDTH - 8)) + " ===")
    for line in lines:
        print("  ".join(v.rjust(w) for v, w in zip(line, widths)))
    for note in (legend(columns), *notes):
        print(textwrap.fill(note, WIDTH, subsequent_indent="  ", break_on_hyphens=False))

def print_strategies(entries, config, costs, depths):
    """The strategies table, then what it rests on: the drafts, the measured costs and a batch's
    depth."""
    L, b = config.n_layer, costs["block"]
    exact = {True: "identical to full depth on every prompt", False: "NOT identical to full depth",
             None: "exact in distribution (tested)"}
    notes = [f"self_speculative {e['mode']}: draft_exit={e['draft_exit']}, num_draft="
             f"{e['num_draft']}, acceptance {e['acceptance_rate']:.3f} (drafts kept over drafts "
             f"a row could keep), "
             f"{e['tokens_per_verify']:.2f} tokens a verify pass, " + exact[e["identical_to_full"]]
             for e in entries if e["name"] == "self_speculative"]
    # the full model's decoders: a smaller GPT re-prefills fewer layers
    prefill = sorted({round(e["prefill_layers"], 2) for e in entries if "GPT" not in e["name"]})
    depth = ", ".join(f"B={B}: {d:.2f}" for B, d in depths.items())
    impossible = ""
    if costs["token"] < L * b:
        impossible = f", IMPOSSIBLE ({L} blocks): so after {costs['attempts']} measurements"
    check = config.confidence_measure
    notes += [f"Chosen on val: exits (exit_layers={config.exit_layers!r}) at the sample's "
              "threshold, and self_speculative's prediction, its speed-up timed on val (per round: "
              "a round's time over the tokens it emits). Prefilling the prompt and re-prefilling "
              "the window every block_size/2 tokens adds "
              + " to ".join(f"{p:.2f}" for p in prefill) + " per token for every decoder. Sampled: "
              f"temperature {config.temperature:g}, top_k {config.top_k}.",
              f"output's agreement: on {config.quality_positions:,} test positions, "
              "teacher-forced. The guarantee of a calibrated threshold covers every exit checked "
              "with an exact cache: not a subset of exits, nor state_copy or holes.",
              f"Measured at batch 1: a block {1e6 * b:.0f} us; in blocks, an exit check "
              f"{costs['check ' + check] / b:.2f} ({check}), a state-copy write "
              f"{costs['state_copy'] / b:.2f}, the final head {costs['final_head'] / b:.2f}, a "
              f"full-depth token {costs['token'] / b:.1f}{impossible}.",
              f"A batch runs as deep as its deepest row; expected layers a step (of {L}): {depth}."]
    print_table(STRATEGY_TABLE, entries, f"{config.bench_prompts} test prompts of "
                f"{config.bench_prompt_len} characters, {config.bench_tokens} more each, batch 1, "
                f"median of {config.bench_repeats} interleaved runs", notes)

def batch_notes(batched, cfg):
    """The notes under the batch table; cfg: the config as a dict (report.json's)."""
    plan, schedule = batched["plan"], batched["schedule"]
    chose = [f"B={r['batch_size']} {r['mode']} {r['choice']}" for r in batched["entries"]
             if r["name"] == "auto"]
    drafts = sorted({*BATCH_DRAFTS, cfg["num_draft"]})
    return [f"auto chose: {', '.join(chose)} (the cost model's first choice: k drafts a round, or "
            f"full depth). state_copy: exits {plan['checked_exits']}, "
            f"{cfg['confidence_measure']} > {plan['threshold']:g}, each row waiting for the "
            "deepest. skipdecode: every row exits at layer "
            f"{schedule.get('exit_layer', cfg['n_layer'] - 1)} from window position "
            f"{schedule.get('from_position', '-')} (val: {schedule['compute_saved']:.1%} saved, "
            f"{schedule['disagreement']:.2%} disagreement). self_speculative: draft_exit="
            f"{cfg['draft_exit']}, k the fastest on val of {drafts}."]

def print_batches(batched, config):
    print_table(BATCH_TABLE, batched["entries"], "The test workload, one prompt per row, batch "
                f"{', '.join(str(B) for B in BATCH_SIZES if config.bench_prompts % B == 0)}, "
                f"median of {config.bench_repeats} interleaved runs",
                batch_notes(batched, asdict(config)))

def guarantee(cal, positions):
    return (f"Learn then Test: disagreement <= {100 * cal['epsilon']:g}% with probability >= "
            f"{100 * (1 - cal['delta']):g}%, chosen on val, reported on "
            f"{positions:,} test positions")

def calibration_note(rows, threshold):
    """One sentence: do the exits mean the same thing by the same confidence, in the bin of the
    calibrated threshold (of ten)?"""
    b = min(int(10 * threshold), 9)
    top = [r["bins"]["agreement"][b] for r in rows[:-1] if r["bins"]["positions"][b]] or [0.0]
    return (f"Where an exit is {10 * b}-{10 * b + 10}% sure (the calibrated threshold's bin), "
            f"its top-1 is full depth's {min(top):.1%} to "
            f"{max(top):.1%} of the time: " + ("the exits differ (by over 2 points), so one "
                                              "threshold does not mean the same at every exit."
                                              if max(top) - min(top) > 0.02 else "one threshold "
                                              "means about the same at every exit."))

def shift_notes(cal, path):
    """The monitor line and the plain answer: did epsilon hold on the shifted text?"""
    t, sh = cal["test"], cal["shift"]
    return [f"share leaving at layer 0 ({cal['measure']}): test {t['exit_fractions'][0]:.1%}, "
            f"shifted {sh['exit_fractions'][0]:.1%}",
            f"On {path}, epsilon {'held' if sh['held'] else 'was BROKEN'} for {cal['measure']}: "
            f"{sh['disagreement']:.2%} disagreement against {100 * cal['epsilon']:g}%. The "
            "guarantee covers text like val, and nothing else."]

def tail_note(rows):
    full = {r["mode"]: r["ms_p99"] for r in rows if r["name"] == "full"}
    worse = [f"{r['name']} {r['mode']}" for r in rows if r["ms_p99"] > 1.1 * full[r["mode"]]]
    return (f"p99 over 10% above full depth's (a worse tail): {', '.join(worse) or 'none'}. Each "
            "step timed with the device synchronised, in the last timed pass; a round of "
            "speculation is shared by the tokens it emits. A prompt's first step prefills it, and "
            "a step that slides the window re-prefills it: those steps are the tail.")

def print_exit_rule(rule, config):
    """The analysis of choosing the exit rule, each part under the question it answers."""
    n, cal = f"{config.sweep_positions:,}", rule["calibration"]
    shown = [dict(e, fractions=" ".join(f"{100 * f:5.1f}" for f in e["exit_fractions"]))
             for e in rule["sweep"] if round(10 * e["threshold"], 6) % 1 == 0]  # 1.0, 0.9, ...
    print_table(SWEEP_TABLE, shown, f"The sweep on {n} val positions, teacher-forced "
                f"({config.confidence_measure}): compute saved against quality",
                [f"full depth's val loss on the {n} val positions: "
                 f"{rule['sweep'][0]['full_loss']:.4f}"])
    print_table(CALIBRATION_TABLE, rule["calibration_by_measure"],
                guarantee(cal, config.sweep_positions),
                ["Teacher-forced, with an exact cache, every exit checked. The oracle leaves at "
                 "the first exit whose top-1 is full depth's, and spends epsilon where that saves "
                 "most: no rule saves more at the same disagreement."])
    print_table(PATIENCE_TABLE, rule["patience"], f"{n} val positions")
    print_table(EXIT_CALIBRATION_TABLE, rule["exit_calibration"], f"{n} test positions",
                [calibration_note(rule["exit_calibration"],
                                  rule["calibration_by_measure"][0]["threshold"])])  # top1's
    if "shift" in cal:
        print_table(SHIFT_TABLE, rule["calibration_by_measure"], f"{config.shift_path}, up to {n} "
                    "positions", shift_notes(cal, config.shift_path))
    print_table(LENS_TABLE, rule["logit_lens"], "The logit lens on up to 64 val windows: each "
                "layer through the final head and through its own exit head")
    print_table(KINDS_TABLE, rule["slices"], f"The {n} test positions by the kind of the character "
                f"to predict (calibrated threshold {cal['threshold']:g})")

# -----------------------------------------------------------------------------
# Reports, 2: out_dir/report.html, one self-contained page (inline CSS and SVG, no script)

# viridis, dark to light: the layers' order reads without hue (colour-blind safe)
VIRIDIS = ("#440154 #411c66 #3e3779 #3b528b #32678b #2a7c8c #21918c #35a47e #4ab670 #5ec962 "
           "#93d34e #c8dd39 #fde725").split()

def layer_colour(layer, n_layer):
    """The first layer's colour is viridis' darkest, the last one's its lightest."""
    return VIRIDIS[round(layer * (len(VIRIDIS) - 1) / max(1, n_layer - 1))]

def swatch(layer, n_layer):
    """A layer's colour as a background, under text that reads on it."""
    colour = layer_colour(layer, n_layer)
    ink = "#fff"
    if VIRIDIS.index(colour) >= 8:
        ink = "#000"
    return f'style="background:{colour};color:{ink}"'

def esc(text):
    """Text made safe inside HTML and its attributes."""
    return html.escape(str(text))

def datum(key, value):
    """The attributes that tie a number on the page to its place in report.json (a test checks)."""
    return f'data-key="{esc(key)}" data-value="{value!r}"'

HTML_STYLE = """
:root { --bg: #fff; --fg: #1d1d1f; --muted: #6e6e73; --grid: #d2d2d7; --a: #2a788e; --b: #e66101; }
@media (prefers-color-scheme: dark) { :root { --bg: #161618; --fg: #f2f2f7; --muted: #a1a1a6;
  --grid: #3a3a3c; --a: #5ec9c9; --b: #fdb863; } }
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
svg .a { fill: var(--a); stroke: var(--a); } svg .b { fill: var(--b); stroke: var(--b); }
svg .line { fill: none; stroke-width: 2; } svg .mark { stroke: var(--fg); stroke-dasharray: 4 3; }
#summary { border: 1px solid var(--grid); border-radius: 6px; padding: 0 1em; }
"""

def nice_ticks(top, bottom=0, n=5):
    """Round ticks from bottom (0, or a tick under a negative bottom) up to top or just past it:
    steps of 1, 2 or 5 times a power of ten."""
    span = max(top - bottom, 1e-9)
    power = 10 ** math.floor(math.log10(span / n))
    step = next(m * power for m in (1, 2, 5, 10) if m * power * n >= span)
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

def svg_point(cls, x, y, ticks, key, tip, width):
    """One figure with its report key: a bar `width` wide (a share of the x axis), or a dot."""
    data = f'class="{cls}" {datum(key, y)}><title>{esc(tip)}</title>'
    if width:
        return (f'<rect x="{plot_x(x):.1f}" y="{plot_y(y, ticks):.1f}" '
                f'width="{PLOT_WIDTH * width:.1f}" '
                f'height="{PLOT_HEIGHT - plot_y(y, ticks):.1f}" {data}</rect>')
    return f'<circle cx="{plot_x(x):.1f}" cy="{plot_y(y, ticks):.1f}" r="3" {data}</circle>'

def svg_chart(series, x_ticks, titles, y_fmt, bars=False, mark=None, line=None, top=None):
    """Lines, or bars side by side (their x labels on two rows). series: (name, class, points), a
    point (x in [0, 1], y, report key, hover text); x_ticks: {label: x}; titles: the axes'; mark:
    (x, report key, label), a dashed line up the chart; line: (y, label), one across it (at most
    top); top: the axis's top, if not the data's (bars: at least 1.0x, full depth's)."""
    ys = [p[1] for _, _, points in series for p in points]
    ticks, H = nice_ticks(top or max(ys + [int(bars)]), min(ys + [0])), PLOT_HEIGHT
    parts = [f'<div class="scroll"><svg viewBox="0 0 640 {H + 64 + 18 * len(series)}" '
             f'width="100%" role="img"><text transform="translate(14 {H / 2}) rotate(-90)" '
             f'text-anchor="middle">{esc(titles[1])}</text><text x="345" y="{H + 52}" '
             f'text-anchor="middle">{esc(titles[0])}</text>']
    parts += [f'<line class="grid" x1="64" x2="630" y1="{plot_y(t, ticks):.1f}" '
              f'y2="{plot_y(t, ticks):.1f}"/><text x="58" y="{plot_y(t, ticks) + 4:.1f}" '
              f'text-anchor="end">{y_fmt.format(t)}</text>' for t in ticks]
    parts += [f'<text x="{plot_x(x):.1f}" y="{H + 18 + 14 * (i % 2 * bars)}" '
              f'text-anchor="middle">{esc(label)}</text>'
              for i, (label, x) in enumerate(x_ticks.items())]
    width = 0.8 / len(x_ticks) / len(series) * bars  # a bar group fills 80% of its share; lines: 0
    if mark:
        parts.append(f'<line class="mark" x1="{plot_x(mark[0]):.1f}" x2="{plot_x(mark[0]):.1f}" '
                     f'y1="0" y2="{H}" {datum(mark[1], mark[0])}/><text '
                     f'x="{plot_x(mark[0]) + (4 if mark[0] < 0.5 else -4):.1f}" y="12" '
                     f'text-anchor="{"start" if mark[0] < 0.5 else "end"}">{esc(mark[2])}</text>')
    for s, (name, cls, points) in enumerate(series):
        if not bars:
            coords = " ".join(f"{plot_x(x):.1f},{plot_y(y, ticks):.1f}" for x, y, _, _ in points)
            parts.append(f'<polyline class="{cls} line" points="{coords}"/>')
        parts += [svg_point(cls, x + (s - len(series) / 2) * width, y, ticks, key, tip, width)
                  for x, y, key, tip in points]
        parts.append(f'<rect class="{cls}" x="70" y="{H + 66 + 18 * s}" width="12" height="12"/>'
                     f'<text x="88" y="{H + 77 + 18 * s}">{esc(name)}</text>')
    if line:  # over the bars, its label at the left end (bars: over full depth's own)
        parts.append(f'<line class="mark" x1="64" x2="630" y1="{plot_y(line[0], ticks):.1f}" '
                     f'y2="{plot_y(line[0], ticks):.1f}"/><text x="72" '
                     f'y="{plot_y(line[0], ticks) - 4:.1f}">{esc(line[1])}</text>')
    return "".join(parts) + "</svg></div>"

def html_table(table, rows, key, notes=()):
    """A table in a box that scrolls sideways on a narrow screen, then its legend and notes;
    key(i, column key): where row i's number in that column is in report.json."""
    columns = table[1]
    out = ["<div class='scroll'><table><tr>"]
    out += [f"<th>{esc(header)}</th>" for _, header, _, _ in columns]
    for i, row in enumerate(rows):
        out.append("</tr><tr>")
        for k, _, fmt, _ in columns:
            value = field(row, k)
            if type(value) in (int, float):  # a number (not a bool): tie it to report.json
                out.append(f"<td {datum(key(i, k), value)}>{esc(fmt.format(value))}</td>")
            else:
                out.append(f"<td>{esc(format_cell(value, fmt))}</td>")
    out.append("</tr></table></div>")
    out += [f"<p class='muted'>{esc(note)}</p>" for note in (legend(columns), *notes)]
    return "".join(out)

def section(anchor, question, *body):
    """One section of the page under its question; the summary links to it by its anchor."""
    return f"<section id='{anchor}'><h2>{esc(question)}</h2>{''.join(body)}</section>"

def html_summary(report, sections):
    """What was trained on what, the run's summary (the console's last lines), links to the rest."""
    cfg = report["config"]
    lines = "".join(f"<li>{esc(line)}</li>" for line in report.get("summary", ()))
    links = " · ".join(f"<a href='#{a}'>{q}</a>" for a, q in sections)  # q: escaped already
    return (f"<div id='summary'><p>A {cfg['n_layer']}-layer GPT ({cfg['n_head']} heads, "
            f"{cfg['n_embd']} wide, context {cfg['block_size']} characters) with an exit head "
            f"after every layer but the last, trained on {esc(cfg['input_path'])}.</p><ul>{lines}"
            "</ul><p class='muted'>Speeds are medians of interleaved runs on the machine that "
            "wrote this page and move with its load; every number here is in report.json.</p>"
            f"<p>{links}</p></div>")

def sample_spans(text, marks):
    """A sample as spans, a character each with its (attributes, title); newlines show a mark."""
    spans = "".join(f'<span {attrs} title="{esc(title)}">{esc(ch)}</span>'
                    for ch, (attrs, title) in zip(text, marks))
    return spans.replace("\n</span>", "&#8629;</span>\n")  # the line breaks after the span

def html_generation(report):
    """The early-exit sample on the colours of its exit layers, full depth's beside it; the legend
    counts the characters that left at each layer."""
    g, L = report["generation"], report["config"]["n_layer"]
    legend = "".join(f"<span {swatch(l, L)}>layer {l}: <b {datum(f'generation.exit_counts.{l}', c)}"
                     f">{c}</b></span>" for l, c in enumerate(g["exit_counts"]))
    marks = [(f'{swatch(l, L)} data-layer="{l}"', f"layer {l}") for l in g["exited_at"]]
    return section(
        "sample", "What does early exit look like?", f"<p class='legend'>{legend}</p><p "
        f"class='muted'>Each character of the early-exit sample ({esc(g['kv_strategy'])}, "
        f"threshold {g['exit_threshold']:g}) sits on the colour of the layer it left at, dark "
        f"(layer 0) to light (layer {L - 1}, full depth); the legend counts the characters that "
        "left at each layer; hover for a character's layer.</p><div "
        "class='row'><div><h3>early exit</h3><pre class='sample'>\n"
        f"{sample_spans(g['sample'], marks)}</pre></div><div><h3>full depth</h3><pre "
        f"class='sample'>\n{esc(g['full_depth_sample'])}</pre></div></div>")

# the sweep's two charts: compute saved on its own axis, disagreement on one up to 2 epsilon
SWEEP_LINES = (("compute saved (share of layer runs)", "a", "compute_saved"),
               ("disagreement with full depth (share of positions)", "b", "disagreement"))

def html_sweep(report):
    """What each threshold trades on val, compute for disagreement, each on its own axis: the
    disagreement's zoomed to twice the budget (epsilon drawn); the calibrated threshold marked."""
    cal = report["calibration"]
    eps = cal["epsilon"]
    ticks = {f"{t / 10:.1f}": t / 10 for t in range(11)}
    mark = (cal["threshold"], "calibration.threshold", f"calibrated: {cal['threshold']:g}")
    titles, charts = (f"exit threshold ({cal['measure']} confidence)", "share"), []
    for (name, cls, key), line in zip(SWEEP_LINES, (None, (eps, f"epsilon: {100 * eps:g}%"))):
        points = [(e["threshold"], e[key], f"sweep.{j}.{key}",
                   f"threshold {e['threshold']:g}: {e[key]:.2%}")
                  for j, e in enumerate(report["sweep"])]
        charts.append(svg_chart([(name, cls, points)], ticks, titles, "{:.1%}", mark=mark,
                                line=line, top=line and 2 * eps))
    return section("threshold", f"Which threshold? ({cal['measure']}, val)", *charts,
                   "<p class='muted'>Disagreement over twice epsilon is drawn at the top of its "
                   "axis; hover for the value.</p>")

def html_speedups(rows, prefix, batch_size):
    """The measured speed-up of each decoder at one batch size, greedy and sampled side by side."""
    shown = [(i, r) for i, r in enumerate(rows) if r["batch_size"] == batch_size]
    names = list(dict.fromkeys(r["name"] for _, r in shown))
    at = {name: (n + 0.5) / len(names) for n, name in enumerate(names)}  # the middle of its group
    series = [(mode, cls, [(at[r["name"]], r["speedup"], f"{prefix}.{i}.speedup", f"{r['name']}, "
                            f"{mode}: {r['speedup']:.2f}x") for i, r in shown if r["mode"] == mode])
              for cls, mode in zip("ab", MODES)]
    titles = (f"decoder, batch {batch_size}", "speed-up over full depth, measured")
    return svg_chart(series, at, titles, "{:.1f}x", bars=True, line=(1, "1.0x: full depth"))

def rows_section(report, part, table, *before):
    """A section that shows report[part]'s rows as a table, after any charts or words."""
    rows = html_table(table, report[part], f"{part}.{{}}.{{}}".format)
    return section(part, table[0], *before, rows)

def html_calibration(report):
    conditions = guarantee(report["calibration"], report["config"]["sweep_positions"])
    return rows_section(report, "calibration_by_measure", CALIBRATION_TABLE,
                        f"<p>{conditions}, teacher-forced, with an exact cache.</p>")

def html_exit_calibration(report):
    note = calibration_note(report["exit_calibration"],
                            report["calibration_by_measure"][0]["threshold"])  # top1's
    return rows_section(report, "exit_calibration", EXIT_CALIBRATION_TABLE, f"<p>{esc(note)}</p>")

def html_shift(report):
    cal, rows = report["calibration"], report["calibration_by_measure"]
    if "shift" not in cal:
        return ""
    notes = shift_notes(cal, report["config"]["shift_path"])
    table = html_table(SHIFT_TABLE, rows, "calibration_by_measure.{}.{}".format, notes)
    return section("shift", SHIFT_TABLE[0], table)

def html_strategies(report):
    chart = html_speedups(report["strategies"], "strategies", 1)
    return rows_section(report, "strategies", STRATEGY_TABLE, chart)

def html_tail(report):
    rows = report["strategies"]
    return section("tail", TAIL_TABLE[0], html_table(TAIL_TABLE, rows, "strategies.{}.{}".format,
                                                      [tail_note(rows)]))

def html_depths(report):
    """Test loss above the full model's against layers run a token: early exit's threshold curve
    (test), the fixed models as points; the verdict; the table."""
    rows, L = report["depths"]["rows"], report["config"]["n_layer"]
    curve = [(e["mean_layers"] / L, e["excess_loss"], f"test_sweep.{j}.excess_loss",
              f"threshold {e['threshold']:g}: {e['mean_layers']:.2f} layers, "
              f"{e['excess_loss']:+.4f}") for j, e in enumerate(report["test_sweep"])]
    fixed = [(r["layers"] / L, r["excess_loss"], f"depths.rows.{j}.excess_loss",
              f"a {r['layers']}-layer GPT: {r['excess_loss']:+.4f}") for j, r in enumerate(rows)]
    chart = svg_chart([("early exit, by threshold", "a", curve), ("a smaller GPT", "b", fixed)],
                      {f"{l}": l / L for l in range(1, L + 1)},
                      ("exit depth, teacher-forced (layers a token)",
                       "test loss above the full model's"), "{:+.2f}")
    return section("depths", DEPTH_TABLE[0], chart,
                   f"<p>Worth it? {esc('; '.join(report['depths']['verdict']))}.</p>",
                   html_table(DEPTH_TABLE, rows, "depths.rows.{}.{}".format))

def html_batches(report):
    rows = report["batched"]["entries"]
    charts = [html_speedups(rows, "batched.entries", B)
              for B in sorted({r["batch_size"] for r in rows})]
    notes = batch_notes(report["batched"], report["config"])
    return section("batches", BATCH_TABLE[0], *charts,
                   html_table(BATCH_TABLE, rows, "batched.entries.{}.{}".format, notes))

# the page's sections in reading order, each drawn where its part of the report is there: by a
# function, or (a table alone) by rows_section
HTML_SECTIONS = (("generation", html_generation),
                 ("sweep", html_sweep), ("calibration_by_measure", html_calibration),
                 ("patience", PATIENCE_TABLE), ("exit_calibration", html_exit_calibration),
                 ("calibration", html_shift), ("logit_lens", LENS_TABLE), ("slices", KINDS_TABLE),
                 ("strategies", html_strategies), ("strategies", html_tail),
                 ("depths", html_depths), ("batched", html_batches))

def write_html_report(report, path):
    """out_dir/report.html: report.json's numbers on a page that reads on a phone."""
    body = "".join(render(report) if callable(render) else rows_section(report, part, render)
                   for part, render in HTML_SECTIONS if report.get(part))
    found = re.findall(r"<section id='([^']+)'><h2>([^<]+)</h2>", body)
    write_text('<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
               'content="width=device-width, initial-scale=1"><meta name="color-scheme" '
               'content="light dark"><title>nanogpt_exit_head report</title>'
               f"<style>{HTML_STYLE}</style></head><body><h1>Early exit in a character-level GPT"
               "</h1>"
               f"{html_summary(report, found)}{body}</body></html>", path)

# -----------------------------------------------------------------------------
# Checkpoints: written to a temporary file, then renamed; resume, Ctrl-C, torchrun

ARCH_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "bias")  # forced on resume
PROGRESS = ("vocab", "iter_num", "train_seconds", "train_log")  # a run's plain data
CHECKPOINT_KEYS = {"model", "optimizer", "config", "rng", *PROGRESS}

def write_text(text, path):
    """Written to path.tmp, then renamed: a crash leaves the old file or the new, never half."""
    Path(path + ".tmp").write_text(text, encoding="utf-8")
    os.replace(path + ".tmp", path)  # atomic on POSIX and Windows

def write_json(obj, path):
    write_text(json.dumps(obj, indent=2), path)

def random_states(device):
    """torch's random states (dropout, layer dropout): the CPU's, and the GPU's if training runs
    on one. Every process of a torchrun job seeds and draws them alike: rank 0's are everyone's."""
    states = {"torch": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states

def set_random_states(states, device):
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)

def save_checkpoint(path, model, optimizer, config, progress):
    """Tensors and plain data only, so torch.load(weights_only=True) reads it back. progress: the
    vocabulary, iter_num (steps done), train_seconds and train_log. Atomic, as in write_text."""
    rng = random_states(next(model.parameters()).device)
    torch.save({**progress, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "config": asdict(config), "rng": rng}, path + ".tmp")
    os.replace(path + ".tmp", path)

def load_checkpoint(path, config, overridden, tokenizer):
    """Load ckpt.pt; architecture fields come from it, and must agree with explicit overrides."""
    if not zipfile.is_zipfile(path):  # torch.save writes a zip; a truncated one lost its directory
        raise ValueError(f"no readable checkpoint at {path!r} (none, truncated, or not a zip); "
                         "train one with --init_from=scratch")
    try:  # weights_only: a checkpoint is data, never code to run
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError) as e:  # a zip not torch's, or objects not data
        raise ValueError(f"{path!r} is not a readable checkpoint: {type(e).__name__}") from None
    if not isinstance(ckpt, dict) or not CHECKPOINT_KEYS <= set(ckpt):
        raise ValueError(f"{path!r} is not a checkpoint of this script: it needs "
                         f"{', '.join(sorted(CHECKPOINT_KEYS))}")
    if ckpt["vocab"] != tokenizer.chars:
        raise ValueError(f"checkpoint vocabulary ({len(ckpt['vocab'])} chars) does not match "
                         f"{config.input_path!r}")
    for name in ARCH_FIELDS:
        if name in overridden and getattr(config, name) != ckpt["config"][name]:
            raise ValueError(f"checkpoint has {name}={ckpt['config'][name]}, but "
                             f"--{name}={getattr(config, name)} was given")
        setattr(config, name, ckpt["config"][name])
    return ckpt

class Interrupted(Exception):
    """Ctrl-C stopped training; the checkpoint at `path` holds every step done."""

def start_processes(config):
    """Under torchrun (RANK set): join the process group, nccl on CUDA and gloo on the CPU.
    Returns (rank, world size, device); (0, 1, None) for a plain run."""
    if "RANK" not in os.environ:
        return 0, 1, None
    device, backend = "cpu", "gloo"
    if torch.cuda.is_available() and config.device in ("auto", "cuda"):
        device, backend = f"cuda:{os.environ['LOCAL_RANK']}", "nccl"
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(backend)
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device

def step_model_for(model, config, world):
    """What takes the training steps: the model, in DistributedDataParallel across processes (each
    its own batch, gradients averaged in backward), compiled with --compile."""
    step_model = model
    if world > 1:
        unused = config.alpha == 0 and config.distill_weight == 0  # no gradient for the exits
        step_model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=unused)
    if config.compile:
        step_model = torch.compile(step_model)
    return step_model

def batch_sampler(config, splits, rank, steps):
    """Process rank's batch generator after `steps` steps: seeded seed + rank, then those steps'
    batches drawn again (one a step, cheap), so a resumed process draws what it would have."""
    generator = torch.Generator().manual_seed(config.seed + rank)
    for _ in range(steps):
        get_batch(splits["train"], config.block_size, config.batch_size, generator, "cpu")
    return generator

def new_or_resumed(config, tokenizer, device, overridden):
    """(model, optimizer, progress): new, or the checkpoint's with its random states back."""
    ckpt = {"vocab": tokenizer.chars, "iter_num": 0, "train_seconds": 0.0, "train_log": []}
    if config.init_from == "resume":  # before the model is built: it sets the architecture
        ckpt = load_checkpoint(os.path.join(config.out_dir, "ckpt.pt"), config, overridden,
                               tokenizer)
    model = RecipeGPT(config).to(device)
    optimizer = configure_optimizer(model, config)
    if config.init_from == "resume":
        try:  # strict: every name and shape must match
            model.load_state_dict(ckpt["model"])
        except RuntimeError as e:
            message = " ".join(str(e).split())[:300]
            raise ValueError(f"checkpoint does not fit the model: {message}") from None
        optimizer.load_state_dict(ckpt["optimizer"])  # a ValueError where its groups do not fit
        set_random_states(ckpt["rng"], device)
    return model, optimizer, {key: ckpt[key] for key in PROGRESS}

def print_setup(model, config, tokenizer, splits, device, world):
    base, heads = count_params(model)
    sizes = "/".join(f"{len(split):,}" for split in splits.values())
    print(f"device: {device} | vocabulary: {tokenizer.vocab_size} characters | train/val/test: "
          f"{sizes} characters | processes: {world}")
    print(f"parameters: {base / 1e6:.3f} M base model, {heads / 1e6:.3f} M in {config.n_layer - 1} "
          f"exit heads ({100 * heads / base:.2f}% overhead)")
    print(f"losses while training: each split's mean over {config.eval_iters} batches of "
          f"{config.batch_size} random windows of {config.block_size} characters; 'val loss' is "
          "full depth's")

def train_with_checkpoints(model, optimizer, splits, config, device, progress, path, rank, world):
    """Train from progress's step to max_iters; rank 0 saves a checkpoint at every evaluation and
    on Ctrl-C, which then raises Interrupted. Updates progress; returns (seconds, ms a step)."""
    done, seconds, log = progress["iter_num"], progress["train_seconds"], progress["train_log"]
    stop, t0 = [], time.time()

    def on_step(it, new_log):  # before every step
        if rank == 0 and (stop or (it % config.eval_interval == 0 and it > done)):
            progress.update(iter_num=it, train_seconds=seconds + time.time() - t0,
                            train_log=log + new_log)
            save_checkpoint(path, model, optimizer, config, progress)
        if stop:
            raise Interrupted(path)

    # Ctrl-C only sets a flag: the step under way finishes, so the checkpoint holds whole steps
    handler = signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    try:
        took, ms, new_log = train(model, optimizer, splits, config, device, done,
                                  batch_sampler(config, splits, rank, done), on_step,
                                  step_model_for(model, config, world), evaluate=rank == 0)
    finally:
        signal.signal(signal.SIGINT, handler)
    progress.update(iter_num=config.max_iters, train_seconds=seconds + took,
                    train_log=log + new_log)
    return took, ms

def train_or_resume(config, tokenizer, splits, device, overridden=(), rank=0, world=1, report=None):
    """A new model or the checkpoint's, trained up to max_iters with a checkpoint at every
    evaluation and on Ctrl-C; None on the ranks of a torchrun job above 0. The training figures go
    into report."""
    path = os.path.join(config.out_dir, "ckpt.pt")
    model, optimizer, progress = new_or_resumed(config, tokenizer, device, overridden)
    done, took, ms_per_iter = progress["iter_num"], 0.0, None
    if rank == 0:
        print_setup(model, config, tokenizer, splits, device, world)
        os.makedirs(config.out_dir, exist_ok=True)
    if done < config.max_iters:
        took, ms_per_iter = train_with_checkpoints(model, optimizer, splits, config, device,
                                                   progress, path, rank, world)
    if rank > 0:
        return None
    losses = estimate_loss(model, splits, config, device)
    print(format_eval(progress["iter_num"], losses))
    save_checkpoint(path, model, optimizer, config, progress)
    if ms_per_iter is None:
        print(f"resumed from {path} at step {done} of max_iters={config.max_iters}: no training "
              "this run")
    else:
        print(f"trained steps {done}..{config.max_iters} in {took:.1f} s, median "
              f"{ms_per_iter:.1f} ms a step; checkpoint: {path}")
    base, heads = count_params(model)
    report.update(config=asdict(config), n_params=base, n_params_exit_heads=heads,
                  train_seconds=progress["train_seconds"], ms_per_iter=ms_per_iter,
                  val_loss={"final": losses["val"][-1], "exits": losses["val"][:-1]},
                  train_loss=losses["train"][-1], train_log=progress["train_log"], processes=world)
    return model.eval()

# -----------------------------------------------------------------------------
# Command line: every Config field as --name=value (argparse), and the rules it checks

RANGES = {  # the numbers each field takes: [ or ] includes that end, ( or ) leaves it out
    "[0, inf)": ("seed", "max_iters", "warmup_iters", "top_k", "draft_exit", "alpha", "min_lr",
                 "weight_decay", "grad_clip", "temperature", "distill_weight"),
    "[1, inf)": ("n_head", "n_embd", "batch_size", "eval_interval", "eval_iters", "max_new_tokens",
                 "num_draft", "quality_positions", "bench_prompts", "bench_prompt_len",
                 "bench_tokens", "bench_repeats", "sweep_positions"),
    "[2, inf)": ("n_layer", "block_size"),
    "(0, inf)": ("learning_rate", "distill_temperature"),
    "[0, 1)": ("dropout", "beta1", "beta2", "layer_dropout"),
    "(0, 1)": ("epsilon", "delta"),
    "[0, 1]": ("schedule_disagreement",),
    "[-1, 1]": ("exit_threshold",),  # -1 calibrates on val; not in (-1, 0)
}
CHOICES = {"init_from": ("scratch", "resume"),
           "kv_strategy": (*KV_STRATEGIES, "self_speculative"),
           "confidence_measure": (*CONFIDENCE_MEASURES, "learned")}

def boolean(text):
    """An argparse type: true/false or 1/0."""
    if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError(text)
    return text.lower() in ("true", "1")

def in_range(value, rule):
    """Whether value lies in an interval of RANGES, e.g. '[0, 1)'."""
    low, high = map(float, rule[1:-1].split(","))
    ends = (value == low and rule[0] == "[") or (value == high and rule[-1] == "]")
    return low < value < high or ends

class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a bad argument raised as a ValueError: main prints one line, exits with 2."""
    def error(self, message):
        raise ValueError(message)

def build_parser():
    """One --name for every field of LabConfig but vocab_size; its help is the field's comment.
    A field not given stays out of what it parses (SUPPRESS), so LabConfig's default holds."""
    source = inspect.getsource(Config) + inspect.getsource(LabConfig)
    comments = dict(re.findall(r"^ +(\w+): .*?  # (.*)$", source.replace("%", "%%"), re.M))
    rules = {name: f" in {rule}" for rule, names in RANGES.items() for name in names}
    rules.update({name: f" one of {', '.join(choices)}" for name, choices in CHOICES.items()})
    parser = ArgumentParser(
        usage="nanogpt_exit_head.py [--name=value ...]", allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
        epilog="N processes: torchrun --standalone --nproc_per_node=N nanogpt_exit_head.py [...]")
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
    validate(config)
    return config, set(vars(known))

def validate(config):
    """The ranges, the rules that tie fields together, the files and the folder."""
    for rule, names in RANGES.items():
        for name in names:
            if not in_range(getattr(config, name), rule):
                raise ValueError(f"--{name}={getattr(config, name)} is outside {rule}")
    for bad, message in (
            (config.n_embd % config.n_head,
             f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}"),
            (config.min_lr > config.learning_rate,
             f"min_lr={config.min_lr} is above learning_rate={config.learning_rate}"),
            (-1 < config.exit_threshold < 0, "exit_threshold: -1 (calibrate on val) or in [0, 1]"),
            (config.draft_exit >= config.n_layer - 1,
             f"draft_exit={config.draft_exit}: a layer below the last, 0..{config.n_layer - 2}"),
            (not config.prompt, "--prompt must hold at least one character"),
            (config.bench_batch and config.quality_positions < max(BATCH_SIZES),
             f"--bench_batch needs quality_positions >= {max(BATCH_SIZES)}: a position a row"),
            (config.lesson_only and (config.init_from == "resume" or config.sample_only),
             "--lesson_only is Part I alone: it trains anew, with no resume or samples only"),
            (config.confidence_measure in ("patience", "learned") and (
                config.lesson_only or config.exit_layers not in ("auto", "all")),
             "patience and the learned rule read every exit, in the lab: no --lesson_only, and "
             "--exit_layers=auto")):
        if bad:
            raise ValueError(message)
    parse_exit_layers(config.exit_layers, config.n_layer)
    check_text(config)
    try:  # say now, not after training, that out_dir cannot be a folder of ours
        os.makedirs(config.out_dir, exist_ok=True)
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
    need = max(config.block_size, config.bench_prompt_len, config.quality_positions) + 2
    if min(map(len, split_data(text).values())) < need:
        raise ValueError(f"--input_path={config.input_path!r} ({len(text):,} characters) is too "
                         f"short: each split needs {need} for block_size, bench_prompt_len and "
                         "quality_positions")
    others = {"--prompt": config.prompt}
    if config.shift_path:
        others["--shift_path ('' skips it)"] = read_text(config, "shift_path")
        if len(others["--shift_path ('' skips it)"]) < 2:  # a character to read, one to predict
            raise ValueError(f"--shift_path={config.shift_path!r} holds under 2 characters")
    for name, other in others.items():
        unknown = "".join(sorted(set(other) - set(text)))
        if unknown:
            raise ValueError(f"{name} has characters not in the vocabulary of "
                             f"{config.input_path!r}: {unknown!r}")

def parse_exit_layers(text, n_layer):
    """'all' or '0,2' -> the sorted layers (below the last) whose exit head is checked; 'auto' is
    resolved per strategy by the exit plan, and checks all elsewhere."""
    if text in ("all", "auto"):
        return list(range(n_layer - 1))
    if not re.fullmatch(r"\d+(,\d+)*", text) or max(map(int, text.split(","))) > n_layer - 2:
        raise ValueError(f"exit_layers={text!r}: 'all', 'auto' or a comma list of layers "
                         f"0..{n_layer - 2} (the last layer always exits)")
    return sorted({int(t) for t in text.split(",")})

def pick_device(name):
    """'auto' picks CUDA, then the CPU; Apple's MPS runs only when named. A named device must be
    on this machine."""
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
    return name

# -----------------------------------------------------------------------------
# Main: the lesson, then the lab, every analysis under the question it answers

def choose_exit_rule(model, tokenizer, splits, config, device):
    """Sweep on val; calibrate every rule on val, report it on test and on the shifted text beside
    the oracle; patience's k swept on val; each exit's calibration, the logit lens, the slices."""
    texts = {s: splits[s] for s in ("val", "test")}
    if config.shift_path:
        texts["shift"] = torch.tensor(tokenizer.encode(read_text(config, "shift_path")))
    records = {s: record_exits(model, t.to(device), config.sweep_positions)
               for s, t in texts.items()}
    val, test, shifted = records["val"], records["test"], records.get("shift")
    checked = list(range(config.n_layer - 1))  # every rule, as it reads every exit
    measure = config.confidence_measure
    cals = {m: calibration_report(val, test, shifted, m, checked, config.epsilon, config.delta)
            for m in exit_rules(model)}
    best = {**oracle(test, checked, config.epsilon), "oracle_share": 1.0}
    by_k = [{"k": k, **exit_summary(val, exits_at_threshold(val, "patience", 1 - 0.5 ** (k - 1),
                                                            checked))}
            for k in range(1, config.n_layer + 1)]  # k = n_layer: never leaves early
    T = config.block_size
    # (<= 64, T): back-to-back windows of val, each character followed by one more
    windows = splits["val"][:-1].unfold(0, T, T)[:64].to(device)
    exits = exits_at_threshold(test, measure, cals[measure]["threshold"], checked)
    return {"sweep": sweep(val, measure, checked), "test_sweep": sweep(test, measure, checked),
            "calibration": cals[measure],
            "calibration_by_measure": [*cals.values(), {"measure": "oracle", "test": best}],
            "patience": by_k, "exit_calibration": exit_calibration(test),
            "logit_lens": logit_lens(model, windows), "slices": exit_slices(test, exits, tokenizer)}

def sample_decoder(model, config, threshold):
    """The early-exit sample's decoder (--kv_strategy), its label and the exits it checks."""
    if config.kv_strategy == "self_speculative":
        spec = (config.draft_exit, config.num_draft)
        label = f"self_speculative, layer {spec[0]} drafts up to {spec[1]} a round, the rest verify"
        return decoder(model, "self_speculative", spec=spec), label, ()
    checked = parse_exit_layers(config.exit_layers, config.n_layer)
    plan = {"threshold": threshold, "checked_exits": checked}
    label = f"{config.kv_strategy}, {config.confidence_measure} > {threshold:g}"
    return decoder(model, config.kv_strategy, plan, config.confidence_measure), label, checked

def generation_report(tokenizer, idx, samples, threshold, config):
    """The report.json entry of both samples (report.html colours each character by its exit)."""
    (full, full_speed), (early, speed) = samples.values()
    T0 = idx.size(1)
    exited_at = early.exited_at[0]  # (max_new_tokens,)
    return {"exit_threshold": threshold, "kv_strategy": config.kv_strategy,
            "exit_counts": torch.bincount(exited_at, minlength=config.n_layer).tolist(),
            "tokens_per_second": speed, "full_depth_tokens_per_second": full_speed,
            "sample": tokenizer.decode(early.tokens[0, T0:].tolist()),
            "exited_at": exited_at.tolist(),
            "full_depth_sample": tokenizer.decode(full.tokens[0, T0:].tolist())}

def measure_strategies(model, splits, config, device, fixed, threshold):
    """The strategies table on the workload, costs and plans, batch depth, and (--bench_batch) the
    batch table."""
    entries, quality, plans, costs, val_records = compare_strategies(model, splits, config, device,
                                                                     fixed, threshold)
    depths = expected_batch_depth(quality["backfill"]["exited_at"], BATCH_SIZES, config.n_layer)
    print_strategies(entries, config, costs, depths)
    print_table(TAIL_TABLE, entries, "Batch 1, the test workload", [tail_note(entries)])
    report = {"strategies": entries, "decode_costs": costs,
              "workload": {"split": "test", "prompts": config.bench_prompts,
                           "prompt_len": config.bench_prompt_len, "tokens": config.bench_tokens,
                           "repeats": config.bench_repeats, "chosen_on": "val"}}
    if config.bench_batch:
        report["batched"] = measure_batches(model, splits, config, device, plans, val_records,
                                            costs)
        print_batches(report["batched"], config)
    return report

def train_fixed_depths(config, splits, device, depths):
    """depth -> a plain GPT (alpha 0) of that depth: the same width, steps and data."""
    fixed = {}
    for d in depths:
        print(f"\n--- a {d}-layer GPT trained as a plain model (alpha 0: its exit heads untrained "
              "and unused), with the same width, steps and data ---")
        # evaluated once, at the end: its training log is not the question
        config_d = replace(lesson_config(config), n_layer=d, alpha=0.0,
                           eval_interval=config.max_iters)
        fixed[d] = train_new_model(config_d, splits, device)
    return fixed

def depth_rows(fixed, test, config, strategies, full_loss):
    """Each fixed model on the test positions the exit rules are reported on (its loss, and above
    full_loss, the full model's), with its speed from the strategies table."""
    rows = []
    for d, small in fixed.items():
        r = record_exits(small, test, config.sweep_positions)
        loss = average(r.nll[-1])
        rows.append({"layers": d, "test_loss": loss, "excess_loss": loss - full_loss,
                     "test_accuracy": average(r.pred[-1] == r.targets),
                     **{f"{k}_{e['mode']}": e[k] for k in ("speedup", "tokens_per_second")
                        for e in strategies if e["name"] == f"{d}-layer GPT"}})
    return rows

def verdict(cal, strategies, row):
    """'Would a smaller model do as well?' in two parts: early exit at the calibrated threshold
    (its exit depth and test loss teacher-forced, deferred's and self-speculation's speed-ups),
    then the fixed model nearest that depth; losses on the same test positions, speed-ups on the
    same workload."""
    x, t = {(e["name"], e["mode"]): e["speedup"] for e in strategies}, cal["test"]
    return [f"early exit ({cal['measure']} > {cal['threshold']:g}) at {t['mean_layers']:.2f} "
            f"layers a token: test loss {t['loss']:.4f}, deferred {x['deferred', 'greedy']:.2f}x "
            f"greedy and {x['deferred', 'sampled']:.2f}x sampled; self-speculation at full "
            f"depth's {t['full_loss']:.4f}, {x['self_speculative', 'greedy']:.2f}x greedy and "
            f"{x['self_speculative', 'sampled']:.2f}x sampled",
            f"a {row['layers']}-layer GPT is "
            f"{'better' if row['test_loss'] < t['full_loss'] else 'worse'} than full depth "
            f"(test loss {row['test_loss']:.4f}) at {row['speedup_greedy']:.2f}x greedy, "
            f"{row['speedup_sampled']:.2f}x sampled"]

def summary(report):
    """The run's answers in four lines: the model's loss, what early exit skips with a guarantee,
    the fastest decoder with an exact cache in each mode, and the smaller model's verdict."""
    cal = report["calibration"]
    best = max(report["calibration_by_measure"][:-1],  # not the oracle
               key=lambda c: c["test"]["compute_saved"])
    exact = [e for e in report["strategies"] if e["name"] in ("full", "backfill", "deferred",
                                                               "self_speculative")]
    # each mode's fastest: the last of its rows sorted by speed (full depth: none is faster)
    fastest = {e["mode"]: e for e in sorted(exact, key=lambda e: e["speedup"])}
    return [f"val loss {report['val_loss']['final']:.4f}: full depth, on random windows of val",
            f"saved at the guarantee (disagreement <= {100 * cal['epsilon']:g}% with probability "
            f"{100 * (1 - cal['delta']):g}%): {cal['test']['compute_saved']:.1%} of layer runs on "
            f"test ({cal['measure']} > {cal['threshold']:g}); the best rule, {best['measure']}: "
            f"{best['test']['compute_saved']:.1%} (test disagreement "
            f"{best['test']['disagreement']:.2%})",
            "fastest with an exact cache: " + ", ".join(
                f"{fastest[m]['name']} {fastest[m]['speedup']:.2f}x {m}" for m in MODES),
            f"smaller model: {report['depths']['verdict'][1]}"]

def lesson_config(config):
    """Part I's Config from the lab's fields, with Part I's own threshold where the lab's says
    'calibrate'."""
    lesson = Config(**{f.name: getattr(config, f.name) for f in fields(Config)})
    if lesson.exit_threshold < 0:
        lesson.exit_threshold = Config.exit_threshold
    return lesson

def write_report(report, config, name):
    path = os.path.join(config.out_dir, name)
    write_json(report, path + ".json")
    write_html_report(report, path + ".html")
    print(f"page: {path}.html (its numbers: {name}.json beside it)")

def run_lab(model, tokenizer, splits, config, device, report):
    """Part I's samples from the lab's model, threshold and decoder, then every analysis of the
    lab."""
    # the learned rule, fitted on ten pieces from across train (one play alone fits it worse)
    train, step = splits["train"], len(splits["train"]) // 10
    n = min(config.sweep_positions // 10, step - 1)  # ten pieces that never overlap
    fit_exit_predictor(model, train.unfold(0, n + 1, step)[:10].flatten().to(device), 10 * n)
    rule = None
    threshold = config.exit_threshold
    if threshold < 0:  # calibrate on val (Learn then Test)
        rule = choose_exit_rule(model, tokenizer, splits, config, device)
        threshold = rule["calibration"]["threshold"]
        print(f"\nthe early-exit sample uses the threshold calibrated on val ({threshold:g})")
    # sample_decoder gives show_samples its (early_exit, label, checked_exits)
    idx, samples = show_samples(model, tokenizer, config, device,
                                *sample_decoder(model, config, threshold))
    report["generation"] = generation_report(tokenizer, idx, samples, threshold, config)
    if config.sample_only:  # sampling leaves the trained run's report alone: samples.*
        return write_report({"config": asdict(config), **report}, config, "samples")
    if rule is None:  # an explicit threshold: the exit rule is still analysed
        rule = choose_exit_rule(model, tokenizer, splits, config, device)
    print_exit_rule(rule, config)
    report.update(rule)
    L, cal = config.n_layer, rule["calibration"]
    nearest = min(max(round(cal["test"]["mean_layers"]), 1), L - 1)  # to the calibrated depth
    fixed = train_fixed_depths(config, splits, device,
                               range(1, L) if config.compare_depths else [nearest])
    report.update(measure_strategies(model, splits, config, device, fixed, threshold))
    rows = depth_rows(fixed, splits["test"].to(device), config, report["strategies"],
                      cal["test"]["full_loss"])
    report["depths"] = {"rows": rows, "verdict": verdict(cal, report["strategies"],
                                                         rows[list(fixed).index(nearest)])}
    print_table(DEPTH_TABLE, rows, f"Plain GPTs, {config.sweep_positions:,} test positions",
                ["Worth it? " + "; ".join(report["depths"]["verdict"]) + "."])
    report["summary"] = summary(report)
    print("\nsummary:\n  " + "\n  ".join(report["summary"]))
    write_report(report, config, "report")

def run(config, overridden):
    """The default job: the lab's model (trained, resumed or loaded), its samples and every
    analysis; --lesson_only runs Part I alone."""
    torch.manual_seed(config.seed)
    if config.lesson_only:
        return run_lesson(lesson_config(config), pick_device(config.device))
    rank, world, process_device = start_processes(config)
    device = process_device or pick_device(config.device)
    tokenizer, splits = load_data(config)
    report = {}
    if config.sample_only:
        if config.init_from != "resume":
            raise ValueError("--sample_only=1 samples from a checkpoint: add --init_from=resume")
        model = new_or_resumed(config, tokenizer, device, overridden)[0].eval()  # no training
    else:
        model = train_or_resume(config, tokenizer, splits, device, overridden, rank, world, report)
    if world > 1:
        torch.distributed.destroy_process_group()
    if model is not None:  # None: a torchrun rank above 0; only rank 0 analyses, prints and writes
        run_lab(model, tokenizer, splits, config, device, report)

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
