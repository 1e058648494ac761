"""Chapter 06's learner-facing checks: the reference passes; each classic bug gets a specific message with numbers."""
from __future__ import annotations

import pytest
import torch

from course_lib import checks
from course_lib import decoding
from course_lib.decoding import apply_repetition_penalty, apply_temperature, top_k_filter
from tests.helpers import mutant


def divide_by_zero(logits, temperature):
    if temperature < 0:
        raise ValueError("temperature")
    return logits / temperature


def exactly_k(logits, k):
    values, indices = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)
    return torch.full_like(logits, float("-inf")).scatter(-1, indices, values)


def probabilities_out(logits, k):
    return top_k_filter(logits, k).softmax(-1)


def crossing_dropped(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum > p
    drop[..., 0] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def multiplied(logits, temperature):
    if temperature < 0:
        raise ValueError("temperature")
    if temperature == 0:
        return apply_temperature(logits, 0.0)
    return logits * temperature


def one_hot_probabilities_at_zero(logits, temperature):
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return apply_temperature(logits, temperature)


def zeros_for_filtered(logits, k):
    return top_k_filter(logits, k).nan_to_num(neginf=0.0)


def k_not_clamped(logits, k):
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def mask_in_sorted_order(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)
    return logits.masked_fill(before >= p, float("-inf"))  # the sorted mask applied to the unsorted logits


def divide_all(logits, ids, penalty):
    return logits.scatter(1, ids, torch.gather(logits, 1, ids) / penalty)


def stop_at_first_eos(model, input_ids, max_new_tokens, eos_token_id=None, pad_token_id=None):
    idx = input_ids
    for _ in range(max_new_tokens):
        nxt = model(idx)[0][:, -1].argmax(-1)
        idx = torch.cat([idx, nxt[:, None]], 1)
        if eos_token_id is not None and (nxt == eos_token_id).any():
            break
    return idx


def penalised_per_occurrence(logits, ids, penalty):
    logits = logits.clone()
    for b in range(ids.shape[0]):
        for t in ids[b].tolist():
            logits[b, t] = logits[b, t] * penalty if logits[b, t] < 0 else logits[b, t] / penalty
    return logits


def every_rows_history(logits, ids, penalty):
    return apply_repetition_penalty(logits, ids.reshape(1, -1).expand(logits.shape[0], -1), penalty)


def samples(model, input_ids, max_new_tokens, eos_token_id=None, pad_token_id=None):
    gen = torch.Generator().manual_seed(0)
    idx = input_ids
    for _ in range(max_new_tokens):
        nxt = torch.multinomial(model(idx)[0][:, -1].softmax(-1), 1, generator=gen)
        idx = torch.cat([idx, nxt], 1)
    return idx


def never_stops(model, input_ids, max_new_tokens, eos_token_id=None, pad_token_id=None):
    idx, finished = input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        nxt = model(idx)[0][:, -1].argmax(-1)
        if eos_token_id is not None:
            nxt = torch.where(finished, pad_token_id, nxt)
            finished |= nxt == eos_token_id
        idx = torch.cat([idx, nxt[:, None]], 1)
    return idx


def no_padding(model, input_ids, max_new_tokens, eos_token_id=None, pad_token_id=None):
    idx, finished = input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        nxt = model(idx)[0][:, -1].argmax(-1)
        finished |= nxt == eos_token_id if eos_token_id is not None else False
        idx = torch.cat([idx, nxt[:, None]], 1)
        if finished.all():
            break
    return idx


def _greedy_variant(pad_default, finished_by_prompt, finished_emit_eos):
    """greedy_search with one of three contract slips (issue 24's adversarial pass)."""
    def greedy(model, input_ids, max_new_tokens, eos_token_id=None, pad_token_id=None):
        pad = pad_default(eos_token_id) if pad_token_id is None else pad_token_id
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        if finished_by_prompt and eos_token_id is not None:
            finished = (input_ids == eos_token_id).any(1)
        idx = input_ids
        for _ in range(max_new_tokens):
            if finished.all():
                break
            nxt = model(idx)[0][:, -1].argmax(-1)
            if eos_token_id is not None:
                nxt = torch.where(finished, eos_token_id if finished_emit_eos else pad, nxt)
                finished = finished | (nxt == eos_token_id)
            idx = torch.cat([idx, nxt[:, None]], 1)
        return idx
    return greedy


eos_in_prompt_finishes = _greedy_variant(lambda eos: eos, True, False)
pad_defaults_to_zero = _greedy_variant(lambda eos: 0, False, False)
finished_rows_emit_eos = _greedy_variant(lambda eos: eos, False, True)


def beam_variant(*replacements):
    """course_lib's beam_search with each (old, new) replacement of its source applied: a planted bug."""
    return mutant(decoding.beam_search, *replacements)


beams_start_equal = beam_variant(("running_scores[:, 0] = 0.0", "running_scores[:, :] = 0.0"))
prompt_in_length_penalty = beam_variant(("(cur_len + 1 - T0) ** length_penalty", "(cur_len + 1) ** length_penalty"))
mask_ignored = beam_variant(("cached_forward(model, new, cache, mask)", "cached_forward(model, new, cache)"))
cache_not_reordered = beam_variant(("        cache.reorder((source + rows * K).view(-1))\n", ""))
ended_run_on = beam_variant(("alive = scores.masked_fill(ends, -inf)", "alive = scores.masked_fill(ends & (cur_len + 1 == max_len), -inf)"))
first_row_done_stops_all = beam_variant(("if not searching.any():", "if not searching.all():"))
stopped_rows_take_hypotheses = beam_variant(("ends & searching[:, None]", "ends"))
never_as_false = beam_variant(('best_len = max_len - T0 if early_stopping == "never" and length_penalty > 0 else cur_len + 1 - T0',
                               "best_len = cur_len + 1 - T0"))  # issue 41: caught by the hidden Hugging Face test only
true_as_false = beam_variant(("        if early_stopping is True:\n            searching &= finished_scores[:, -1] == -inf\n", ""))


@pytest.mark.parametrize("check, fn, message", [
    (checks.check_apply_temperature, divide_by_zero, "temperature 0 gave NaN"),
    (checks.check_apply_temperature, lambda logits, t: logits / max(t, 1e-10), r"return exactly 0 at the maximum and -inf"),
    (checks.check_apply_temperature, lambda logits, t: logits, r"returned the logits unchanged"),
    (checks.check_apply_temperature, lambda logits, t: torch.softmax(logits / t, -1), r"those are probabilities; return logits"),
    (checks.check_apply_temperature, multiplied, "multiplies the logits by the temperature"),
    (checks.check_apply_temperature, one_hot_probabilities_at_zero, "a 1/0 one-hot is probabilities"),
    (checks.check_top_k_filter, exactly_k, "three logits tied"),
    (checks.check_top_k_filter, probabilities_out, "they look like probabilities, not logits"),
    (checks.check_top_k_filter, zeros_for_filtered, "set the filtered tokens to 0"),
    (checks.check_top_k_filter, k_not_clamped, "clamp k to V"),
    (checks.check_top_p_filter, crossing_dropped, "the token that crosses p included"),
    (checks.check_top_p_filter, mask_in_sorted_order, "put the mask back in vocabulary order"),
    (checks.check_apply_repetition_penalty, divide_all, "RAISES it"),
    (checks.check_apply_repetition_penalty, penalised_per_occurrence, "penalised once"),
    (checks.check_apply_repetition_penalty, every_rows_history, "by its own input_ids only"),
    (checks.check_greedy_search, stop_at_first_eos, "the other rows go on"),
    (checks.check_greedy_search, samples, "never samples"),
    (checks.check_greedy_search, never_stops, "stop the loop as soon as all rows have produced EOS"),
    (checks.check_greedy_search, no_padding, "a row that produced EOS emits padding"),
    (checks.check_greedy_search, eos_in_prompt_finishes, "an EOS already in the prompt does not finish a row"),
    (checks.check_greedy_search, pad_defaults_to_zero, "pad_token_id=None means pad with eos_token_id"),
    (checks.check_greedy_search, finished_rows_emit_eos, "is pad_token_id ignored?"),
    (checks.check_beam_search, beams_start_equal, "Your beams never left greedy's path"),
    (checks.check_beam_search, prompt_in_length_penalty, "the length penalty counts the prompt"),
    (checks.check_beam_search, mask_ignored, "wrong with its left padding and attention mask: pass the mask"),
    (checks.check_beam_search, cache_not_reordered, "without any EOS already differs: the search itself"),
    (checks.check_beam_search, ended_run_on, "right without EOS, wrong with eos_token_id=10: the finished hypotheses"),
    (checks.check_beam_search, first_row_done_stops_all, "but not in a batch: the rows affect each other"),
    (checks.check_beam_search, never_as_false, "early_stopping='never' on the left-padded batch: row 1 differs from generated "
     "token 3 on: yours 10, Hugging Face's 6 (lengths 16 and 16). Your result is your early_stopping=False one: is the rule ignored?"),
    (checks.check_beam_search, true_as_false, "early_stopping=True on the left-padded batch: row 0 differs from generated token 5 "
     "on: yours 1, Hugging Face's 10 (lengths 16 and 12). Your result is your early_stopping=False one: is the rule ignored? "
     "early_stopping=True: a row stops as soon as it has K finished hypotheses"),
    (checks.check_beam_search, stopped_rows_take_hypotheses, "but not in a batch: the rows affect each other"),
])
def test_each_classic_bug_gets_a_specific_message(check, fn, message):
    with pytest.raises(checks.CheckFailed) as failure:
        check(fn)
    assert message in str(failure.value)
