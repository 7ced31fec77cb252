"""nanogpt_exit_head.py: a character-level GPT with an exit head after every layer, decoded with confidence-gated
early exit, and an honest measurement of what that buys. `python nanogpt_exit_head.py` trains, samples and
measures (about 3 min on 2 cores); `--lesson_only=true` stops after Part I; `--help` lists every field.

Part I, the seed design end to end and a program of its own: exit heads and the joint loss, the per-layer KV
cache, gated decoding with backfill, exit statistics, training. Part II, one idea a section: deferred recompute,
state copy (CALM, arXiv:2207.07061), holes, self-speculative decoding (LayerSkip, arXiv:2404.16710), training
recipes, choosing the threshold, measurement, reports, checkpoints, the command line. Left out on purpose: BPE,
rotary embeddings, mixed precision in decoding, PABEE patience, dependencies beyond torch, numpy and tqdm."""

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
# Part I: the lesson, the seed design end to end

# -----------------------------------------------------------------------------
# Config: every hyperparameter, one per line; override any as --name=value

@dataclass
class Config:
    """The lesson's hyperparameters; Part II's LabConfig adds the lab's (recipes, decoders, measurement)."""
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
    exit_threshold: float = 0.9  # exit when confidence exceeds this (1 never, 0 always); Part II calibrates it
    confidence_measure: str = "top1"  # how sure a head is: top1; Part II adds margin and entropy

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
    x = torch.stack([data[i : i + block_size] for i in ix])  # (B, T)
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])  # (B, T)
    return x.to(device), y.to(device)

def load_data(config):
    """The text, its vocabulary (which also sets config.vocab_size), and the three splits."""
    with open(config.input_path, encoding="utf-8") as f:
        text = f.read()
    tokenizer = CharTokenizer(text)
    config.vocab_size = tokenizer.vocab_size
    return tokenizer, split_data(torch.tensor(tokenizer.encode(text), dtype=torch.long))

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
        if cache is not None:  # every (position, layer) block run is counted: the honest cost of a strategy
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
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

class GPT(nn.Module):
    """nanoGPT with exit_heads[l] after block l for l < n_layer - 1; the last exit is ln_f + lm_head."""
    def __init__(self, config):
        super().__init__()
        self.config = config  # the recipes' fields (exit_weights, exit_head, distill_*, layer_dropout) are Part II's
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
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def embed(self, idx, pos0=0):
        """Token + position embeddings of idx, whose first token sits at window position pos0."""
        T = idx.size(1)
        assert pos0 + T <= self.config.block_size, f"position {pos0 + T - 1} is past block_size"
        pos = torch.arange(pos0, pos0 + T, dtype=torch.long, device=idx.device)  # (T,)
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)

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
        """The seed's joint loss CE(final) + alpha * sum_l CE(exit_l); with alpha = 0 the exits are not run."""
        loss = cross_entropy(logits, targets)
        for l in range(self.config.n_layer - 1) if self.config.alpha > 0 else ():
            loss = loss + self.config.alpha * cross_entropy(self.exit_logits(states[l], l), targets)
        return loss

# -----------------------------------------------------------------------------
# The KV cache: one per-layer mechanism that every decoding strategy uses

class KVCache:
    """Preallocated keys and values for every layer, each layer with its own filled length.

    Invariant: layer l holds entries for window positions [0, lengths[l]) and nothing else, written in place;
    full depth keeps all lengths equal. A token that exits early leaves the layers above behind, and what a
    KV strategy does about it is all that tells strategies apart."""
    def __init__(self, config, batch_size, device):
        shape = (config.n_layer, batch_size, config.n_head, config.block_size, config.n_embd // config.n_head)
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
        assert n + T <= self.k.size(3), f"layer {layer} cache is full ({n} + {T} > block_size)"
        self.k[layer, :, :, n : n + T] = k
        self.v[layer, :, :, n : n + T] = v
        self.lengths[layer] = n + T
        # one new query needs no mask; a chunk of T queries sees the n old keys and its own past
        mask = None if T == 1 else torch.ones(T, n + T, dtype=torch.bool, device=k.device).tril(n)
        return self.k[layer, :, :, : n + T], self.v[layer, :, :, : n + T], mask

# -----------------------------------------------------------------------------
# Decoding: confidence, sampling, the context window, and the gated step with backfill

CONFIDENCE_MEASURES = {"top1": lambda probs: probs.amax(-1)}  # name -> (B, V) -> (B,); Part II adds two more

def confidence(logits, measure="top1"):
    """How sure a head is, in [0, 1], higher is surer: (B, V) logits -> (B,)."""
    return CONFIDENCE_MEASURES[measure](logits.float().softmax(-1))

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
    """Where the context window begins when the sequence holds n tokens and token n-1 is fed next. Positions
    never pass block_size: a full window keeps its newest half, re-prefilled at full depth in one parallel pass."""
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

class Backfill:
    """The seed's KV strategy: a token that exits early still runs the layers above, for the cache alone.
    Part II's strategies subclass it: run_layer runs a block for the newest token, and once every row has
    exited, skips says whether the layers above are skipped and skip_layers what the cache gets instead."""
    skips = False

    def exit_checks(self, pos, checked_exits):
        """The exits checked for a token at window position pos."""
        return checked_exits

    def run_layer(self, block, cache, layer, x, pos):
        return block(x, cache, layer)

def decode_step(model, cache, idx, pos, strategy, exit_threshold=1.0, checked_exits=(), measure="top1"):
    """Feed one token per row, idx (B, 1), at window position pos; returns emitted logits (B, V) and exit layers (B,).
    Each row exits on its own confidence; the step runs as deep as its deepest row."""
    L = model.config.n_layer
    checks = strategy.exit_checks(pos, checked_exits) if exit_threshold < 1 else ()  # a confidence never exceeds 1
    x = model.embed(idx, pos)  # (B, 1, C)
    logits, exited = None, None
    exit_layer = torch.full((idx.size(0),), L - 1, dtype=torch.long, device=idx.device)
    for l, block in enumerate(model.transformer.h):
        x = strategy.run_layer(block, cache, l, x, pos)
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

@torch.inference_mode()
def generate(model, idx, max_new_tokens, strategy=Backfill, exit_threshold=1.0, checked_exits=None,
             measure="top1", temperature=1.0, top_k=0, generator=None, forced=None):
    """Decode max_new_tokens after idx (B, T0) with the KV cache; forced (B, N) teacher-forces the tokens.
    strategy makes a fresh KV strategy for this generation (one may keep state: deferred's parked states)."""
    cfg, (B, T0) = model.config, idx.shape
    checked_exits = range(cfg.n_layer - 1) if checked_exits is None else checked_exits
    kv_strategy = strategy()
    tokens = torch.cat([idx, idx.new_zeros(B, max_new_tokens)], dim=1)  # (B, T0 + N)
    exits, emitted, prefilled = idx.new_zeros(B, max_new_tokens), [], 0
    cache, start = KVCache(cfg, B, idx.device), None
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
    return Generation(tokens, exits, logits, sum(cache.layer_evals) - prefilled, prefilled)

# -----------------------------------------------------------------------------
# Exit statistics: where the tokens left, as the seed prints them

def format_exit_stats(counts):
    """The seed's per-layer lines, 'Layer 0:   42 tokens (21.0%)', with a bar each."""
    total, names = sum(counts), [f"Layer {l}:" for l in range(len(counts) - 1)] + [f"Layer {len(counts) - 1} (full):"]
    lines = [f"{name:<16}{c:>6} tokens ({100 * c / total:5.1f}%) {'#' * round(30 * c / total)}"
             for name, c in zip(names, counts)]
    mean = sum((l + 1) * c for l, c in enumerate(counts)) / total
    lines.append(f"mean exit depth: {mean:.2f} of {len(counts)} layers per token")
    return "\n".join(lines)

# -----------------------------------------------------------------------------
# Training: AdamW, warmup then cosine decay, the joint loss

def synchronize(device):
    """Wait for queued kernels, so a timer reads finished work (CUDA and MPS launches return at once)."""
    if torch.device(device).type in ("cuda", "mps"):
        getattr(torch, torch.device(device).type).synchronize()  # torch.cuda or torch.mps

def autocast_context(device):
    """bf16 autocast for training and evaluation on CUDA; plain fp32 elsewhere, and in all decoding."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if str(device).startswith("cuda") else nullcontext()

def get_lr(it, config):
    if it < config.warmup_iters:
        return config.learning_rate * (it + 1) / config.warmup_iters
    ratio = (it - config.warmup_iters) / max(1, config.max_iters - config.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(1.0, ratio)))  # 1 -> 0
    return config.min_lr + coeff * (config.learning_rate - config.min_lr)

def configure_optimizer(model, config):
    """AdamW with weight decay on matrices only, as nanoGPT does."""
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": config.weight_decay},
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
    model.train(was_training)  # back to the mode it came in: evaluation never leaves layer dropout on
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

def train(model, optimizer, splits, config, device, start_iter=0, generator=None, on_step=None, step_model=None,
          evaluate=True):
    """The training loop, evaluating every eval_interval steps; returns (seconds, median ms per step, log). Part II's
    hooks: generator draws the batches (resumed, or one per process); on_step(it, log) runs before every step
    (checkpoints, Ctrl-C); step_model takes the steps (compiled, or wrapped for several processes)."""
    generator = generator or torch.Generator().manual_seed(config.seed)
    step_model = step_model or model
    t_start, step_ms, log = time.time(), [], []
    with tqdm(range(start_iter, config.max_iters), initial=start_iter, total=config.max_iters, disable=not evaluate,
              mininterval=1.0 if sys.stderr.isatty() else 30.0, desc="training") as progress:
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
            x, y = get_batch(splits["train"], config.block_size, config.batch_size, generator, device)
            loss = train_step(step_model, optimizer, x, y, config)
            synchronize(device)
            step_ms.append(1000 * (time.time() - t0))
            if it % 10 == 0:  # .item() waits for the device, so read the loss only now and then
                log.append({"iter": it, "loss": loss.item()})
                progress.set_postfix_str(f"joint loss {log[-1]['loss']:.3f} | {step_ms[-1]:.0f} ms", refresh=False)
    return time.time() - t_start, float(np.median(step_ms)) if step_ms else 0.0, log

# -----------------------------------------------------------------------------
# The lesson's run: data, a trained model, two samples, and where the tokens left

def train_new_model(config, splits, device):
    """A new model trained for max_iters steps (Part II's train_or_resume adds checkpoints and resume)."""
    torch.manual_seed(config.seed)
    model = GPT(config).to(device)
    train(model, configure_optimizer(model, config), splits, config, device)
    print(format_eval(config.max_iters, estimate_loss(model, splits, config, device)))
    return model.eval()

def speed_note(samples, checked_exits, n_layer):
    """Why the early-exit sample ran faster or slower than full depth: the work it did per token."""
    (_, full), (out, speed) = samples.values()
    N = out.exited_at.size(1)
    checks = sum(int((out.exited_at >= l).sum()) for l in checked_exits if l < n_layer - 1) / N
    return (f"{speed / full:.2f}x full depth's speed: {out.layers_run / N:.2f} layer runs per token "
            f"(of {n_layer}), plus {checks:.2f} exit checks (each a head, a softmax and a host sync)")

def show_samples(model, tokenizer, config, device, early_exit, label, checked_exits):
    """A full-depth and an early-exit sample from one prompt and seed, their speeds, and where the tokens
    left. early_exit(idx, n, generator=, temperature=, top_k=) -> Generation draws the second sample."""
    idx = torch.tensor([tokenizer.encode(config.prompt)], dtype=torch.long, device=device)
    print("\n=== What does early exit look like? Two samples from the same prompt and seed ===")
    samples = {}  # name -> (Generation, tokens per second)
    for name, decode in (("full-depth", partial(generate, model)), ("early-exit", early_exit)):
        gen = torch.Generator(device=device).manual_seed(config.seed)
        t0 = time.perf_counter()
        out = decode(idx, config.max_new_tokens, generator=gen, temperature=config.temperature,
                     top_k=config.top_k)
        synchronize(device)
        samples[name] = out, config.max_new_tokens / (time.perf_counter() - t0)
        text = tokenizer.decode(out.tokens[0, idx.size(1) :].tolist())
        how = f": {label}" if name == "early-exit" else ""
        print(f"\n--- {name} sample{how} ({samples[name][1]:,.0f} tok/s) ---\n{text}")
    print(f"({speed_note(samples, checked_exits, config.n_layer)})")
    counts = torch.bincount(out.exited_at[0], minlength=config.n_layer).tolist()
    print("\nper-layer exit statistics:\n" + format_exit_stats(counts))
    return idx, samples

def run_lesson(config, device):
    """Part I end to end: train, then a full-depth and an early-exit sample (backfill, the threshold of the
    config), and where the tokens left."""
    tokenizer, splits = load_data(config)
    model = train_new_model(config, splits, device)
    early_exit = partial(generate, model, exit_threshold=config.exit_threshold,
                         measure=config.confidence_measure)
    label = f"backfill, {config.confidence_measure} > {config.exit_threshold:g}"
    _, samples = show_samples(model, tokenizer, config, device, early_exit, label, range(config.n_layer - 1))
    return model, samples

# =============================================================================
# Part II: the lab, one idea per section

import argparse
import difflib
import inspect
import itertools
import json
import os
import pickle
import re
import signal
import textwrap
import zipfile
from collections import Counter
from dataclasses import asdict, fields
from pathlib import Path

@dataclass
class LabConfig(Config):
    """The lab's settings on top of the lesson's; the command line takes every field of both as --name=value."""
    exit_threshold: float = -1.0  # -1 calibrates it on val (Learn then Test); a value in [0, 1] is used as is
    # runs
    out_dir: str = "out"  # where ckpt.pt, report.json and report.html go
    init_from: str = "scratch"  # 'scratch' trains a new model, 'resume' continues from out_dir/ckpt.pt
    device: str = "auto"  # 'auto' picks cuda, then cpu; mps only when named (--device=mps)
    compile: bool = False  # torch.compile the model for training (slow to start, faster on GPU)
    lesson_only: bool = False  # run Part I alone: its GPT, training, threshold (0.9 for -1) and backfill
    sample_only: bool = False  # with --init_from=resume: the samples, exit map and statistics only, no training
    # training recipes (the seed: constant, separate, 0, 1.0, 0)
    exit_weights: str = "constant"  # per-exit loss weights: constant (alpha each), linear, geometric, layerskip
    exit_head: str = "separate"  # 'separate' heads, one 'shared' head, or 'final': ln_f + lm_head at every exit
    distill_weight: float = 0.1  # self-distillation: weight of KL(final || exit), the final head detached
    distill_temperature: float = 1.0  # temperature of that distillation; higher matches more of the distribution
    layer_dropout: float = 0.2  # LayerSkip's p_max: in training skip block l with p_max * (2^(l / (L-1)) - 1)
    # decoders
    kv_strategy: str = "backfill"  # the early-exit sample's decoder: a KV strategy (backfill, ...) or self_speculative
    exit_layers: str = "auto"  # exits checked: 'auto' (the cost-aware plan per strategy; all in samples), 'all', '1,3'
    draft_exit: int = 0  # self-speculative: the last layer of the draft (its exit head drafts)
    num_draft: int = 8  # self-speculative: the most tokens drafted per verify pass
    # measurement
    quality_positions: int = 2000  # test positions decoded teacher-forced per decoder; more is steadier and slower
    bench_prompts: int = 16  # timed workload: prompts from evenly spaced places of test (val, when choosing)
    bench_prompt_len: int = 32  # characters per workload prompt
    bench_tokens: int = 100  # characters generated per prompt per timed run
    bench_repeats: int = 3  # timed passes over the workload per decoder, interleaved; the median is reported
    epsilon: float = 0.01  # calibration: tolerated rate of disagreement with full depth; lower is more cautious
    delta: float = 0.05  # calibration: allowed chance that the chosen threshold breaks epsilon
    sweep_positions: int = 20000  # val and test positions recorded for the sweep and calibration
    strategies_threshold: float = -1.0  # threshold of the strategies table; -1 chooses it on val
    schedule_disagreement: float = 0.03  # SkipDecode: the most disagreement with full depth its schedule may cost
    # studies beyond the default run
    compare_recipes: bool = False  # train every recipe in RECIPES at this budget and compare them (~2 min each)
    spec_sweep: bool = False  # also time self-speculative decoding on every (draft_exit, num_draft, draft_stop)
    bench_batch: bool = False  # also measure every batch design at batch 1, 4 and 16 (a few minutes)

EARLY_EXIT_FRACTION = 0.3  # a speed threshold is the highest at which this fraction of val positions exit early
THRESHOLDS = tuple(round(1 - 0.01 * i, 2) for i in range(101))  # 1.00, 0.99, ..., 0.00: cautious first
MODES = ("greedy", "sampled")  # sampled draws with config.temperature and config.top_k
BATCH_SIZES = (1, 4, 16)

# -----------------------------------------------------------------------------
# Deferred recompute: fill the holes later, in one chunk with the next token that needs them

class Deferred(Backfill):
    """An exit parks its state; the next token that needs a layer runs the parked positions and itself
    there as one causal chunk. Exact, like backfill, with the work postponed and batched."""
    skips = True

    def __init__(self):
        self.parked = None  # (B, block_size, C): the state each position reached, for the layers it skipped

    def park(self, cache, x, pos):
        if self.parked is None:
            self.parked = x.new_zeros(x.size(0), cache.k.size(3), x.size(2))
        self.parked[:, pos] = x[:, 0]

    def run_layer(self, block, cache, layer, x, pos):
        n = cache.lengths[layer]
        if n == pos:  # nothing parked below this position
            return block(x, cache, layer)
        self.park(cache, x, pos)
        self.parked[:, n : pos + 1] = block(self.parked[:, n : pos + 1], cache, layer)  # (B, pos + 1 - n, C)
        return self.parked[:, pos : pos + 1]

    def skip_layers(self, model, cache, x, pos, layer):
        self.park(cache, x, pos)  # the state the skipped layers will start from

# -----------------------------------------------------------------------------
# State copy (CALM): the skipped layers' keys and values computed from the exit state

def kv_projection(block):
    """A block's x -> (K, V) map with ln_1's gain and bias folded in: (2C, C) weight, (2C,) bias.

    K and V of a state x are W_kv (g * norm(x) + beta) + b_kv = (W_kv g) norm(x) + (W_kv beta + b_kv):
    one matrix per layer, applied to one shared norm(x)."""
    C = block.ln_1.normalized_shape[0]
    w = block.attn.c_attn.weight[C:]  # (2C, C): the K and V rows of the fused projection
    bias = torch.zeros(2 * C, device=w.device, dtype=w.dtype)
    if block.ln_1.bias is not None:
        bias = bias + w @ block.ln_1.bias
    if block.attn.c_attn.bias is not None:
        bias = bias + block.attn.c_attn.bias[C:]
    return w * block.ln_1.weight, bias

def state_copy_projections(model):
    """Every layer's folded K/V projection, stacked: (L, 2C, C) and (L, 2C)."""
    projections = [kv_projection(block) for block in model.transformer.h]
    return tuple(torch.stack(t) for t in zip(*projections))

def write_state_copy(cache, first_layer, x, weight, bias):
    """CALM's state propagation: the K and V of layers first_layer.. computed from the exit state x (B, 1, C),
    written at the next position of a level cache. One batched matmul serves every skipped layer."""
    n, nh = cache.lengths[first_layer], cache.k.size(2)
    assert all(m == n for m in cache.lengths[first_layer:]), "state copy needs the skipped layers level"
    xn = F.layer_norm(x[:, 0], x.shape[-1:])  # (B, C): the normalisation shared by every ln_1
    kv = torch.matmul(xn, weight[first_layer:].transpose(1, 2)) + bias[first_layer:, None]  # (J, B, 2C)
    J, B, C2 = kv.shape
    k, v = kv.view(J, B, 2 * nh, C2 // (2 * nh)).chunk(2, dim=2)  # (J, B, nh, hs) each
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
    """Later tokens attend only to the entries that exist: the skipped layers' caches just have fewer."""
    skips = True

    def skip_layers(self, model, cache, x, pos, layer):
        pass

KV_STRATEGIES = {"backfill": Backfill, "deferred": Deferred, "state_copy": StateCopy, "holes": Holes}

def kv_strategy(name):
    """The KV strategy class of a name, or a one-line error."""
    if name not in KV_STRATEGIES:
        raise ValueError(f"unknown KV strategy {name!r}: one of {', '.join(KV_STRATEGIES)}")
    return KV_STRATEGIES[name]

# -----------------------------------------------------------------------------
# Self-speculative decoding (LayerSkip): the early layers draft, the rest verify, one decoder for any batch

class RowKVCache(KVCache):
    """The KV cache with a length per row: at the start of a round, every layer of row b holds its window
    positions [0, pos[b]), where pos[b] = n[b] - 1 - start[b] is the row's own position in its window.

    The rows of a batch accept different numbers of drafts, roll back on their own and slide their windows
    at different rounds. Rolling a row back is moving its n back: the entries past its position are stale,
    masked and then overwritten. Every block call of a step writes each row's entries at its own slots,
    laid out once per step (lay_out); attention reads the slots any row has filled, through one mask.
    `spare` slots past block_size take the drafts of rows with less room than others; those are always
    rolled back."""
    def __init__(self, config, batch_size, device, spare=0):
        L, hs = config.n_layer, config.n_embd // config.n_head
        shape = (L, batch_size, config.n_head, config.block_size + spare, hs)
        self.k = torch.zeros(shape, device=device)  # (L, B, nh, block_size + spare, hs)
        self.v = torch.zeros(shape, device=device)
        self.lengths, self.layer_evals, self.start = [0] * L, [0] * L, 0
        self.layout = None  # what the block calls of one step share: lay_out()

    def lay_out(self, slots, width=None):
        """(slots (B, T), their scatter index, the mask of what each query may see, W), W the slots any
        row has filled by then: attention reads no empty slot past the last. One row's slots are the last
        T of its W: a single query needs no mask, a chunk a causal one (and append writes a slice)."""
        B, T = slots.shape
        if width is None:
            width = int(slots.max()) + 1
        if B == 1:
            mask = None if T == 1 else torch.ones(T, width, dtype=torch.bool, device=slots.device).tril(width - T)
            return slots, None, mask, width
        seen = torch.arange(width, device=slots.device)[None, None, :] <= slots[:, :, None]  # (B, T, W)
        mask = torch.zeros(seen.shape, device=slots.device).masked_fill_(~seen, float("-inf"))[:, None]
        index = slots[:, None, :, None].expand(B, self.k.size(2), T, self.k.size(4))  # (B, nh, T, hs)
        return slots, index, mask, width

    def lay_out_steps(self, start, k, furthest):
        """The layouts of k one-token steps from slot start[b] (B,) on (furthest: max(start)): a list of k."""
        widths = [furthest + 1 + j for j in range(k)]  # each step reads one slot more
        if len(start) == 1:  # one row: a single query sees all of its slots
            return [(None, None, None, w) for w in widths]
        slots = start[:, None] + torch.arange(k, device=start.device)  # (B, k)
        _, index, mask, _ = self.lay_out(slots, furthest + k)
        return [(slots[:, j : j + 1], index[:, :, j : j + 1], mask[:, :, j : j + 1, :w], w)
                for j, w in enumerate(widths)]

    def keep_rows(self, keep):
        """Drop the rows of a batch that are done: keep (B,) bool; the rest become rows 0..R-1."""
        self.k = self.k[:, keep]
        self.v = self.v[:, keep]

    def append(self, layer, k, v):
        """Write k, v (B, nh, T, hs) at each row's laid-out slots; return the first W slots and the mask."""
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
    lengths). Returns the block runs, counted in layer_evals (one call serves all these rows)."""
    m = int(n[rows[0]] - 1 - starts[rows[0]])
    if m == 0:
        return 0
    window = torch.arange(m, device=tokens.device)
    idx = tokens[rows[:, None], starts[rows][:, None] + window]  # (R, m)
    # a plain cache for just these rows (no per-row mask needed: they are level), then copied into place
    level = KVCache(model.config, len(rows), tokens.device)
    prefill(model, level, idx, 0)
    cache.k[:, rows, :, :m] = level.k[:, :, :, :m]
    cache.v[:, rows, :, :m] = level.v[:, :, :, :m]
    cache.layer_evals = [a + b for a, b in zip(cache.layer_evals, level.layer_evals)]
    return m * model.config.n_layer

def slide_rows(model, cache, tokens, starts, n):
    """Each row slides its window by window_start's rule; rows that moved re-prefill together, grouped by
    window length. Returns (block runs counted in layer_evals, block runs x rows)."""
    if not bool((n - starts > model.config.block_size).any()):  # most rounds: no row moves
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
        evals += runs
        row_runs += runs * len(group)
    return evals, row_runs

def draft(model, cache, tokens, n, pos, room, draft_exit, temperature, top_k, generator):
    """Every row drafts with layers 0..draft_exit from its own position pos[b], max(room) steps. Returns
    the draft logits (B, k, V), the drafts (B, k), their states (B, k, C), which the verify pass takes up
    from, and the slots any row has filled: the verify pass's width."""
    k, furthest = torch.stack((room.max(), pos.max())).tolist()  # one read of the device a round
    rows, steps = torch.arange(len(n), device=n.device), torch.arange(k, device=n.device)
    layouts = cache.lay_out_steps(pos, k, furthest)
    # a row with less room than k drafts on in spare slots at the last position; those are never kept
    wpos = (pos[:, None] + steps).clamp(max=model.config.block_size - 1)  # (B, k)
    wpe = model.transformer.wpe(wpos).unbind(1)  # k x (B, C)
    token, q, states, drafts = tokens[rows, n - 1], [], [], []
    for j in range(k):
        x = (model.transformer.wte(token) + wpe[j])[:, None]  # (B, 1, C); decoding never drops out
        cache.layout = layouts[j]
        for l in range(draft_exit + 1):
            x = model.transformer.h[l](x, cache, l)
        logits = model.exit_logits(x[:, 0], draft_exit)  # (B, V)
        token = sample(logits, temperature, top_k, generator)
        q.append(logits)
        states.append(x[:, 0])
        drafts.append(token)
    cache.layout = None
    drafts = torch.stack(drafts, dim=1)  # (B, k)
    tokens[rows[:, None], n[:, None] + steps] = drafts
    return torch.stack(q, dim=1), drafts, torch.stack(states, dim=1), furthest + k

def verify(model, cache, pos, x, draft_exit, width):
    """The layers above the draft run once over every row's drafted states x (B, k, C): (B, k, V) logits."""
    slots = pos[:, None] + torch.arange(x.size(1), device=pos.device)  # (B, k)
    cache.layout = cache.lay_out(slots, width)
    for l in range(draft_exit + 1, model.config.n_layer):
        x = model.transformer.h[l](x, cache, l)
    cache.layout = None
    return model.exit_logits(x, model.config.n_layer - 1)  # (B, k, V)

def speculative_accept(drafts, q, p, room, temperature, generator):
    """How many drafts each row keeps (at most room[b]), and the full model's token after them.

    Greedy (q, p logits): keep the longest prefix that matches the full model's argmax, then take the
    full model's choice. Sampled (q, p probabilities): keep draft d with probability min(1, p(d) / q(d));
    at the first rejection draw from max(p - q, 0), renormalised. Either way each emitted token has
    exactly the full model's distribution (speculative sampling: Leviathan et al. 2023, Chen et al. 2023).
    drafts (B, k), q, p (B, k, V). Returns (accepted (B,), next token (B,), has_next (B,)): has_next is
    false where a row kept all it could; room (B,) is how many drafts each row may keep (None: all k)."""
    B, k = drafts.shape
    rows = torch.arange(B, device=drafts.device)
    if temperature == 0:
        target = p.argmax(-1)  # (B, k)
        keep = target == drafts
    else:
        d = drafts[..., None]
        ratio = (p.gather(-1, d) / q.gather(-1, d))[..., 0]  # (B, k)
        keep = torch.rand(B, k, generator=generator, device=drafts.device) < ratio
    if room is not None:
        keep &= torch.arange(k, device=drafts.device)[None] < room[:, None]  # (B, k)
    accepted = keep.long().cumprod(1).sum(1)  # (B,)
    has_next = accepted < (k if room is None else room)
    at = accepted.clamp(max=k - 1)
    if temperature == 0:
        return accepted, target[rows, at], has_next
    if not bool(has_next.any()):  # no row rejected: nothing to draw
        return accepted, drafts[:, -1], has_next
    residual = (p - q)[rows, at].clamp_min(0) + (~has_next)[:, None]  # rows without a rejection: unused
    return accepted, draw(residual / residual.sum(-1, keepdim=True), generator), has_next

def speculative_round(model, cache, tokens, n, pos, room, draft_exit, temperature, top_k, generator):
    """One round of every row: draft up to room[b] tokens from window position pos[b], verify them in one
    pass, keep each row's accepted prefix and write the full model's token after it. Returns (accepted
    (B,), has_next (B,)), as speculative_accept."""
    q, drafts, states, width = draft(model, cache, tokens, n, pos, room, draft_exit, temperature, top_k,
                                     generator)
    p = verify(model, cache, pos, states, draft_exit, width)
    if temperature > 0:
        q = probs_from_logits(q, temperature, top_k)
        p = probs_from_logits(p, temperature, top_k)
    accepted, nxt, has_next = speculative_accept(drafts, q, p, room, temperature, generator)
    rows = torch.arange(len(n), device=n.device)
    tokens[rows, n + accepted] = nxt  # a row that kept all it could writes a slot its next round overwrites
    return accepted, has_next

@dataclass
class SpeculativeGeneration(Generation):
    stats: dict = None  # rounds (verify passes), drafted (drafts a row could keep), accepted, rejected

@torch.inference_mode()
def generate_self_speculative(model, idx, max_new_tokens, draft_exit=0, num_draft=8, temperature=0.0,
                              top_k=0, generator=None):
    """Self-speculative decoding of B rows at once (B = 1 included): each round every row drafts up to
    num_draft tokens with layers 0..draft_exit, the layers above verify them in one pass, and each row
    keeps its own accepted prefix, rolls back and slides its window on its own; a row that is done leaves
    the batch. Every row's tokens are those it would get alone at full depth (greedy), or have their
    distribution (sampled)."""
    cfg, (B, T0), dev = model.config, idx.shape, idx.device
    if not 0 <= draft_exit < cfg.n_layer - 1 or num_draft < 1:
        raise ValueError(f"need 0 <= draft_exit < {cfg.n_layer - 1} and num_draft >= 1, "
                         f"got draft_exit={draft_exit}, num_draft={num_draft}")
    end = T0 + max_new_tokens
    tokens = torch.cat([idx, idx.new_zeros(B, max_new_tokens + num_draft)], dim=1)
    out_tokens, cache = tokens[:, :end].clone(), RowKVCache(cfg, B, dev, spare=num_draft)
    # a negative start: no window yet (and far enough back that the first round places one)
    n, starts = torch.full((B,), T0, device=dev), torch.full((B,), -cfg.block_size - 1, device=dev)
    ids, rounds, evals, prefilled = torch.arange(B, device=dev), [], 0, 0.0
    while max_new_tokens > 0 and len(ids):  # ids (R,): the rows still in the batch
        e, row_runs = slide_rows(model, cache, tokens, starts, n)
        evals, prefilled = evals + e, prefilled + row_runs / B
        pos = n - 1 - starts  # (R,) window position of each row's first token fed this round
        room = torch.minimum(end - n, cfg.block_size - pos).clamp(max=num_draft)  # no position past block_size
        accepted, has_next = speculative_round(model, cache, tokens, n, pos, room, draft_exit, temperature,
                                               top_k, generator)
        rounds.append((ids, n, accepted, has_next, room))
        n = n + accepted + has_next  # moving n back past a rejected draft rolls the row's cache back
        done = n >= end  # rows that are done leave: the next rounds run on the rest only
        if bool(done.any()):
            out_tokens[ids[done]] = tokens[done, :end]
            tokens, n, starts, ids = tokens[~done], n[~done], starts[~done], ids[~done]
            cache.keep_rows(~done)
    ids, n, accepted, has_next, room = (torch.cat(t) for t in zip(*rounds)) if rounds else [idx[0, :0]] * 5
    stats = {"rounds": len(rounds), "drafted": int(room.sum()), "accepted": int(accepted.sum()),
             "rejected": int(has_next.sum()), "num_draft": num_draft}
    exited_at = kept_drafts(ids, n, accepted, B, end, draft_exit, cfg.n_layer - 1)[:, T0:]
    layers_run = sum(cache.layer_evals) - evals
    return SpeculativeGeneration(out_tokens, exited_at, None, layers_run, prefilled, stats)

def kept_drafts(ids, n, accepted, B, end, draft_exit, full_exit):
    """(B, end): draft_exit where a token is a kept draft, full_exit elsewhere. Each round of row ids[i]
    kept accepted[i] drafts from position n[i]: +1 where kept drafts begin, -1 where they end, summed along
    (kept runs never overlap)."""
    marks = torch.zeros(B, end + 1, dtype=torch.long, device=n.device)
    marks.index_put_((ids, n), torch.ones_like(n), accumulate=True)
    marks.index_put_((ids, n + accepted), -torch.ones_like(n), accumulate=True)
    return torch.where(marks.cumsum(1)[:, :end] > 0, draft_exit, full_exit)

# -----------------------------------------------------------------------------
# Training recipes: exits that agree with the final head draft well (layer dropout, self-distillation)

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

def distillation(logits, teacher_log_probs, temperature):
    """T^2 * KL(teacher || student) per position, the usual scaling so gradients match across T."""
    student = (logits.float() / temperature).log_softmax(-1)
    kl = F.kl_div(student.reshape(-1, student.size(-1)), teacher_log_probs.reshape(-1, student.size(-1)),
                  log_target=True, reduction="batchmean")
    return temperature**2 * kl

class RecipeGPT(GPT):
    """The lesson's GPT trained with a recipe of LabConfig: exit-loss weights, one shared head or the final head
    at every exit, self-distillation toward the final head, LayerSkip's layer dropout. The seed recipe
    (SEED_RECIPE) computes exactly GPT's loss; the default, dropout_distill, won the recipe comparison."""
    def __init__(self, config):
        super().__init__(config)
        if config.exit_head != "separate":  # one shared head (its parameters count once), or none at all
            heads = [ExitHead(config)] * (config.n_layer - 1) if config.exit_head == "shared" else []
            self.exit_heads = nn.ModuleList(heads)
            self.exit_heads.apply(self._init_weights)

    def exit_logits(self, x, layer):
        """exit_head='final' reads every exit through ln_f + lm_head."""
        return super().exit_logits(x, self.config.n_layer - 1 if self.config.exit_head == "final" else layer)

    def hidden_states(self, idx):
        """GPT's, with LayerSkip's layer dropout in training: each sequence skips block l with its rate."""
        x, states = self.embed(idx), []
        for l, block in enumerate(self.transformer.h):
            p = layer_dropout_prob(l, self.config) if self.training else 0.0
            y = block(x)
            if p > 0:
                keep = torch.rand(x.size(0), 1, 1, device=x.device) >= p  # (B, 1, 1)
                y = torch.where(keep, y, x)
            x = y
            states.append(x)
        return states

    def joint_loss(self, states, logits, targets):
        """The recipe's joint loss: weighted exit CEs, plus KL toward the detached final head when distilling.
        Exits with nothing to learn (alpha = 0, no distillation) are not computed at all."""
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

def count_params(model):
    """(base model, exit heads) parameter counts; unlike nanoGPT's, position embeddings are counted."""
    heads = sum(p.numel() for p in model.exit_heads.parameters())
    return sum(p.numel() for p in model.parameters()) - heads, heads

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

# -----------------------------------------------------------------------------
# Choosing the exit rule, 1: record every exit once, teacher-forced, then sweep without the model

def margin(probs):
    """Top-1 minus top-2 probability: (B, V) -> (B,)."""
    top2 = probs.topk(2, dim=-1).values  # (B, 2)
    return top2[:, 0] - top2[:, 1]

def normalised_entropy(probs):
    """1 - H / log V: 1 for a one-hot distribution, 0 for a uniform one. (B, V) -> (B,)."""
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
    return 1.0 - entropy / math.log(probs.size(-1))

CONFIDENCE_MEASURES.update(margin=margin, entropy=normalised_entropy)

@dataclass
class ExitRecords:
    """What every exit says at each position of a text, read in the decoder's own windows."""
    confidences: dict  # measure -> (L, N): each exit's confidence in its top prediction
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

    The windows are exactly those of sequential decoding fed data[0], data[1], ... (window_start), so a decoder
    that keeps its cache exact (backfill, deferred) makes exactly these predictions; that is tested. Windows of
    equal length run together, batch_size at a time."""
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
    conf = records.confidences[measure]
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

def threshold_for_exit_fraction(records, measure, checked_exits, fraction=EARLY_EXIT_FRACTION):
    """The highest threshold at which at least `fraction` of positions exit early."""
    L = records.pred.size(0)
    for t in THRESHOLDS:
        if (exits_at_threshold(records, measure, t, checked_exits) < L - 1).float().mean() >= fraction:
            return t
    return THRESHOLDS[-1]

# -----------------------------------------------------------------------------
# Choosing the exit rule, 2: the threshold sweep on val, and a threshold calibrated with a guarantee

def sweep(records, measure, checked_exits):
    """One entry per threshold: where positions exit, compute saved, loss and disagreement with full depth."""
    return [{"threshold": t, **exit_summary(records, exits_at_threshold(records, measure, t, checked_exits))}
            for t in THRESHOLDS]

def binomial_tail(k, n, epsilon):
    """P(Binomial(n, epsilon) <= k): the p-value of 'risk > epsilon' after k failures in n trials."""
    i = torch.arange(k + 1, dtype=torch.float64)
    log_pmf = (math.lgamma(n + 1) - torch.lgamma(i + 1) - torch.lgamma(n - i + 1)
               + i * math.log(epsilon) + (n - i) * math.log1p(-epsilon))
    return float(torch.logsumexp(log_pmf, 0).exp())

def fixed_sequence_test(failures, n, epsilon, delta):
    """Learn then Test with fixed-sequence testing (CALM, arXiv:2207.07061, section 4).

    failures[i] is the number of the n calibration positions that disagree with full depth at the i-th
    threshold, ordered most cautious first. Test H0: 'risk > epsilon' at each threshold in that order with the
    exact binomial p-value; stop at the first that is not rejected at level delta. Returns the index of the last
    rejected one (-1: none, so full depth). Because the order is fixed in advance, the chance that the returned
    threshold's true risk exceeds epsilon is at most delta (for i.i.d. positions)."""
    chosen = -1
    for i, k in enumerate(failures):
        if binomial_tail(k, n, epsilon) > delta:
            break
        chosen = i
    return chosen

def calibrate(records, measure, checked_exits, epsilon, delta):
    """The threshold fixed-sequence testing certifies: walking THRESHOLDS from cautious (1.0) down, the last one
    before the first whose disagreement with full depth is not certified below epsilon; 1.0 if none is."""
    N = records.targets.numel()
    failures = []
    for t in THRESHOLDS:
        exits = exits_at_threshold(records, measure, t, checked_exits)
        failures.append(int((records.pred[exits, torch.arange(N, device=exits.device)] != records.pred[-1]).sum()))
    chosen = fixed_sequence_test(failures, N, epsilon, delta)
    return 1.0 if chosen < 0 else THRESHOLDS[chosen]

def calibration_report(val, test, measure, checked_exits, epsilon, delta):
    """Calibrate on val, then report the chosen threshold's figures on test (never used to choose)."""
    threshold = calibrate(val, measure, checked_exits, epsilon, delta)
    keys = ("disagreement", "loss", "full_loss", "accuracy", "compute_saved", "mean_layers")
    figures = {name: exit_summary(r, exits_at_threshold(r, measure, threshold, checked_exits))
               for name, r in (("val", val), ("test", test))}
    return {"measure": measure, "epsilon": epsilon, "delta": delta, "threshold": threshold,
            **{name: {k: f[k] for k in keys} for name, f in figures.items()}}

# -----------------------------------------------------------------------------
# Choosing the exit rule, 3: the logit lens, and what "easy" means for this model

@torch.inference_mode()
def logit_lens(model, x):
    """Each layer read through ln_f + lm_head (never trained for it) and through its own exit head."""
    states = model.hidden_states(x)  # L x (B, T, C)
    final = model.exit_logits(states[-1], model.config.n_layer - 1).float()
    target = final.argmax(-1)  # (B, T): the final prediction
    entries = []
    for l, h in enumerate(states[:-1]):
        for readout, logits in (("ln_f + lm_head", model.exit_logits(h, model.config.n_layer - 1)),
                                ("exit head", model.exit_logits(h, l))):
            logits = logits.float()
            rank = (logits > logits.gather(-1, target[..., None])).sum(-1)  # 0 when it agrees
            entries.append({"layer": l, "readout": readout,
                            "agreement": (logits.argmax(-1) == target).float().mean().item(),
                            "mean_rank": rank.float().mean().item(),
                            "confidence": logits.softmax(-1).amax(-1).mean().item()})
    return entries

def exit_slices(records, exits, tokenizer, data, n_top=10):
    """Accuracy of the tokens leaving at each layer, and the characters that leave at the shallowest layer any
    token left at (with the context they most often follow)."""
    L, N = records.pred.shape
    correct = records.pred[exits, torch.arange(N, device=exits.device)] == records.targets
    per_layer = [{"layer": l, "tokens": int((exits == l).sum()),
                  "accuracy": correct[exits == l].float().mean().item() if (exits == l).any() else None}
                 for l in range(L)]
    shallowest = int(exits.min()) if N else 0
    contexts = {}
    for i in (exits == shallowest).nonzero().flatten().tolist():  # position i predicts data[i + 1] after data[..i]
        ch = tokenizer.decode([int(records.targets[i])])
        contexts.setdefault(ch, []).append(tokenizer.decode(data[max(0, i - 3) : i + 1].tolist()))
    top = sorted(contexts.items(), key=lambda kv: -len(kv[1]))[:n_top]
    chars = [{"char": ch, "exits": len(ctx), "example_context": Counter(ctx).most_common(1)[0][0]} for ch, ctx in top]
    return {"per_layer": per_layer, "first_exit_layer": shallowest, "earliest_chars": chars}

# -----------------------------------------------------------------------------
# Measurement, 1: every decoder on one workload, quality teacher-forced, then wall-clock, at any batch size

def workload(data, n_prompts, prompt_len):
    """n_prompts prompts of prompt_len characters from evenly spaced places of a split: (n_prompts,
    prompt_len). One prompt proves nothing: a greedy character model soon loops ("the the the"), and a
    loop is easy to draft. Timed figures continue every prompt of test's workload; choices use val's."""
    if len(data) < prompt_len + 2:
        raise ValueError(f"a split of {len(data)} characters is too short for prompts of {prompt_len}")
    starts = torch.linspace(0, len(data) - prompt_len - 1, n_prompts).long().tolist()
    return torch.stack([data[s : s + prompt_len] for s in starts])

def repetition(tokens, n=4):
    """1 - distinct n-grams / n-grams of one generated sequence: 0 never repeats itself, near 1 a loop."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)

def mode_temperature(mode, config):
    return 0.0 if mode == "greedy" else config.temperature

SPECULATIVE = ("self_speculative", "auto")  # exact by construction: no quality pass of their own

def decoder(model, name, plan=None, measure="top1", spec=(0, 8), schedule=None):
    """The decoder of one table row, for any batch size: decode(idx (B, T0), n, generator=, temperature=,
    top_k=, forced=) -> Generation. name: full, a KV strategy with its exit plan, skipdecode with its
    schedule, or self_speculative with spec = (draft_exit, num_draft). Full depth is one decoder on every
    device: the predictions and the speed-ups divide by the same baseline."""
    if name == "self_speculative":
        return partial(generate_self_speculative, model, draft_exit=spec[0], num_draft=spec[1])
    if name == "full":
        return partial(generate, model)
    if name == "skipdecode":
        return partial(generate, model, strategy=partial(SkipDecode, schedule), exit_threshold=0.0)
    return partial(generate, model, strategy=kv_strategy(name), exit_threshold=plan["threshold"],
                   checked_exits=plan["checked_exits"], measure=measure)

def quality_pass(decode, data, n_positions, n_layer, batch_size=1):
    """Teacher-forced decoding of batch_size contiguous pieces of data at once, n_positions in all: every
    decoder sees the same text, and its own cache's effects."""
    per_row = n_positions // batch_size
    pieces = data[: batch_size * (per_row + 1)].view(batch_size, per_row + 1)  # (B, per_row + 1)
    out = decode(pieces[:, :1], per_row, forced=pieces[:, 1:])
    logits = out.logits.flatten(0, 1)  # (N, V)
    targets = pieces[:, 1:].flatten().to(logits.device)  # (N,)
    exited_at = out.exited_at.flatten().cpu()
    counts = torch.bincount(exited_at, minlength=n_layer).float()
    return {"pred": logits.argmax(-1), "exited_at": exited_at,
            "exit_fractions": (counts / len(exited_at)).tolist(), "mean_layers": out.layers_run / per_row,
            "test_loss": F.cross_entropy(logits, targets).item(),
            "test_accuracy": (logits.argmax(-1) == targets).float().mean().item()}

def speed_pass(decoders, prompts, batch_size, n_tokens, repeats, seed, top_k):
    """Every decoder continues the workload, batch_size prompts a call, in turn, repeats times,
    interleaved; decoders: key -> (decode, temperature). Per decoder: median tokens/s of all rows, block
    runs per token while decoding (catch-up included) and re-prefilling, how repetitive the text is, and
    the last pass's Generations."""
    batches = prompts.view(-1, batch_size, prompts.size(1))  # (n_batches, B, T0)
    times, outputs = {key: [] for key in decoders}, {}
    for _ in range(repeats):
        for key, (decode, temperature) in decoders.items():
            synchronize(prompts.device)
            t0, outs = time.perf_counter(), []
            for i, batch in enumerate(batches):
                gen = torch.Generator(device=prompts.device).manual_seed(seed + i)
                outs.append(decode(batch, n_tokens, generator=gen, temperature=temperature, top_k=top_k))
            synchronize(prompts.device)
            times[key].append(time.perf_counter() - t0)
            outputs[key] = outs
    steps = len(batches) * n_tokens  # layers_run and prefill_runs count per row
    return {key: {"tokens_per_second": len(prompts) * n_tokens / float(np.median(times[key])),
                  "mean_layers": sum(o.layers_run for o in outs) / steps,
                  "prefill_layers": sum(o.prefill_runs for o in outs) / steps,
                  "repetition": float(np.mean([repetition(r[-n_tokens:].tolist()) for o in outs
                                               for r in o.tokens])),
                  "outputs": outs} for key, outs in outputs.items()}

def spec_stats(outputs, full_outputs, mode):
    """Acceptance (drafts kept over drafts a row could keep), tokens per verify pass, the draft that ran,
    and (greedy) whether every row's output equals full depth's. Outputs of full depth (auto's choice
    where speculation does not pay) count no drafts."""
    runs = [o.stats for o in outputs if isinstance(o, SpeculativeGeneration)]
    stats = {k: sum(s[k] for s in runs) for k in ("rounds", "drafted", "accepted")}
    same = None
    if mode == "greedy":
        same = all(torch.equal(a.tokens, b.tokens) for a, b in zip(outputs, full_outputs))
    if not runs:
        return {"identical_to_full": same}
    new_tokens = sum(o.exited_at.numel() for o in outputs)
    return {"acceptance_rate": stats["accepted"] / max(1, stats["drafted"]), "rounds": stats["rounds"],
            "tokens_per_verify": new_tokens / stats["rounds"], "num_draft": runs[0]["num_draft"],
            "identical_to_full": same}

def table_row(name, mode, speed, quality, config, batch_size=1):
    """One row of a decoder table: speed over full depth at the same batch size and mode, quality beside
    it; a speculative decoder's quality is full depth's by construction."""
    s, full = speed[name, mode], speed["full", mode]
    q = quality.get(name, quality["full"])
    row = {"batch_size": batch_size, "name": name, "mode": mode, "tokens_per_second": s["tokens_per_second"],
           "speedup": s["tokens_per_second"] / full["tokens_per_second"],
           "ideal_speedup": config.n_layer / s["mean_layers"], "mean_layers": s["mean_layers"],
           "prefill_layers": s["prefill_layers"], "repetition": s["repetition"],
           "test_loss": q["test_loss"], "test_accuracy": q["test_accuracy"],
           "agreement": (q["pred"] == quality["full"]["pred"]).float().mean().item(),
           "quality_from": "full depth (exact by construction)", "identical_to_full": None}
    if name in quality:
        row["quality_from"] = "teacher-forced test positions"
    if name in SPECULATIVE:
        row.update(spec_stats(s["outputs"], full["outputs"], mode), draft_exit=config.draft_exit)
    return row

def measure_decoders(decoders, test, prompts, config, batch_size=1):
    """The rows of a decoder table at one batch size, both modes: quality (greedy decoders, teacher-forced
    on test) and speed on the test workload. decoders: name -> {mode: decode}."""
    quality = {name: quality_pass(d["greedy"], test, config.quality_positions, config.n_layer, batch_size)
               for name, d in decoders.items() if name not in SPECULATIVE}
    timed = {(name, mode): (d[mode], mode_temperature(mode, config))
             for mode in MODES for name, d in decoders.items()}
    speed = speed_pass(timed, prompts, batch_size, config.bench_tokens, config.bench_repeats, config.seed,
                       config.top_k)
    rows = [table_row(name, mode, speed, quality, config, batch_size) for mode in MODES for name in decoders]
    return rows, quality

@torch.inference_mode()
def decode_costs(model, prompts, n_tokens, repeats=200, attempts=3):
    """Seconds, one new token at batch 1 (medians): a block, an exit check (head, confidence and the host
    sync that decides), a state-copy write, the final head, and a whole full-depth token on these prompts,
    by the same full-depth decoder the speed-ups divide by. A token cheaper than n_layer blocks is
    impossible (a busy machine): measured again, up to `attempts` times."""
    cfg, device = model.config, prompts.device
    cache, x = KVCache(cfg, 1, device), torch.zeros(1, 1, cfg.n_embd, device=device)
    weight, bias = state_copy_projections(model)
    stages = {"block": partial(model.transformer.h[0], x, cache, 0),
              "check": partial(exit_check, model, x),
              "state_copy": partial(write_state_copy, cache, 1, x, weight, bias),
              "final_head": partial(model.exit_logits, x[:, 0], cfg.n_layer - 1)}
    full = {"full": (decoder(model, "full"), 0.0)}
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

def exit_check(model, x):
    """What decode_step does at a checked exit: the head, its confidence and the host sync that decides."""
    return bool((confidence(model.exit_logits(x[:, 0], 0)) > 0.9).any())

def predict_speedup(records, measure, threshold, checked_exits, costs, strategy, n_layer):
    """Full depth's measured time per token over the predicted time of a strategy checking these exits.

    Exiting at layer e skips n_layer - 1 - e blocks and the final head (not under backfill, which runs
    them all) and costs a state-copy write under state_copy; every checked exit at or below e costs a
    check. Deferred's catch-up rides in the next token's block call, so it is counted as no extra call."""
    exits = exits_at_threshold(records, measure, threshold, checked_exits).float()  # (N,)
    L = n_layer
    checks = sum((exits >= l).float() for l in checked_exits).mean().item()
    early = (exits < L - 1).float().mean().item()
    saved = 0.0
    if strategy != "backfill":
        saved = (L - 1 - exits).mean().item() * costs["block"] + early * costs["final_head"]
    extra = checks * costs["check"]
    if strategy == "state_copy":
        extra += early * costs["state_copy"]
    return costs["token"] / (costs["token"] - saved + extra)

def plan_exits(records, measure, costs, strategy, n_layer, threshold=None):
    """The cost-aware exit plan: every subset of exits, each at its threshold (given, or the highest with
    EARLY_EXIT_FRACTION of val positions exiting early), ranked by predicted speed-up; best first."""
    plans = []
    for r in range(1, n_layer):
        for subset in map(list, itertools.combinations(range(n_layer - 1), r)):
            t = threshold
            if t is None:
                t = threshold_for_exit_fraction(records, measure, subset)
            speedup = predict_speedup(records, measure, t, subset, costs, strategy, n_layer)
            plans.append({"checked_exits": subset, "threshold": t, "predicted_speedup": speedup})
    return sorted(plans, key=lambda p: -p["predicted_speedup"])

def strategy_plans(val_records, costs, config):
    """Per KV strategy: the exits it checks, their threshold and the predicted speed-up, chosen on val."""
    L, measure = config.n_layer, config.confidence_measure
    fixed = None if config.strategies_threshold < 0 else config.strategies_threshold
    plans = {}
    for name in KV_STRATEGIES:
        if config.exit_layers == "auto":
            plans[name] = plan_exits(val_records, measure, costs, name, L, fixed)[0]
            continue
        checked = parse_exit_layers(config.exit_layers, L)
        t = fixed
        if t is None:
            t = threshold_for_exit_fraction(val_records, measure, checked)
        speedup = predict_speedup(val_records, measure, t, checked, costs, name, L)
        plans[name] = {"checked_exits": checked, "threshold": t, "predicted_speedup": speedup}
    return plans

def speculation_costs(model, prompts, config, batch_size, cells):
    """Self-speculation on a workload at batch_size, every (draft_exit, num_draft) cell beside full depth,
    both modes, interleaved: an entry per cell and mode. The cost model is per round: a round costs
    ms_per_round (its drafts, the verify pass, the accept rule, its share of re-prefills) and emits
    tokens_per_verify over the batch (kept drafts and the full model's token: fewer at window edges, and a
    batch waits for its slowest row); the speed-up is full depth's time per token over a round's. Timed
    on val, it is the prediction beside test's speed-ups and what auto chooses by."""
    decoders = {}
    for mode in MODES:
        T = mode_temperature(mode, config)
        decoders["full", mode] = decoder(model, "full"), T
        for cell in cells:
            decoders[cell, mode] = decoder(model, "self_speculative", spec=cell), T
    speed = speed_pass(decoders, prompts, batch_size, config.bench_tokens, config.bench_repeats,
                       config.seed, config.top_k)
    entries = []
    for (cell, mode), s in speed.items():
        full = speed["full", mode]
        if cell == "full":
            continue
        stats = spec_stats(s["outputs"], full["outputs"], mode)
        ms_per_round = 1e3 * len(prompts) * config.bench_tokens / s["tokens_per_second"] / stats["rounds"]
        full_ms = 1e3 / full["tokens_per_second"]  # full depth's time per token of the batch
        entries.append({**stats, "draft_exit": cell[0], "mode": mode, "ms_per_round": ms_per_round,
                        "speedup": full_ms * stats["tokens_per_verify"] / ms_per_round,
                        "repetition": s["repetition"]})
    return entries

def compare_strategies(model, splits, config, device):
    """The strategies table at batch 1: exit plans chosen on val, quality teacher-forced on test, speed on
    the test workload, greedy and sampled."""
    val_prompts, test_prompts = (workload(splits[s], config.bench_prompts, config.bench_prompt_len).to(device)
                                 for s in ("val", "test"))
    val_records = record_exits(model, splits["val"].to(device), config.quality_positions)
    costs = decode_costs(model, val_prompts[:4], config.bench_tokens)
    plans = strategy_plans(val_records, costs, config)
    spec = (config.draft_exit, config.num_draft)
    spec_costs = {e["mode"]: e for e in speculation_costs(model, val_prompts, config, 1, [spec])}
    names = ("full",) + tuple(KV_STRATEGIES) + ("self_speculative",)
    decoders = {name: decoder(model, name, plans.get(name), config.confidence_measure, spec)
                for name in names}
    rows, quality = measure_decoders({name: {mode: d for mode in MODES} for name, d in decoders.items()},
                                     splits["test"].to(device), test_prompts, config)
    for row in rows:
        if row["name"] in plans:
            plan = plans[row["name"]]
            row.update(plan, checked_exits=",".join(map(str, plan["checked_exits"])))
        if row["name"] == "self_speculative":
            row["predicted_speedup"] = spec_costs[row["mode"]]["speedup"]
    return rows, quality, plans, costs, val_records

SPEC_GRID = dict(draft_exits=(0, 1, 2), num_drafts=(4, 6, 8, 12))

def sweep_speculative(model, prompts, config, grid=SPEC_GRID):
    """--spec_sweep: every (draft_exit, num_draft) on the val workload, greedy and sampled."""
    cells = [(E, k) for E in grid["draft_exits"] if E < config.n_layer - 1 for k in grid["num_drafts"]]
    return speculation_costs(model, prompts, config, 1, cells)

# -----------------------------------------------------------------------------
# Batches: a batch runs as deep as its deepest row, unless a schedule (SkipDecode) or speculation decides

def expected_batch_depth(exited_at, batch_sizes, n_layer):
    """Mean of the deepest exit among B independent draws from the recorded per-token exit layers."""
    counts = torch.bincount(exited_at.cpu(), minlength=n_layer).double()
    cdf = counts.cumsum(0) / len(exited_at)  # P(exit <= l)
    depth = torch.arange(1, n_layer + 1, dtype=torch.float64)
    below = torch.cat([cdf.new_zeros(1), cdf[:-1]])  # P(exit < l)
    return {B: float(((cdf**B - below**B) * depth).sum()) for B in batch_sizes}

class SkipDecode(Holes):
    """After SkipDecode (arXiv:2307.02628): every row at window position pos exits at schedule[pos], a
    depth that never rises along the window, so a later token never reads a layer an earlier one skipped:
    no holes are ever read, no exit check is needed, and a batch saves what a row saves."""
    def __init__(self, schedule):
        self.schedule = schedule

    def exit_checks(self, pos, checked_exits):
        return [self.schedule[pos]]  # the last layer is never checked: it always exits

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
                best = {"schedule": [n_layer - 1] * a + [e] * (block_size - a), "from_position": a,
                        "exit_layer": e, "compute_saved": figures["compute_saved"],
                        "disagreement": figures["disagreement"]}
    return best

BATCH_DESIGNS = ("full", "state_copy", "skipdecode", "self_speculative", "auto")
BATCH_DRAFTS = (4, 8, 11, 16)  # num_draft tried in batches (11 fills 33 new tokens, block 64's half + 1)

def choose_drafts(entries):
    """From speculation_costs' entries: per mode, the k predicted fastest (self_speculative's), and what
    auto runs: that k, or None (full depth) where no k is predicted faster than full depth."""
    drafts, auto = {}, {}
    for mode in MODES:
        best = max((e for e in entries if e["mode"] == mode), key=lambda e: e["speedup"])
        drafts[mode] = best["num_draft"]
        auto[mode] = best["num_draft"] if best["speedup"] > 1 else None
    return drafts, auto

def batch_decoders(model, config, plan, schedule, drafts, auto):
    """The batch table's decoders: name -> {mode: decode}. drafts: the k of self_speculative per mode;
    auto: per mode, the k it runs, or None for full depth."""
    decoders = {name: {} for name in BATCH_DESIGNS}
    for mode in MODES:
        for name in BATCH_DESIGNS[:3]:
            decoders[name][mode] = decoder(model, name, plan, config.confidence_measure,
                                           schedule=schedule["schedule"])
        spec = decoder(model, "self_speculative", spec=(config.draft_exit, drafts[mode]))
        decoders["self_speculative"][mode] = spec
        decoders["auto"][mode] = decoders["full"][mode] if auto[mode] is None else spec
    return decoders

def batch_predictions(row, plan, skip, depth, spec, auto):
    """The cost models' speed-up beside a batch-table row: state_copy at the batch's expected depth (every
    row waits for the deepest), skipdecode from the block runs it skips, speculation per round (on val)."""
    name, mode = row["name"], row["mode"]
    B = row["batch_size"]
    if name == "full":
        return {"predicted_speedup": 1.0}
    if name == "state_copy":
        return {"expected_layers": depth[B], "predicted_speedup": plan["predicted_speedup"] * depth[1] / depth[B]}
    if name == "skipdecode":
        return {"predicted_speedup": skip}
    k = row.get("num_draft")
    if name == "auto" and auto[mode] is None:
        return {"predicted_speedup": 1.0, "choice": "full depth"}
    figures = {"predicted_speedup": spec[mode, k]["speedup"]}
    if name == "auto":
        figures["choice"] = f"k={k}"
    return figures

def measure_batches(model, splits, config, device, plans, val_records, unit_costs):
    """The batch table: every design at every batch size, greedy and sampled, quality beside speed, and the
    cost models' predictions (unit_costs: decode_costs' batch-1 figures)."""
    L, plan = config.n_layer, plans["state_copy"]
    test_prompts, val_prompts = (workload(splits[s], config.bench_prompts, config.bench_prompt_len).to(device)
                                 for s in ("test", "val"))
    schedule = choose_schedule(val_records, L, config.block_size, config.schedule_disagreement)
    exits = exits_at_threshold(val_records, config.confidence_measure, plan["threshold"], plan["checked_exits"])
    # skipdecode skips the same share of block runs in every row, with no checks: that share of a token's blocks
    skipped = schedule["compute_saved"] * L * unit_costs["block"]
    skip = unit_costs["token"] / (unit_costs["token"] - skipped)
    rows, chosen, grid = [], {}, sorted(set(BATCH_DRAFTS) | {config.num_draft})
    for B in (b for b in BATCH_SIZES if config.bench_prompts % b == 0):
        entries = speculation_costs(model, val_prompts, config, B, [(config.draft_exit, k) for k in grid])
        drafts, auto = choose_drafts(entries)  # on val
        chosen[B] = {"num_draft": drafts, "auto": auto, "speculation_costs": entries}
        spec = {(e["mode"], e["num_draft"]): e for e in entries}
        decoders = batch_decoders(model, config, plan, schedule, drafts, auto)
        batch_rows, _ = measure_decoders(decoders, splits["test"].to(device), test_prompts, config, B)
        depth = expected_batch_depth(exits, (1, B), L)  # a step runs as deep as its deepest row
        rows += [dict(r, **batch_predictions(r, plan, skip, depth, spec, auto)) for r in batch_rows]
    return {"entries": rows, "schedule": schedule, "plan": plan, "drafts": chosen}

# -----------------------------------------------------------------------------
# Measurement, 2: training recipes compared at the same budget

def evaluate_recipe(name, model, splits, config, device, prompts):
    """The figures a recipe is judged on: losses, calibrated compute saved, self-speculative speed."""
    model.eval()
    losses = estimate_loss(model, splits, config, device)
    checked_exits = list(range(config.n_layer - 1))
    val, test = (record_exits(model, splits[s].to(device), config.sweep_positions) for s in ("val", "test"))
    cal = calibration_report(val, test, config.confidence_measure, checked_exits, config.epsilon, config.delta)
    cell = (config.draft_exit, config.num_draft)
    spec = {r["mode"]: r for r in speculation_costs(model, prompts, config, 1, [cell])}
    return {"recipe": name, **RECIPES[name], "val_loss_final": losses["val"][-1],
            "val_loss_exits": losses["val"][:-1], "calibrated_threshold": cal["threshold"],
            "compute_saved": cal["test"]["compute_saved"], "test_loss": cal["test"]["loss"],
            "test_full_loss": cal["test"]["full_loss"], "spec_speedup": spec["greedy"]["speedup"],
            "spec_acceptance_rate": spec["greedy"]["acceptance_rate"],
            "spec_identical_to_full": spec["greedy"]["identical_to_full"],
            "spec_speedup_sampled": spec["sampled"]["speedup"],
            "spec_acceptance_rate_sampled": spec["sampled"]["acceptance_rate"]}

def compare_recipes(config, splits, device, prompts):
    """Train every recipe from scratch with the same data, seed and budget; evaluate each the same way."""
    entries = []
    for name, changes in RECIPES.items():
        cfg = LabConfig(**{**asdict(config), **SEED_RECIPE, **changes})
        print(f"\n--- recipe {name}: {changes or 'the seed recipe'} ---")
        torch.manual_seed(cfg.seed)
        model = RecipeGPT(cfg).to(device)
        seconds, _, _ = train(model, configure_optimizer(model, cfg), splits, cfg, device)
        entries.append({**evaluate_recipe(name, model, splits, cfg, device, prompts), "train_seconds": seconds})
    return entries

# -----------------------------------------------------------------------------
# Reports: the exit map, tables for people, JSON for programs

LAYER_COLOURS = (31, 33, 32, 36, 34, 35, 91, 93, 92, 96, 94, 95)  # ANSI foreground codes, shallow to deep
LAYER_MARKS = "0123456789abcdefghijklmnopqrstuvwxyz"  # the mark of layer l in a plain-text exit map

def colour_text(text, layers, n_layer, tty):
    """Every character coloured by the layer it left at; without a terminal, the layer's mark underneath."""
    if tty:
        legend = " ".join(f"\033[{LAYER_COLOURS[l % 12]}mlayer {l}\033[0m" for l in range(n_layer))
        body = "".join(f"\033[{LAYER_COLOURS[l % 12]}m{ch}\033[0m" for ch, l in zip(text, layers))
        return f"legend: {legend}\n{body}"
    out, i = ["(under each character, the layer it exited at: 0-9, then a for 10, b for 11, ...)"], 0
    for line in text.split("\n"):
        out += [line, "".join(LAYER_MARKS[l] for l in layers[i : i + len(line)])]
        i += len(line) + 1
    return "\n".join(out)

WIDTH = 120  # console tables and their notes fit this many columns

def print_title(question):
    """A table's question as its title, '=== ... ===', wrapped to WIDTH."""
    print("\n=== " + "\n    ".join(textwrap.wrap(question, WIDTH - 8)) + " ===")

def print_table(title, entries, columns, notes=()):
    """The question a table answers, the table (columns: (key, header, format) triples), and notes under it."""
    cells = [[fmt.format(e[k]) if e.get(k) is not None else "-" for k, _, fmt in columns] for e in entries]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(columns)]
    print_title(title)
    for line in [[h for _, h, _ in columns]] + cells:
        print("  ".join(v.rjust(w) for v, w in zip(line, widths)))
    for note in notes:
        print(textwrap.fill(note, WIDTH, subsequent_indent="  ") if len(note) > WIDTH else note)

STRATEGY_COLUMNS = (("mode", "mode", "{}"), ("name", "decoder", "{}"), ("checked_exits", "exits", "{}"),
                    ("threshold", "thr", "{:.2f}"), ("tokens_per_second", "tok/s", "{:,.0f}"),
                    ("speedup", "speed-up", "{:.2f}x"), ("predicted_speedup", "predicted", "{:.2f}x"),
                    ("ideal_speedup", "ideal", "{:.2f}x"), ("mean_layers", "layers", "{:.2f}"),
                    ("repetition", "repeats", "{:.2f}"), ("test_loss", "test loss", "{:.4f}"),
                    ("agreement", "agree", "{:.3f}"))
BATCH_COLUMNS = (("batch_size", "B", "{}"), ("mode", "mode", "{}"), ("name", "design", "{}"),
                 ("tokens_per_second", "tok/s", "{:,.0f}"), ("speedup", "speed-up", "{:.2f}x"),
                 ("predicted_speedup", "predicted", "{:.2f}x"), ("choice", "auto chose", "{}"),
                 ("num_draft", "k", "{}"), ("mean_layers", "layers", "{:.2f}"),
                 ("expected_layers", "expected", "{:.2f}"), ("test_loss", "test loss", "{:.4f}"),
                 ("agreement", "agree", "{:.3f}"), ("identical_to_full", "identical", "{}"))
LENS_COLUMNS = (("layer", "layer", "{}"), ("readout", "readout", "{}"), ("agreement", "top-1 = final", "{:.3f}"),
                ("mean_rank", "mean rank", "{:.2f}"), ("confidence", "mean confidence", "{:.3f}"))
RECIPE_COLUMNS = (("recipe", "recipe", "{}"), ("val_loss_final", "val loss", "{:.4f}"),
                  ("calibrated_threshold", "thr", "{:.2f}"), ("compute_saved", "saved", "{:.1%}"),
                  ("test_loss", "test loss", "{:.4f}"), ("test_full_loss", "full", "{:.4f}"),
                  ("spec_acceptance_rate", "accept", "{:.3f}"), ("spec_speedup", "greedy", "{:.2f}x"),
                  ("spec_speedup_sampled", "sampled", "{:.2f}x"))

def print_strategies(entries, quality, config, costs, depths):
    spec = [f"self_speculative {e['mode']}: draft_exit={e['draft_exit']}, num_draft={e['num_draft']}, draft_stop="
            f"{e['draft_stop']:g}, acceptance {e['acceptance_rate']:.3f}, {e['tokens_per_verify']:.2f} tokens per "
            f"verify pass, " + {True: "identical to full depth on every prompt", False: "NOT identical to full depth",
                                None: "exact in distribution (tested)"}[e["identical_to_full"]]
            for e in entries if e["name"] == "self_speculative"]
    b, L, prefill = costs["block"], config.n_layer, sorted({round(e["prefill_layers"], 2) for e in entries})
    impossible = (f" IMPOSSIBLE (a token runs {L} blocks and a head): still so after {costs['attempts']} measurements, "
                  "the machine is busy; the predictions above use it" if costs["token"] < L * b else "")
    print_table(f"What does each KV strategy buy? {config.bench_prompts} test prompts of {config.bench_prompt_len} "
                f"characters, {config.bench_tokens} more each, batch 1, median of {config.bench_repeats} interleaved "
                "runs", entries, STRATEGY_COLUMNS, spec + [
        f"speed-up: tokens per second over full depth's in the same mode (sampled: temperature {config.temperature:g}, "
        f"top_k {config.top_k}); predicted: the cost model's figure (self_speculative: the goodput model's, costs "
        f"measured on val); ideal: {L} / layers, what the skipped layers would give if a layer were all a step cost.",
        f"exits, thr: the exits checked and their threshold, chosen on val (exit_layers={config.exit_layers!r}: the "
        f"highest threshold sending {EARLY_EXIT_FRACTION:.0%} of val positions out early). layers: blocks run per "
        f"token while decoding, catch-up included; re-prefilling the window every block_size/2 tokens adds "
        f"{' to '.join(f'{p:.2f}' for p in prefill)} per token for every decoder (it also repairs holes and state "
        "copies).",
        "repeats: the share of the text's 4-grams that repeat an earlier one (a loop is easy to draft and to exit "
        f"from). test loss, agree: {config.quality_positions} test positions teacher-forced through each decoder, "
        "and how often its top-1 equals full depth's (self_speculative: full depth's, by construction). The "
        "Learn-then-Test guarantee covers none of these rows.",
        "\nwhere test tokens exit (teacher-forced), and layers run per token counting catch-up work:"]
        + [f"  {name:<11} {' '.join(f'{100 * f:5.1f}%' for f in q['exit_fractions'])}  | {q['mean_layers']:.2f} "
           "layers/token" for name, q in quality.items()]
        + [f"measured costs, one token at batch 1: block {1e6 * b:.0f} us, exit check {costs['check'] / b:.2f} of a "
           f"block, state-copy write {costs['state_copy'] / b:.2f}, final head {costs['final_head'] / b:.2f}; a "
           f"full-depth token {costs['token'] / b:.1f} blocks{impossible}",
           "a batch runs as deep as its deepest row: expected layers per step, from where these test tokens exit:"]
        + [f"  B = {B:>2}: {d:.2f} of {L} layers ({100 * (1 - d / L):4.1f}% of layer runs saved)"
           for B, d in depths.items()])

def spec_grid(grid, mode):
    """The self-speculative sweep of one mode as a grid: (draft_exit, num_draft) lines, draft_stop columns, and
    cell(E, k, stop) -> (its index in the sweep, its entry)."""
    cells = {(g["draft_exit"], g["num_draft"], g["draft_stop"]): (i, g)
             for i, g in enumerate(grid) if g["mode"] == mode}
    return sorted({c[:2] for c in cells}), sorted({c[2] for c in cells}), lambda E, k, s: cells[E, k, s]

def print_spec_sweep(grid):
    print_title("Which draft_exit, num_draft and draft_stop? The self-speculative sweep on the val workload, every "
                "cell beside full depth in the same mode, interleaved")
    print("each cell: the speed-up over full depth (the share of drafts kept); E: the draft's last layer, k: the most "
          "drafts a round,\n  stop: drafting stops when the draft's top-1 probability falls below it (0: never)")
    for mode in MODES:
        lines, stops, cell = spec_grid(grid, mode)
        print(f"{mode:>8} E,k " + "".join(f"{'stop=' + format(s, 'g'):>16}" for s in stops))
        for E, k in lines:
            print(f"{E:>8},{k:<3} " + "".join(f"{cell(E, k, s)[1]['speedup']:>9.2f}x "
                                             f"({cell(E, k, s)[1]['acceptance_rate']:.2f})" for s in stops))
        best = max((g for g in grid if g["mode"] == mode), key=lambda g: g["speedup"])
        print(f"best {mode}: draft_exit={best['draft_exit']}, num_draft={best['num_draft']}, "
              f"draft_stop={best['draft_stop']:g} ({best['speedup']:.2f}x)")
    print(f"greedy output identical to full depth in every cell: "
          f"{all(g['identical_to_full'] for g in grid if g['mode'] == 'greedy')}")

def batch_notes(batched, cfg):
    """The lines under the batch table; cfg: the config as a dict (report.json's)."""
    plan, schedule = batched["plan"], batched["schedule"]
    return ["tok/s: characters per second of the whole batch; speed-up: over full depth at the same batch size and "
            "mode; predicted: the cost model's speed-up (speculation: the goodput model; state_copy: batch 1's plan "
            "at the batch's depth; skipdecode: the block runs it skips); auto chose: the goodput controller's first "
            "choice (k drafts a round, or full depth); auto_approx: auto that may also choose skipdecode, within "
            f"its disagreement budget (schedule_disagreement={cfg['schedule_disagreement']:g}), and then is as "
            "approximate as it; k: drafts a round; layers: blocks run per token; expected: what the recorded exits "
            "predict; test loss, agree: teacher-forced test positions, agreement with full depth's top-1; identical: "
            "greedy output equal to full depth's on every row.",
            f"state_copy: every row waits for the deepest (exits {plan['checked_exits']}, {cfg['confidence_measure']}"
            f" > {plan['threshold']:g}; expected: layers per step from val's exits). skipdecode: every row exits at "
            f"layer {schedule.get('exit_layer', cfg['n_layer'] - 1)} from window position "
            f"{schedule.get('from_position', '-')} (val: {schedule['compute_saved']:.1%} saved, "
            f"{schedule['disagreement']:.2%} disagreement). self_speculative: draft_exit={cfg['draft_exit']}, k the "
            f"fastest on val of {sorted(set(BATCH_DRAFTS) | {cfg['num_draft']})} (batch 1: num_draft). Speed-up: "
            "over full depth at the same batch size and mode.",
            "Where batched greedy speculation's time goes (one timed pass; a batch lasts as long as its slowest "
            "row):"] + [
        f"  batch {c['batch_size']}, k={c['num_draft']}: {c['rounds']} rounds (alone, each batch's slowest row needs "
        f"{c['slowest_row_rounds']} in all, its mean row {c['mean_row_rounds']:.1f}); time: "
        + ", ".join(f"{phase} {share:.0%}" for phase, share in c["shares"].items())
        + f"; a draft step {c['draft_step_ms']:.2f} ms, a verify pass {c['verify_ms']:.2f} ms, a full-depth step "
        f"{c['full_step_ms']:.2f} ms (re-prefills included)" for c in batched["speculation_costs"]]

def print_batches(batched, config):
    print_table(f"Does early exit still save in a batch? The test workload, one prompt per row, batch "
                f"{', '.join(map(str, BATCH_SIZES))}, median of {config.bench_repeats} interleaved runs",
                batched["entries"], BATCH_COLUMNS, batch_notes(batched, asdict(config)))

def print_exit_rule(rule, config):
    """The analysis of choosing the exit rule, each part under the question it answers."""
    L, cal, n = config.n_layer, rule["calibration"], f"{config.sweep_positions:,}"
    shown = [dict(e, fractions=" ".join(f"{100 * f:5.1f}" for f in e["exit_fractions"])) for e in rule["sweep"]
             if round(100 * e["threshold"]) % 10 == 0 or e["threshold"] in (0.99, 0.98, 0.95)]
    print_table(f"Which threshold? The sweep on {n} val positions, teacher-forced ({config.confidence_measure}): "
                "compute saved against quality",
                shown, (("threshold", "threshold", "{:.2f}"), ("fractions", f"% exiting at layer 0..{L - 1}", "{}"),
                        ("mean_layers", "layers", "{:.2f}"), ("compute_saved", "val saved", "{:.1%}"),
                        ("loss", "val loss", "{:.4f}"), ("disagreement", "disagree", "{:.2%}")),
                [f"layers: mean layers run per position; val saved: the share of layer runs skipped; val loss: the "
                 f"loss of the head each position exits at (full depth's: {rule['sweep'][0]['full_loss']:.4f} on "
                 "these positions); disagree: the share of positions whose top-1 differs from full depth's.",
                 "text plot: compute saved (#) and disagreement with full depth (x, same scale), one line a threshold"]
                + [f"  {e['threshold']:4.2f} |{'#' * round(40 * e['compute_saved']):<40}| {e['compute_saved']:6.1%} "
                   f"saved |{'x' * min(10, round(40 * e['disagreement'])):<10}| {e['disagreement']:6.2%} disagree"
                   for e in shown])
    cals = rule["calibration_by_measure"]
    print_table(f"Which threshold, with a guarantee? Learn then Test: disagreement <= {cal['epsilon']:.0%} with "
                f"probability >= {1 - cal['delta']:.0%}, chosen on val, reported on {n} test positions",
                [{"measure": c["measure"], "threshold": c["threshold"], **c["test"]} for c in cals],
                (("measure", "measure", "{}"), ("threshold", "threshold", "{:.2f}"), ("compute_saved", "test saved",
                 "{:.1%}"), ("disagreement", "disagree", "{:.2%}"), ("loss", "test loss", "{:.4f}"),
                 ("full_loss", "full depth's", "{:.4f}"), ("accuracy", "accuracy", "{:.3f}")),
                ["teacher-forced with an exact cache (backfill, deferred); test loss and accuracy at the calibrated "
                 "threshold, beside full depth's test loss on the same positions. Most compute saved at the same "
                 "guarantee: " + max(cals, key=lambda c: c["test"]["compute_saved"])["measure"]])
    print_table("Does an exit need a trained head? The logit lens on up to 64 val windows: each layer through the "
                "final head (untrained for it) and through its own exit head", rule["logit_lens"], LENS_COLUMNS,
                ["top-1 = final: how often the layer's top-1 is the final prediction; mean rank: how many characters "
                 "it ranks above the final top-1 (0 when it agrees)."])
    slices = rule["slices"]
    print_table(f"What does 'easy' mean for this model? The {n} test positions by the layer they leave at (calibrated "
                f"threshold {cal['threshold']:g})",
                slices["per_layer"], (("layer", "layer", "{}"), ("tokens", "tokens", "{}"),
                                      ("accuracy", "accuracy", "{:.3f}")),
                [f"characters that most often leave at layer {slices['first_exit_layer']} (with a typical context):"]
                + [f"  {c['char']!r:>6}: {c['exits']:>5} times, e.g. after {c['example_context']!r}"
                   for c in slices["earliest_chars"]])

def print_recipes(entries, config):
    base = next(e for e in entries if e["recipe"] == "baseline")["val_loss_final"]
    shown = [dict(e, vs_base=e["val_loss_final"] / base - 1, exits=" ".join(f"{v:.2f}" for v in e["val_loss_exits"]))
             for e in entries]
    extra = (("vs_base", "vs base", "{:+.2%}"), ("exits", "val loss per exit", "{}"))
    print_table(f"Which training recipe? Every recipe at the same budget ({config.max_iters} steps, seed "
                f"{config.seed})", shown, RECIPE_COLUMNS[:2] + extra + RECIPE_COLUMNS[2:],
                [f"val loss: full depth's on {config.eval_iters} val batches, and beside it each exit's; vs base: over "
                 f"the plain GPT's. thr, saved, test loss: the calibrated {config.confidence_measure} threshold "
                 f"(epsilon {config.epsilon:g}, delta {config.delta:g}, chosen on val), the share of layer runs it "
                 f"saves and its loss on {config.sweep_positions:,} test positions (full: full depth's there). accept, "
                 f"greedy, sampled: self-speculative decoding on the val workload at draft_exit={config.draft_exit}, "
                 f"num_draft={config.num_draft}, draft_stop={config.draft_stop:g}: the greedy drafts kept, the "
                 "speed-up over full depth in each mode."])

# -----------------------------------------------------------------------------
# Reports, 2: out_dir/report.html, one self-contained page (inline CSS and SVG, no script, light and dark)

VIRIDIS = ("#440154", "#3b528b", "#21918c", "#5ec962", "#fde725")  # shallow to deep; told apart without hue

def layer_colour(layer, n_layer):
    """Viridis at layer / (n_layer - 1), linearly between its stops: a sequential, colour-blind-safe scale."""
    t = layer / max(1, n_layer - 1) * (len(VIRIDIS) - 1)
    i = min(int(t), len(VIRIDIS) - 2)
    a, b = (tuple(int(c[j : j + 2], 16) for j in (1, 3, 5)) for c in VIRIDIS[i : i + 2])
    return "#" + "".join(f"{round(x + (t - i) * (y - x)):02x}" for x, y in zip(a, b))

def ink(colour):
    """Black or white text, whichever reads on this background."""
    r, g, b = (int(colour[j : j + 2], 16) for j in (1, 3, 5))
    return "#000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#fff"

def esc(text):
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")

def datum(key, value):
    """The attributes that tie a number on the page to its place in report.json (checked by a test)."""
    return f'data-key="{esc(key)}" data-value="{value!r}"'

def swatch(colour):
    return f'style="background:{colour};color:{ink(colour)}"'

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
  stroke-width: 2; } svg .mark { stroke: var(--fg); stroke-dasharray: 4 3; } a { color: var(--a); }
.acc { background: var(--a); color: var(--bg); } .fix { background: var(--b); color: #000; }
#summary { border: 1px solid var(--grid); border-radius: 6px; padding: 0 1em; }
"""

def nice_ticks(top, n=5):
    """Round ticks from 0 up to top or just past it: steps of 1, 2 or 5 times a power of ten, about n of them."""
    power = 10 ** math.floor(math.log10(max(top, 1e-9) / n))
    step = next(m * power for m in (1, 2, 5, 10) if m * power * n >= top)
    return [i * step for i in range(math.ceil(top / step - 1e-9) + 1)]

def svg_frame(width, height, y_ticks, y_fmt, y_title, Y):
    """The opening of a chart that fills the page width: horizontal grid lines with round ticks, the y axis title."""
    return [f'<svg viewBox="0 0 {width} {height + 72}" width="100%" role="img">',
            f'<text transform="translate(14 {height / 2}) rotate(-90)" text-anchor="middle">{esc(y_title)}</text>'] + [
        f'<line class="grid" x1="64" x2="{width - 10}" y1="{Y(t):.1f}" y2="{Y(t):.1f}"/><text x="58" y="{Y(t) + 4:.1f}"'
        f' text-anchor="end">{y_fmt.format(t)}</text>' for t in y_ticks]

def svg_legend(y, entries):
    """A legend in one line along the chart's foot, at height y: (class, label) pairs."""
    parts, x = [], 70
    for cls, label in entries:
        parts.append(f'<rect class="{cls}" x="{x}" y="{y - 10}" width="12" height="12"/><text x="{x + 18}" y="{y}">'
                     f'{esc(label)}</text>')
        x += 40 + 7 * len(label)  # about 7 px a character at 12 px
    return "".join(parts)

def svg_bars(values, labels, keys, fmt, y_title, y_fmt, classes=None, colours=None, group=1, legend=(), ref=None,
             width=1100, height=230):
    """Vertical bars with a value on each (None: no bar), labelled per group of `group` bars, each carrying its report
    key; ref: (value, label) drawn as a dashed line at the right (the 1.0x of full depth)."""
    ticks = nice_ticks(max([v for v in values if v is not None] + [ref[0] if ref else 0]))
    Y, w = (lambda y: height - (height - 24) * y / ticks[-1]), (width - 180) / len(values)  # noqa: E731
    parts = svg_frame(width, height, ticks, y_fmt, y_title, Y)
    for i, (v, label, key) in enumerate(zip(values, labels, keys)):
        x, fill = 70 + i * w, f' style="fill:{colours[i]}"' if colours else ""
        if v is not None:
            parts.append(f'<rect class="{(classes or "a" * len(values))[i]}"{fill} x="{x + 3:.1f}" y="{Y(v):.1f}" '
                         f'width="{w - 6:.1f}" height="{height - Y(v):.1f}" {datum(key, v)}><title>{esc(label)}: '
                         f'{fmt.format(v)}</title></rect><text x="{x + w / 2:.1f}" y="{Y(v) - 4:.1f}" '
                         f'text-anchor="middle">{fmt.format(v)}</text>')
        if i % group == 0:
            parts.append(f'<text x="{x + group * w / 2:.1f}" y="{height + 16}" text-anchor="middle">{esc(label)}'
                         '</text>')
    if ref:
        parts.append(f'<line class="mark" x1="64" x2="{width - 104}" y1="{Y(ref[0]):.1f}" y2="{Y(ref[0]):.1f}"/>'
                     f'<text x="{width - 100}" y="{Y(ref[0]) + 4:.1f}">{esc(ref[1])}</text>')
    return "".join(parts) + svg_legend(height + 62, legend) + "</svg>"

def svg_lines(series, x_title, y_title, x_ticks, x_name, mark=None, width=1100, height=250):
    """Lines over x in [0, 1], y a fraction shown in percent: series of (name, class, xs, ys, keys); x_name(x) names
    a point in its hover text; mark: (x, report key, label) drawn as a labelled dashed vertical line."""
    ticks = nice_ticks(max(max(ys) for _, _, _, ys, _ in series) or 1.0)
    X = lambda x: 70 + (width - 90) * x  # noqa: E731
    Y = lambda y: height - (height - 24) * y / ticks[-1]  # noqa: E731
    parts = svg_frame(width, height, ticks, "{:.0%}", y_title, Y)
    for name, cls, xs, ys, keys in series:
        path = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in zip(xs, ys))
        parts.append(f'<polyline class="{cls} line" points="{path}"><title>{esc(name)}</title></polyline>')
        parts += [f'<circle class="{cls}" cx="{X(x):.1f}" cy="{Y(y):.1f}" r="2.5" {datum(k, y)}><title>{esc(name)}, '
                  f'{esc(x_name(x))}: {y:.2%}</title></circle>' for x, y, k in zip(xs, ys, keys) if k]
    if mark is not None:
        parts.append(f'<line class="mark" x1="{X(mark[0]):.1f}" x2="{X(mark[0]):.1f}" y1="0" y2="{height}" '
                     f'{datum(mark[1], mark[0])}/><text x="{X(mark[0]) + 4:.1f}" y="{height - 6}">{esc(mark[2])}'
                     '</text>')
    parts += [f'<text x="{X(x):.1f}" y="{height + 16}" text-anchor="middle">{esc(t)}</text>' for x, t in x_ticks]
    parts.append(f'<text x="{X(0.5)}" y="{height + 38}" text-anchor="middle">{esc(x_title)}</text>')
    return "".join(parts) + svg_legend(height + 62, [(cls, name) for name, cls, *_ in series]) + "</svg>"

def html_table(entries, columns, key_prefix):
    """A table whose number cells carry their report keys (key_prefix.i.column key); columns: (key, header, format)."""
    def cell(i, key, fmt, v):
        attr = datum(f"{key_prefix}.{i}.{key}", v) if isinstance(v, (int, float)) and not isinstance(v, bool) else ""
        return f"<td {attr}>{esc(fmt.format(v)) if v is not None else '-'}</td>"
    body = "".join("<tr>" + "".join(cell(i, k, fmt, e.get(k)) for k, _, fmt in columns) + "</tr>"
                   for i, e in enumerate(entries))
    return "<table><tr>" + "".join(f"<th>{esc(h)}</th>" for _, h, _ in columns) + f"</tr>{body}</table>"

def section(anchor, question, *body):
    """One section of the page under its question; the summary links to it by its anchor."""
    return f"<section id='{anchor}'><h2>{esc(question)}</h2>{''.join(body)}</section>"

def headlines(report):
    """The summary's figures, each with its report key and its conditions: (text before, key, value, format, after)."""
    out, cals = [], report.get("calibration_by_measure", [])
    for i, c in enumerate(cals[:1]):
        out.append((f"Early exit calibrated on val ({c['measure']} > {c['threshold']:g}) skips ",
                    f"calibration_by_measure.{i}.test.compute_saved", c["test"]["compute_saved"], "{:.1%}",
                    f" of the layer runs on test at most {c['epsilon']:.0%} disagreement with full depth, with "
                    f"probability {1 - c['delta']:.0%}."))
    rows = report.get("strategies", [])
    for j, e in enumerate(rows):
        if e["name"] == "self_speculative":
            out.append((f"Self-speculative decoding, exact ({e['mode']}): ", f"strategies.{j}.speedup", e["speedup"],
                        "{:.2f}x", " full depth's speed on the test workload at batch 1."))
    approx = [(j, e) for j, e in enumerate(rows) if e["mode"] == "sampled" and e["name"] in ("state_copy", "holes")]
    if approx:
        j, e = max(approx, key=lambda je: je[1]["speedup"])
        out.append((f"The fastest approximate per-token strategy, sampled ({e['name']}): ", f"strategies.{j}.speedup",
                    e["speedup"], "{:.2f}x", f", agreeing with full depth on {e['agreement']:.1%} of test positions."))
    return out

def html_summary(report, sections):
    """What was trained on what, the headline figures with their conditions, and links to every section."""
    cfg, L = report.get("config", {}), report.get("config", {}).get("n_layer", 0)
    model = (f"a {L}-layer GPT ({cfg.get('n_head')} heads, {cfg.get('n_embd')} wide, context {cfg.get('block_size')} "
             f"characters) with an exit head after every layer but the last, trained on {cfg.get('input_path')}")
    val = report.get("val_loss", {}).get("final")
    loss = f"; full-depth val loss <span {datum('val_loss.final', val)}>{val:.4f}</span>" if val is not None else ""
    figures = "".join(f"<li>{esc(a)}<b {datum(k, v)}>{fmt.format(v)}</b>{esc(b)}</li>" for a, k, v, fmt, b in
                      headlines(report))
    links = " · ".join(f"<a href='#{a}'>{q}</a>" for a, q in sections)  # q: escaped already
    return (f"<div id='summary'><p>{esc(model)}{loss}.</p><ul>{figures}</ul><p class='muted'>Speeds are medians of "
            "interleaved runs on the machine that wrote this page and move with its load; every number here is in "
            f"report.json.</p><p>{links}</p></div>")

def sample_spans(text, paint):
    """A sample as spans; paint(i) gives (attributes, title) of character i. A newline shows as a mark, then breaks."""
    return "".join(f'<span {attrs} title="{esc(title)}">{"&#8629;" if ch == chr(10) else esc(ch)}</span>'
                   + ("\n" if ch == "\n" else "") for ch, (attrs, title) in zip(text, map(paint, range(len(text)))))

def html_generation(g, L):
    """The early-exit sample coloured by exit layer beside the full-depth one, and where its tokens left."""
    legend = "".join(f'<span {swatch(layer_colour(l, L))}>layer {l}</span>' for l in range(L))
    spans = sample_spans(g["sample"], lambda i: (f'{swatch(layer_colour(g["exited_at"][i], L))} data-layer='
                                                 f'"{g["exited_at"][i]}"', f"layer {g['exited_at'][i]}, confidence "
                                                 f"{g['confidences'][i]:.2f}"))
    full = (f"<div><h3>full depth</h3><pre class='sample'>\n{esc(g['full_depth_sample'])}</pre></div>"
            if g.get("full_depth_sample") is not None else "")
    return [section("sample", "What does early exit look like?", f"<p class='legend'>{legend}</p><p class='muted'>"
            f"Each character of the early-exit sample sits on the colour of the layer it left the network at, dark "
            f"(layer 0) to light (layer {L - 1}, full depth); &#8629; is a newline. {esc(g['kv_strategy'])}, "
            f"threshold {g['exit_threshold']:g}; hover a character for its layer and the head's confidence.</p>"
            f"<div class='row'><div><h3>early exit</h3><pre class='sample'>\n{spans}</pre></div>{full}</div>"),
            section("exits", "Where do the tokens leave?", svg_bars(
                g["exit_counts"], [f"layer {l}" for l in range(L)], [f"generation.exit_counts.{l}" for l in range(L)],
                "{:d}", "tokens of the sample", "{:g}", colours=[layer_colour(l, L) for l in range(L)]))]

def html_speculation(s):
    """The self-speculative sample: which characters were drafts the full model accepted, which its corrections."""
    kept = s["drafted"]
    spans = sample_spans(s["sample"], lambda i: (f'class="{"acc" if kept[i] else "fix"}" data-drafted="{int(kept[i])}"',
                                                 "a draft the full model accepted" if kept[i]
                                                 else "the full model's token: a draft was rejected"))
    return section("speculation", "What does the verifier do?", "<p class='legend'><span class='acc'>accepted draft"
                   "</span><span class='fix'>the full model's token</span></p><p class='muted'>The same prompt and "
                   f"seed, drafted by layer{'s 0..' if s['draft_exit'] else ' '}{s['draft_exit']} (up to "
                   f"{s['num_draft']} a round) and verified by the rest in one pass a round: "
                   f"<b {datum('speculation.acceptance_rate', s['acceptance_rate'])}>"
                   f"{s['acceptance_rate']:.0%}</b> of the drafts were accepted, in <span "
                   f"{datum('speculation.rounds', s['rounds'])}>{s['rounds']}</span> verify passes for "
                   f"{len(s['sample'])} characters. Where a draft is rejected, the full model's own token replaces it "
                   f"and the round ends.</p><pre class='sample'>\n{spans}</pre>")

def html_sweep(report, i, s):
    """One confidence measure's sweep on val, with its calibrated threshold marked."""
    cals = report.get("calibration_by_measure", [])
    c = next((c for c, cal in enumerate(cals) if cal["measure"] == s["measure"]), None)
    xs = [e["threshold"] for e in s["entries"]]
    series = [(label, cls, xs, [e[key] for e in s["entries"]],
               [f"sweep_by_measure.{i}.entries.{j}.{key}" for j in range(len(xs))])
              for label, cls, key in (("compute saved (share of layer runs)", "a", "compute_saved"),
                                      ("disagreement with full depth (share of positions)", "b", "disagreement"))]
    mark = None if c is None else (cals[c]["threshold"], f"calibration_by_measure.{c}.threshold",
                                   f"calibrated: {cals[c]['threshold']:g}")
    ticks = [(t / 10, f"{t / 10:.1f}") for t in range(11)]
    return section(f"threshold-{s['measure']}", f"Which threshold? ({s['measure']}, val)", svg_lines(
        series, f"exit threshold ({s['measure']} confidence)", "percent", ticks, lambda x: f"threshold {x:.2f}", mark))

def html_calibration(report):
    """Learn then Test per confidence measure: the threshold certified on val, its figures on test."""
    cals = report["calibration_by_measure"]
    rows = [{"measure": c["measure"], "threshold": c["threshold"], **{f"test.{k}": v for k, v in c["test"].items()}}
            for c in cals]
    cols = (("measure", "measure", "{}"), ("threshold", "threshold", "{:.2f}"),
            ("test.compute_saved", "test: layer runs saved", "{:.1%}"), ("test.disagreement", "disagreement", "{:.2%}"),
            ("test.loss", "test loss", "{:.4f}"), ("test.full_loss", "full depth's", "{:.4f}"))
    return section("calibration", "Which threshold, with a guarantee?", f"<p class='muted'>Learn then Test on val: "
                   f"disagreement with full depth at most {cals[0]['epsilon']:.0%} with probability at least "
                   f"{1 - cals[0]['delta']:.0%}, reported on {report.get('config', {}).get('sweep_positions', 0):,} "
                   "test positions, teacher-forced, with an exact cache.</p>", html_table(rows, cols,
                                                                                       "calibration_by_measure"))

def html_slices(sl):
    return section("easy", "What does 'easy' mean for this model?", "<div class='row'><div>", html_table(
        sl["per_layer"], (("layer", "layer", "{}"), ("tokens", "test tokens leaving here", "{}"), ("accuracy",
                          "accuracy", "{:.3f}")), "slices.per_layer"), f"</div><div><p>The characters that most often "
        f"leave at layer {sl['first_exit_layer']}:</p>", html_table(
        [dict(c, char=repr(c["char"]), example_context=repr(c["example_context"])) for c in sl["earliest_chars"]],
        (("char", "character", "{}"), ("exits", "times", "{}"), ("example_context", "typically after", "{}")),
        "slices.earliest_chars"), "</div></div>")

def html_speedups(entries, prefix, label, second):
    """Per mode: measured speed-up per decoder beside a second figure (key, legend), against a 1.0x line."""
    out = []
    for mode in MODES:
        idx = [j for j, e in enumerate(entries) if e["mode"] == mode]
        values = [entries[j].get(k) for j in idx for k in ("speedup", second[0])]
        keys = [f"{prefix}.{j}.{k}" for j in idx for k in ("speedup", second[0])]
        out.append(f"<h3>{mode}</h3>" + svg_bars(values, [label(entries[j]) for j in idx for _ in "ab"], keys,
                                                 "{:.2f}x", "speed-up over full depth", "{:.1f}x",
                                                 classes="ab" * len(idx), group=2,
                                                 legend=(("a", "measured"), ("b", second[1])),
                                                 ref=(1.0, "1.0x: full depth")))
    return out

def html_heatmap(grid):
    """The self-speculative sweep per mode: a cell per (draft_exit, num_draft) line and draft_stop column."""
    out, top = [], max(g["speedup"] for g in grid)
    for mode in MODES:
        lines, stops, cell = spec_grid(grid, mode)
        out.append(f"<h3>{mode}: speed-up over full depth</h3><table><tr><th>E, k</th>"
                   + "".join(f"<th>stop {s:g}</th>" for s in stops) + "</tr>" + "".join(
                       f"<tr><th>{E}, {k}</th>" + "".join(
                           f'<td {swatch(layer_colour(g["speedup"] / top, 2))} '
                           f'{datum(f"spec_sweep.{i}.speedup", g["speedup"])}>{g["speedup"]:.2f}x</td>'
                           for i, g in (cell(E, k, s) for s in stops)) + "</tr>" for E, k in lines) + "</table>")
    return "".join(out)

def html_lens(lens, L):
    """Agreement with the final prediction per layer, through the exit head and through the final head."""
    x = lambda l: l / max(1, L - 2)  # noqa: E731  (layers 0..L-2 across the chart)
    series = [(label, cls, [x(e["layer"]) for e in lens if e["readout"] == name],
               [e["agreement"] for e in lens if e["readout"] == name],
               [f"logit_lens.{j}.agreement" for j, e in enumerate(lens) if e["readout"] == name])
              for name, label, cls in (("exit head", "its own exit head", "a"),
                                       ("ln_f + lm_head", "the final head (ln_f + lm_head), untrained there", "b"))]
    return section("lens", "Does an exit need a trained head?", "<p class='muted'>How often each layer's top-1 "
                   "equals the final prediction on val windows.</p>", svg_lines(
                       series, "layer", "agreement with the final top-1", [(x(l), str(l)) for l in range(L - 1)],
                       lambda v: f"layer {round(v * max(1, L - 2))}"))

def write_html_report(report, path):
    """out_dir/report.html: the same numbers as report.json, as pictures, every section under its question."""
    L, body = report.get("config", {}).get("n_layer", 0), []
    if report.get("generation"):
        body += html_generation(report["generation"], L)
    if report.get("speculation"):
        body.append(html_speculation(report["speculation"]))
    body += [html_sweep(report, i, s) for i, s in enumerate(report.get("sweep_by_measure", []))]
    if report.get("calibration_by_measure"):
        body.append(html_calibration(report))
    if report.get("slices"):
        body.append(html_slices(report["slices"]))
    if report.get("strategies"):
        body.append(section("strategies", "What does each KV strategy buy?", "<p class='muted'>Test workload, batch 1; "
                            "the ideal is what the layers skipped would give if a layer were all a step cost.</p>",
                            *html_speedups(report["strategies"], "strategies", lambda e: e["name"],
                                           ("ideal_speedup", "ideal: L / layers run")),
                            html_table(report["strategies"], STRATEGY_COLUMNS, "strategies")))
    if report.get("batched"):
        b = report["batched"]
        short = {"self_speculative": "spec", "state_copy": "copy", "skipdecode": "skip", "auto_approx": "auto~"}
        body.append(section("batches", "Does early exit still save in a batch?", "<p class='muted'>" + ", ".join(
            f"{v}: {k}" for k, v in short.items()) + " (auto_approx: auto that may choose SkipDecode, approximate then)"
            "</p>", *html_speedups(
            b["entries"], "batched.entries", lambda e: f"B{e['batch_size']} {short.get(e['name'], e['name'])}",
            ("predicted_speedup", "predicted by the cost model")), html_table(
            b["entries"], BATCH_COLUMNS, "batched.entries"),
            *(f"<p>{esc(n)}</p>" for n in batch_notes(b, report["config"]))))
    if report.get("spec_sweep"):
        body.append(section("spec-sweep", "Which draft_exit, num_draft and draft_stop?",
                            html_heatmap(report["spec_sweep"])))
    if report.get("logit_lens"):
        body.append(html_lens(report["logit_lens"], L))
    if report.get("recipes"):
        body.append(section("recipes", "Which training recipe?",
                            html_table(report["recipes"], RECIPE_COLUMNS, "recipes")))
    found = re.findall(r"<section id='([^']+)'><h2>([^<]+)</h2>", "".join(body))
    write_text(f'<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="color-scheme" '
               f'content="light dark"><title>nanogpt_exit_head report</title><style>{HTML_STYLE}</style></head><body>'
               f"<h1>Early exit in a character-level GPT</h1>{html_summary(report, found)}{''.join(body)}"
               "</body></html>", path)

# -----------------------------------------------------------------------------
# Checkpoints: written to a temporary file, then renamed; resume, Ctrl-C, torchrun

ARCH_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "exit_head")  # forced on resume
PROGRESS = ("vocab", "iter_num", "train_seconds", "train_log")  # a run's plain data
CHECKPOINT_KEYS = {"model", "optimizer", "config", "rng", *PROGRESS}

def atomic_save(obj, path, writer=torch.save):
    writer(obj, path + ".tmp")
    os.replace(path + ".tmp", path)  # atomic: a crash leaves the old file or the new, never half

def write_text(text, path):
    atomic_save(text, path, lambda t, p: Path(p).write_text(t, encoding="utf-8"))

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
    vocabulary, iter_num (steps done), train_seconds and train_log."""
    rng = random_states(next(model.parameters()).device)
    atomic_save({**progress, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "config": asdict(config), "rng": rng}, path)

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
    """What takes the training steps (None: the model itself): DistributedDataParallel across
    processes (each its own batch, gradients averaged in backward), compiled with --compile."""
    step_model = None
    if world > 1:
        unused = config.alpha == 0 and config.distill_weight == 0  # no gradient for the exits
        step_model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=unused)
    if config.compile:
        step_model = torch.compile(step_model or model)
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
    if config.init_from == "scratch":
        model = RecipeGPT(config).to(device)
        progress = {"vocab": tokenizer.chars, "iter_num": 0, "train_seconds": 0.0, "train_log": []}
        return model, configure_optimizer(model, config), progress
    ckpt = load_checkpoint(os.path.join(config.out_dir, "ckpt.pt"), config, overridden, tokenizer)
    model = RecipeGPT(config)
    try:  # strict: every name and shape must match
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        message = " ".join(str(e).split())[:300]
        raise ValueError(f"checkpoint does not fit the model: {message}") from None
    model.to(device)
    optimizer = configure_optimizer(model, config)
    optimizer.load_state_dict(ckpt["optimizer"])  # a ValueError where its groups do not fit
    set_random_states(ckpt["rng"], device)
    return model, optimizer, {key: ckpt[key] for key in PROGRESS}

def print_setup(model, config, tokenizer, splits, device, world):
    base, heads = count_params(model)
    sizes = "/".join(f"{len(splits[s]):,}" for s in ("train", "val", "test"))
    print(f"device: {device} | vocabulary: {tokenizer.vocab_size} characters | train/val/test: "
          f"{sizes} characters | processes: {world}")
    print(f"parameters: {base / 1e6:.3f} M base model, {heads / 1e6:.3f} M in {config.n_layer - 1} "
          f"exit heads ({config.exit_head}; {100 * heads / base:.2f}% overhead)")
    print(f"losses while training: each split's mean over {config.eval_iters} batches of "
          f"{config.batch_size} x {config.block_size} characters; 'val loss' is full depth's")

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
    progress.update(train_seconds=seconds + took, train_log=log + new_log)
    return took, ms

def train_or_resume(config, tokenizer, splits, device, overridden=(), rank=0, world=1, report=None):
    """A new model or the checkpoint's, trained up to
    max_iters with a checkpoint at every evaluation and on Ctrl-C; None on the ranks of a torchrun
    job above 0. The training figures go into report."""
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
    progress["iter_num"] = max(done, config.max_iters)
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
    report.update({"config": asdict(config), "n_params": base, "n_params_exit_heads": heads,
                   "train_seconds": progress["train_seconds"], "ms_per_iter": ms_per_iter,
                   "val_loss": {"final": losses["val"][-1], "exits": losses["val"][:-1]},
                   "train_loss": losses["train"][-1], "train_log": progress["train_log"],
                   "processes": world})
    return model.eval()

def load_trained(config, tokenizer, device, overridden=()):
    """The lab's build_model for --sample_only: the checkpoint's model, no training."""
    return new_or_resumed(config, tokenizer, device, overridden)[0].eval()

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
    "[-1, 1]": ("exit_threshold", "strategies_threshold"),  # -1 chooses on val; not in (-1, 0)
}
CHOICES = {"init_from": ("scratch", "resume"),
           "exit_weights": ("constant", "linear", "geometric", "layerskip"),
           "exit_head": ("separate", "shared", "final"),
           "kv_strategy": (*KV_STRATEGIES, "self_speculative"),
           "confidence_measure": tuple(CONFIDENCE_MEASURES)}

def boolean(text):
    """An argparse type: true/false or 1/0."""
    if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError(text)
    return text.lower() in ("true", "1")

def in_range(value, rule):
    """Whether value lies in an interval of RANGES, e.g. '[0, 1)'."""
    low, high = (float(end) for end in rule[1:-1].split(","))
    ends = (value == low and rule[0] == "[") or (value == high and rule[-1] == "]")
    return low < value < high or ends

class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a bad argument raised as a ValueError: main prints one line, exits with 2."""
    def error(self, message):
        raise ValueError(message)

def build_parser():
    """One --name for every field of LabConfig but vocab_size; its help is the field's comment."""
    source = inspect.getsource(Config) + inspect.getsource(LabConfig)
    comments = dict(re.findall(r"^ +(\w+): .*?  # (.*)$", source.replace("%", "%%"), re.M))
    rules = {name: f" in {rule}" for rule, names in RANGES.items() for name in names}
    rules.update({name: f" one of {', '.join(choices)}" for name, choices in CHOICES.items()})
    parser = ArgumentParser(prog="nanogpt_exit_head.py", usage="%(prog)s [--name=value ...]",
                            allow_abbrev=False, epilog="several processes: torchrun "
                            "--standalone --nproc_per_node=N nanogpt_exit_head.py [...]")
    for f in fields(LabConfig):
        if f.name != "vocab_size":
            help = f"{comments.get(f.name, '')} (default {f.default!r}){rules.get(f.name, '')}"
            kind = boolean if f.type is bool else f.type
            parser.add_argument(f"--{f.name}", type=kind, default=f.default,
                                choices=CHOICES.get(f.name), metavar="", help=help)
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
    return config, {a[2:].split("=")[0] for a in argv if a.startswith("--")}

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
            (-1 < config.strategies_threshold < 0, "strategies_threshold: -1 (choose on val) or in "
                                                   "[0, 1]"),
            (config.draft_exit >= config.n_layer - 1,
             f"draft_exit={config.draft_exit} must be a layer below the last: "
             f"0..{config.n_layer - 2}"),
            (not config.prompt, "--prompt must hold at least one character")):
        if bad:
            raise ValueError(message)
    parse_exit_layers(config.exit_layers, config.n_layer)
    check_text(config)
    try:  # say now, not after training, that out_dir cannot be a folder of ours
        os.makedirs(config.out_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out_dir={config.out_dir!r} cannot be a folder: {e.strerror}") from None

def check_text(config):
    """The input file is UTF-8 text long enough for every split, holding the prompt's characters."""
    try:
        text = Path(config.input_path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:  # no such file, or not UTF-8 (iconv -t UTF-8 it)
        raise ValueError(f"--input_path={config.input_path!r}: {e}") from None
    need = max(config.block_size, config.bench_prompt_len) + 2
    if min(len(split) for split in split_data(text).values()) < need:
        raise ValueError(f"--input_path={config.input_path!r} ({len(text):,} characters) is too "
                         f"short: each split needs {need} for block_size and bench_prompt_len")
    unknown = "".join(sorted(set(config.prompt) - set(text)))
    if unknown:
        raise ValueError(f"--prompt has characters not in the vocabulary of "
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
    """Sweep on val, calibrate per measure, report on test; the logit lens and the exit slices."""
    val, test = (record_exits(model, splits[s].to(device), config.sweep_positions)
                 for s in ("val", "test"))
    checked = parse_exit_layers(config.exit_layers, config.n_layer)
    measure = config.confidence_measure
    sweeps = {m: sweep(val, m, checked) for m in CONFIDENCE_MEASURES}
    cals = {m: calibration_report(val, test, m, checked, config.epsilon, config.delta)
            for m in CONFIDENCE_MEASURES}
    T = config.block_size
    # (<= 64, T): back-to-back windows of val, each character followed by one more
    windows = splits["val"][:-1].unfold(0, T, T)[:64].to(device)
    lens = logit_lens(model, windows)
    exits = exits_at_threshold(test, measure, cals[measure]["threshold"], checked)
    return {"sweep": sweeps[measure],
            "sweep_by_measure": [{"measure": m, "entries": e} for m, e in sweeps.items()],
            "calibration": cals[measure], "calibration_by_measure": list(cals.values()),
            "logit_lens": lens, "slices": exit_slices(test, exits, tokenizer, splits["test"])}

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

def generation_report(model, tokenizer, idx, samples, threshold, config):
    """The early-exit sample's exit map (printed) and the report.json entry of both samples."""
    (full, full_speed), (early, speed) = samples.values()
    T0 = idx.size(1)
    exited_at = early.exited_at[0]  # (max_new_tokens,)
    layers = exited_at.tolist()
    text = tokenizer.decode(early.tokens[0, T0:].tolist())
    print("\n" + colour_text(text, layers, config.n_layer, sys.stdout.isatty()))
    # the confidence of the head each character left from, every exit recorded at once in the
    # decoder's windows with an exact cache (what backfill and deferred read; state copy and
    # holes, whose caches differ, read a little differently)
    records = record_exits(model, early.tokens[0], early.tokens.size(1) - 1)
    confidences = records.confidences[config.confidence_measure][:, T0 - 1 :]  # (L, max_new_tokens)
    return {"exit_threshold": threshold, "kv_strategy": config.kv_strategy,
            "exit_counts": torch.bincount(exited_at, minlength=config.n_layer).tolist(),
            "mean_layers": sum(l + 1 for l in layers) / len(layers),
            "layers_run_per_token": early.layers_run / config.max_new_tokens,
            "tokens_per_second": speed, "full_depth_tokens_per_second": full_speed,
            "sample": text, "exited_at": layers,
            "full_depth_sample": tokenizer.decode(full.tokens[0, T0:].tolist()),
            "confidences": confidences.gather(0, exited_at[None])[0].tolist()}

def speculation_map(model, tokenizer, idx, samples, config):
    """The self-speculative sample from the same prompt and seed (the early-exit one, if it was
    drawn so): which characters were drafts the full model accepted, and which its own tokens
    where it rejected one."""
    spec = samples["early-exit"][0]
    if not isinstance(spec, SpeculativeGeneration):
        gen = torch.Generator(device=idx.device).manual_seed(config.seed)
        spec = generate_self_speculative(model, idx, config.max_new_tokens, config.draft_exit,
                                         config.num_draft, config.temperature, config.top_k, gen)
    drafted = (spec.exited_at[0] < config.n_layer - 1).tolist()
    s = spec.stats
    rate = s["accepted"] / max(1, s["drafted"])
    note = (f"the verifier at work (report.html draws it): a self-speculative sample from the "
            f"same prompt and seed kept {rate:.0%} of its drafts; {sum(drafted)} of {len(drafted)} "
            f"characters are accepted drafts, the rest the full model's own, in {s['rounds']} "
            f"verify passes")
    print("\n" + textwrap.fill(note, WIDTH))
    return {"sample": tokenizer.decode(spec.tokens[0, idx.size(1) :].tolist()), "drafted": drafted,
            "acceptance_rate": rate, "rounds": s["rounds"], "draft_exit": config.draft_exit,
            "num_draft": config.num_draft}

def measure_strategies(model, splits, config, device):
    """The strategies table on the workload, costs and plans, batch depth, and (--spec_sweep) the
    self-speculative grid and (--bench_batch) the batch table."""
    entries, quality, plans, costs, val_records = compare_strategies(model, splits, config, device)
    depths = expected_batch_depth(quality["backfill"]["exited_at"], BATCH_SIZES, config.n_layer)
    print_strategies(entries, quality, config, costs, depths)
    # batch_depth's keys, batch sizes, become strings in the JSON
    report = {"strategies": entries, "exit_plans": plans, "decode_costs": costs,
              "exit_check_cost": costs["check"] / costs["block"], "batch_depth": depths,
              "workload": {"split": "test", "prompts": config.bench_prompts,
                           "prompt_len": config.bench_prompt_len, "tokens": config.bench_tokens,
                           "repeats": config.bench_repeats, "chosen_on": "val"}}
    if config.bench_batch:
        report["batched"] = measure_batches(model, splits, config, device, plans, val_records,
                                            costs)
        print_batches(report["batched"], config)
    if config.spec_sweep:
        val_prompts = workload(splits["val"], config.bench_prompts, config.bench_prompt_len)
        report["spec_sweep"] = sweep_speculative(model, val_prompts.to(device), config)
        print_spec_sweep(report["spec_sweep"])
    return report

def run_recipe_comparison(config, device):
    """--compare_recipes=1: every recipe trained and judged alike; a table, and recipes.json in
    out_dir (which validate made)."""
    _, splits = load_data(config)
    # choosing is done on val
    prompts = workload(splits["val"], config.bench_prompts, config.bench_prompt_len).to(device)
    entries = compare_recipes(config, splits, device, prompts)
    print_recipes(entries, config)
    path = os.path.join(config.out_dir, "recipes.json")
    write_json(entries, path)
    write_html_report({"config": asdict(config), "recipes": entries},
                      os.path.join(config.out_dir, "report.html"))
    print(f"\nrecipes: {path}")

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
    print(f"\nreport: {path}.json and {name}.html beside it")

def run_lab(model, tokenizer, splits, config, device, report):
    """Part I's samples from the lab's model, threshold and decoder, then every analysis of the
    lab."""
    rule = None
    threshold = config.exit_threshold
    if threshold < 0:  # calibrate on val (Learn then Test)
        rule = choose_exit_rule(model, tokenizer, splits, config, device)
        threshold = rule["calibration"]["threshold"]
        print(f"\nthe early-exit sample uses the threshold calibrated on val ({threshold:g})")
    # sample_decoder gives show_samples its (early_exit, label, checked_exits)
    idx, samples = show_samples(model, tokenizer, config, device,
                                *sample_decoder(model, config, threshold))
    report["generation"] = generation_report(model, tokenizer, idx, samples, threshold, config)
    report["speculation"] = speculation_map(model, tokenizer, idx, samples, config)
    if config.sample_only:  # sampling leaves the trained run's report alone: samples.*
        return write_report({"config": asdict(config), **report}, config, "samples")
    if rule is None:  # an explicit threshold: the exit rule is still analysed
        rule = choose_exit_rule(model, tokenizer, splits, config, device)
    print_exit_rule(rule, config)
    report.update(rule)
    report.update(measure_strategies(model, splits, config, device))
    write_report(report, config, "report")

def run(config, overridden):
    """The default job: the lab's model (trained, resumed or loaded), its samples and every
    analysis; --lesson_only runs Part I alone, --compare_recipes the recipe comparison."""
    torch.manual_seed(config.seed)
    if config.lesson_only:
        return run_lesson(lesson_config(config), pick_device(config.device))
    rank, world, process_device = start_processes(config)
    device = process_device or pick_device(config.device)
    if config.compare_recipes:
        return run_recipe_comparison(config, device)
    tokenizer, splits = load_data(config)
    report = {}
    if config.sample_only:
        if config.init_from != "resume":
            raise ValueError("--sample_only=1 samples from a checkpoint: add --init_from=resume")
        model = load_trained(config, tokenizer, device, overridden)
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
