"""Decoding strategies, chapter 06: logits processors, greedy, sampling, beam search and ``generate``.

A language model gives, at every step, logits (B, V) over the vocabulary for the next token. A
*decoding strategy* turns them into a choice. This module follows Hugging Face's
``generation/logits_process.py``: one small function per processor, composed in one documented order
(``PROCESSOR_ORDER``), and a ``generate`` whose shared arguments mean what they mean in Hugging Face's
``model.generate`` (``generate``'s docstring lists where the two differ).

Shapes: B batch, T tokens, V vocabulary, K beams. Logits are float tensors (B, V); token ids int64.
A filtered token has logit -inf (probability exactly 0 after softmax).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .gpt import extend, greedy_choice, sample_choice
from .kv_cache import KVCache, cached_forward
from .validation import check_positive

#: the order in which ``process_logits`` (and therefore ``generate``) applies the processors
PROCESSOR_ORDER = ("repetition_penalty", "frequency_presence_penalty", "temperature", "top_k", "top_p", "min_p")

# ----------------------------------------------------------------------------------------------------
# logits processors: (B, V) -> (B, V)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logits at the given temperature, whose softmax is the distribution to sample from: (B, V) -> (B, V).

    temperature > 1 flattens it, < 1 sharpens it. temperature = 0 is the limit tau -> 0+: all the
    probability on the largest logit(s) (greedy), returned as 0 for the maxima and -inf elsewhere,
    never a division by zero. temperature < 0 raises ValueError.
    """
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if temperature == 0:
        is_max = logits == logits.amax(dim=-1, keepdim=True)
        return torch.where(is_max, 0.0, float("-inf")).to(logits.dtype)
    return logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row, set the others to -inf: (B, V) -> (B, V).

    Ties with the k-th largest value are all kept (so a row may keep more than k tokens); k larger
    than the vocabulary keeps everything. Logits and probabilities have the same order, so filtering
    either gives the same set; the result is logits (never probabilities).
    k must be a Python int >= 1: 0, a negative k, a float (even 2.0), a bool (an int in Python, but
    not a count), a numpy integer or a tensor raise ValueError (convert with int(k) first).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {k!r}")
    k = min(k, logits.shape[-1])
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of most probable tokens whose mass is >= p: (B, V) -> (B, V).

    The token whose probability makes the running mass cross p is kept, and so is the most probable
    token whatever p. The kept logits are returned unchanged, in the vocabulary order of the input, the
    others -inf. Where the mass reaches p exactly (up to float rounding) either set is right: the tests
    keep away from such boundaries. p must be in (0, 1]: p <= 0 or p > 1 raises ValueError.
    """
    if not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    tail_mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # mass of this token and every less probable one
    drop = tail_mass <= 1 - p
    drop[..., -1] = False  # the most probable token always stays
    drop = drop.scatter(-1, order, drop)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep the tokens whose probability is >= min_p times that of the most probable token: (B, V) -> (B, V)."""
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def apply_repetition_penalty(logits: torch.Tensor, input_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty on every token in input_ids, sign-aware as Hugging Face's: (B, V), (B, T) -> (B, V).

    A token that already occurs (prompt included) becomes less likely for penalty > 1, whatever the sign
    of its logit, by Hugging Face's rule (the exercise's introduction), not CTRL's (Keskar et al., 2019),
    which would *raise* a negative logit. A token is penalised once, however often it
    occurs; each row by its own history only; tokens not in input_ids keep their logits.
    penalty > 1 discourages repetition, 0 < penalty < 1 encourages it, 1 changes nothing; penalty <= 0
    (or NaN) raises ValueError.
    """
    if not penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0 (1 means no penalty), got {penalty}")
    score = torch.gather(logits, 1, input_ids)  # (B, T): the logit of every token seen so far
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.scatter(1, input_ids, score)  # repeated ids write the same value: once per token


def apply_frequency_presence_penalty(logits: torch.Tensor, token_ids: torch.Tensor, frequency_penalty: float = 0.0,
                                     presence_penalty: float = 0.0) -> torch.Tensor:
    """OpenAI-style additive penalties: logit[j] -= frequency * count[j] + presence * (count[j] > 0).

    logits (B, V); token_ids (B, T): the tokens generated so far (``generate`` passes the generated
    tokens only, not the prompt, as OpenAI's API does). Both penalties must be in [-2, 2].
    """
    for name, value in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
        if not -2 <= value <= 2:
            raise ValueError(f"{name} must be in [-2, 2], got {value}")
    counts = torch.zeros_like(logits).scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=logits.dtype))
    return logits - frequency_penalty * counts - presence_penalty * (counts > 0).to(logits.dtype)


def process_logits(logits: torch.Tensor, input_ids: torch.Tensor, generated_ids: torch.Tensor | None = None, *,
                   repetition_penalty: float | None = None, frequency_penalty: float = 0.0,
                   presence_penalty: float = 0.0, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None, min_p: float | None = None,
                   apply_repetition_penalty: Callable = apply_repetition_penalty,
                   apply_frequency_presence_penalty: Callable = apply_frequency_presence_penalty,
                   apply_temperature: Callable = apply_temperature, top_k_filter: Callable = top_k_filter,
                   top_p_filter: Callable = top_p_filter, min_p_filter: Callable = min_p_filter) -> torch.Tensor:
    """Apply the processors in PROCESSOR_ORDER: penalties, temperature, top-k, top-p, min-p. (B, V) -> (B, V).

    input_ids (B, T): everything so far, prompt included (for the repetition penalty);
    generated_ids (B, T_new): the generated tokens only (for the frequency and presence penalties).
    Processors left at their neutral value (None, 0, 1) are skipped, as in Hugging Face.
    apply_repetition_penalty, ..., min_p_filter: the processor functions that run, this module's by default;
    pass another version by the name of the function it replaces (the learner's, say:
    ``top_k_filter=my_top_k_filter``). The input logits are copied first, so a version that works in place
    cannot change them.
    """
    logits = logits.clone()
    if repetition_penalty is not None and repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, input_ids, repetition_penalty)
    if (frequency_penalty or presence_penalty) and generated_ids is not None:
        logits = apply_frequency_presence_penalty(logits, generated_ids, frequency_penalty, presence_penalty)
    if temperature != 1.0:
        logits = apply_temperature(logits, temperature)
    if top_k:
        logits = top_k_filter(logits, top_k)
    if top_p is not None and top_p != 1.0:
        logits = top_p_filter(logits, top_p)
    if min_p is not None:
        logits = min_p_filter(logits, min_p)
    return logits


def check_settings(vocab_size: int, **settings) -> None:
    """Range-check sampling settings (``process_logits``'s keywords, processor functions included) where each is
    checked, by the processor that applies it, as Hugging Face's processors check theirs when built: every processor
    the settings ask for runs once on a probe row of vocab_size logits. Raises that processor's ValueError, which names
    the setting and its range; ``generate``, ``serving.validate`` and the server call this, and check no range
    themselves."""
    probe_ids = torch.zeros(1, 1, dtype=torch.long)
    process_logits(torch.zeros(1, vocab_size), probe_ids, probe_ids, **settings)


# ----------------------------------------------------------------------------------------------------
# greedy search (the plain loop of the exercise) and the cached decoding loop of generate


def greedy_search(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None,
                  pad_token_id: int | None = None) -> torch.Tensor:
    """Greedy decoding, one argmax per step: input_ids (B, T) -> (B, T + n), n <= max_new_tokens.

    ``model(idx)`` returns ``(logits (B, T, V), loss)`` (our GPT). A row that has produced
    eos_token_id is finished: from then on it emits pad_token_id (default: eos_token_id), while the
    other rows go on; the loop stops early once every row is finished. Only generated tokens finish a
    row: an eos_token_id already in the prompt does not. No cache and no cropping: every step runs the
    model over the whole sequence, so T + max_new_tokens must fit in the model's context (our GPT raises
    ValueError beyond its block_size). ``generate`` does the same with a KV cache.
    """
    if eos_token_id is not None and pad_token_id is None:
        pad_token_id = eos_token_id
    idx = input_ids
    finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)  # (B,)
    for _ in range(max_new_tokens):
        logits, _ = model(idx)
        next_token = logits[:, -1, :].argmax(dim=-1)  # (B,)
        if eos_token_id is not None:
            next_token = torch.where(finished, pad_token_id, next_token)
            finished = finished | (next_token == eos_token_id)
        idx = torch.cat([idx, next_token[:, None]], dim=1)
        if finished.all():
            break
    return idx


def _as_id_list(eos_token_id) -> list[int]:
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) else [int(i) for i in eos_token_id]
    return ids


def _check_length(model, T: int, max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    block_size = model.config.block_size
    if T + max_new_tokens > block_size:
        raise ValueError(f"prompt length + max_new_tokens must be <= block_size = {block_size}, "
                         f"got {T} + {max_new_tokens}")


def _ends_with(idx: torch.Tensor, stop_sequences) -> torch.Tensor:
    """(B,) bool: which rows end with one of the stop sequences (lists of token ids)."""
    hit = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    for seq in stop_sequences:
        L = len(seq)
        if 0 < L <= idx.shape[1]:
            hit |= (idx[:, -L:] == torch.tensor(seq, device=idx.device)).all(dim=1)
    return hit


@torch.no_grad()
def _decode(model, input_ids, max_new_tokens: int, choose: Callable, process: Callable, eos_ids: list[int],
            pad_token_id, attention_mask, use_cache: bool, stop_sequences, streamer) -> torch.Tensor:
    """Greedy and sampling decoding on the library's one loop (``gpt.extend``): the model's step is a cached forward
    pass (the prefill, then one token each), whose logits ``process`` turns into scores and ``choose`` (B, 1) into
    tokens; a finished row emits padding, and the loop ends once every row has finished."""
    B, T0 = input_ids.shape
    unfinished = torch.ones(B, dtype=torch.bool, device=input_ids.device)
    eos = torch.tensor(eos_ids, dtype=torch.long, device=input_ids.device)
    mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask.new_ones(B, max_new_tokens)], dim=1)
    cache = KVCache.for_model(model, B, T0 + max_new_tokens) if use_cache else None

    def next_scores(tokens, new):
        seen = None if mask is None else mask[:, :tokens.shape[1]]
        if use_cache:
            logits = cached_forward(model, new, cache, seen)[:, -1, :]
        else:  # recompute everything: a fresh cache over the whole sequence each step
            logits = cached_forward(model, tokens, KVCache.for_model(model, B, tokens.shape[1]), seen)[:, -1, :]
        return process(tokens, tokens[:, T0:], logits.float())

    def choose_or_pad(scores):
        token = choose(scores)  # (B, 1)
        return token if pad_token_id is None else torch.where(unfinished[:, None], token, pad_token_id)

    def finished(tokens):
        nonlocal unfinished
        if streamer is not None:
            streamer(tokens[:, -1])
        unfinished = unfinished & ~(torch.isin(tokens[:, -1], eos) | _ends_with(tokens, stop_sequences))
        return not unfinished.any()

    return extend(input_ids, max_new_tokens, next_scores, choose_or_pad, finished)


def sample(model, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, min_p: float | None = None, repetition_penalty: float | None = None,
           frequency_penalty: float = 0.0, presence_penalty: float = 0.0, eos_token_id=None, pad_token_id=None,
           attention_mask=None, use_cache: bool = True, generator: torch.Generator | None = None,
           stop_sequences: Sequence[Sequence[int]] = (), streamer: Callable | None = None,
           **processors: Callable) -> torch.Tensor:
    """Ancestral sampling: at each step process the logits (PROCESSOR_ORDER), then draw from their softmax.

    input_ids (B, T) -> (B, T + n). One ``torch.multinomial`` draw of shape (B, 1) per step, from
    ``generator`` (default: the global generator, which is what Hugging Face uses: seed it with
    ``torch.manual_seed`` and both draw the same tokens). processors: other versions of ``process_logits``'s
    processor functions, by name (``top_k_filter=...``), as for ``generate``.
    """
    return generate(model, input_ids, max_new_tokens, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                    min_p=min_p, repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                    presence_penalty=presence_penalty, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                    attention_mask=attention_mask, use_cache=use_cache, generator=generator,
                    stop_sequences=stop_sequences, streamer=streamer, **processors)


# ----------------------------------------------------------------------------------------------------
# beam search


def gnmt_length_penalty(generated_len, alpha: float):
    """The GNMT length penalty (Wu et al., 2016): ((5 + L) / 6) ** alpha; a hypothesis is ranked by score / this."""
    return ((5 + generated_len) / 6) ** alpha


@torch.no_grad()
def beam_search(model, input_ids: torch.Tensor, max_new_tokens: int, num_beams: int, *, length_penalty: float = 1.0,
                early_stopping: bool | str = False, eos_token_id: int | None = None, pad_token_id: int | None = None,
                attention_mask: torch.Tensor | None = None, logits_processor: Callable | None = None):
    """Beam search as Hugging Face's ``generate(num_beams=K)``: input_ids (B, T) -> (sequences, scores).

    model: a course GPT in eval mode, run through chapter 05's ``cached_forward`` (keep one cache and reorder
    it, or recompute the prefix each step: both are fine). attention_mask (B, T): 0 marks left padding.
    max_new_tokens: an int >= 1 with T + max_new_tokens <= the model's block_size. num_beams K: an int >= 1.
    eos_token_id: one token id or None. length_penalty, early_stopping (True, False or "never"):
    Hugging Face's meanings. pad_token_id: fills a sequence after its end (default: eos_token_id, else 0).

    Returns sequences (B, T + n) int64, each row the best finished hypothesis of that row (prompt first,
    then its tokens, then padding), n the longest of them (n <= max_new_tokens); and scores (B,) float32,
    their length-penalised scores, as Hugging Face's ``sequences_scores``. Each row's result is the one
    it gets alone. K = 1 is greedy. ValueError for num_beams < 1 (or not an int) and any other early_stopping.
    The hidden tests compare tokens exactly (scores to 1e-4) with Hugging Face's generate on a converted
    GPT and with brute force on lookup-table models: every early_stopping rule, all beams ending, EOS at
    the first step, positive and negative length penalties, batches with left padding.
    logits_processor: None, or a function (the beams' tokens (B * K, t), t the prompt's length and the tokens
    generated so far; log-probs (B * K, V)) -> (B * K, V) that each step's log-probs pass through before the
    ranking, as in Hugging Face's beam search (the course's own beam_search runs chapter 15's grammar through it:
    -inf for what the grammar forbids). No check, test or later cell passes it to yours: yours may ignore it.
    """
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be an integer >= 1, got {num_beams!r}")
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    B, T0 = input_ids.shape
    K, max_len, inf = num_beams, T0 + max_new_tokens, float("inf")
    eos = -1 if eos_token_id is None else eos_token_id  # -1: no token ends a beam
    pad = pad_token_id if pad_token_id is not None else max(eos, 0)
    rows = torch.arange(B)[:, None]  # (B, 1): indexes each row's own beams
    running = input_ids.new_full((B, K, max_len), pad)  # (B, K, max_len): the beams, padded
    running[:, :, :T0] = input_ids[:, None]
    running_scores = torch.full((B, K), -inf)
    running_scores[:, 0] = 0.0  # the K beams start as one prompt: only one of them may expand
    finished, finished_scores = running.clone(), torch.full((B, K), -inf)  # the K best hypotheses; -inf: none
    finished_len = torch.full((B, K), T0)
    searching = torch.ones(B, dtype=torch.bool)  # rows that may still take hypotheses
    mask = None if attention_mask is None else attention_mask.repeat_interleave(K, dim=0)  # (B * K, T)
    cache = KVCache.for_model(model, B * K, max_len)
    new = input_ids.repeat_interleave(K, dim=0)  # the prefill, then each beam's last token
    for cur_len in range(T0, max_len):
        log_probs = cached_forward(model, new, cache, mask)[:, -1].float().log_softmax(dim=-1)  # (B * K, V)
        if logits_processor is not None:
            log_probs = logits_processor(running[:, :, :cur_len].reshape(B * K, cur_len), log_probs)
        V = log_probs.shape[-1]
        total = (running_scores[:, :, None] + log_probs.view(B, K, V)).view(B, K * V)
        scores, flat = total.topk(2 * K, dim=-1)  # (B, 2K) over all K x V at once: at most K of them end
        beam, token = flat // V, flat % V
        candidates = running[rows, beam]  # (B, 2K, max_len)
        candidates[:, :, cur_len] = token
        ends = (token == eos) | (cur_len + 1 == max_len)
        # those of the best K that end are hypotheses, ranked by score / generated length ** length_penalty
        ranked = (scores / (cur_len + 1 - T0) ** length_penalty).masked_fill(~(ends & searching[:, None]), -inf)
        ranked[:, K:] = -inf
        best = torch.cat([finished_scores, ranked], dim=1).topk(K, dim=-1)
        finished = torch.cat([finished, candidates], dim=1)[rows, best.indices]
        finished_len = torch.cat([finished_len, torch.full_like(beam, cur_len + 1)], dim=1)[rows, best.indices]
        finished_scores = best.values
        # the best K that did not end run on
        alive = scores.masked_fill(ends, -inf)
        keep = alive.topk(K, dim=-1).indices
        running, running_scores, source = candidates[rows, keep], alive[rows, keep], beam[rows, keep]
        # a row stops when its best beam cannot beat its worst hypothesis (early_stopping=True: when it has K)
        best_len = max_len - T0 if early_stopping == "never" and length_penalty > 0 else cur_len + 1 - T0
        searching &= running_scores[:, 0] / best_len ** length_penalty > finished_scores[:, -1]
        if early_stopping is True:
            searching &= finished_scores[:, -1] == -inf
        if not searching.any():
            break
        cache.reorder((source + rows * K).view(-1))
        new = running[:, :, cur_len].reshape(B * K, 1)
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(B * K, 1)], dim=1)
    return finished[:, 0, :int(finished_len[:, 0].max())], finished_scores[:, 0]


# ----------------------------------------------------------------------------------------------------
# generate


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, do_sample: bool = False, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
             repetition_penalty: float | None = None, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
             num_beams: int = 1, length_penalty: float = 1.0, early_stopping: bool | str = False,
             eos_token_id=None, pad_token_id=None, attention_mask=None, use_cache: bool = True,
             generator: torch.Generator | None = None, stop_sequences: Sequence[Sequence[int]] = (),
             streamer: Callable | None = None, apply_repetition_penalty: Callable = apply_repetition_penalty,
             apply_frequency_presence_penalty: Callable = apply_frequency_presence_penalty,
             apply_temperature: Callable = apply_temperature, top_k_filter: Callable = top_k_filter,
             top_p_filter: Callable = top_p_filter, min_p_filter: Callable = min_p_filter,
             beam_search: Callable = beam_search) -> torch.Tensor:
    """Generate up to max_new_tokens after input_ids (B, T) with a course_lib.gpt.GPT: -> (B, T + n).

    Greedy (default), sampling (``do_sample``; processors in PROCESSOR_ORDER, the penalties also apply
    to greedy), or beam search (``num_beams`` > 1; num_beams = 1 is greedy). eos_token_id: an id or a
    list of ids; a finished row emits pad_token_id (default: the first EOS id) and generation stops when
    every row has finished. attention_mask (B, T): 0 marks left padding.

    Same meaning as in Hugging Face's ``generate`` (tests/lib/test_decoding.py checks it token for token):
    max_new_tokens, do_sample, temperature > 0, top_k, top_p, min_p, repetition_penalty, num_beams,
    length_penalty, early_stopping, eos_token_id, pad_token_id, attention_mask. Different: only the
    processors asked for apply (Hugging Face's do_sample=True also applies its default top_k=50);
    temperature=0 is greedy (Hugging Face refuses it); frequency_penalty and presence_penalty are
    OpenAI's (Hugging Face has neither); stop_sequences are lists of token ids that finish a row like an
    EOS (Hugging Face's stop_strings are text); streamer is a function called with the new tokens (B,)
    after every step (Hugging Face's is an object with put and end); generator is ours only. Beam search
    takes one EOS id, no processors and always keeps its cache (use_cache is for num_beams = 1).

    The functions it runs can be replaced, each by a keyword argument named after this module's function
    it replaces (the learner's, say): the processors of ``process_logits`` (``top_k_filter=my_top_k_filter``)
    and ``beam_search`` (called as this module's ``beam_search``, whose sequences are returned). Each processor
    setting is range-checked by its processor only, once before the first step (on a probe row), greedy or not.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (B, T), got {tuple(input_ids.shape)}")
    _check_length(model, input_ids.shape[1], max_new_tokens)
    check_positive("num_beams", num_beams)
    processors = dict(apply_repetition_penalty=apply_repetition_penalty,
                      apply_frequency_presence_penalty=apply_frequency_presence_penalty,
                      apply_temperature=apply_temperature, top_k_filter=top_k_filter, top_p_filter=top_p_filter,
                      min_p_filter=min_p_filter)
    penalties = dict(repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                     presence_penalty=presence_penalty)
    warpers = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    check_settings(model.config.vocab_size, **penalties, **warpers, **processors)  # greedy or not
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    eos_ids = _as_id_list(eos_token_id)
    if pad_token_id is None and eos_ids:
        pad_token_id = eos_ids[0]
    if stop_sequences and pad_token_id is None:
        raise ValueError("pad_token_id (or eos_token_id) is required with stop_sequences: finished rows emit padding")
    if model.training:
        raise ValueError("the model must be in eval mode (model.eval()): generation runs without dropout")

    if num_beams > 1:
        if do_sample:
            raise ValueError("do_sample=True with num_beams > 1 (beam sampling) is not supported: use num_beams=1")
        if frequency_penalty or presence_penalty or stop_sequences or streamer is not None or len(eos_ids) > 1 \
                or repetition_penalty not in (None, 1.0):
            raise ValueError("repetition_penalty, frequency_penalty, presence_penalty, stop_sequences, streamer and "
                             f"several EOS ids need num_beams=1 (got num_beams={num_beams})")
        if max_new_tokens == 0:
            return input_ids
        return beam_search(model, input_ids, max_new_tokens, num_beams, length_penalty=length_penalty,
                           early_stopping=early_stopping, eos_token_id=eos_ids[0] if eos_ids else None,
                           pad_token_id=pad_token_id, attention_mask=attention_mask)[0]

    def process(idx, generated, logits):
        # greedy: the warpers cannot change the argmax, so only the penalties apply (as in Hugging Face)
        return process_logits(logits, idx, generated, **penalties, **(warpers if do_sample else {}), **processors)

    def choose(scores):
        return sample_choice(scores, generator) if do_sample else greedy_choice(scores)

    return _decode(model, input_ids, max_new_tokens, choose, process, eos_ids, pad_token_id, attention_mask,
                   use_cache, stop_sequences, streamer)


# ----------------------------------------------------------------------------------------------------
# measuring generated text


def distinct_n(sequences: Sequence[Sequence[int]], n: int) -> float:
    """Distinct-n (Li et al., 2016): unique n-grams / all n-grams over the given token sequences (0 if none)."""
    grams = [tuple(s[i:i + n]) for s in sequences for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def repetition_rate(sequences: Sequence[Sequence[int]], n: int = 4) -> float:
    """The fraction of n-grams that already occurred earlier in the same sequence (loops score near 1)."""
    repeated = total = 0
    for s in sequences:
        seen = set()
        for i in range(len(s) - n + 1):
            gram = tuple(s[i:i + n])
            repeated += gram in seen
            total += 1
            seen.add(gram)
    return repeated / total if total else 0.0


@torch.no_grad()
def mean_log_likelihood(model, idx: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Mean log p_model(token | prefix) of the tokens after the prompt, per row: idx (B, T) -> (B,).

    Measured with the model's own distribution (temperature 1, no filtering), whatever strategy chose the tokens.
    """
    logits, _ = model(idx[:, :-1])
    log_probs = F.log_softmax(logits.float(), dim=-1).gather(2, idx[:, 1:, None]).squeeze(2)  # (B, T - 1)
    return log_probs[:, prompt_len - 1:].mean(dim=1)
