"""Visible checks of chapter 11 (from GPT-2 to Llama), and the independent oracles they compare against.

Oracles: float64 formulas written out here (the root mean square, SiLU as x * sigmoid(x)), the row order of the
RoPE permutation spelled out index by index, and (exercise 5, the conversion) Hugging Face's LlamaForCausalLM and
MistralForCausalLM built from their own configurations; never course_lib's reference solutions.
"""
from __future__ import annotations

import torch

from .core import assert_close, assert_shape, assert_tensor, call_learner, fail, passed

__all__ = ["check_rms_norm", "check_swiglu", "check_rope_to_half", "check_expand_kv_heads", "check_llama_conversion",
           "rms_norm_oracle", "swiglu_oracle", "half_rows"]


def rms_norm_oracle(x, weight, eps):
    """x / sqrt(mean(x^2) + eps) * weight in float64."""
    x, weight = x.double(), weight.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def swiglu_oracle(x, w_gate, w_up, w_down):
    """(SiLU(x W_gate^T) * (x W_up^T)) W_down^T in float64, SiLU(a) = a * sigmoid(a)."""
    x, w_gate, w_up, w_down = x.double(), w_gate.double(), w_up.double(), w_down.double()
    a = x @ w_gate.T
    return (a * torch.sigmoid(a) * (x @ w_up.T)) @ w_down.T


def half_rows(n_heads: int, d_head: int) -> list[int]:
    """The rows of W_q or W_k, in the order the half layout wants them: per head, the even rows, then the odd rows."""
    return [h * d_head + r for h in range(n_heads) for r in list(range(0, d_head, 2)) + list(range(1, d_head, 2))]


def _differs(got, expected, tol: float = 1e-4) -> bool:
    return not torch.allclose(got.double(), expected, rtol=tol, atol=tol)


def check_rms_norm(rms_norm) -> None:
    """Visible checks for chapter 11, exercise 1: the root mean square, no mean subtracted, eps inside the root."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 8, generator=generator) + 2.0  # a mean far from 0: subtracting it shows
    weight = torch.rand(8, generator=generator) + 0.5
    got = assert_tensor(rms_norm(x, weight, 1e-5), "rms_norm(x, weight, 1e-5)")
    assert_shape(got, x.shape, "rms_norm(x, weight, 1e-5)")
    expected = rms_norm_oracle(x, weight, 1e-5)
    if _differs(got, expected):
        centred = x - x.mean(-1, keepdim=True)
        if not _differs(got, rms_norm_oracle(centred, weight, 1e-5)) or not _differs(
                got, (centred / torch.sqrt(centred.var(-1, unbiased=False, keepdim=True) + 1e-5) * weight).double()):
            fail("your rms_norm subtracts the mean first: that is LayerNorm (without its bias). RMSNorm divides x itself "
                 "by its root mean square, sqrt(mean(x^2) + eps), and subtracts nothing")
        if not _differs(got, rms_norm_oracle(x, torch.ones(8), 1e-5)):
            fail("your rms_norm ignores weight: multiply the normalised x by the learned gain")
        if not _differs(got, rms_norm_oracle(x, 1.0 + weight, 1e-5)):
            fail("your rms_norm multiplies by (1 + weight): that is Gemma's convention, whose checkpoints store the gain "
                 "minus 1. Llama's RMSNorm (and Hugging Face's LlamaRMSNorm) multiplies by weight itself")
        squares = x.double() ** 2
        if not _differs(got, x.double() / torch.sqrt(squares.sum(-1, keepdim=True) / 7 + 1e-5) * weight.double()):
            fail("your rms_norm divides the sum of squares by n - 1 (8 - 1 here), as an unbiased variance does: the "
                 "root MEAN square divides by n, mean(x^2)")
        if not _differs(got, x.double() / torch.sqrt(squares.sum(-1, keepdim=True) + 1e-5) * weight.double()):
            fail("your rms_norm divides by the Euclidean norm, sqrt(sum(x^2)): RMSNorm divides by the root MEAN square, "
                 "sqrt(mean(x^2) + eps), so that a vector of ones stays ones")
        for dim in (0, 1):
            if not _differs(got, x.double() / torch.sqrt(squares.mean(dim, keepdim=True) + 1e-5) * weight.double()):
                fail(f"your rms_norm takes the mean of the squares over axis {dim}: each vector is normalised on its own, "
                     "over its features, the last axis (mean(x ** 2, dim=-1, keepdim=True))")
        worst = (got.double() - expected).abs().max().item()
        fail(f"rms_norm(x, weight, 1e-5) differs from x / sqrt(mean(x^2) + eps) * weight by up to {worst:.3g} "
             "(the mean of the squares over the last axis only)")
    small = 1e-3 * torch.randn(4, 16, generator=generator)  # root mean square ~1e-3: eps = 1e-5 matters here
    got = rms_norm(small, torch.ones(16), 1e-5)
    expected = rms_norm_oracle(small, torch.ones(16), 1e-5)
    if _differs(got, expected, 1e-3):
        outside = small.double() / (torch.sqrt((small.double() ** 2).mean(-1, keepdim=True)) + 1e-5)
        if not _differs(got, outside, 1e-3):
            fail("for inputs of root mean square ~1e-3 your rms_norm adds eps outside the square root: "
                 "x / (sqrt(mean(x^2)) + eps). eps goes inside: x / sqrt(mean(x^2) + eps), as in Hugging Face's LlamaRMSNorm")
        if not _differs(got, small.double() / torch.sqrt((small.double() ** 2).mean(-1, keepdim=True)), 1e-3):
            fail("for inputs of root mean square ~1e-3 your rms_norm ignores eps: x / sqrt(mean(x^2) + eps), with eps "
                 "inside the square root (it also keeps an all-zero vector finite)")
        fail(f"for inputs of root mean square ~1e-3 your rms_norm differs from x / sqrt(mean(x^2) + eps) by up to "
             f"{(got.double() - expected).abs().max().item():.3g}: is eps used, and inside the square root?")
    zero = rms_norm(torch.zeros(2, 4), torch.ones(4), 1e-5)
    if not torch.isfinite(zero).all():
        fail("rms_norm of an all-zero vector gives NaN or infinity: eps inside the square root keeps it finite (0)")
    passed("rms_norm")


def check_swiglu(swiglu) -> None:
    """Visible checks for chapter 11, exercise 2: SiLU on the gate, times the up projection, projected down."""
    generator = torch.Generator().manual_seed(12)
    C, F_ = 6, 10
    x = torch.randn(2, 3, C, generator=generator)
    w_gate, w_up = torch.randn(F_, C, generator=generator), torch.randn(F_, C, generator=generator)
    w_down = torch.randn(C, F_, generator=generator)
    got = call_learner(lambda: swiglu(x, w_gate, w_up, w_down),  # a shape error: most often a weight the wrong way round
                       f"swiglu(x, w_gate, w_up, w_down) for x (2, 3, {C}), w_gate and w_up ({F_}, {C}), w_down ({C}, {F_})",
                       "the weights are nn.Linear-shaped (out, in): x W_gate^T and x W_up^T are (..., F), and the product "
                       "goes down through W_down^T, F.linear(h, w_down), not w_down itself")
    got = assert_tensor(got, "swiglu(x, w_gate, w_up, w_down)")
    assert_shape(got, x.shape, "swiglu(x, w_gate, w_up, w_down)")
    expected = swiglu_oracle(x, w_gate, w_up, w_down)
    if _differs(got, expected):
        if not _differs(got, swiglu_oracle(x, w_up, w_gate, w_down)):
            fail("your swiglu swaps the gate and up projections: SiLU goes on x W_gate^T, and the result multiplies "
                 "x W_up^T (which stays linear). The two are not interchangeable for given weights")
        xd = x.double()
        gelu = (torch.nn.functional.gelu(xd @ w_gate.double().T) * (xd @ w_up.double().T)) @ w_down.double().T
        if not _differs(got, gelu):
            fail("your swiglu uses GELU on the gate (that is GEGLU); SwiGLU uses SiLU, a * sigmoid(a)")
        sig = (torch.sigmoid(xd @ w_gate.double().T) * (xd @ w_up.double().T)) @ w_down.double().T
        if not _differs(got, sig):
            fail("your swiglu uses sigmoid(a) on the gate (that is GLU); SwiGLU uses SiLU, a * sigmoid(a)")
        a = xd @ w_gate.double().T
        product = a * (xd @ w_up.double().T)
        if not _differs(got, (product * torch.sigmoid(product)) @ w_down.double().T):
            fail("your swiglu applies SiLU to the product of the two projections: SiLU goes on the gate alone, "
                 "SiLU(x W_gate^T), and then multiplies x W_up^T")
        if not _differs(got, (a * torch.sigmoid(a)) @ w_down.double().T):
            fail("your swiglu leaves out the up projection: SiLU(x W_gate^T) must be multiplied, element by element, by x W_up^T")
        up = xd @ w_up.double().T
        if not _differs(got, (a * torch.sigmoid(a) * up * torch.sigmoid(up)) @ w_down.double().T):
            fail("your swiglu applies SiLU to both projections: only the gate goes through SiLU; x W_up^T stays linear")
        if not _differs(got, (a * torch.sigmoid(a) + up) @ w_down.double().T):
            fail("your swiglu adds the two projections: the gate MULTIPLIES, element by element, SiLU(x W_gate^T) * x W_up^T")
        if not _differs(got, (torch.relu(a) * up) @ w_down.double().T):
            fail("your swiglu uses ReLU on the gate (that is ReGLU); SwiGLU uses SiLU, a * sigmoid(a)")
        fail(f"swiglu differs from (SiLU(x W_gate^T) * (x W_up^T)) W_down^T by up to {(got.double() - expected).abs().max().item():.3g}")
    passed("swiglu")


def check_rope_to_half(rope_to_half) -> None:
    """Visible checks for chapter 11, exercise 3: within each head, the even rows first, then the odd rows."""
    n_heads, d_head, C = 2, 8, 3
    weight = torch.arange(n_heads * d_head * C, dtype=torch.float32).reshape(n_heads * d_head, C)  # row r holds 3r, 3r+1, 3r+2
    given = weight.clone()
    got = assert_tensor(rope_to_half(given, n_heads), "rope_to_half(weight, 2)")
    if not torch.equal(given, weight):
        fail("rope_to_half changed the weight it was given: return a new tensor (weight[order]), and leave the "
             "caller's weight as it was (the Hugging Face state dict it came from still uses it)")
    assert_shape(got, weight.shape, "rope_to_half(weight, 2) for a (16, 3) weight")
    expected = weight[half_rows(n_heads, d_head)]
    if not torch.equal(got, expected):
        rows = [int(r) // C for r in got[:, 0].tolist()] if torch.equal(got[:, 0] % C, torch.zeros(len(got))) else None
        if rows == half_rows(1, n_heads * d_head):
            fail("rope_to_half permutes the rows of the whole matrix as one head: the pairs live inside each head. "
                 "Reorder rows 0..7 of head 0, then rows 8..15 of head 1, each on its own")
        if rows == [h * d_head + r for h in range(n_heads) for r in [0, 4, 1, 5, 2, 6, 3, 7]]:
            fail("rope_to_half applies the inverse permutation (half -> interleaved): row j of a head's result must be "
                 "row 2j for j < Dh/2, and row Dh/2 + j must be row 2j + 1")
        if rows == list(range(n_heads * d_head)):
            fail("rope_to_half returns the rows in their old order: with those weights, half-split RoPE pairs the wrong features")
        fail(f"rope_to_half(weight, 2) for a (16, 3) weight (two heads of 8 rows): expected the rows in the order "
             f"{half_rows(n_heads, d_head)}, got {rows if rows is not None else 'other values'}")
    passed("rope_to_half")


def check_expand_kv_heads(expand_kv_heads) -> None:
    """Visible checks for chapter 11, exercise 4: head h of the result is key/value head h // n_rep (grouped)."""
    kv = torch.arange(2 * 3 * 4 * 2, dtype=torch.float32).reshape(2, 3, 4, 2)  # (B, H_kv, T, Dh) = (2, 3, 4, 2)
    got = assert_tensor(expand_kv_heads(kv, 2), "expand_kv_heads(kv, 2)")
    if tuple(got.shape) == (2, 3, 8, 2):
        fail("expand_kv_heads(kv, 2) for kv of shape (B, H_kv, T, Dh) = (2, 3, 4, 2) repeats along the time axis: "
             "the heads are axis 1, the result is (2, 6, 4, 2)")
    assert_shape(got, (2, 6, 4, 2), "expand_kv_heads(kv, 2) for kv of shape (2, 3, 4, 2)")
    expected = torch.stack([kv[:, h // 2] for h in range(6)], dim=1)
    if not torch.equal(got, expected):
        if torch.equal(got, kv.repeat(1, 2, 1, 1)):
            fail("expand_kv_heads tiles the heads (k0 k1 k2 k0 k1 k2): each key/value head serves a GROUP of "
                 "consecutive query heads, so head h of the result must be key/value head h // n_rep (k0 k0 k1 k1 k2 k2)")
        fail("expand_kv_heads(kv, 2): head h of the result should be key/value head h // 2, for h = 0 .. 5")
    if not torch.equal(expand_kv_heads(kv, 1), kv):
        fail("expand_kv_heads(kv, 1) should return the heads unchanged (multi-head attention: one key/value head per query head)")
    passed("expand_kv_heads")


# ----------------------------------------------------------------------------- exercise 5: the conversion both ways

_SIZES = dict(vocab_size=37, n_layer=2, n_head=4, n_embd=32, n_kv_head=2, intermediate_size=48)  # Dh = 8, two query heads per key/value head
_EPS, _THETA = 1e-3, 500.0  # far from both defaults (ours 1e-5 and 10,000; Hugging Face's 1e-6 and 10,000)
_ATTN = "model.layers.0.self_attn."


def _random_gains(model):
    """Norm gains away from 1 (their init), so that a norm copied to the wrong place shows in the logits."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(torch.rand_like(parameter) + 0.5)
    return model.eval()


def _hf_llama(transformers, window=None, n_layer=2, **settings):
    """Hugging Face's model of the check's sizes, built from its own configuration (the oracle for llama_from_hf);
    settings override its configuration (hidden_act="gelu": a model ours cannot be)."""
    sizes = dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=n_layer, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=_EPS,
                 rope_parameters={"rope_type": "default", "rope_theta": _THETA}, tie_word_embeddings=False, **settings)
    if window is None:
        return _random_gains(transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)))
    return _random_gains(transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=window, **sizes)))


def _snapshot(model) -> dict:
    return {name: value.clone() for name, value in model.state_dict().items()}


def _unchanged(model, before: dict, who: str) -> None:
    for name, value in model.state_dict().items():
        if not torch.equal(value, before[name]):
            fail(f"{who} changed the model it was given ({name}): permute and copy new tensors, and leave the "
                 "model you were handed as it was")


def _compare_logits(got_model, expected_model, name: str) -> None:
    idx = torch.randint(0, _SIZES["vocab_size"], (2, 12))  # 12 tokens: longer than the window of 4 below
    with torch.no_grad():
        got, expected = got_model(idx), expected_model(idx)
    got, expected = (out.logits if hasattr(out, "logits") else out[0] for out in (got, expected))
    assert_close(got, expected, name)


def _diagnose_rows(q, k, v, original_q, original_k, original_v, who: str, permute: str) -> None:
    """Name the classic mistakes of the W_q, W_k, W_v rows, given the converted and the original matrices of layer 0.
    Expected: q = original_q[half_rows(H, Dh)] and k = original_k[half_rows(H_kv, Dh)] (to the half layout), v unchanged;
    the inverse permutation gives original_q = q[half_rows(H, Dh)] instead."""
    H, H_kv, Dh = _SIZES["n_head"], _SIZES["n_kv_head"], _SIZES["n_embd"] // _SIZES["n_head"]
    if torch.equal(q, original_q) and torch.equal(k, original_k):
        fail(f"{who} copies W_q and W_k without the permutation: the interleaved layout rotates the feature pairs "
             f"(2i, 2i + 1), Hugging Face's the pairs (i, i + Dh/2). The rows of W_q and W_k must be permuted within "
             f"each head ({permute}); without it nothing fails loudly, the logits are just wrong")
    if torch.equal(v, original_v[half_rows(H_kv, Dh)]) or torch.equal(original_v, v[half_rows(H_kv, Dh)]):
        fail(f"{who} permutes the rows of W_v too: RoPE rotates queries and keys only, and the values (like W_o and "
             "the MLP) are copied as they are")
    if torch.equal(original_q, q[half_rows(H, Dh)]) and torch.equal(original_k, k[half_rows(H_kv, Dh)]):
        inverse = "rope_to_interleaved" if "rope_to_half" in permute else "rope_to_half"
        fail(f"{who} permutes W_q and W_k the wrong way, with {inverse}: rope_to_half takes the interleaved layout to "
             f"Hugging Face's half layout and rope_to_interleaved undoes it, and the two differ as soon as Dh >= 8 "
             f"(here Dh = {Dh}). This direction needs {permute}")
    if torch.equal(q, original_q):
        fail(f"{who} permutes W_k but not W_q: both are rotated, so both need the permutation ({permute})")
    if torch.equal(k, original_k):
        fail(f"{who} permutes W_q but not W_k: both are rotated, so both need the permutation ({permute}), "
             "W_k with n_kv_head heads")
    wrong_heads = half_rows(H, H_kv * Dh // H)  # W_k's rows cut into n_head "heads" of H_kv Dh / H rows
    if torch.equal(k, original_k[wrong_heads]) or torch.equal(original_k, k[wrong_heads]):
        fail(f"{who} permutes W_k as if it had n_head = {H} heads: W_k has n_kv_head = {H_kv} heads of Dh = {Dh} rows "
             f"(grouped-query attention), so its permutation works head by head over {H_kv} heads")


def _check_to_hf(llama_to_hf, transformers) -> None:
    from ..llama import Llama, LlamaConfig

    config = LlamaConfig(block_size=16, eps=_EPS, rope_base=_THETA, rope_layout="interleaved", **_SIZES)
    ours = _random_gains(Llama(config))
    before = _snapshot(ours)
    what = (f"llama_to_hf(model) for a model with rope_layout='interleaved', n_head = {config.n_head}, "
            f"n_kv_head = {config.n_kv_head}, eps = {_EPS}, rope_base = {_THETA:g}")
    theirs = call_learner(lambda: llama_to_hf(ours), what,
                          "Hugging Face's configuration must give its model our shapes: hidden_size, intermediate_size, "
                          "num_attention_heads, num_key_value_heads, vocab_size, num_hidden_layers")
    if not isinstance(theirs, transformers.LlamaForCausalLM):
        fail(f"{what} should return a transformers.LlamaForCausalLM, got {type(theirs).__name__}")
    _unchanged(ours, before, "llama_to_hf")
    c = theirs.config
    if c.rms_norm_eps != _EPS:
        fail(f"{what}: its rms_norm_eps is {c.rms_norm_eps:g}, the model's eps is {_EPS:g}. Pass eps along: the "
             "defaults differ (ours 1e-5, Hugging Face's 1e-6), and eps changes every norm of the model")
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta")
    if theta != _THETA:
        fail(f"{what}: its rope_theta is {theta}, the model's rope_base is {_THETA:g}. Pass it along in "
             "rope_parameters={'rope_type': 'default', 'rope_theta': ...}: the base sets every rotation's speed")
    if c.tie_word_embeddings or theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr():
        fail(f"{what}: its lm_head is tied to the token embedding (tie_word_embeddings=True). Llama's head is its own "
             "matrix: tie_word_embeddings=False, and lm_head.weight copied from the model's lm_head")
    state, mine = theirs.state_dict(), ours.state_dict()
    _diagnose_rows(*(state[_ATTN + f"{m}_proj.weight"] for m in "qkv"), *(mine[_ATTN + f"{m}_proj.weight"] for m in "qkv"),
                   "llama_to_hf", "rope_to_half(W_q, n_head), rope_to_half(W_k, n_kv_head)")
    Dh = config.head_dim
    for name, value in mine.items():
        heads = config.n_head if name.endswith("q_proj.weight") else config.n_kv_head if name.endswith("k_proj.weight") else 0
        expected = value[half_rows(heads, Dh)] if heads else value
        if name not in state or not torch.equal(state[name], expected):
            fail(f"{what}: Hugging Face's {name} is not the model's " + ("(its rows permuted within each head)" if heads else "(copied as it is)"))
    _compare_logits(theirs, ours, f"the logits of {what}")

    windowed = _random_gains(Llama(LlamaConfig(block_size=16, window=4, **{**_SIZES, "n_layer": 1})))
    theirs = call_learner(lambda: llama_to_hf(windowed), "llama_to_hf(model) for a model with window = 4")
    if not isinstance(theirs, transformers.MistralForCausalLM) or getattr(theirs.config, "sliding_window", None) != 4:
        fail(f"llama_to_hf(model) for a model with window = 4 should return a transformers.MistralForCausalLM with "
             f"sliding_window = 4 (LlamaForCausalLM has no window), got a {type(theirs).__name__} with sliding_window = "
             f"{getattr(theirs.config, 'sliding_window', None)}")
    _compare_logits(theirs, windowed, "the logits of llama_to_hf(model) for a model with window = 4, on 12 tokens")


def _check_from_hf(llama_from_hf, transformers) -> None:
    from ..llama import Llama

    theirs = _hf_llama(transformers)
    before = _snapshot(theirs)
    for layout in ("interleaved", "half"):
        what = f"llama_from_hf(hf_model, {layout!r}) for a LlamaForCausalLM with 4 heads, 2 key/value heads"
        ours = call_learner(lambda: llama_from_hf(theirs, layout), what,
                            "our LlamaConfig must give the model Hugging Face's shapes: n_embd, n_head, n_kv_head, "
                            "intermediate_size, vocab_size, n_layer")
        if not isinstance(ours, Llama):
            fail(f"{what} should return a course_lib.llama.Llama, got {type(ours).__name__}")
        _unchanged(theirs, before, "llama_from_hf")
        expected = dict(rope_layout=layout, eps=_EPS, rope_base=_THETA, n_kv_head=2, block_size=16, window=None)
        for field, value in expected.items():
            if getattr(ours.config, field) != value:
                source = {"rope_layout": "the rope_layout argument", "eps": "rms_norm_eps", "rope_base": "rope_theta",
                          "n_kv_head": "num_key_value_heads", "block_size": "max_position_embeddings",
                          "window": "sliding_window (a LlamaForCausalLM has none)"}[field]
                fail(f"{what}: the model's config.{field} is {getattr(ours.config, field)!r}, expected {value!r}, "
                     f"from Hugging Face's {source}")
        if layout == "interleaved":
            state, hf_state = ours.state_dict(), theirs.state_dict()
            # read backwards: Hugging Face's rows are ours permuted to the half layout
            _diagnose_rows(*(hf_state[_ATTN + f"{m}_proj.weight"] for m in "qkv"), *(state[_ATTN + f"{m}_proj.weight"] for m in "qkv"),
                           "llama_from_hf(hf_model, 'interleaved')", "rope_to_interleaved(W_q, n_head), rope_to_interleaved(W_k, n_kv_head)")
        _compare_logits(ours, theirs, f"the logits of {what}")
    mistral = _hf_llama(transformers, window=4, n_layer=1)
    ours = call_learner(lambda: llama_from_hf(mistral), "llama_from_hf(hf_model) for a MistralForCausalLM with sliding_window = 4")
    if ours.config.window != 4:
        fail(f"llama_from_hf(hf_model) for a MistralForCausalLM with sliding_window = 4: the model's config.window is "
             f"{ours.config.window!r}, expected 4 (Hugging Face's sliding_window)")
    _compare_logits(ours, mistral, "the logits of llama_from_hf(hf_model) for a MistralForCausalLM with sliding_window = 4, on 12 tokens")
    for setting, word, why in ((dict(hidden_act="gelu"), "hidden_act", "our Llama (SiLU gate) cannot represent GELU"),
                               (dict(mlp_bias=True), "bias", "our Llama's MLP has no biases")):
        shown = ", ".join(f"{key}={value!r}" for key, value in setting.items())
        refused = _hf_llama(transformers, n_layer=1, **setting)
        try:
            llama_from_hf(refused)
        except ValueError as error:
            if word not in str(error):
                fail(f"llama_from_hf(hf_model) for a LlamaForCausalLM with {shown} raised ValueError({str(error)!r}): "
                     f"name the setting it refuses, {word}")
        except Exception as error:  # noqa: BLE001 - the learner's code may raise anything; say what was expected
            fail(f"llama_from_hf(hf_model) for a LlamaForCausalLM with {shown} raised {type(error).__name__} "
                 f"({' '.join(str(error).split())[:120]}), expected a ValueError naming {word} ({why}): check the settings first")
        else:
            fail(f"llama_from_hf(hf_model) converted a LlamaForCausalLM with {shown}, which {why}: it would be "
                 f"another function, with no error. Raise a ValueError naming {word}, and likewise for the other "
                 "settings of the docstring (scaled RoPE, biases, head_dim)")


def check_llama_conversion(llama_to_hf, llama_from_hf) -> None:
    """Visible checks for chapter 11, exercise 5: our Llama to Hugging Face's and back, with grouped-query heads,
    the interleaved RoPE layout, eps and rope_base away from every default, an untied head and a sliding window;
    a GELU model and one with MLP biases refused."""
    import transformers

    from ..llama import Llama, LlamaConfig

    with torch.random.fork_rng():  # the check's random models leave the notebook's random numbers as they were
        torch.manual_seed(11)
        _check_to_hf(llama_to_hf, transformers)
        _check_from_hf(llama_from_hf, transformers)
        config = LlamaConfig(block_size=16, eps=_EPS, rope_base=_THETA, rope_layout="interleaved", **_SIZES)
        ours = _random_gains(Llama(config))
        back = call_learner(lambda: llama_from_hf(llama_to_hf(ours), "interleaved"), "llama_from_hf(llama_to_hf(model), 'interleaved')")
        if back.config != config:
            fail(f"llama_from_hf(llama_to_hf(model), 'interleaved') has config {back.config}, expected the model's {config}")
        for (name, value), mine in zip(back.state_dict().items(), ours.state_dict().values()):
            if not torch.equal(value, mine):
                fail(f"llama_from_hf(llama_to_hf(model), 'interleaved'): {name} is not the model's: the two "
                     "conversions must undo each other exactly (rope_to_interleaved undoes rope_to_half)")
    passed("llama_to_hf and llama_from_hf")
