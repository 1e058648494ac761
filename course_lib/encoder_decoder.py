"""The encoder-decoder transformer, chapter 03 (the only model here: the decoder-only ones are gpt.py and llama.py):
masks, encoder and decoder layers, and the encoder-decoder model.

Mask convention (the course's, from chapter 01 on): a boolean tensor that broadcasts
against the attention scores ``(B, H, Tq, Tk)``; ``True`` means "this query may attend
to this key".

* ``make_padding_mask(tokens, pad_id)`` -> ``(B, 1, 1, T)``: the real (non-padding) keys.
* ``make_causal_mask(T)`` -> ``(1, 1, T, T)``: lower triangle, query i sees keys 0..i.
* ``make_target_mask(tgt, pad_id)`` -> ``(B, 1, T, T)``: both at once, for the decoder's
  self-attention.

PyTorch's ``nn.Transformer*`` layers use the opposite convention for boolean masks
(``True`` = *not* allowed): pass ``~mask`` to them.

``make_padding_mask``, ``make_causal_mask``, ``make_target_mask``, ``EncoderLayer`` and
``DecoderLayer`` are the reference solutions of chapter 03's exercises; the notebook's
solution cells are the same code (``tests/grading/test_solution_drift.py`` checks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .attention import MultiHeadAttention
from .data import BOS, EOS, PAD, Seq2SeqBatch
from .layers import FeedForward, LayerNorm
from .positional import sinusoidal_encoding
from .validation import check_positive


def make_padding_mask(tokens, pad_id):
    """tokens (B, T) int -> (B, 1, 1, T) bool, True on real tokens (the keys that may be attended).

    Any pad_id, and padding anywhere in a row (not only at its end): False exactly where tokens == pad_id.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must have shape (B, T), got shape {tuple(tokens.shape)}")
    return (tokens != pad_id)[:, None, None, :]


def make_causal_mask(T, device=None):
    """(1, 1, T, T) bool, True on and below the diagonal: query i may attend to keys 0..i (itself included)."""
    if T < 1:
        raise ValueError(f"T must be >= 1, got {T}")
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]


def make_target_mask(tgt, pad_id):
    """tgt (B, T) int -> (B, 1, T, T) bool: query i may attend to key j iff j <= i and token j is not padding.

    Exactly this shape (B, 1, T, T), not merely broadcastable to it; the hidden tests compare it with your
    padding and causal masks.
    """
    return make_padding_mask(tgt, pad_id) & make_causal_mask(tgt.shape[1], tgt.device)


class EncoderLayer(nn.Module):
    """The transformer's encoder layer: self-attention, then the position-wise feed-forward network.

    Contract. Constructor arguments as given. The layer holds exactly these submodules, under these
    names (trained weights load into it by them, and the checks copy them into PyTorch's layer):
    self_attn = MultiHeadAttention(d_model, n_heads, dropout); ffn = FeedForward(d_model, d_ff, dropout);
    norm1, norm2 = LayerNorm(d_model); dropout1, dropout2 = nn.Dropout(dropout); and the flag norm_first.
    norm_first=False is post-LN (the original transformer), norm_first=True pre-LN: with dropout 0 the
    output equals that of torch.nn.TransformerEncoderLayer(batch_first=True, norm_first=norm_first)
    holding the same weights. The tests check both arrangements against it (also in float64), that
    positions the mask hides change no other output, and that dropout is off after model.eval().
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.0, norm_first: bool = False):
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.norm1 = LayerNorm(d_model)
        self.norm2 = LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        """x (B, S, D); mask bool broadcastable to (B, H, S, S), True = attend (e.g. (B, 1, 1, S)). Returns (B, S, D)."""
        if self.norm_first:
            h = self.norm1(x)
            x = x + self.dropout1(self.self_attn(h, h, h, mask)[0])
            x = x + self.dropout2(self.ffn(self.norm2(x)))
        else:
            x = self.norm1(x + self.dropout1(self.self_attn(x, x, x, mask)[0]))
            x = self.norm2(x + self.dropout2(self.ffn(x)))
        return x


class DecoderLayer(nn.Module):
    """The transformer's decoder layer: masked self-attention, cross-attention to the encoder's output
    (memory), then the position-wise feed-forward network.

    Contract. Constructor arguments as given. The layer holds exactly these submodules, under these
    names: self_attn, cross_attn = MultiHeadAttention(d_model, n_heads, dropout); ffn = FeedForward(d_model,
    d_ff, dropout); norm1, norm2, norm3 = LayerNorm(d_model); dropout1, dropout2, dropout3 = nn.Dropout(dropout);
    and the flag norm_first. With dropout 0 the output equals that of torch.nn.TransformerDecoderLayer(
    batch_first=True, norm_first=norm_first) holding the same weights. The tests check both arrangements
    against it (also in float64), that no output depends on a later target position under a causal
    tgt_mask, that memory positions hidden by memory_mask change nothing while the others do, and that
    dropout is off after model.eval().
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.0, norm_first: bool = False):
        super().__init__()
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.norm1 = LayerNorm(d_model)
        self.norm2 = LayerNorm(d_model)
        self.norm3 = LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)

    def forward(self, x, memory, tgt_mask=None, memory_mask=None):
        """x (B, T, D), memory (B, S, D); tgt_mask bool broadcastable to (B, H, T, T) (padding & causal);
        memory_mask bool broadcastable to (B, H, T, S) (the source padding mask (B, 1, 1, S)). Returns (B, T, D)."""
        if self.norm_first:
            h = self.norm1(x)
            x = x + self.dropout1(self.self_attn(h, h, h, tgt_mask)[0])
            x = x + self.dropout2(self.cross_attn(self.norm2(x), memory, memory, memory_mask)[0])
            x = x + self.dropout3(self.ffn(self.norm3(x)))
        else:
            x = self.norm1(x + self.dropout1(self.self_attn(x, x, x, tgt_mask)[0]))
            x = self.norm2(x + self.dropout2(self.cross_attn(x, memory, memory, memory_mask)[0]))
            x = self.norm3(x + self.dropout3(self.ffn(x)))
        return x


class Transformer(nn.Module):
    """Encoder-decoder transformer (Vaswani et al., 2017) for token-to-token tasks.

    Embeddings are scaled by sqrt(d_model) and added to sinusoidal positions. A pre-LN
    model (norm_first=True) ends each stack with a final LayerNorm, as pre-LN needs; the
    post-LN stacks end in a LayerNorm already. Decoding is greedy and recomputes the
    whole prefix at every step (chapter 05 adds a cache).

    ``encoder_layer`` and ``decoder_layer`` are the layer classes the stacks are built from
    (chapter 03 passes the learner's own); they are called as ``cls(d_model, n_heads, d_ff,
    dropout, norm_first)`` and must hold the parameters of ``EncoderLayer`` and ``DecoderLayer``
    under the same names, so one state_dict fits either.
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, d_model: int = 64, n_heads: int = 4, d_ff: int = 128,
                 n_encoder_layers: int = 2, n_decoder_layers: int = 2, dropout: float = 0.1, max_len: int = 64,
                 pad_id: int = PAD, norm_first: bool = False, encoder_layer: type[nn.Module] = EncoderLayer,
                 decoder_layer: type[nn.Module] = DecoderLayer):
        super().__init__()
        for name, value in (("src_vocab_size", src_vocab_size), ("tgt_vocab_size", tgt_vocab_size),
                            ("n_encoder_layers", n_encoder_layers), ("n_decoder_layers", n_decoder_layers), ("max_len", max_len)):
            check_positive(name, value)
        if not 0 <= pad_id < min(src_vocab_size, tgt_vocab_size):
            raise ValueError(f"pad_id must be in [0, {min(src_vocab_size, tgt_vocab_size)}), got {pad_id}")
        self.d_model, self.pad_id, self.max_len = d_model, pad_id, max_len
        self.src_embed = nn.Embedding(src_vocab_size, d_model, padding_idx=pad_id)
        self.tgt_embed = nn.Embedding(tgt_vocab_size, d_model, padding_idx=pad_id)
        for embedding in (self.src_embed, self.tgt_embed):  # times sqrt(d_model) below: unit variance, like the positions
            nn.init.normal_(embedding.weight, std=d_model ** -0.5)
            embedding.weight.data[pad_id] = 0.0
        self.register_buffer("positions", sinusoidal_encoding(max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)
        self.encoder_layers = nn.ModuleList(encoder_layer(d_model, n_heads, d_ff, dropout, norm_first) for _ in range(n_encoder_layers))
        self.decoder_layers = nn.ModuleList(decoder_layer(d_model, n_heads, d_ff, dropout, norm_first) for _ in range(n_decoder_layers))
        self.encoder_norm = LayerNorm(d_model) if norm_first else nn.Identity()
        self.decoder_norm = LayerNorm(d_model) if norm_first else nn.Identity()
        self.generator = nn.Linear(d_model, tgt_vocab_size)

    def embed(self, embedding: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> (B, T, D): scaled embeddings plus sinusoidal positions."""
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"sequence length must be <= max_len = {self.max_len}, got {tokens.shape[1]}")
        return self.dropout(embedding(tokens) * math.sqrt(self.d_model) + self.positions[: tokens.shape[1]])

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src (B, S) -> memory (B, S, D) and the source padding mask (B, 1, 1, S)."""
        src_mask = make_padding_mask(src, self.pad_id)
        x = self.embed(self.src_embed, src)
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        return self.encoder_norm(x), src_mask

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """Decoder inputs tgt_in (B, T) (BOS, then the target shifted right) -> logits (B, T, V)."""
        tgt_mask = make_target_mask(tgt_in, self.pad_id)
        x = self.embed(self.tgt_embed, tgt_in)
        for layer in self.decoder_layers:
            x = layer(x, memory, tgt_mask, src_mask)
        return self.generator(self.decoder_norm(x))

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V), teacher-forced."""
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask)

    @torch.no_grad()
    def generate(self, src: torch.Tensor, max_len: int, bos_id: int = BOS, eos_id: int = EOS) -> torch.Tensor:
        """Greedy decoding, tokens only (as Hugging Face's encoder-decoder ``generate``): src (B, S) -> tokens
        (B, max_len); after its EOS a sequence gets pad_id. (Chapter 01's ``GRUSeq2Seq.greedy_decode`` returns the
        attention weights too, and pads nothing.)"""
        check_positive("max_len", max_len)
        memory, src_mask = self.encode(src)
        tokens = torch.full((src.shape[0], 1), bos_id, device=src.device)
        done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            next_token = self.decode(tokens, memory, src_mask)[:, -1].argmax(-1)
            next_token = next_token.masked_fill(done, self.pad_id)
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            done |= next_token == eos_id
            if done.all():
                break
        out = torch.full((src.shape[0], max_len), self.pad_id, device=src.device)
        out[:, : tokens.shape[1] - 1] = tokens[:, 1:]
        return out

    @torch.no_grad()
    def cross_attention_weights(self, src: torch.Tensor, tgt_in: torch.Tensor) -> list[torch.Tensor]:
        """Cross-attention weights of every decoder layer, each (B, H, T, S), recorded with forward hooks."""
        recorded: list[torch.Tensor] = []
        hooks = [layer.cross_attn.register_forward_hook(lambda module, args, output: recorded.append(output[1]))
                 for layer in self.decoder_layers]
        try:
            self(src, tgt_in)
        finally:
            for hook in hooks:
                hook.remove()
        return recorded


def shift_right(tgt: torch.Tensor, bos_id: int = BOS) -> torch.Tensor:
    """Teacher forcing: tgt (B, T) -> decoder inputs (B, T) = BOS followed by tgt[:, :-1]."""
    return torch.cat([torch.full_like(tgt[:, :1], bos_id), tgt[:, :-1]], dim=1)


def transformer_loss(logits: torch.Tensor, tgt: torch.Tensor, pad_id: int = PAD) -> torch.Tensor:
    """Mean cross-entropy over the real (non-padding) target tokens. logits (B, T, V), tgt (B, T)."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=pad_id)


@dataclass
class TransformerRun:
    """A trained model and its per-step training losses."""

    model: Transformer
    losses: list[float] = field(default_factory=list)


def train_transformer(model: Transformer, make_batch: Callable[[torch.Generator], Seq2SeqBatch], steps: int = 300,
                      lr: float = 2e-3, warmup: int = 50, seed: int = 1, progress: bool = True) -> TransformerRun:
    """Teacher-forced training with Adam (betas 0.9, 0.98), linear warm-up then cosine decay to lr / 10.

    make_batch(generator) returns a fresh Seq2SeqBatch; the generator is seeded with ``seed``, so
    the training strings can be replayed. Gradients are clipped to norm 1. Leaves the model in eval mode.
    """
    from tqdm.auto import trange

    check_positive("steps", steps)
    check_positive("warmup", warmup)
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))

    def schedule(step: int) -> float:
        return min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    run = TransformerRun(model)
    model.train()
    for _ in trange(steps, disable=not progress, desc="training", mininterval=1.0):
        batch = make_batch(generator)
        loss = transformer_loss(model(batch.src, shift_right(batch.tgt)), batch.tgt, model.pad_id)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        run.losses.append(loss.item())
    model.eval()
    return run


@torch.no_grad()
def exact_match(model: Transformer, batch: Seq2SeqBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy-decode batch.src; returns (exact (B,) bool: every target token up to EOS right, tokens (B, T))."""
    model.eval()
    tokens = model.generate(batch.src, max_len=batch.tgt.shape[1])
    real = batch.tgt != model.pad_id
    return ((tokens == batch.tgt) | ~real).all(dim=1), tokens
