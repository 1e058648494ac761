"""What the heads learned (chapter 13): head scores, a hand-built induction circuit, ablation.

Scores of attention heads: two simple conventions and the test of Olsson et al. (2022), "In-context Learning and
Induction Heads":

* previous-token score (``previous_token_score``, chapter 04 reads it too): the mean weight of query t on key t - 1;
* first-token ("sink") score: the mean weight of query t >= 1 on key 0 (the "attention sink" of Xiao et al. 2023);
* induction score, Olsson et al.'s, on the repeated-random-tokens test (a random sequence of `period` tokens, repeated): the
  mean weight of each query t >= period (a token of a later copy) on key t - period + 1, the token that came
  *after* the same token's earlier occurrence.

``AttentionOnly`` is a transformer without MLPs or LayerNorm, whose parts are named as course_lib.gpt's GPT
names them (``transformer.wte``, ``transformer.wpe``, ``transformer.h[i].attn.c_attn``/``c_proj``/``n_head``,
``lm_head``), so that ``gpt.attention_maps`` and ``ablate_head`` work on both. ``build_induction_model`` sets
its weights by hand so that it completes [A][B] ... [A] with [B].
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention import masked_softmax
from .gpt import attention_maps, qkv_heads
from .validation import check_positive

__all__ = ["AttentionOnly", "AttentionOnlyBlock", "HeadAttention", "ablate_head", "build_induction_model",
           "copy_losses", "first_token_score", "induction_figures", "induction_score", "induction_training_batch",
           "previous_token_score", "repeated_random_tokens", "train_induction"]


def repeated_random_tokens(vocab_size: int, period: int, batch: int, generator=None, copies: int = 2) -> torch.Tensor:
    """The repeated-random-tokens test: (batch, copies * period) int64, each row a random sequence repeated.

    Each copy's tokens are distinct when period <= vocab_size (so that every token of a later copy has exactly
    one earlier occurrence per copy), drawn with replacement otherwise.
    """
    if vocab_size < 1 or period < 1 or batch < 1 or copies < 1:
        raise ValueError(f"vocab_size, period, batch and copies must be >= 1, got {vocab_size}, {period}, {batch}, {copies}")
    if period <= vocab_size:
        rows = torch.stack([torch.randperm(vocab_size, generator=generator)[:period] for _ in range(batch)])
    else:
        rows = torch.randint(vocab_size, (batch, period), generator=generator)
    return rows.repeat(1, copies)


def check_maps(maps: torch.Tensor) -> None:
    """ValueError naming maps unless it is every layer's and head's attention weights, (L, B, H, T, T)."""
    if maps.dim() != 5 or maps.shape[-1] != maps.shape[-2]:
        raise ValueError(f"maps must be (L, B, H, T, T), got shape {tuple(maps.shape)}")


def previous_token_score(maps: torch.Tensor) -> torch.Tensor:
    """How much each head attends to the token just before the query: (L, B, H, T, T) -> (L, H).

    The mean, over the batch and the query positions t >= 1, of the weight on key t - 1.
    A perfect previous-token head scores 1; a head that attends uniformly over the context scores much less.
    ValueError naming maps unless it is (L, B, H, T, T).
    """
    check_maps(maps)
    previous = maps.diagonal(offset=-1, dim1=-2, dim2=-1)  # (L, B, H, T - 1): weight of query t on key t - 1
    return previous.mean(dim=(1, 3))


def first_token_score(maps: torch.Tensor) -> torch.Tensor:
    """How much each head attends to the first token (an "attention sink"): (L, B, H, T, T) -> (L, H).

    The mean, over the batch and the query positions t >= 1, of the weight on key 0 (query 0 has no choice).
    ValueError naming maps unless it is (L, B, H, T, T).
    """
    check_maps(maps)
    return maps[..., 1:, 0].mean(dim=(1, 3))


def induction_score(maps: torch.Tensor, period: int) -> torch.Tensor:
    """Each head's induction score on repeated random tokens: (L, B, H, T, T) -> (L, H), float64.

    maps: attention weights of every layer and head (as gpt.attention_maps returns them) for
    sequences that repeat with the given period (token t == token t - period for t >= period). The score is
    the mean, over the batch and every query t >= period, of the weight on key t - period + 1: the token that
    followed the query's token when it occurred one period earlier. A perfect induction head scores 1.
    ValueError naming maps unless it is (L, B, H, T, T), naming period unless 1 <= period < T.
    """
    ### BEGIN SOLUTION
    if maps.dim() != 5 or maps.shape[-1] != maps.shape[-2]:
        raise ValueError(f"maps must be (L, B, H, T, T), got shape {tuple(maps.shape)}")
    T = maps.shape[-1]
    if not 1 <= period < T:
        raise ValueError(f"period must be in [1, T) = [1, {T}), got {period}")
    queries = torch.arange(period, T)  # the tokens of every later copy
    keys = queries - period + 1  # the token after each one's earlier occurrence
    weights = maps[..., queries, keys].double()  # (L, B, H, T - period)
    return weights.mean(dim=(1, 3))
    ### END SOLUTION


@torch.no_grad()
def copy_losses(model: nn.Module, tokens: torch.Tensor, period: int) -> tuple[float, float]:
    """Mean next-token loss (nats) on the first copy and on the second copy of repeated tokens (B, 2 * period).

    First copy: the predictions of tokens 1 .. period - 1; second copy: of tokens period + 1 .. 2 * period - 1
    (the first token of each copy follows a token that never came before it, so neither counts).
    The model returns logits (B, T, V), or a tuple whose first element they are.
    """
    if tokens.shape[1] != 2 * period or period < 2:
        raise ValueError(f"tokens must be (B, 2 * period) with period >= 2, got {tuple(tokens.shape)} and {period}")
    out = model(tokens)
    logits = (out[0] if isinstance(out, tuple) else out).double()
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")  # (B, T - 1): predicting token t + 1
    return losses[:, :period - 1].mean().item(), losses[:, period:].mean().item()


class HeadAttention(nn.Module):
    """Causal multi-head self-attention without biases or dropout, named and computed as GPT's."""

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} must be a multiple of n_head {n_head}")
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=False)  # rows 0..C: queries, C..2C: keys, 2C..3C: values
        self.c_proj = nn.Linear(d_model, d_model, bias=False)  # the heads' outputs (concatenated) -> the residual stream

    def forward(self, x):
        """x (B, T, C) -> (B, T, C)."""
        B, T, C = x.shape
        q, k, v = qkv_heads(self, x)  # (B, H, T, Dh)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        weights = masked_softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), causal)  # (B, H, T, T)
        y = (weights @ v).transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y)


class AttentionOnlyBlock(nn.Module):
    """x + attn(x): no LayerNorm, no MLP."""

    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.attn = HeadAttention(d_model, n_head)

    def forward(self, x):
        return x + self.attn(x)


class AttentionOnly(nn.Module):
    """An attention-only transformer: token + position embeddings, n_layer attention blocks, an untied head.

    forward(idx (B, T)) -> (logits (B, T, V), None), the GPT's return convention. All weights start at zero:
    whoever builds one sets them. ValueError naming the size for any size below 1.
    """

    def __init__(self, vocab_size: int, max_len: int, d_model: int, n_layer: int = 2, n_head: int = 1):
        super().__init__()
        for name, size in (("vocab_size", vocab_size), ("max_len", max_len), ("d_model", d_model), ("n_layer", n_layer),
                           ("n_head", n_head)):
            check_positive(name, size)
        self.vocab_size, self.max_len, self.d_model = vocab_size, max_len, d_model
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab_size, d_model),  # weight (V, C): row v is token v's vector
            "wpe": nn.Embedding(max_len, d_model),  # weight (max_len, C): row t is position t's vector
            "h": nn.ModuleList([AttentionOnlyBlock(d_model, n_head) for _ in range(n_layer)]),
        })
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)  # weight (V, C): logit v = weight[v] . x
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.zero_()

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        if T > self.max_len:
            raise ValueError(f"sequence of {T} tokens, the model's max_len is {self.max_len}")
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T, device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(x)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def build_induction_model(vocab_size: int, max_len: int) -> AttentionOnly:
    """A two-layer attention-only model, weights set by hand, that completes [A][B] ... [A] with [B].

    Returns an AttentionOnly(vocab_size, max_len, d_model, n_layer=2, n_head=1), d_model of your choice,
    whose layer 2 head is an induction head (chapter 13, section 3). Graded by behaviour only, on repeated
    random tokens (heads.repeated_random_tokens, two copies) at every period p with 2 <= p <= vocab_size (each
    copy's tokens distinct) and 2p <= max_len: layer 1's previous-token score and layer 2's induction score above
    0.9, the loss on the second copy below 0.1, on the first copy above ln(vocab_size) / 2 (random tokens cannot
    be predicted before they repeat: a lower loss means the model sees the future). AttentionOnly refuses a
    vocab_size or max_len below 1 with a ValueError.
    """
    ### BEGIN SOLUTION
    V, P = vocab_size, max_len
    TOK, POS, PREV, OUT = 0, V, V + P, 2 * V + P  # where each subspace of the residual stream starts
    model = AttentionOnly(V, P, d_model=3 * V + P, n_layer=2, n_head=1)
    C = model.d_model
    hard = 30.0 * math.sqrt(C)  # scores are divided by sqrt(head size) = sqrt(C): a match scores 30, others 0
    eye_v, eye_p = torch.eye(V), torch.eye(P)
    with torch.no_grad():  # setting weights, not training them
        model.transformer.wte.weight[:, TOK:TOK + V] = eye_v  # token v -> basis vector TOK + v
        model.transformer.wpe.weight[:, POS:POS + P] = eye_p  # position t -> basis vector POS + t
        # layer 1, the previous-token head: query t holds position t, key j holds position j + 1
        attn = model.transformer.h[0].attn
        W = attn.c_attn.weight  # (3C, C): rows [0, C) make queries, [C, 2C) keys, [2C, 3C) values
        W[0:P, POS:POS + P] = hard * eye_p  # q[t] = hard * e_t
        W[C + 1:C + P, POS:POS + P - 1] = eye_p[:P - 1, :P - 1]  # k[j] = e_(j+1): matches the query at j + 1
        W[2 * C:2 * C + V, TOK:TOK + V] = eye_v  # v[j] = the token at j
        attn.c_proj.weight[PREV:PREV + V, 0:V] = eye_v  # written into PREV: "the token before me"
        # layer 2, the induction head: query = my token, key = the token before each position
        attn = model.transformer.h[1].attn
        W = attn.c_attn.weight
        W[0:V, TOK:TOK + V] = hard * eye_v  # q[t] = hard * (my token)
        W[C:C + V, PREV:PREV + V] = eye_v  # k[j] = the token before j (layer 1's output): K-composition
        W[V, TOK:TOK + V] = hard  # q[t][V] = hard for every token (the TOK coordinates always sum to 1) ...
        W[C + V, POS] = -1.0  # ... and k[0][V] = -1: position 0 has no previous token (layer 1 wrote its own there)
        W[2 * C:2 * C + V, TOK:TOK + V] = eye_v  # v[j] = the token at j
        attn.c_proj.weight[OUT:OUT + V, 0:V] = eye_v  # written into OUT, which nothing else writes
        model.lm_head.weight[:, OUT:OUT + V] = 10.0 * eye_v  # logit of v = 10 * (weight on tokens v)
    return model
    ### END SOLUTION


@contextlib.contextmanager
def ablate_head(model: nn.Module, layer: int, head: int):
    """Zero-ablate one attention head for the duration of a with-block: `with ablate_head(model, 0, 2): ...`.

    model: the course's GPT or AttentionOnly (model.transformer.h[layer].attn has c_proj and n_head). Inside
    the block, head `head`'s output (its slice of the concatenated heads, the input of c_proj) is zero; every
    other head and every weight is untouched. On leaving the block, normally or by an exception, the model
    computes exactly what it computed before. ValueError for a layer or head that does not exist.
    """
    ### BEGIN SOLUTION
    blocks = model.transformer.h
    if not 0 <= layer < len(blocks):
        raise ValueError(f"layer must be in [0, {len(blocks)}), got {layer}")
    attn = blocks[layer].attn
    if not 0 <= head < attn.n_head:
        raise ValueError(f"head must be in [0, {attn.n_head}), got {head}")
    size = attn.c_proj.in_features // attn.n_head  # the head size: head h owns inputs [h * size, (h + 1) * size)

    def zero_head(module, args):
        y = args[0].clone()  # never edit the caller's tensor in place
        y[..., head * size:(head + 1) * size] = 0.0
        return (y, *args[1:])

    handle = attn.c_proj.register_forward_pre_hook(zero_head)
    try:
        yield model
    finally:  # restore, even if the block raised
        handle.remove()
    ### END SOLUTION



# ----------------------------------------------------------------------------- a trained pair (course pretrain)


def induction_training_batch(vocab_size: int, length: int, batch: int, periods, generator=None) -> torch.Tensor:
    """Training data for induction heads: (batch, length) int64, each row random tokens with one repeated stretch.

    Each row draws a period p from `periods` and an offset o uniformly from [0, length - 2p]; tokens before o are
    random, tokens o .. o + p - 1 are a random segment (distinct tokens when p <= vocab_size), and from o + p on
    that segment repeats (two copies or more, the last one cut at `length`). The random period and offset are what
    make a model find the earlier occurrence by content: no position holds the answer in every row.
    """
    periods = [int(p) for p in periods]
    if not periods or min(periods) < 1 or 2 * max(periods) > length or batch < 1 or vocab_size < 1:
        raise ValueError(f"periods must be non-empty, each in [1, length / 2 = {length // 2}], got {periods}; "
                         f"batch and vocab_size must be >= 1, got {batch}, {vocab_size}")
    tokens = torch.randint(vocab_size, (batch, length), generator=generator)
    choice = torch.randint(len(periods), (batch,), generator=generator)
    for b in range(batch):
        p = periods[int(choice[b])]
        o = int(torch.randint(length - 2 * p + 1, (1,), generator=generator))
        segment = torch.randperm(vocab_size, generator=generator)[:p] if p <= vocab_size else tokens[b, o:o + p]
        tokens[b, o:] = segment.repeat(length // p + 1)[:length - o]
    return tokens


def induction_figures(model: nn.Module, periods, batch: int, seed: int) -> dict:
    """What a trained model does on repeated random tokens of each period (heads.repeated_random_tokens, two copies,
    batch rows drawn with torch.Generator().manual_seed(seed)), by period: every head's induction score,
    previous-token score and first-token score ([layer][head], 4 decimals), the mean loss on the first and on the
    second copy, and under "ablated" ("layer.head": with that head zero-ablated) the induction scores and losses again."""

    def scores(tokens, period):
        maps = attention_maps(model, tokens)
        first, second = copy_losses(model, tokens, period)
        return {"induction": [[round(float(s), 4) for s in layer] for layer in induction_score(maps, period)],
                "previous_token": [[round(float(s), 4) for s in layer] for layer in previous_token_score(maps)],
                "first_token": [[round(float(s), 4) for s in layer] for layer in first_token_score(maps)],
                "first_copy_loss": round(first, 4), "second_copy_loss": round(second, 4)}

    figures = {}
    model.eval()
    with torch.no_grad():
        for period in periods:
            tokens = repeated_random_tokens(model.vocab_size, period, batch, torch.Generator().manual_seed(seed))
            figures[str(period)] = scores(tokens, period)
            ablated = {}
            for layer, block in enumerate(model.transformer.h):
                for head in range(block.attn.n_head):
                    with ablate_head(model, layer, head):
                        s = scores(tokens, period)
                    ablated[f"{layer}.{head}"] = {k: s[k] for k in ("induction", "first_copy_loss", "second_copy_loss")}
            figures[str(period)]["ablated"] = ablated
    return figures


def train_induction(model: nn.Module, steps: int, batch_size: int, lr: float, init_std: float, seed: int, periods,
                    held_out_periods, eval_batch: int, eval_seed: int, progress: bool = True, score_every: int = 50) -> dict:
    """Train an AttentionOnly model on induction_training_batch rows (periods drawn from `periods`), then score it
    on held_out_periods, which training never drew.

    Weights: normal(0, init_std) from the global generator (the caller seeds it); Adam(lr), constant; every step
    a fresh batch from torch.Generator().manual_seed(seed); the loss: next-token cross-entropy at every position.
    Returns {"losses": per-step losses (4 decimals), "held_out": {"periods", "batch", "seed", "by_period":
    induction_figures(model, held_out_periods, eval_batch, eval_seed)}, "during_training": {"period", "batch", "seed",
    "steps", "induction", "previous_token"}}: every score_every steps (and before the first), the largest induction score
    of the last layer's heads and the largest previous-token score of the first layer's, on eval_batch rows of the
    longest held-out period (repeated_random_tokens, torch.Generator().manual_seed(eval_seed)). Measuring reads the
    model under no_grad and draws from its own generator: the training is the same with or without it.
    """
    if set(periods) & set(held_out_periods):
        raise ValueError(f"held-out periods {sorted(held_out_periods)} must not be trained on: {sorted(periods)}")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, init_std)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    probe_period = max(held_out_periods)
    probe = repeated_random_tokens(model.vocab_size, probe_period, eval_batch, torch.Generator().manual_seed(eval_seed))
    during = {"period": probe_period, "batch": eval_batch, "seed": eval_seed, "steps": [], "induction": [], "previous_token": []}

    def record_scores(step):
        with torch.no_grad():
            maps = attention_maps(model, probe)
        during["steps"].append(step)
        during["induction"].append(round(induction_score(maps, probe_period)[-1].max().item(), 4))
        during["previous_token"].append(round(previous_token_score(maps)[0].max().item(), 4))

    record_scores(0)
    model.train()
    for step in range(steps):
        x = induction_training_batch(model.vocab_size, model.max_len, batch_size, periods, generator)
        logits, _ = model(x)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, model.vocab_size), x[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(round(loss.item(), 4))
        if (step + 1) % score_every == 0:
            record_scores(step + 1)
        if progress and (step + 1) % max(1, steps // 10) == 0:
            print(f"step {step + 1}/{steps}: loss {loss.item():.4f}", flush=True)
    model.eval()
    return {"losses": losses, "held_out": {"periods": list(held_out_periods), "batch": eval_batch, "seed": eval_seed,
                                           "by_period": induction_figures(model, held_out_periods, eval_batch, eval_seed)},
            "during_training": during}
