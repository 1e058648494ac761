"""Chapter 01's model: a tiny GRU encoder-decoder, with or without additive attention.

Without attention the decoder sees the source only through one fixed vector (the
encoder's final state): the seq2seq bottleneck. With attention it reads a weighted
average of all encoder states at every step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AdditiveAttention, additive_attention
from .data import BOS, DIGIT_VOCAB_SIZE, PAD, Seq2SeqBatch, reversal_batch


class GRUSeq2Seq(nn.Module):
    """Bidirectional GRU encoder, GRU-cell decoder, optional additive attention."""

    def __init__(self, vocab_size: int = DIGIT_VOCAB_SIZE, emb_dim: int = 32, hidden: int = 64, use_attention: bool = True):
        super().__init__()
        self.use_attention = use_attention
        self.embed = nn.Embedding(vocab_size, emb_dim, padding_idx=PAD)
        self.encoder = nn.GRU(emb_dim, hidden, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * hidden, hidden)
        self.attention = AdditiveAttention(hidden, 2 * hidden, hidden)
        self.decoder = nn.GRUCell(emb_dim + 2 * hidden, hidden)
        self.readout = nn.Linear(hidden + 2 * hidden + emb_dim, vocab_size)

    def encode(self, src, src_lengths):
        """src (B, S) -> encoder states (B, S, 2H), final summary (B, 2H)."""
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(src), src_lengths.cpu(), batch_first=True, enforce_sorted=False)
        states, final = self.encoder(packed)
        states, _ = nn.utils.rnn.pad_packed_sequence(states, batch_first=True, total_length=src.shape[1])
        return states, torch.cat([final[0], final[1]], dim=-1)

    def decode_step(self, token, state, enc_states, summary, src_mask):
        """One decoder step. token (B,), state (B, H) -> logits (B, V), new state, weights (B, S) or None."""
        emb = self.embed(token)
        if self.use_attention:
            context, weights = self.attention(state.unsqueeze(1), enc_states, enc_states, src_mask.unsqueeze(1))
            context, weights = context.squeeze(1), weights.squeeze(1)
        else:  # the bottleneck: the same fixed vector at every step
            context, weights = summary, None
        state = self.decoder(torch.cat([emb, context], dim=-1), state)
        return self.readout(torch.cat([state, context, emb], dim=-1)), state, weights

    def forward(self, batch: Seq2SeqBatch):
        """Teacher-forced logits (B, T, V) for batch.tgt."""
        enc_states, summary = self.encode(batch.src, batch.src_lengths)
        state = torch.tanh(self.bridge(summary))
        inputs = torch.cat([torch.full_like(batch.tgt[:, :1], BOS), batch.tgt[:, :-1]], dim=1)
        logits = []
        for t in range(inputs.shape[1]):
            step_logits, state, _ = self.decode_step(inputs[:, t], state, enc_states, summary, batch.src_mask)
            logits.append(step_logits)
        return torch.stack(logits, dim=1)

    @torch.no_grad()
    def greedy_decode(self, src, src_lengths, max_len: int):
        """Greedy decoding. Returns tokens (B, max_len) and attention weights (B, max_len, S) (zeros without attention)."""
        enc_states, summary = self.encode(src, src_lengths)
        state = torch.tanh(self.bridge(summary))
        token = torch.full((src.shape[0],), BOS)
        tokens, weights = [], []
        for _ in range(max_len):
            logits, state, w = self.decode_step(token, state, enc_states, summary, src != PAD)
            token = logits.argmax(-1)
            tokens.append(token)
            weights.append(w if w is not None else torch.zeros_like(src, dtype=torch.float))
        return torch.stack(tokens, 1), torch.stack(weights, 1)


def decoder_step(model, token, state, enc_states, src_mask):
    """One step of the attention decoder of a GRUSeq2Seq, computed from the model's weights.

    model: a GRUSeq2Seq with use_attention=True. Its weights, by name: model.embed (nn.Embedding(V, E)),
        model.attention.W_q (H, A), .W_k (2H, A), .v (A,), model.decoder (nn.GRUCell(E + 2H, H): weight_ih,
        weight_hh, bias_ih, bias_hh) and model.readout (nn.Linear(H + 2H + E, V)). The layout it was trained
        with: the GRU cell reads torch.cat([embedding, context]), the readout torch.cat([new state, context, embedding]).
    token: (B,) int, the token written at the previous step   state: (B, H), the decoder state before this step
    enc_states: (B, S, 2H), from model.encode   src_mask: (B, S) bool, True on real source positions
    Returns (logits (B, V), new state (B, H), weights (B, S)): weights are the attention weights this step's
    context was made with; padding gets exactly 0 and each row sums to 1. Raises ValueError naming
    use_attention when model.use_attention is False. The tests compare all three with the course's
    model (GRUSeq2Seq.decode_step, which calls torch.nn.GRUCell) and with a float64 reference.
    """
    if not model.use_attention:
        raise ValueError("model must have use_attention=True: this decoder reads the source through attention")
    emb = model.embed(token)  # (B, E)
    attention = model.attention
    # the query is the state *before* this step: it asks where to look for the token to write now
    context, weights = additive_attention(state.unsqueeze(1), enc_states, enc_states, attention.W_q, attention.W_k,
                                          attention.v, src_mask.unsqueeze(1))  # (B, 1, 2H), (B, 1, S)
    context, weights = context.squeeze(1), weights.squeeze(1)
    # the GRU cell from its equations, in PyTorch's convention: the reset gate scales W_hn h + b_hn
    gru = model.decoder
    x = torch.cat([emb, context], dim=-1)  # (B, E + 2H)
    r_x, z_x, n_x = (x @ gru.weight_ih.T + gru.bias_ih).chunk(3, dim=-1)  # (B, H) each
    r_h, z_h, n_h = (state @ gru.weight_hh.T + gru.bias_hh).chunk(3, dim=-1)
    reset, update = torch.sigmoid(r_x + r_h), torch.sigmoid(z_x + z_h)
    candidate = torch.tanh(n_x + reset * n_h)
    new_state = (1 - update) * candidate + update * state  # the update gate keeps part of the old state
    logits = model.readout(torch.cat([new_state, context, emb], dim=-1))  # (B, V)
    return logits, new_state, weights


def greedy_translate(model, src, src_lengths, max_len):
    """Greedy decoding with decoder_step: the whole translator of a trained GRUSeq2Seq (use_attention=True).

    src: (B, S) int, padded with PAD   src_lengths: (B,) int   max_len: the number of steps, >= 1.
    model.encode(src, src_lengths) gives the encoder states and the summary; as in training, the decoder starts
    from the state tanh(model.bridge(summary)) and the token BOS.
    Returns (tokens (B, max_len), weights (B, max_len, S)): tokens[b, i] is the most likely token of step i and
    the input of step i + 1; weights[b, i] are the attention weights of step i. Every row runs max_len steps
    (no stop at EOS). Raises ValueError naming max_len when max_len < 1. The tests compare with the course's
    model (GRUSeq2Seq.greedy_decode): the same tokens, the same weights up to float32 rounding; a string's
    result does not depend on its padding or on the other strings of its batch.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    enc_states, summary = model.encode(src, src_lengths)  # (B, S, 2H), (B, 2H)
    state = torch.tanh(model.bridge(summary))  # (B, H)
    token = torch.full((src.shape[0],), BOS)  # (B,)
    src_mask = src != PAD  # (B, S)
    tokens, weights = [], []
    for _ in range(max_len):
        logits, state, step_weights = decoder_step(model, token, state, enc_states, src_mask)
        token = logits.argmax(dim=-1)  # the model's own choice is the next step's input
        tokens.append(token)
        weights.append(step_weights)
    return torch.stack(tokens, dim=1), torch.stack(weights, dim=1)


def seq2seq_loss(logits, tgt):
    """Mean cross-entropy over real (non-PAD) target tokens. logits (B, T, V), tgt (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=PAD)


@dataclass
class TrainResult:
    model: GRUSeq2Seq
    losses: list[float] = field(default_factory=list)


def train_reversal(model: GRUSeq2Seq, steps: int = 400, batch_size: int = 64, lr: float = 3e-3, max_len: int = 10, seed: int = 1, progress: bool = True) -> TrainResult:
    """Train on random reversal batches with Adam and gradient clipping; returns per-step losses."""
    from tqdm.auto import trange

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    result = TrainResult(model)
    model.train()
    for _ in trange(steps, disable=not progress, desc="training", mininterval=1.0):
        batch = reversal_batch(batch_size, max_len=max_len, generator=generator)
        loss = seq2seq_loss(model(batch), batch.tgt)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        result.losses.append(loss.item())
    model.eval()
    return result


@torch.no_grad()
def evaluate_reversal(model: GRUSeq2Seq, batch: Seq2SeqBatch, *, greedy_translate=greedy_translate) -> dict:
    """Exact-match accuracy per example and the alignment accuracy of the attention.

    A model with attention is decoded by ``greedy_translate`` (the course's; chapter 01 passes the learner's version
    under that name, which shadows the course's here); a model without attention, which greedy_translate refuses,
    by its own ``greedy_decode``. Both decode greedily for as many steps as the targets are long.

    Alignment accuracy: over all output positions i < L (L = source length), the fraction
    whose attention argmax is source position L - 1 - i, the digit being copied.
    Returns {"exact": (B,) bool, "alignment": float or None, "tokens", "weights"}.
    """
    decode = greedy_translate if model.use_attention else type(model).greedy_decode
    with torch.no_grad():
        tokens, weights = decode(model, batch.src, batch.src_lengths, max_len=batch.tgt.shape[1])
    # Exact match: every target token up to and including EOS is right.
    real = batch.tgt != PAD
    exact = ((tokens == batch.tgt) | ~real).all(dim=1)
    alignment = None
    if model.use_attention:
        hits, total = 0, 0
        for row, length in enumerate(batch.src_lengths.tolist()):
            expected = torch.arange(length - 1, -1, -1)
            hits += int((weights[row, :length].argmax(-1) == expected).sum())
            total += length
        alignment = hits / total
    return {"exact": exact, "alignment": alignment, "tokens": tokens, "weights": weights}
