"""Visible checks of chapter 04 (GPT), and the independent oracles they compare against.

Oracles: Hugging Face's ``GPT2LMHeadModel`` holding the learner's weights (``hf_logits``, converted by
``course_lib.hf.to_hf``, which reads only the state_dict and the config), a float64 GPT forward written with
``torch.nn.functional`` only (``gpt_forward_oracle``, ``causal_attention_oracle``:
``F.scaled_dot_product_attention(is_causal=True)``), the stated initialisation tested statistically
(``assert_gpt2_init``), and a parameter count of the same architecture from PyTorch's own modules
(``gpt_param_count_oracle``: ``nn.TransformerEncoderLayer``, ``nn.LayerNorm``); never course_lib's reference
solutions.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..gpt import IGNORE_INDEX  # a constant (plain data, no reference solution)
from .core import assert_close, assert_shape, assert_tensor, fail, passed, unpack_pair

__all__ = ["assert_gpt2_init", "check_causal_self_attention", "check_gpt", "check_gpt_param_count", "causal_attention_oracle",
           "gpt2_state_dict_names", "gpt_forward_oracle", "gpt_param_count_oracle", "hf_gpt2", "hf_logits", "randomize_as_gpt2",
           "randomize_gpt"]


def randomize_gpt(module: nn.Module, seed: int, scale: float = 0.2) -> nn.Module:
    """Overwrite every parameter in place with seeded noise (LayerNorm gains 1 + noise); ties survive (in-place copies).

    The checks then depend neither on the global random state nor on the initialisation (zero biases
    and unit gains would hide a forgotten bias or gain).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            noise = torch.randn(parameter.shape, generator=gen) * scale
            parameter.copy_(1.0 + noise if "ln" in name and name.endswith("weight") else noise)
    return module.eval()


def randomize_as_gpt2(model: nn.Module, seed: int) -> nn.Module:
    """randomize_gpt, then lm_head.weight made equal to transformer.wte.weight where it is a separate matrix.

    GPT-2's weights whatever the tie: a head that is a copy of the embedding is the tying test's business,
    so it fails no test of the logits or the loss as well.
    """
    randomize_gpt(model, seed)
    head, embedding = model.lm_head.weight, model.transformer.wte.weight
    if head is not embedding and head.shape == embedding.shape:
        with torch.no_grad():
            head.copy_(embedding)
    return model


def hf_gpt2(model: nn.Module):
    """Hugging Face's GPT2LMHeadModel (eval mode) holding model's weights.

    course_lib.hf.to_hf converts by name (GPT-2's names, transposing the Conv1D matrices) from model.state_dict()
    and model.config alone; a state_dict without GPT-2's names fails there, with a message saying which.
    """
    from ..hf import to_hf  # transformers is imported on first use only

    try:
        return to_hf(model)
    except RuntimeError as error:
        fail(f"your GPT does not convert to Hugging Face's GPT2LMHeadModel: {error}")


def hf_logits(model: nn.Module, idx) -> torch.Tensor:
    """The logits (B, T, V), float32, of Hugging Face's GPT2LMHeadModel holding model's weights (``hf_gpt2``)."""
    hf_model = hf_gpt2(model)
    with torch.no_grad():
        return hf_model(idx).logits


def causal_attention_oracle(c_attn_weight, c_attn_bias, c_proj_weight, c_proj_bias, x, n_head: int,
                            scale: float | None = None):
    """Float64 causal self-attention from the fused projection's weights: x (B, T, C) -> (B, T, C).

    Uses torch.nn.functional.scaled_dot_product_attention(is_causal=True) on each head; ``scale`` (default
    1/sqrt(Dh)) multiplies the scores (the checks pass other scales to name a wrong one).
    """
    x = x.double()
    B, T, C = x.shape
    qkv = F.linear(x, c_attn_weight.double(), None if c_attn_bias is None else c_attn_bias.double())
    q, k, v = (t.reshape(B, T, n_head, C // n_head).permute(0, 2, 1, 3) for t in qkv.split(C, dim=-1))
    heads = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)  # (B, H, T, Dh)
    merged = heads.permute(0, 2, 1, 3).reshape(B, T, C)
    return F.linear(merged, c_proj_weight.double(), None if c_proj_bias is None else c_proj_bias.double())


def _attention_oracle_of(module, x, n_head, scale=None):
    return causal_attention_oracle(module.c_attn.weight.detach(), _bias(module.c_attn), module.c_proj.weight.detach(),
                                   _bias(module.c_proj), x, n_head, scale)


def _close(actual, expected) -> bool:
    return bool(torch.allclose(actual.double(), expected.double(), rtol=1e-4, atol=1e-5))


def _bias(linear):
    return None if linear.bias is None else linear.bias.detach()


def gpt_forward_oracle(model: nn.Module, idx, positions: bool = True, final_norm: bool = True, gelu: str = "tanh",
                       post_ln: bool = False):
    """Float64 logits (B, T, V) of a GPT with GPT-2's parameter names, written with torch.nn.functional only.

    positions=False leaves out the position embedding, final_norm=False the final LayerNorm ln_f, gelu="none"
    uses the exact GELU, post_ln=True normalises after each residual addition (the post-LN block): the checks
    compare with these to name a mistake.
    """
    s = {name: p.detach().double() for name, p in model.named_parameters(remove_duplicate=False)}
    get = s.get
    cfg = model.config
    B, T = idx.shape
    x = F.embedding(idx, s["transformer.wte.weight"]) + (s["transformer.wpe.weight"][:T] if positions else 0)
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        ln_1 = lambda h: F.layer_norm(h, (cfg.n_embd,), s[p + "ln_1.weight"], get(p + "ln_1.bias"), 1e-5)  # noqa: E731
        ln_2 = lambda h: F.layer_norm(h, (cfg.n_embd,), s[p + "ln_2.weight"], get(p + "ln_2.bias"), 1e-5)  # noqa: E731
        attn = lambda h: causal_attention_oracle(s[p + "attn.c_attn.weight"], get(p + "attn.c_attn.bias"),  # noqa: E731
                                                 s[p + "attn.c_proj.weight"], get(p + "attn.c_proj.bias"), h, cfg.n_head)
        mlp = lambda h: F.linear(F.gelu(F.linear(h, s[p + "mlp.c_fc.weight"], get(p + "mlp.c_fc.bias")),  # noqa: E731
                                        approximate=gelu), s[p + "mlp.c_proj.weight"], get(p + "mlp.c_proj.bias"))
        if post_ln:
            x = ln_1(x + attn(x))
            x = ln_2(x + mlp(x))
        else:
            x = x + attn(ln_1(x))
            x = x + mlp(ln_2(x))
    if final_norm:
        x = F.layer_norm(x, (cfg.n_embd,), s["transformer.ln_f.weight"], get("transformer.ln_f.bias"), 1e-5)
    return x @ s["lm_head.weight"].T


def gpt_param_count_oracle(config, tied: bool = True) -> int:
    """The parameters of GPT(config), counted on PyTorch's own modules.

    nn.TransformerEncoderLayer(C, H, 4C) holds exactly a GPT block's parameters: a fused (3C, C)
    input projection, the output projection, the two MLP matrices and two LayerNorms (with or
    without biases). One layer is built (on the CPU: a meta-device build would wrap torch.manual_seed,
    which the grader's integrity check reports) and counted, times n_layer; then the final
    nn.LayerNorm, and the two embedding tables (V, C) and (block_size, C), plus a bias-free (V, C)
    head when untied.
    """
    C = config.n_embd
    layer = nn.TransformerEncoderLayer(C, config.n_head, 4 * C, bias=config.bias)
    per_layer = sum(p.numel() for p in layer.parameters())
    final_norm = sum(p.numel() for p in nn.LayerNorm(C, bias=config.bias).parameters())
    embeddings = config.vocab_size * C + config.block_size * C
    head = 0 if tied else config.vocab_size * C
    return embeddings + config.n_layer * per_layer + final_norm + head


def gpt2_state_dict_names(config, prefix: str = "") -> set[str]:
    """The entries of a GPT-2 state_dict with this config's sizes (the names of course_lib.gpt and the shipped checkpoints).

    Written out from GPT-2's layout, not read from a model: wte, wpe, per block ln_1, attn.c_attn, attn.c_proj,
    ln_2, mlp.c_fc, mlp.c_proj, then ln_f and lm_head (tied to wte, but a state_dict lists it too); biases
    only when config.bias. ``prefix`` "transformer.h.0.attn." gives one attention module's names without it.
    """
    weights_and_biases = lambda name: {f"{name}.weight"} | ({f"{name}.bias"} if config.bias else set())  # noqa: E731
    names = {"transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"} | weights_and_biases("transformer.ln_f")
    for i in range(config.n_layer):
        for part in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            names |= weights_and_biases(f"transformer.h.{i}.{part}")
    return {name[len(prefix):] for name in names if name.startswith(prefix)}


def _check_names(module, expected: set[str], what: str) -> None:
    """A clear failure if module's state_dict has entries beyond (or short of) GPT-2's names."""
    names = set(module.state_dict())
    extra, missing = sorted(names - expected), sorted(expected - names)
    if extra or missing:
        fail(f"{what}'s state_dict has {'the extra entries ' + str(extra) if extra else 'no extra entries'}"
             f"{' and lacks ' + str(missing) if missing else ''}: it must hold exactly GPT-2's parameters (the names the "
             "shipped checkpoints are saved with), or the shipped model cannot load into it. A tensor that is not a "
             "parameter (a causal mask, positions) belongs in forward, or in a buffer registered with persistent=False.")


def _config(**sizes):
    from ..gpt import GPTConfig  # the config dataclass only (plain data, no reference solution)

    return GPTConfig(**sizes)


def _name_position_0_error(attn, x, first_error: float) -> None:
    """Position 0 is off: tell a head split that mixes channels from a mask that leaves out the diagonal.

    A single token attends to itself alone, with weight 1, whatever its query and key: the right output is
    c_proj of its own value. A head split that mixes positions (a plain reshape to (B, H, T, Dh)) is right
    there; one that reads q or k channels as values (a per-head view(B, T, H, 3 * Dh)) depends on the q and
    k weights; a mask without the diagonal is wrong there with neither.
    """
    import copy

    C = x.shape[-1]
    one = x[:, :1]
    with torch.no_grad():
        y_one = attn(one)
        single_error = (y_one.double() - _attention_oracle_of(attn, one, 2)).abs().max().item()
        other_qk = copy.deepcopy(attn)
        other_qk.c_attn.weight[:2 * C] += 1.0  # the q and k rows of the fused projection only
        reads_qk = (other_qk(one) - y_one).abs().max().item() > 1e-6
    if single_error <= 1e-4:
        fail(f"your output at position 0 is off by {first_error:.3g} in a sequence of {x.shape[1]} tokens, but right for a "
             "single token: in a sequence your heads mix up channels and positions. Is the head split wrong? A plain "
             "reshape/view(B, H, T, Dh) of (B, T, C) lays a head's channels out as positions: split each of q, k, v with "
             "view(B, T, H, Dh).transpose(1, 2), and merge the heads back with transpose(1, 2).reshape(B, T, C)")
    if reads_qk:
        fail(f"your output for a single token is off by {single_error:.3g} and changes with the q and k weights: one "
             "token attends to itself alone, with weight 1, so its output is c_proj of its own value whatever q and k "
             "are. Your values take channels of q or k: is the head split wrong? c_attn(x) is [q | k | v], C channels "
             "each: split it with .split(C, dim=2) first, then each into heads with view(B, T, H, Dh).transpose(1, 2) "
             "(a per-head view(B, T, H, 3 * Dh) reads the wrong channels)")
    fail(f"your output at position 0 is off by {first_error:.3g}: position 0 must attend to itself, with weight 1 "
         "(does your mask leave out the diagonal?)")


def check_causal_self_attention(CausalSelfAttention) -> None:
    """Visible checks for chapter 04, exercise 1: shapes, no peeking at the future, the float64 oracle, GPT-2's names."""
    config = _config(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=8)
    attn = randomize_gpt(CausalSelfAttention(config), seed=401)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(402))
    with torch.no_grad():
        y = attn(x)
        assert_tensor(y, "CausalSelfAttention(x)")
        assert_shape(y, (2, 5, 8), "the output for x of shape (B, T, C) = (2, 5, 8)")
        changed = x.clone()
        changed[:, 3:] += 1.0  # change only the tokens at positions 3 and 4
        leak = (attn(changed)[:, :3] - y[:, :3]).abs().max().item()
    if leak > 1e-6:
        fail(f"changing the inputs at positions 3 and 4 changed your outputs at positions 0-2 by up to {leak:.3g}: "
             "position t must not see positions after t (is the causal mask missing, inverted or shifted up by one? "
             "Or are the heads split without a transpose: view(B, H, T, Dh) mixes positions into a head's channels; "
             "split with view(B, T, H, Dh).transpose(1, 2))")
    expected = _attention_oracle_of(attn, x, 2)
    first_error = (y[:, 0].double() - expected[:, 0]).abs().max().item()
    if first_error > 1e-4:
        _name_position_0_error(attn, x, first_error)
    for scale, mistake in ((1 / math.sqrt(8), "1/sqrt(C) = 1/sqrt(n_embd), the model's width"), (1.0, "nothing (no scale at all)"),
                           (1 / 8, "1/C")):
        if not _close(y, expected) and _close(y, _attention_oracle_of(attn, x, 2, scale)):
            fail(f"your scores are scaled by {mistake}; scale them by 1/sqrt(Dh), Dh = C / n_head = 4 the size of one head")
    assert_close(y, expected.float(), "your causal self-attention (2 heads) compared with a float64 oracle")
    _check_names(attn, gpt2_state_dict_names(config, prefix="transformer.h.0.attn."), "your CausalSelfAttention")
    passed("CausalSelfAttention")


def _assert_normal(values: torch.Tensor, std: float, what: str, rule: str = "") -> None:
    """values look like independent draws from N(0, std^2): their mean, their standard deviation and the share of
    them within one std of 0 (68.3% for a normal distribution) each within 5 standard errors of n draws. rule, shown
    after the expected standard deviation, says where it comes from."""
    x = values.detach().double().flatten()
    n = x.numel()
    mean, sd, within = x.mean().item(), x.std().item(), (x.abs() < std).double().mean().item()
    normal_within = math.erf(1 / math.sqrt(2))
    if abs(mean) > 5 * std / math.sqrt(n):
        fail(f"{what}: mean {mean:.3g}, expected 0 (to within {5 * std / math.sqrt(n):.2g}, 5 standard errors of {n:,} draws)")
    if abs(sd - std) > 5 * std / math.sqrt(2 * (n - 1)):
        fail(f"{what}: standard deviation {sd:.5f}, expected {std:.5f}{rule} (to within {5 * std / math.sqrt(2 * (n - 1)):.5f}, "
             f"5 standard errors of {n:,} draws)")
    if abs(within - normal_within) > 5 * math.sqrt(normal_within * (1 - normal_within) / n):
        fail(f"{what}: {within:.1%} of the values lie within one standard deviation of 0; for a normal distribution "
             f"{normal_within:.1%} do")


def assert_gpt2_init(model: nn.Module) -> None:
    """The weights of a freshly built GPT follow the GPT-2 paper's initialisation as nanoGPT and Hugging Face implement
    it, judged by GPT-2's parameter names: every Linear and Embedding weight N(0, 0.02^2), except attn.c_proj and
    mlp.c_proj weights N(0, (0.02 / sqrt(2 n_layer))^2), each kind pooled over the layers; Linear biases exactly 0;
    LayerNorm weights exactly 1 and biases exactly 0."""
    named = dict(model.named_parameters(remove_duplicate=False))
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layer)
    kinds = {"transformer.wte.weight": 0.02, "transformer.wpe.weight": 0.02, "lm_head.weight": 0.02,
             "attn.c_attn.weight": 0.02, "mlp.c_fc.weight": 0.02, "attn.c_proj.weight": residual_std,
             "mlp.c_proj.weight": residual_std}
    for kind, std in kinds.items():
        pooled = [p.flatten() for name, p in named.items() if name.endswith(kind)]
        if not pooled:
            fail(f"your GPT has no parameter named ...{kind}")
        rule = f" = 0.02 / sqrt(2 n_layer), n_layer = {model.config.n_layer}" if std != 0.02 else ""
        _assert_normal(torch.cat(pooled), std, f"your initial {kind} weights (N(0, {std:.5f}^2) stated)", rule)
    for name, p in named.items():
        if name.endswith(".bias") and not torch.equal(p, torch.zeros_like(p)):
            fail(f"your initial {name} is not all zeros (every bias starts at 0)")
        if ".ln_" in f".{name}" and name.endswith(".weight") and not torch.equal(p, torch.ones_like(p)):
            fail(f"your initial {name} is not all ones (a LayerNorm starts as weight 1, bias 0)")


def check_gpt(GPT) -> None:
    """Visible checks for chapter 04, exercise 2: GPT-2's names (the converter and the shipped checkpoint need them),
    the tie, the initialisation (assert_gpt2_init, on a 2-layer model), (logits, loss), the logits against Hugging Face's GPT2LMHeadModel with the same weights, and the loss
    against F.cross_entropy of those logits."""
    config = _config(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=8)
    torch.manual_seed(403)
    model = GPT(config)
    if not (hasattr(model, "lm_head") and hasattr(model, "transformer")):
        fail("your GPT should have the attributes transformer (with wte, wpe, h, ln_f) and lm_head; "
             f"it has {sorted(name for name, _ in model.named_children())}")
    if getattr(model, "config", None) != config:
        fail("your GPT should keep its GPTConfig as model.config (the converter reads the sizes there)")
    if model.lm_head.weight is not model.transformer.wte.weight:
        fail("model.lm_head.weight is not model.transformer.wte.weight: the LM head must share the token embedding's "
             "Parameter (assign the Parameter itself, after both modules exist, and never replace it afterwards)")
    _check_names(model, gpt2_state_dict_names(config), "your GPT")
    torch.manual_seed(406)  # a larger fresh model, so that a wrong distribution stands out from sampling noise
    assert_gpt2_init(GPT(_config(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)))
    randomize_gpt(model, seed=404)
    gen = torch.Generator().manual_seed(405)
    idx, targets = torch.randint(0, 13, (3, 6), generator=gen), torch.randint(0, 13, (3, 6), generator=gen)
    expected = hf_logits(model, idx)
    with torch.no_grad():
        logits, loss = unpack_pair(model(idx), "GPT.forward(idx)", ("logits", "loss"))
        if loss is not None:
            fail(f"GPT.forward(idx) without targets should return (logits, None), got a loss of {loss!r}")
        assert_shape(logits, (3, 6, 13), "the logits for idx of shape (B, T) = (3, 6) and a vocabulary of 13")
        if not _close(logits, expected):
            for mistake, kwargs in (("without the position embedding (add transformer.wpe of positions 0..T-1)", dict(positions=False)),
                                    ("without the final LayerNorm (apply transformer.ln_f before lm_head)", dict(final_norm=False)),
                                    ("with the exact GELU; GPT-2's is the tanh approximation (F.gelu(x, approximate='tanh'))",
                                     dict(gelu="none")),
                                    ("of post-LN blocks (LayerNorm after each residual addition); GPT-2's blocks are pre-LN: "
                                     "x + attn(ln_1(x)), then x + mlp(ln_2(x))", dict(post_ln=True))):
                if _close(logits, gpt_forward_oracle(model, idx, **kwargs)):
                    fail(f"your logits are those of a GPT {mistake}")
        assert_close(logits, expected, "your logits compared with Hugging Face's GPT2LMHeadModel holding your weights")
        logits, loss = unpack_pair(model(idx, targets), "GPT.forward(idx, targets)", ("logits", "loss"))
    assert_tensor(loss, "the loss")
    assert_shape(loss, (), "the loss (a scalar: the mean over every position)")
    expected = expected.double()
    expected_loss = F.cross_entropy(expected.reshape(-1, 13), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    wrong_losses = {
        "against the inputs idx, not the targets": F.cross_entropy(expected.reshape(-1, 13), idx.reshape(-1)),
        "with the targets shifted a second time (logits[:, :-1] against targets[:, 1:]); targets[b, t] is already "
        "the token after idx[b, t]": F.cross_entropy(expected[:, :-1].reshape(-1, 13), targets[:, 1:].reshape(-1)),
        "summed, not averaged over the positions": F.cross_entropy(expected.reshape(-1, 13), targets.reshape(-1), reduction="sum"),
    }
    if not _close(loss, expected_loss):
        for mistake, wrong in wrong_losses.items():
            if _close(loss, wrong):
                fail(f"your loss is the cross-entropy {mistake}")
    assert_close(loss, expected_loss.float(), "your loss compared with F.cross_entropy of Hugging Face's logits")
    passed("GPT")


def _named_difference(difference: int, config, tied: bool) -> str:
    """What a parameter count off by `difference` most likely got wrong, or ''."""
    V, T, L, C = config.vocab_size, config.block_size, config.n_layer, config.n_embd
    biases = L * 11 * C + C  # every Linear's bias and every LayerNorm's bias
    known = {
        V * C: "the LM head counted although it is tied to the token embedding (one shared matrix, counted once)"
               if tied else "the LM head counted twice",
        -V * C: "the untied LM head left out (tied=False adds a (V, C) matrix, without bias)",
        -T * C: "the position embedding wpe (block_size x C) left out",
        -2 * C: "the final LayerNorm ln_f (a weight and a bias of C each) left out",
        -C: "the final LayerNorm's weight or bias left out",
        biases: "biases counted although config.bias is False (no bias in any Linear or LayerNorm)",
        -biases: "the biases left out although config.bias is True",
        -L * (6 * C * C + (3 * C if config.bias else 0)): "the MLP made C wide instead of 4C (c_fc is C x 4C, c_proj 4C x C)",
    }
    return f": {known[difference]}" if difference in known else ""


def check_gpt_param_count(gpt_param_count) -> None:
    """Visible checks for chapter 04, exercise 3: the course model's size, tied and untied, with and without biases."""
    for bias in (True, False):
        config = _config(vocab_size=103, block_size=128, n_layer=4, n_head=4, n_embd=128, bias=bias)
        for tied in (True, False):
            got, expected = gpt_param_count(config, tied=tied), gpt_param_count_oracle(config, tied=tied)
            if not isinstance(got, int) or isinstance(got, bool):
                fail(f"gpt_param_count should return an int, got {type(got).__name__}")
            if got != expected:
                fail(f"gpt_param_count({config}, tied={tied}) = {got:,}, but the model has {expected:,} parameters "
                     f"(a difference of {got - expected:+,}{_named_difference(got - expected, config, tied)}; "
                     f"C = 128 so C^2 = {128 ** 2:,}, V*C = {103 * 128:,}, block_size*C = {128 * 128:,})")
    passed("gpt_param_count")
