"""Visible checks of chapter 13 (what the heads learned), and the oracles they compare against.

Oracles: the induction score by a float64 loop over queries written from its definition (Olsson et al. 2022);
the hand-built model judged by behaviour, its attention maps and losses computed by the course (gpt.attention_maps,
heads.copy_losses) on a float64 copy of it; an ablated head checked against a copy of the model whose c_proj
columns for that head are zero (the same function, reached by editing weights instead of a hook).
"""
from __future__ import annotations

import copy
import math

import torch

from ..gpt import attention_maps
from ..heads import AttentionOnly, copy_losses, repeated_random_tokens
from .core import assert_close, assert_shape, call_learner, fail, passed

__all__ = [
    "check_ablate_head",
    "check_build_induction_model",
    "check_induction_score",
    "head_zeroed_copy",
    "induction_oracle",
    "induction_report",
    "random_attention_only",
    "random_maps",
]


def random_maps(L: int, B: int, H: int, T: int, generator) -> torch.Tensor:
    """Random causal attention weights (L, B, H, T, T) in float64: each row a softmax over keys 0 .. t."""
    scores = torch.randn(L, B, H, T, T, generator=generator, dtype=torch.float64) * 2
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    return torch.softmax(scores, -1)


def induction_oracle(maps: torch.Tensor, period: int, offset: int = 1, first: int | None = None) -> torch.Tensor:
    """The induction score by a plain loop in float64: (L, H). `offset` 1 reads key t - period + 1 (the token after
    the earlier occurrence); 0 would read the earlier occurrence itself. `first`: the first query counted (period)."""
    L, B, H, T, _ = maps.shape
    first = period if first is None else first
    total = torch.zeros(L, H, dtype=torch.float64)
    count = 0
    for t in range(first, T):
        key = t - period + offset
        if key < 0:
            continue
        total += maps[:, :, :, t, key].double().sum(1)
        count += B
    return total / count


def check_induction_score(induction_score) -> None:
    """Visible checks for chapter 13, exercise 1: the induction score of every head from its attention weights."""
    g = torch.Generator().manual_seed(13)
    maps = random_maps(2, 3, 4, 10, g)
    maps[1, :, 2] = 0.0
    for t in range(4, 10):  # layer 1, head 2: a perfect induction head for period 4
        maps[1, :, 2, t, t - 3] = 1.0
    for t in range(4):
        maps[1, :, 2, t, t] = 1.0
    got = call_learner(lambda: induction_score(maps, 4), "induction_score(maps of shape (2, 3, 4, 10, 10), period 4)")
    assert_shape(got, (2, 4), "the score of maps (L 2, B 3, H 4, T 10, T 10)")
    want = induction_oracle(maps, 4)
    if torch.allclose(got.double(), induction_oracle(maps, 4, offset=0), atol=1e-9):
        fail(f"your scores {got[0].tolist()} read key t - period, the earlier occurrence of the query's own token (a "
             "duplicate-token score). An induction head attends to the token *after* it: key t - period + 1")
    if torch.allclose(got.double(), induction_oracle(maps, 4, offset=2), atol=1e-9):
        fail("your scores read key t - period + 2, one past the token after the earlier occurrence: key t - period + 1")
    if any(torch.allclose(got.double(), induction_oracle(maps, 4, first=first), atol=1e-9) for first in (0, 1, 3)):
        fail("your scores average over the queries of the first copy too; they have no earlier occurrence. "
             "Average over the queries t >= period only")
    if abs(got[1, 2].item() - 1.0) > 1e-9:
        fail(f"a perfect induction head (layer 1, head 2: every query t >= 4 puts weight 1 on key t - 3) scores "
             f"{got[1, 2].item():.4f}, expected 1")
    assert_close(got.double(), want, "the induction scores (float64 loop over the queries)", rtol=1e-12, atol=1e-12)
    maps32 = maps.float()
    got = call_learner(lambda: induction_score(maps32, 3), "induction_score(float32 maps, period 3)")
    if got.dtype != torch.float64:
        fail(f"float32 maps gave a {got.dtype} score: the docstring asks for float64 (convert before averaging)")
    assert_close(got, induction_oracle(maps32, 3), "the scores of float32 maps with period 3", rtol=1e-7, atol=1e-7)
    for period in (0, 10):
        try:
            induction_score(maps, period)
        except ValueError:
            continue
        except Exception as error:  # noqa: BLE001 - any other error is the wrong one
            fail(f"period {period} with T = 10: expected ValueError (1 <= period < T), got {type(error).__name__}: {error}")
        fail(f"period {period} with T = 10: expected ValueError (1 <= period < T)")
    passed("induction_score")


@torch.no_grad()
def induction_report(model, vocab_size: int, period: int, batch: int = 8, seed: int = 0) -> dict:
    """What the hand-built model does on repeated random tokens, measured on a float64 copy of it."""
    tokens = repeated_random_tokens(vocab_size, period, batch, torch.Generator().manual_seed(seed))
    model64 = copy.deepcopy(model).double()
    maps = attention_maps(model64, tokens)  # (L, B, H, T, T)
    T = tokens.shape[1]
    t = torch.arange(1, T)
    later = torch.arange(period, T)
    first, second = copy_losses(model64, tokens, period)
    return {
        "previous": maps[0][..., t, t - 1].mean(dim=(0, 2)),  # layer 1, per head
        "self": maps[0][..., t, t].mean(dim=(0, 2)),
        "largest_1": maps[0][..., t, :].amax(-1).mean(dim=(0, 2)),
        "induction": maps[-1][..., later, later - period + 1].mean(dim=(0, 2)),  # last layer, per head
        "duplicate": maps[-1][..., later, later - period].mean(dim=(0, 2)),
        "largest_2": maps[-1][..., later, :].amax(-1).mean(dim=(0, 2)),
        "first": first, "second": second, "ln V": math.log(vocab_size),
    }


def check_build_induction_model(build_induction_model) -> None:
    """Visible checks for chapter 13, exercise 2: a hand-built two-layer induction circuit."""
    V, max_len, period = 12, 30, 12
    model = call_learner(lambda: build_induction_model(V, max_len), f"build_induction_model({V}, {max_len})")
    if not isinstance(model, AttentionOnly):
        fail(f"build_induction_model should return a course_lib.heads.AttentionOnly, got {type(model).__name__}")
    if len(model.transformer.h) != 2:
        fail(f"your model has {len(model.transformer.h)} layers: the circuit needs exactly two")
    tokens = repeated_random_tokens(V, period, 2, torch.Generator().manual_seed(1))
    logits, _ = call_learner(lambda: model(tokens), "your model on repeated random tokens")
    assert_shape(logits, (2, 2 * period, V), "the logits of (2, 24) tokens")
    r = induction_report(model, V, period)
    prev, best = r["previous"].max().item(), int(r["previous"].argmax())
    if prev < 0.9:
        where = f"layer 1's head {best} puts {prev:.3f} on the previous token"
        if r["self"][best] > 0.5:
            fail(f"{where} and {r['self'][best].item():.3f} on the current one: it attends to the current token. Its "
                 "key at position j must match the query at position j + 1 (say k[j] = e_(j+1), q[t] = e_t)")
        if r["largest_1"][best] < 0.5:
            fail(f"{where}; its largest weight averages {r['largest_1'][best].item():.3f}: the attention is diffuse. "
                 "Scores are divided by sqrt(head size): multiply the query by a large scale (a match worth ~30)")
        fail(f"{where} (expected above 0.9): query t must match key t - 1 and nothing else")
    ind, best = r["induction"].max().item(), int(r["induction"].argmax())
    if ind < 0.9:
        where = f"layer 2's head {best} has an induction score of {ind:.3f}"
        if r["duplicate"][best] > 0.3:
            fail(f"{where}: it puts {r['duplicate'][best].item():.3f} on the earlier occurrence of the query's own "
                 "token, and copies A instead of B. Its keys read the current token; they must read what layer 1 "
                 "wrote (the token *before* each position), its queries the current token")
        if r["largest_2"][best] < 0.5:
            fail(f"{where}; its largest weight averages {r['largest_2'][best].item():.3f}: the attention is diffuse. "
                 "Multiply the query by a large scale, so that a match wins nearly all the weight")
        fail(f"{where} (expected above 0.9): from token A it must attend to the position right after A's earlier "
             "occurrence")
    if r["second"] > 0.1:
        fail(f"the loss on the second copy is {r['second']:.3f} nats (expected below 0.1) although layer 2 attends "
             f"to the right token ({ind:.3f}): does its output reach the logits? Write it into a subspace of the "
             "residual stream nothing else writes, and let lm_head read that subspace with a large weight")
    if r["first"] < 0.5 * r["ln V"]:
        fail(f"the loss on the first copy is {r['first']:.3f}, below half of ln V = {r['ln V']:.3f}: random tokens "
             "cannot be predicted the first time; does your model see the future?")
    print(f"layer 1: previous-token score {prev:.3f}; layer 2: induction score {ind:.3f}; loss on the first copy "
          f"{r['first']:.3f} (ln V = {r['ln V']:.3f}), on the second {r['second']:.4f}")
    passed("build_induction_model")


def head_zeroed_copy(model, layer: int, head: int):
    """A copy of the model in which head `head` of layer `layer` is silenced by zeroing its columns of c_proj."""
    twin = copy.deepcopy(model)
    attn = twin.transformer.h[layer].attn
    size = attn.c_proj.in_features // attn.n_head
    with torch.no_grad():
        attn.c_proj.weight[:, head * size:(head + 1) * size] = 0.0
    return twin


def random_attention_only(seed: int, V: int = 11, max_len: int = 16, d_model: int = 12, n_layer: int = 2, n_head: int = 3):
    """An AttentionOnly with random float64 weights (a model in which every head matters)."""
    g = torch.Generator().manual_seed(seed)
    model = AttentionOnly(V, max_len, d_model, n_layer, n_head).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.7)
    return model


def _logits(model, idx):
    with torch.no_grad():
        out = model(idx)
    return out[0] if isinstance(out, tuple) else out


def check_ablate_head(ablate_head) -> None:
    """Visible checks for chapter 13, exercise 3: zero one head's output inside a with-block, restore it after."""
    model = random_attention_only(131)
    idx = torch.randint(11, (2, 16), generator=torch.Generator().manual_seed(132))
    before = _logits(model, idx)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for layer, head in ((0, 1), (1, 2), (0, 0)):
        with call_learner(lambda layer=layer, head=head: ablate_head(model, layer, head), f"ablate_head(model, {layer}, {head})",
                          "use it as `with ablate_head(model, layer, head):` (a @contextlib.contextmanager that yields)",
                          (RuntimeError, TypeError, AttributeError)):
            inside = _logits(model, idx)
        want = _logits(head_zeroed_copy(model, layer, head), idx)
        if torch.allclose(inside, before, atol=1e-12):
            fail(f"ablate_head(model, {layer}, {head}): the logits inside the with-block are the unablated ones; "
                 "nothing was silenced while the block ran")
        for other in range(3):
            if other != head and torch.allclose(inside, _logits(head_zeroed_copy(model, layer, other), idx), atol=1e-10):
                fail(f"ablate_head(model, {layer}, {head}) silenced head {other} instead: head h owns the inputs "
                     "[h * size, (h + 1) * size) of c_proj, size = C // n_head")
        rows = copy.deepcopy(model)
        attn = rows.transformer.h[layer].attn
        with torch.no_grad():
            attn.c_proj.weight[head * 4:(head + 1) * 4, :] = 0.0
        if torch.allclose(inside, _logits(rows, idx), atol=1e-10):
            fail(f"ablate_head(model, {layer}, {head}) zeroed c_proj's *output* slice (residual dimensions), not the "
                 "head: the heads are concatenated at c_proj's *input*; zero the head's slice of that input")
        assert_close(inside, want, f"the logits with head {head} of layer {layer} ablated (float64)", rtol=1e-10, atol=1e-10)
        after = _logits(model, idx)
        if not torch.allclose(after, before, atol=1e-12):
            fail(f"after the with-block of ablate_head(model, {layer}, {head}) the model still differs from before (by "
                 f"{(after - before).abs().max():.3g}): remove the hook, or restore the weights, when the block ends")
    try:
        with ablate_head(model, 1, 0):
            raise KeyError("an error inside the with-block")
    except KeyError:
        pass
    after = _logits(model, idx)
    if not torch.allclose(after, before, atol=1e-12):
        fail("after an exception inside the with-block the head is still ablated: restore it in a `finally:` "
             "around the `yield`")
    for name, value in model.state_dict().items():
        if not torch.equal(value, weights[name]):
            fail(f"the model's {name} changed: ablate_head must leave every weight as it found it")
    for layer, head in ((2, 0), (0, 3)):
        try:
            with ablate_head(model, layer, head):
                pass
        except ValueError:
            continue
        except Exception as error:  # noqa: BLE001 - any other error is the wrong one
            fail(f"ablate_head(model, {layer}, {head}) on a model of 2 layers of 3 heads: expected ValueError, got "
                 f"{type(error).__name__}: {error}")
        fail(f"ablate_head(model, {layer}, {head}) on a model of 2 layers of 3 heads: expected ValueError")
    passed("ablate_head")
