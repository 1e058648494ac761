"""Conversion between course_lib.gpt.GPT and Hugging Face's GPT2LMHeadModel, both ways; (chapter 11) between
course_lib.llama.Llama and Hugging Face's LlamaForCausalLM / MistralForCausalLM, both ways; and (chapter 09) Hugging
Face ``tokenizers``' byte-level BPE, the oracle of course_lib.bpe, trained and read in our ids.

Nothing is downloaded: ``to_hf`` builds a ``GPT2Config`` from our config and a randomly
initialised ``GPT2LMHeadModel``, then copies our weights in. The parameter names are the same
(``transformer.h.0.attn.c_attn.weight``, ...); the one difference is that GPT-2 stores its
projections in ``Conv1D`` modules whose weight is (in, out), the transpose of ``nn.Linear``'s
(out, in). Those four matrices per block are transposed; everything else is copied as is.

Activation: GPT-2 uses the tanh approximation of GELU, which Hugging Face calls ``"gelu_new"``;
our MLP calls ``F.gelu(x, approximate="tanh")``, the same function (they differ by float rounding
only, far below the 1e-5 tolerance). ``from_hf`` accepts the tanh-GELU variants and refuses the
others (exact ``"gelu"`` would silently change every activation by up to about 1e-3).
"""
from __future__ import annotations

import json
import os

import torch

from .bpe import BYTE_VOCAB
from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig
from .positional import rope_to_half, rope_to_interleaved

#: Conv1D weights of GPT-2, stored (in, out): transposed relative to nn.Linear
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
#: Hugging Face activation names that equal our tanh-approximated GELU
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
    import transformers

    return transformers


def hf_config(config: GPTConfig, activation: str = "gelu_new"):
    """The GPT2Config of a model with our sizes: no dropout, LayerNorm eps 1e-5, tied embeddings."""
    if activation not in TANH_GELU:
        raise ValueError(f"activation must be one of {TANH_GELU} (tanh-approximated GELU, as ours), got {activation!r}")
    if not config.bias:
        raise ValueError("GPT-2 has biases in every Linear and LayerNorm; only a config with bias=True converts")
    transformers = _transformers()
    return transformers.GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.n_embd, n_layer=config.n_layer,
        n_head=config.n_head, n_inner=4 * config.n_embd, activation_function=activation, layer_norm_epsilon=1e-5,
        resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.dropout,
        scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
        # no special tokens: a character model has no end-of-text token, so generate() never stops early
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def _copy_into(theirs: dict, ours: dict, who: str) -> None:
    """Copy our converted tensors into Hugging Face's state dict in place; names and shapes must match exactly."""
    missing, unexpected = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
    if missing or unexpected:
        raise RuntimeError(f"parameter names differ: missing in ours {missing[:3]}, not in {who} {unexpected[:3]}")
    with torch.no_grad():
        for name, value in theirs.items():
            if value.shape != ours[name].shape:
                raise RuntimeError(f"{name}: {who} expects {tuple(value.shape)}, ours converts to {tuple(ours[name].shape)}")
            value.copy_(ours[name])


def _converted(state: dict) -> dict:
    """Transpose the Conv1D/Linear weights (the operation is its own inverse)."""
    return {name: (value.t().contiguous() if name.endswith(TRANSPOSED) else value.clone()) for name, value in state.items()}


def to_hf(model: GPT, activation: str = "gelu_new"):
    """A GPT2LMHeadModel (eval mode) with the weights of our model; its logits equal ours."""
    transformers = _transformers()
    from transformers.initialization import no_init_weights  # what from_pretrained builds a model under

    with no_init_weights():  # every tensor is overwritten below: no random initialisation to draw first
        hf_model = transformers.GPT2LMHeadModel(hf_config(model.config, activation))
    hf_model.tie_weights()  # skipped with the initialisation
    ours = _converted(model.state_dict())
    theirs = hf_model.state_dict()
    unset = sorted(name for name, _ in hf_model.named_buffers() if name not in theirs)
    if unset:
        raise RuntimeError(f"buffers outside the state dict would keep no initial value: {unset[:3]}")
    _copy_into(theirs, ours, "GPT-2")
    if hf_model.lm_head.weight.data_ptr() != hf_model.transformer.wte.weight.data_ptr():
        raise RuntimeError("the converted model's lm_head is not tied to its token embedding")
    return hf_model.eval()


def from_hf(hf_model) -> GPT:
    """Our GPT (eval mode) with the weights of a GPT2LMHeadModel whose LM head is tied to its embedding."""
    c = hf_model.config
    if c.activation_function not in TANH_GELU:
        raise ValueError(f"hf_model.config.activation_function must be one of {TANH_GELU}, got {c.activation_function!r}")
    if abs(c.layer_norm_epsilon - 1e-5) > 1e-12:
        raise ValueError(f"hf_model.config.layer_norm_epsilon must be 1e-5 (as nn.LayerNorm's), got {c.layer_norm_epsilon}")
    if c.scale_attn_by_inverse_layer_idx or not c.scale_attn_weights:
        raise ValueError("hf_model must scale attention scores by 1/sqrt(head size) only, as GPT-2 does")
    if hf_model.lm_head.weight.data_ptr() != hf_model.transformer.wte.weight.data_ptr():
        raise ValueError("hf_model's lm_head must be tied to its token embedding (tie_word_embeddings=True)")
    inner = c.n_inner if c.n_inner is not None else 4 * c.n_embd
    if inner != 4 * c.n_embd:
        raise ValueError(f"hf_model.config.n_inner must be 4 * n_embd = {4 * c.n_embd}, got {inner}")
    config = GPTConfig(vocab_size=c.vocab_size, block_size=c.n_positions, n_layer=c.n_layer, n_head=c.n_head,
                       n_embd=c.n_embd, dropout=0.0, bias=True)
    model = GPT(config)
    state = _converted({k: v for k, v in hf_model.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))})
    model.load_state_dict(state)
    return model.eval()


# ----------------------------------------------------------------------------- Llama and Mistral (chapter 11)
#
# Our Llama uses Hugging Face's parameter names, so the state dicts match name for name. The one difference
# can be the RoPE layout: Hugging Face pairs feature i with i + Dh/2 ("half"); a model of ours built with
# rope_layout="interleaved" pairs 2i with 2i + 1, and converts by permuting the rows of every W_q and W_k
# within each head (``rope_to_half``; back: ``rope_to_interleaved``). A model with a sliding window converts
# to MistralForCausalLM (``sliding_window=W``), one without to LlamaForCausalLM. Both functions are the
# reference solution of chapter 11's fifth exercise, the conversion both ways.


def llama_to_hf(model):
    """Our Llama -> Hugging Face's model with the same weights and the same function, in eval mode.

    model: our Llama (float32), either rope_layout, any n_kv_head, with or without a window.
    Returns a LlamaForCausalLM, or a MistralForCausalLM with sliding_window = W when model.config.window = W,
    built from a configuration (nothing downloaded), with its own (untied) lm_head. Its logits equal model's on
    any input within 1e-5 (float32), whatever the layout, n_kv_head, eps and rope_base; llama_from_hf(result,
    model.config.rope_layout) gives model's config and weights back exactly. model itself is left unchanged.
    The parameter names are the same on both sides.
    """
    import transformers  # here rather than at the top: it takes seconds to import

    c = model.config  # ours: sizes, eps, rope_base, layout, window
    sizes = dict(vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
                 num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
                 head_dim=c.head_dim, max_position_embeddings=c.block_size, rms_norm_eps=c.eps,
                 rope_parameters={"rope_type": "default", "rope_theta": c.rope_base}, hidden_act="silu",
                 tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if c.window is None:
        hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **sizes))
    else:
        hf_model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=c.window, **sizes))
    state = {}
    for name, weight in model.state_dict().items():
        if c.rope_layout == "interleaved" and name.endswith("self_attn.q_proj.weight"):
            weight = rope_to_half(weight, c.n_head)  # rotated features: pairs (2i, 2i + 1) -> (i, i + Dh/2)
        elif c.rope_layout == "interleaved" and name.endswith("self_attn.k_proj.weight"):
            weight = rope_to_half(weight, c.n_kv_head)  # W_k has H_kv heads, not H
        state[name] = weight
    hf_model.load_state_dict(state)  # strict: the same names and shapes on both sides, or an error
    return hf_model.eval()


def llama_from_hf(hf_model, rope_layout="half"):
    """Hugging Face's LlamaForCausalLM or MistralForCausalLM -> our Llama with the same weights and function, eval mode.

    hf_model: float32, built from a configuration or loaded from a checkpoint. rope_layout: "half" (Hugging Face's
    pairing) or "interleaved" (chapter 02's). Returns our Llama with that rope_layout whose config
    holds hf_model's sizes, num_key_value_heads, intermediate_size, max_position_embeddings (as block_size),
    rms_norm_eps (as eps), rope_theta (as rope_base) and sliding_window (as window; None for full attention), and
    whose logits equal hf_model's within 1e-5; llama_to_hf of it gives hf_model's weights back exactly. A tied
    head (tie_word_embeddings=True) converts too: our lm_head is a copy of the embedding. hf_model is unchanged.
    Raises ValueError, naming the setting, for what our Llama cannot represent: a rope_type other than "default"
    (scaled RoPE), a hidden_act other than "silu", biases (attention_bias or mlp_bias), or head_dim *
    num_attention_heads != hidden_size.
    """
    c = hf_model.config
    if c.rope_parameters["rope_type"] != "default":
        raise ValueError(f"hf_model must use RoPE without scaling (rope_type 'default'), got {c.rope_parameters['rope_type']!r}")
    if c.hidden_act != "silu":
        raise ValueError(f"hf_model.config.hidden_act must be 'silu' (SwiGLU), got {c.hidden_act!r}")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError("hf_model must have no biases: attention_bias and mlp_bias must be False")
    if c.head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError(f"hf_model.config.head_dim x num_attention_heads must equal hidden_size = {c.hidden_size}, "
                         f"got {c.head_dim} x {c.num_attention_heads}")
    config = LlamaConfig(vocab_size=c.vocab_size, block_size=c.max_position_embeddings, n_layer=c.num_hidden_layers,
                         n_head=c.num_attention_heads, n_embd=c.hidden_size, n_kv_head=c.num_key_value_heads,
                         intermediate_size=c.intermediate_size, rope_base=float(c.rope_parameters["rope_theta"]),
                         eps=c.rms_norm_eps, window=getattr(c, "sliding_window", None), rope_layout=rope_layout)
    state = {}
    for name, weight in hf_model.state_dict().items():
        if rope_layout == "interleaved" and name.endswith("self_attn.q_proj.weight"):
            weight = rope_to_interleaved(weight, config.n_head)
        elif rope_layout == "interleaved" and name.endswith("self_attn.k_proj.weight"):
            weight = rope_to_interleaved(weight, config.n_kv_head)
        state[name] = weight
    model = Llama(config)
    model.load_state_dict(state)
    return model.eval()


# ----------------------------------------------------------------------------- Hugging Face tokenizers (the oracle)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from the 256 bytes to 256 printable characters (Hugging Face ByteLevel writes tokens with it):
    printable Latin-1 bytes map to themselves, the others to chr(256 + n) in byte order."""
    return dict(_BYTES_TO_UNICODE)


def _bytes_to_unicode() -> dict[int, str]:
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    mapping, n = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


_BYTES_TO_UNICODE = _bytes_to_unicode()
_UNICODE_TO_BYTES = {c: b for b, c in _BYTES_TO_UNICODE.items()}


def hf_token_bytes(token: str) -> bytes:
    """The bytes of a Hugging Face byte-level token string ('Ġworld' -> b' world')."""
    return bytes(_UNICODE_TO_BYTES[c] for c in token)


def train_hf_bpe(text: str, vocab_size: int):
    """Hugging Face ``tokenizers``' BPE trained on text like ``train_bpe``: byte-level pre-tokenization with GPT-2's
    pattern (add_prefix_space=False), all 256 bytes in the alphabet, no special tokens, min_frequency 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not isinstance(vocab_size, int) or vocab_size < BYTE_VOCAB:
        raise ValueError(f"vocab_size must be an int >= {BYTE_VOCAB} (the byte tokens), got {vocab_size!r}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=0, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer=trainer)
    return tokenizer


def hf_merges(tokenizer) -> list[tuple[str, str]]:
    """A Hugging Face BPE tokenizer's merges, in rank order, as pairs of its token strings."""
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


def merges_from_hf(tokenizer) -> dict:
    """Our merges {(a, b): new_id} from a Hugging Face byte-level BPE tokenizer's merges (same order, our ids)."""
    ids = {bytes([b]): b for b in range(BYTE_VOCAB)}
    merges = {}
    for left, right in hf_merges(tokenizer):
        a, b = ids[hf_token_bytes(left)], ids[hf_token_bytes(right)]
        new_id = BYTE_VOCAB + len(merges)
        merges[(a, b)] = new_id
        ids[hf_token_bytes(left) + hf_token_bytes(right)] = new_id
    return merges


def hf_encode_bytes(tokenizer, text: str) -> list[bytes]:
    """The bytes of each token Hugging Face's tokenizer gives text."""
    return [hf_token_bytes(t) for t in tokenizer.encode(text).tokens]
