"""Chapter 06's learner-facing checks: the reference passes; each classic bug gets a specific message with numbers."""
from __future__ import annotations

import pytest
import torch

from course_lib import checks
from course_lib.decoding import (apply_repetition_penalty, apply_temperature, beam_search_step, greedy_search, top_k_filter,
                                 top_p_filter)


def test_reference_implementations_pass_every_visible_check(capsys):
    checks.check_apply_temperature(apply_temperature)
    checks.check_top_k_filter(top_k_filter)
    checks.check_top_p_filter(top_p_filter)
    checks.check_apply_repetition_penalty(apply_repetition_penalty)
    checks.check_greedy_search(greedy_search)
    checks.check_beam_search_step(beam_search_step)
    assert capsys.readouterr().out.count("all visible checks passed") == 6


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


def prompt_counted(log_probs, beam_scores, n, cur_len, prompt_len, length_penalty=1.0):
    scores, beam, token, _ = beam_search_step(log_probs, beam_scores, n, cur_len, prompt_len, length_penalty)
    return scores, beam, token, scores / (cur_len + 1) ** length_penalty


@pytest.mark.parametrize("check, fn, message", [
    (checks.check_apply_temperature, divide_by_zero, "temperature 0 gave NaN"),
    (checks.check_top_k_filter, exactly_k, "three logits tied"),
    (checks.check_top_k_filter, probabilities_out, "not probabilities"),
    (checks.check_top_p_filter, crossing_dropped, "the token that crosses p included"),
    (checks.check_apply_repetition_penalty, divide_all, "RAISES it"),
    (checks.check_greedy_search, stop_at_first_eos, "the other rows go on"),
    (checks.check_beam_search_step, prompt_counted, "(7 + 1 - 4) ** 2 = 16"),
])
def test_each_classic_bug_gets_a_specific_message(check, fn, message):
    with pytest.raises(checks.CheckFailed, match=None) as failure:
        check(fn)
    assert message in str(failure.value)
