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
    "induction_periods",
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
    one_layer = maps[0]  # (B, H, T, T): one layer's maps, the layer dimension left out
    try:
        induction_score(one_layer, 4)
    except ValueError:
        pass
    except Exception as error:  # noqa: BLE001 - any other error is the wrong one
        fail(f"maps of shape {tuple(one_layer.shape)} (one layer's maps, no layer dimension): expected a ValueError naming "
             f"maps (it must be (L, B, H, T, T)), got {type(error).__name__}: {error}")
    else:
        fail(f"maps of shape {tuple(one_layer.shape)} (one layer's maps, no layer dimension): expected a ValueError naming "
             "maps (it must be (L, B, H, T, T)); your function returned a result")
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
    """What the hand-built model does on repeated random tokens, measured on a float64 copy of it: scores per head
    (previous-token of layer 1, induction of the last layer, and what a miss looks like), the two copies' losses."""
    tokens = repeated_random_tokens(vocab_size, period, batch, torch.Generator().manual_seed(seed))
    model64 = copy.deepcopy(model).double()
    maps = attention_maps(model64, tokens)  # (L, B, H, T, T)
    T = tokens.shape[1]
    t = torch.arange(1, T)
    later = torch.arange(period, T)
    first, second = copy_losses(model64, tokens, period)
    out = model64(tokens)
    logits = out[0] if isinstance(out, tuple) else out  # (B, T, V)
    middle = torch.arange(period, T - 1)  # second-copy positions whose next token is predictable
    return {
        "previous": maps[0][..., t, t - 1].mean(dim=(0, 2)),  # layer 1, per head
        "self": maps[0][..., t, t].mean(dim=(0, 2)),
        "largest_1": maps[0][..., t, :].amax(-1).mean(dim=(0, 2)),
        "previous_top": (maps[0][..., t, :].argmax(-1) == t - 1).double().mean(dim=(0, 2)),  # t - 1 the largest weight
        "induction": maps[-1][..., later, later - period + 1].mean(dim=(0, 2)),  # last layer, per head
        "duplicate": maps[-1][..., later, later - period].mean(dim=(0, 2)),
        "largest_2": maps[-1][..., later, :].amax(-1).mean(dim=(0, 2)),
        "induction_top": (maps[-1][..., later, :].argmax(-1) == later - period + 1).double().mean(dim=(0, 2)),
        "restart_on_0": maps[-1][..., period, 0].mean(dim=0),  # the second copy's first token, on position 0
        "repeats_current": (logits[:, middle].argmax(-1) == tokens[:, middle]).double().mean().item(),
        "last_layer_moves_logits": bool((logits - _logits(_last_layer_silenced(model64), tokens)).abs().max() > 1e-6),
        "first": first, "second": second, "ln V": math.log(vocab_size), "d_model": model64.transformer.wte.weight.shape[1],
    }


def _last_layer_silenced(model):
    """A copy of the model whose last attention layer writes nothing (every column of its c_proj zero)."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.transformer.h[-1].attn.c_proj.weight.zero_()
    return twin


def induction_periods(vocab_size: int, max_len: int) -> range:
    """Every period the circuit must handle: 2 <= p <= vocab_size (each copy's tokens distinct), 2p <= max_len."""
    return range(2, min(vocab_size, max_len // 2) + 1)


def _scale(r: dict) -> str:
    d = r["d_model"]
    return (f"Scores are divided by sqrt(head size) = sqrt(d_model) = {math.sqrt(d):.2f}: a query scaled by s gives a match "
            f"only s / {math.sqrt(d):.2f} (a query scale of 30 gives a match only {30 / math.sqrt(d):.1f}). Scale the query "
            f"by 30 sqrt(d_model) = {30 * math.sqrt(d):.0f}, so that a match scores about 30 after the division")


def _weak(largest) -> str:
    return "the attention is diffuse" if largest < 0.5 else "the match wins, but not by enough"


def _circuit_failure(r: dict, period: int) -> str | None:
    """What is wrong with the circuit at one period (induction_report's r), or None: the message names the cause."""
    at = f"at period {period}, "
    prev, best = r["previous"].max().item(), int(r["previous"].argmax())
    if prev < 0.9:
        where = f"{at}layer 1's head {best} puts {prev:.3f} on the previous token"
        if r["self"][best] > 0.5:
            return (f"{where} and {r['self'][best].item():.3f} on the current one: it attends to the current token. Its "
                    "key at position j must match the query at position j + 1 (say k[j] = e_(j+1), q[t] = e_t)")
        if r["previous_top"][best] > 0.9 or r["largest_1"][best] < 0.5:
            return (f"{where}; its largest weight averages {r['largest_1'][best].item():.3f}, on the previous token in "
                    f"{r['previous_top'][best].item():.0%} of the rows: {_weak(r['largest_1'][best])}. {_scale(r)}")
        return f"{where} (expected above 0.9): query t must match key t - 1 and nothing else"
    ind, best = r["induction"].max().item(), int(r["induction"].argmax())
    restart = (f"from the first token of the second copy (query {period}) layer 2 puts {r['restart_on_0'].max().item():.3f} "
               "on position 0: position 0 has no previous token, so layer 1 wrote position 0's own token there, and it "
               "matches the query as well as the right key does. Give position 0's key a coordinate that loses (hint 3)")
    if ind < 0.9:
        where = f"{at}layer 2's head {best} has an induction score of {ind:.3f}"
        if r["duplicate"][best] > 0.3:
            return (f"{where}: it puts {r['duplicate'][best].item():.3f} on the earlier occurrence of the query's own "
                    "token, and copies A instead of B. Its keys read the current token; they must read what layer 1 "
                    "wrote (the token *before* each position), its queries the current token")
        if r["restart_on_0"].max() > 0.3:
            return f"{where}: {restart}"
        if r["induction_top"][best] > 0.9 or r["largest_2"][best] < 0.5:
            return (f"{where}; its largest weight averages {r['largest_2'][best].item():.3f}, on the right key in "
                    f"{r['induction_top'][best].item():.0%} of the rows: {_weak(r['largest_2'][best])}. {_scale(r)}")
        return (f"{where} (expected above 0.9): from token A it must attend to the position right after A's earlier "
                "occurrence")
    if r["second"] > 0.1:
        what = f"{at}the loss on the second copy is {r['second']:.3f} nats (expected below 0.1) although layer 2 attends to the right token ({ind:.3f})"
        if r["restart_on_0"].max() > 0.3:
            return f"{what}: {restart}"
        if not r["last_layer_moves_logits"]:
            return (f"{what}, and silencing layer 2 does not change the logits: its output does not reach them. Write it "
                    "into a subspace of the residual stream nothing else writes, and let lm_head read that subspace with "
                    "a large weight")
        if r["repeats_current"] > 0.5:
            return (f"{what}: your model predicts the current token A again ({r['repeats_current']:.0%} of the second copy), "
                    "not the B that followed it. Layer 2's value reads what layer 1 wrote at the attended position (the "
                    "token before it, A); it must read that position's own token, B")
        return (f"{what}: does its output reach the logits? Write it into a subspace of the residual stream nothing else "
                "writes, and let lm_head read that subspace with a large weight")
    if r["first"] < 0.5 * r["ln V"]:
        return (f"{at}the loss on the first copy is {r['first']:.3f}, below half of ln V = {r['ln V']:.3f}: random tokens "
                "cannot be predicted the first time; does your model see the future?")
    return None


def check_build_induction_model(build_induction_model) -> None:
    """Visible checks for chapter 13, exercise 2: a hand-built two-layer induction circuit, at every period 2 to 12 of a
    vocabulary of 12 (max_len 30), and at period 64 of a vocabulary of 103 (max_len 128), the largest section 3 runs."""
    V, max_len = 12, 30
    model = call_learner(lambda: build_induction_model(V, max_len), f"build_induction_model({V}, {max_len})")
    if not isinstance(model, AttentionOnly):
        fail(f"build_induction_model should return a course_lib.heads.AttentionOnly, got {type(model).__name__}")
    if len(model.transformer.h) != 2:
        fail(f"your model has {len(model.transformer.h)} layers: the circuit needs exactly two")
    tokens = repeated_random_tokens(V, V, 2, torch.Generator().manual_seed(1))
    logits, _ = call_learner(lambda: model(tokens), "your model on repeated random tokens")
    assert_shape(logits, (2, 2 * V, V), f"the logits of (2, {2 * V}) tokens")
    for period in reversed(induction_periods(V, max_len)):  # the longest first: it shows most mistakes most clearly
        r = induction_report(model, V, period)
        failure = _circuit_failure(r, period)
        if failure is not None:
            fail(failure)
    r = induction_report(model, V, V)
    print(f"every period from 2 to {V} passed; at period {V}: layer 1's previous-token score {r['previous'].max().item():.3f}, "
          f"layer 2's induction score {r['induction'].max().item():.3f}, loss on the first copy {r['first']:.3f} "
          f"(ln V = {r['ln V']:.3f}), on the second {r['second']:.4f}")
    # the largest case section 3's table runs (vocabulary 103, max_len 128, period 64): a query scale or an lm_head
    # weight that suffices for 12 tokens in 24 positions can fall short for 103 tokens in 128 positions
    V, max_len, period = 103, 128, 64
    model = call_learner(lambda: build_induction_model(V, max_len), f"build_induction_model({V}, {max_len})")
    r = induction_report(model, V, period)
    failure = _circuit_failure(r, period)
    if failure is not None:
        fail(f"vocabulary {V}, max_len {max_len}: {failure}")
    print(f"vocabulary {V}, max_len {max_len}, period {period} passed: induction score {r['induction'].max().item():.3f}, "
          f"loss on the second copy {r['second']:.4f}")
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
