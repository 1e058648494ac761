"""GPT, chapter 04: a GPT-2-style decoder-only language model, small enough to train on a CPU.

The architecture is GPT-2's (Radford et al., 2019), and so are the parameter names, so that a
state dict converts to and from Hugging Face's ``GPT2LMHeadModel`` by transposing a few matrices
(``course_lib.hf``)::

    transformer.wte            token embedding (V, C)
    transformer.wpe            learned position embedding (block_size, C)
    transformer.h[i]           n_layer pre-LN blocks: x + attn(ln_1(x)), then x + mlp(ln_2(x))
    transformer.ln_f           final LayerNorm
    lm_head                    (C -> V), its weight *is* transformer.wte.weight (weight tying)

Shapes: B batch, T time (tokens), C = n_embd, H = n_head, Dh = C / H, V = vocab_size.

``CausalSelfAttention``, ``GPTMLP``, ``GPTBlock``, ``GPT`` and ``gpt_param_count`` are the reference solutions of
chapter 04's exercises; the notebook's solution cells are the same code (``tests/grading/test_solution_drift.py`` checks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import masked_softmax
from .validation import check_positive

#: Targets equal to this value are padding and are left out of the loss (PyTorch's and Hugging Face's default).
#: ``GPT.forward`` writes it out as -100: it is chapter 04's solution verbatim, where the learner writes PyTorch's idiom.
IGNORE_INDEX = -100


@dataclass
class GPTConfig:
    """Sizes of a GPT. ``bias`` switches the biases of every Linear and LayerNorm on or off (GPT-2 has them)."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            check_positive(name, getattr(self, name))
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd must be divisible by n_head, got n_embd={self.n_embd} and n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused projection for queries, keys and values.

    x (B, T, C) -> (B, T, C). Parameters, GPT-2's names: c_attn, a Linear(C, 3C) whose output is [q | k | v]
    side by side, and c_proj, a Linear(C, C), with biases if config.bias; no other persistent buffer, so that
    GPT-2-named checkpoints load. The output at position t depends on the inputs at positions 0..t only
    (itself included). Each of the n_head heads (any n_head that divides C) attends with its own Dh = C / n_head
    channels, its scores scaled by 1/sqrt(Dh). Dropout (config.dropout) acts on the attention weights
    (attn_dropout) and on the output (resid_dropout), in training mode only. The tests compare with
    F.scaled_dot_product_attention(is_causal=True) in float64.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        """x (B, T, C) -> (B, T, C)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        # split the channels into heads: (B, T, C) -> (B, H, T, Dh)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # (T, T): True on and below the diagonal
        weights = masked_softmax(q @ k.transpose(-2, -1) / math.sqrt(C // self.n_head), causal)  # (B, H, T, T)
        y = self.attn_dropout(weights) @ v  # (B, H, T, Dh)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # merge the heads again
        return self.resid_dropout(self.c_proj(y))


class GPTMLP(nn.Module):
    """The position-wise MLP of a GPT block: x (..., C) -> (..., C), hidden width 4C, GPT-2's GELU (the tanh approximation).

    Parameters, GPT-2's names: c_fc, a Linear(C, 4C), and c_proj, a Linear(4C, C), with biases if config.bias.
    Dropout (config.dropout) acts on the output, in training mode only.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        """x (..., C) -> (..., C)."""
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class GPTBlock(nn.Module):
    """A pre-LN GPT block: x (B, T, C) -> (B, T, C).

    Parameters, GPT-2's names: ln_1 and ln_2, each a LayerNorm(C) (with a bias if config.bias); attn, a
    CausalSelfAttention(config); mlp, a GPTMLP(config). Nothing else persistent.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = GPTMLP(config)

    def forward(self, x):
        """x (B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln_1(x))  # each branch reads the normed stream and adds to the stream itself
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style language model: forward(idx, targets=None) -> (logits, loss).

    idx (B, T) int64 token ids, 1 <= T <= config.block_size; targets (B, T) int64 or None, where targets[b, t]
    is the token that follows idx[b, t] (the data pipeline shifts once; nothing shifts in here) and -100
    (IGNORE_INDEX) marks padding. Returns logits (B, T, V) and, with targets, the mean cross-entropy over the
    targets that are not -100 (a scalar), else None. T > block_size raises ValueError naming block_size.

    Contract (what the tests check):
    * model.config is the GPTConfig; the state_dict holds exactly GPT-2's names, nothing else persistent:
      transformer.wte (V, C), transformer.wpe (block_size, C), transformer.h.i.{ln_1, attn.c_attn,
      attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj} for i < n_layer (attn a CausalSelfAttention, mlp a GPTMLP),
      transformer.ln_f, lm_head (no bias). These are the names the converter to Hugging Face (section 9) and
      the shipped checkpoints use.
    * with the same weights (converted), the logits equal Hugging Face's GPT2LMHeadModel's.
    * weight tying: lm_head.weight *is* transformer.wte.weight, one Parameter, whose gradient holds both uses.
    * the GPT-2 paper's initialisation as nanoGPT and Hugging Face implement it: every Linear and Embedding
      weight N(0, 0.02^2), except attn.c_proj and mlp.c_proj weights N(0, (0.02 / sqrt(2 n_layer))^2);
      Linear biases 0; LayerNorms weight 1, bias 0.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embedding (V, C)
            wpe=nn.Embedding(config.block_size, config.n_embd),  # learned positions (block_size, C)
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([GPTBlock(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying: one Parameter, used twice
        # the GPT-2 paper's initialisation, in place: assigning a new nn.Parameter would silently untie the head
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):  # the two projections that write into the residual stream
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx, targets=None):
        """idx (B, T) int64, targets (B, T) int64 or None -> (logits (B, T, V), mean cross-entropy or None)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length must be <= block_size = {self.config.block_size}, got {T}")
        positions = torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:  # the mean over the real targets only: -100 marks padding
            loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), ignore_index=-100)
        return logits, loss


def fused_qkv(attn, x):
    """The queries, keys and values of a GPT attention module (its fused ``c_attn`` and ``n_head``: a
    CausalSelfAttention, or heads.HeadAttention) in one tensor: x (..., C) -> (..., 3, H, Dh), [..., 0, :, :] the
    queries, [..., 1, :, :] the keys and [..., 2, :, :] the values of the H heads (a view of ``c_attn``'s output).
    ``c_attn``'s output is [q | k | v] side by side, each H * Dh wide: C for a whole module, C / p for a rank's share
    of one (chapter 16's ``tensor_parallel.shard_block``, H its heads alone). ``qkv_heads`` splits it; chapter 12's
    paged forward reads it whole (its keys and values go to the pool in one copy)."""
    qkv = attn.c_attn(x)  # (..., 3 * H * Dh)
    head_size = qkv.shape[-1] // (3 * attn.n_head)  # stated, not -1: a view of T = 0 tokens must still know it
    return qkv.view(*qkv.shape[:-1], 3, attn.n_head, head_size)


def qkv_heads(attn, x):
    """The queries, keys and values of a GPT attention module (as ``fused_qkv``'s), split into heads:
    x (B, T, C) -> q, k, v, each (B, H, T, Dh).
    ``CausalSelfAttention.forward`` writes the same split (chapter 04's exercise); every other reader calls this."""
    q, k, v = fused_qkv(attn, x).unbind(2)  # each (B, T, H, Dh)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def gpt_block(block: GPTBlock, x, attend: Callable):
    """One GPTBlock with its attention step passed in, as ``LlamaBlock.forward(x, attend)``: x (..., C) -> (..., C).

    attend(attn, h) -> (..., C) runs the block's attention module ``attn`` on its normed input h (against a cache,
    say); the two residual steps are ``GPTBlock.forward``'s, which the learner writes in chapter 04 without this hook
    (tests/lib/test_gpt.py checks that the two agree)."""
    x = x + attend(block.attn, block.ln_1(x))
    return x + block.mlp(block.ln_2(x))


def gpt_layers(model: GPT, x, attend: Callable | None = None):
    """The block stack of a GPT, the one layer loop of every way of running it but training's (``GPT.forward`` is
    chapter 04's exercise, whose loop the learner writes): embedded tokens x (..., C) -> the final LayerNorm of the
    last block's output (..., C), ready for the LM head.

    attend(layer, attn, h) -> (..., C), if given, is the attention step of block ``layer`` (``gpt_block``): the cached
    forward (chapter 05) and the paged one (chapter 12) read and write their caches there. By default each block
    runs as it is (training, decoding without a cache).
    """
    tr = model.transformer
    for layer, block in enumerate(tr.h):
        x = block(x) if attend is None else gpt_block(block, x, partial(attend, layer))
    return tr.ln_f(x)


def gpt_logits(model: GPT, idx, positions=None, attend: Callable | None = None, at=None):
    """The forward pass of a GPT without the loss, the one every way of running it but ``GPT.forward`` (chapter 04's
    exercise) calls: embed, ``gpt_layers``, LM head. idx (B, T) int64, or (T,) with an attend that takes (T, C) (one
    row without its batch dimension: chapter 12's paged forward, every sequence's tokens end to end); positions (B, T)
    or (T,) int64, the tokens' positions (default 0..T-1); attend as ``gpt_layers``'s. Returns logits (B, T, V), or
    (T, V); with `at`, an index into the T positions, only theirs, the head run over them alone: at=-1 the last
    position's (B, V), at a (R,) int64 tensor those R positions' (B, R, V) (without B for idx (T,)). Dropout acts as
    in GPT.forward (in training mode only).
    """
    tr = model.transformer
    if positions is None:
        positions = torch.arange(idx.shape[-1], device=idx.device)
    x = gpt_layers(model, tr.drop(tr.wte(idx) + tr.wpe(positions)), attend)  # (B, T, C) or (T, C)
    return model.lm_head(x if at is None else x[..., at, :])


def gpt_param_count(config: GPTConfig, tied: bool = True) -> int:
    """The number of parameters of GPT(config), by formula, without building a model: an int.

    Equal to count_parameters(GPT(config)) when tied (a tied head is counted once, with the embedding), and to
    what that model would have with a separate head when not. config.bias = False means no bias in any Linear
    or LayerNorm; the head never has one. The tests compare with the same architecture counted from PyTorch's
    own modules.
    """
    V, block_size, L, C = config.vocab_size, config.block_size, config.n_layer, config.n_embd
    b = 1 if config.bias else 0
    # per layer: ln_1 and ln_2 (C weight + C bias each), c_attn (3C^2 + 3C), attn c_proj (C^2 + C),
    # c_fc (4C^2 + 4C), mlp c_proj (4C^2 + C)
    per_layer = 12 * C * C + 2 * C + b * (2 * C + 3 * C + C + 4 * C + C)
    embeddings = V * C + block_size * C
    final_norm = C + b * C
    head = 0 if tied else V * C  # the head has no bias
    return embeddings + L * per_layer + final_norm + head


def count_parameters(model: nn.Module) -> int:
    """Parameters counted by walking the model; a shared (tied) Parameter is counted once."""
    return sum(p.numel() for p in model.parameters())


def greedy_choice(logits: torch.Tensor) -> torch.Tensor:
    """The most likely next token of each row: logits (B, V) -> (B, 1)."""
    return logits.argmax(dim=-1, keepdim=True)


def sample_choice(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A next token of each row drawn from softmax(logits), the course's one sampler: logits (B, V) -> (B, 1).

    One ``torch.multinomial`` draw per row from `generator` (default: the global one, as Hugging Face's)."""
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


def extend(idx: torch.Tensor, max_new_tokens: int, next_logits: Callable, choose: Callable,
           done: Callable | None = None) -> torch.Tensor:
    """The autoregressive loop, the library's one: idx (B, T) -> (B, T + n), each new token fed back.

    next_logits(tokens, new) returns the logits (B, V) of the next token, given all tokens so far (B, t) and
    the newest of them (B, n): the prompt at the first call, then the token chosen last (a model with a KV
    cache reads only ``new``; one without reads ``tokens``). choose(logits) picks the next tokens (B, 1)
    (``greedy_choice``, ``sample_choice``). done(tokens), if given, is asked after each step: True ends the loop
    early (n < max_new_tokens). next_logits runs at most max_new_tokens times: the last token chosen is never fed.
    The exercises' loops and the oracles that stay written out are listed in the README ("One loop").
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    tokens, new = idx, idx
    for _ in range(max_new_tokens):
        new = choose(next_logits(tokens, new))
        tokens = torch.cat([tokens, new], dim=1)
        if done is not None and done(tokens):
            break
    return tokens


@torch.no_grad()
def gpt_sample(model: GPT, idx, max_new_tokens: int, temperature: float = 1.0, greedy: bool = False, generator=None):
    """Extend idx (B, T) by max_new_tokens tokens, one at a time, each fed back as input.

    greedy=True takes the most likely token; otherwise it samples from softmax(logits / temperature), at the
    temperature of chapter 06's ``apply_temperature`` (which range-checks it; temperature 0 is greedy).
    The context is cropped to the last block_size tokens. Returns (B, T + max_new_tokens).
    There is no KV cache here: every step re-runs the whole context (chapter 05 fixes that).
    """
    from .decoding import apply_temperature, check_settings  # chapter 06's processor (decoding imports this module)

    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    check_settings(model.config.vocab_size, temperature=temperature)  # greedy or not, as generate

    was_training = model.training
    model.eval()
    idx = extend(idx, max_new_tokens, lambda tokens, new: model(tokens[:, -model.config.block_size:])[0][:, -1],
                 greedy_choice if greedy else lambda logits: sample_choice(apply_temperature(logits, temperature),
                                                                            generator))
    model.train(was_training)
    return idx


@torch.no_grad()
def attention_maps(model: GPT, idx) -> torch.Tensor:
    """The causal attention weights of every layer and head for idx (B, T): (n_layer, B, H, T, T).

    Recomputed from each block's input (captured by a forward pre-hook on its attention module),
    exactly as CausalSelfAttention computes them, without dropout.
    """
    inputs = []
    hooks = [block.attn.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
             for block in model.transformer.h]
    try:
        model(idx)
    finally:
        for hook in hooks:
            hook.remove()
    maps = []
    for block, x in zip(model.transformer.h, inputs):
        q, k, _ = qkv_heads(block.attn, x)  # (B, H, T, Dh)
        T = x.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        maps.append(masked_softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), causal))
    return torch.stack(maps)


@torch.no_grad()
def estimate_loss(model: GPT, batches) -> float:
    """Mean loss of the model (in eval mode) over a list of (x, y) batches."""
    was_training = model.training
    model.eval()
    losses = [model(x, y)[1].item() for x, y in batches]
    model.train(was_training)
    return sum(losses) / len(losses)


def text_nats(model, ids, first: int = 1, stride: int | None = None, batch_size: int = 32) -> float:
    """Total negative log-likelihood, in nats, that a GPT gives tokens ids[first:] of one long text.

    ids: 1-D tensor (N,) of token ids; first >= 1 (token 0 has no context). Windows of block_size tokens start
    every stride tokens (default block_size // 2; the last window ends at the text's end); each token is scored
    once, in the first window that holds it past the window's first position, so every token after the first
    window sees at least block_size - stride - 1 tokens of context. Windows run batch_size at a time; the
    log-probabilities are taken in float64 from the model's logits.
    """
    block = model.config.block_size
    stride = block // 2 if stride is None else stride
    n = len(ids)
    if not 1 <= first < n:
        raise ValueError(f"first must be in [1, {n - 1}] (len(ids) - 1), got {first}")
    if not 1 <= stride <= block - 1:
        raise ValueError(f"stride must be in [1, {block - 1}] (block_size - 1), got {stride}")
    width = min(block, n)
    starts = list(range(0, n - width + 1, stride))
    if starts[-1] + width < n:
        starts.append(n - width)
    total, scored = 0.0, first  # tokens before `scored` are done
    with torch.no_grad():
        for i in range(0, len(starts), batch_size):
            group = starts[i:i + batch_size]
            windows = torch.stack([ids[s:s + width] for s in group])  # (B, width)
            logp = torch.log_softmax(model(windows)[0].double(), dim=-1)  # (B, width, V): [b, j] predicts window[b, j + 1]
            for b, start in enumerate(group):
                targets = torch.arange(max(scored, start + 1), max(scored, start + width))  # (empty: all scored)
                total -= logp[b, targets - start - 1, ids[targets]].sum().item()
                scored = max(scored, start + width)
    return total
