"""course_lib.decoding against Hugging Face transformers (its LogitsProcessor classes and generate()).

The processors are compared on adversarial logits (ties at the k-th value, -inf entries, top-p boundary
probabilities); greedy, seeded sampling and beam search on small random GPTs converted with
course_lib.hf.to_hf (nothing downloaded). Exact token equality is required; processed logits use the
tolerance policy (assert_parity, 1e-5).
"""
from __future__ import annotations

import inspect

import pytest
import torch

from course_lib import decoding as D
from course_lib.gpt import GPT, GPTConfig
from course_lib.hf import to_hf
from tests.helpers import assert_parity

transformers = pytest.importorskip("transformers")
from transformers.generation import logits_process as LP  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # as in the notebooks: tiny models crawl on several busy threads

V = 13


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=64, n_layer=2, n_head=2, n_embd=16)).eval()
    with torch.no_grad():  # sharper distributions than the 0.02 initialisation: EOS and repeats happen
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(20)
    return model, to_hf(model)


def prompts(B=3, T=5, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def left_padded(pad=9):
    x = prompts(3, 6)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return x.masked_fill(mask == 0, pad), mask


def adversarial_logits():
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(V, generator=g) * 3 for _ in range(3)]
    ties = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.5, 0.5, -1.0, -3.0, -3.0, 0.0, 0.0, 2.0, -0.5])  # ties everywhere
    with_inf = torch.randn(V, generator=g)
    with_inf[[1, 4, 7]] = float("-inf")
    boundary = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03125] + [0.03125 / 8] * 8))  # exact dyadic mass
    return torch.stack(rows + [ties, with_inf, boundary])


# ------------------------------------------------------------------ processors vs HF's classes


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 13, 50])
def test_top_k_matches_hf_with_ties_and_k_larger_than_vocab(k):
    logits = adversarial_logits()
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    expected = LP.TopKLogitsWarper(top_k=k)(ids, logits.clone())
    assert torch.equal(D.top_k_filter(logits, k), expected)


@pytest.mark.parametrize("p", [0.05, 0.5, 0.75, 0.875, 0.9, 0.95, 0.99, 1.0])
def test_top_p_matches_hf_including_boundary_masses(p):
    logits = adversarial_logits()
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    assert torch.equal(D.top_p_filter(logits, p), LP.TopPLogitsWarper(top_p=p)(ids, logits.clone()))


def test_top_p_keeps_the_crossing_token_and_at_least_one():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(D.top_p_filter(logits, 0.6))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.6: the token that crosses (0.3) stays
    assert torch.isfinite(D.top_p_filter(logits, 1e-9)).sum() == 1


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.2, 0.5, 1.0])
def test_min_p_matches_hf(min_p):
    logits = adversarial_logits()
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    assert torch.equal(D.min_p_filter(logits, min_p), LP.MinPLogitsWarper(min_p=min_p)(ids, logits.clone()))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_matches_hf(temperature):
    logits = adversarial_logits()
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    assert_parity(D.apply_temperature(logits, temperature), LP.TemperatureLogitsWarper(temperature)(ids, logits.clone()))


def test_temperature_zero_is_greedy_not_a_division_by_zero():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.0, -1.0, -5.0, -0.5]])
    probs = D.apply_temperature(logits, 0.0).softmax(-1)
    assert torch.equal(probs, torch.tensor([[0.0, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_hf_with_repeats_and_negative_logits(penalty):
    logits = adversarial_logits()[:, :V]
    logits[:, 0] = -2.0  # a negative logit that occurs in the history
    ids = torch.tensor([[0, 1, 1, 1, 5], [0, 0, 2, 3, 3], [12, 0, 4, 4, 4], [0, 1, 2, 3, 4], [0, 5, 5, 6, 6],
                        [0, 9, 10, 11, 12]])
    expected = LP.RepetitionPenaltyLogitsProcessor(penalty=penalty)(ids, logits.clone())
    assert_parity(D.apply_repetition_penalty(logits, ids, penalty), expected)


def test_frequency_presence_penalty_is_openai_additive():
    logits = torch.zeros(2, 5)
    ids = torch.tensor([[1, 1, 1, 3], [0, 4, 4, 4]])
    out = D.apply_frequency_presence_penalty(logits, ids, 0.5, 0.25)
    assert_parity(out, torch.tensor([[0.0, -1.75, 0.0, -0.75, 0.0], [-0.75, 0.0, 0.0, 0.0, -1.75]]))


def test_processor_order_matches_hf_list():
    logits = adversarial_logits()
    ids = torch.tensor([[0, 3, 3]] * logits.shape[0])
    hf = LP.LogitsProcessorList([LP.RepetitionPenaltyLogitsProcessor(1.5), LP.TemperatureLogitsWarper(0.7),
                                 LP.TopKLogitsWarper(6), LP.TopPLogitsWarper(0.9), LP.MinPLogitsWarper(0.05)])
    ours = D.process_logits(logits, ids, repetition_penalty=1.5, temperature=0.7, top_k=6, top_p=0.9, min_p=0.05)
    expected = hf(ids, logits.clone())
    assert torch.equal(torch.isfinite(ours), torch.isfinite(expected))
    assert_parity(ours[torch.isfinite(ours)], expected[torch.isfinite(expected)])


@pytest.mark.parametrize("call, message", [
    (lambda: D.apply_temperature(torch.zeros(1, 3), -1.0), "temperature must be >= 0"),
    (lambda: D.top_k_filter(torch.zeros(1, 3), 0), "top_k must be an integer >= 1"),
    (lambda: D.top_p_filter(torch.zeros(1, 3), 0.0), r"top_p must be in \(0, 1\]"),
    (lambda: D.top_p_filter(torch.zeros(1, 3), 1.5), r"top_p must be in \(0, 1\]"),
    (lambda: D.min_p_filter(torch.zeros(1, 3), -0.1), r"min_p must be in \[0, 1\]"),
    (lambda: D.apply_repetition_penalty(torch.zeros(1, 3), torch.zeros(1, 1, dtype=torch.long), 0.0),
     "repetition_penalty must be > 0"),
    (lambda: D.apply_frequency_presence_penalty(torch.zeros(1, 3), torch.zeros(1, 1, dtype=torch.long), 3.0),
     r"frequency_penalty must be in \[-2, 2\]"),
])
def test_bad_processor_arguments_raise_value_error_naming_the_range(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_bad_generate_arguments_raise_value_error(models):
    model, _ = models
    x = prompts()
    for kwargs, message in [(dict(num_beams=0), "num_beams must be an integer >= 1"),
                            (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
                            (dict(early_stopping="sometimes", num_beams=2), "early_stopping must be"),
                            (dict(temperature=-0.5), "temperature must be >= 0"),
                            (dict(do_sample=True, num_beams=2), "beam sampling")]:
        with pytest.raises(ValueError, match=message):
            D.generate(model, x, 3, **kwargs)
    with pytest.raises(ValueError, match="block_size"):
        D.generate(model, x, 60)


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("setting, message", [
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"), (dict(top_k=-1), "top_k must be an integer >= 1"),
    (dict(min_p=2.0), r"min_p must be in \[0, 1\]"), (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(presence_penalty=-3.0), r"presence_penalty must be in \[-2, 2\]"), (dict(temperature=float("nan")), "temperature"),
])
def test_each_setting_is_checked_once_by_its_processor_before_any_step(models, setting, message, do_sample):
    """As Hugging Face's processors check their settings when built: generate asks each processor for its setting up
    front, greedy or not, before running the model; the error is the processor's own (a replaced one's too)."""
    model, _ = models

    def never(*args, **kwargs):
        raise AssertionError("the model ran before the settings were checked")

    with pytest.raises(ValueError, match=message):
        D.generate(model, prompts(), 3, do_sample=do_sample, streamer=never, **setting)
    name = {"top_p": "top_p_filter", "top_k": "top_k_filter", "min_p": "min_p_filter", "temperature": "apply_temperature",
            "repetition_penalty": "apply_repetition_penalty",
            "presence_penalty": "apply_frequency_presence_penalty"}[next(iter(setting))]

    def refuses(*args):
        raise ValueError("the replaced processor's own check")

    with pytest.raises(ValueError, match="the replaced processor's own check"):
        D.generate(model, prompts(), 3, do_sample=do_sample, streamer=never, **setting, **{name: refuses})


def test_top_k_accepts_python_ints_only_as_documented():
    import numpy as np

    logits = adversarial_logits()
    for k in (0, -1, 2.5, 2.0, True, np.int64(2), torch.tensor(2)):
        with pytest.raises(ValueError, match="top_k must be an integer >= 1"):
            D.top_k_filter(logits, k)


def test_greedy_search_ignores_an_eos_in_the_prompt_and_does_not_crop(models):
    model, _ = models
    x = prompts(1, 5)
    free = D.greedy_search(model, x, 6)
    eos = int(x[0, 2])  # in the prompt
    if eos in free[0, 5:].tolist():
        eos = next(t for t in range(V) if t not in free[0].tolist())
        x[0, 2] = eos
        free = D.greedy_search(model, x, 6)
    assert torch.equal(D.greedy_search(model, x, 6, eos_token_id=eos, pad_token_id=12), free)  # nothing finished
    with pytest.raises(ValueError, match="block_size"):
        D.greedy_search(model, x, 61)  # no cropping: the last step would feed 5 + 60 > 64 tokens


class Spy:
    """A replacement for one of decoding's functions: counts its calls, runs the course's, optionally in place."""

    def __init__(self, name, in_place=False):
        self.function, self.calls, self.in_place = getattr(D, name), 0, in_place

    def __call__(self, logits, *args):
        self.calls += 1
        out = self.function(logits, *args)
        if self.in_place:
            logits.copy_(out)
        return out


def test_functions_replace_the_processors_and_the_input_is_left_alone():
    logits, ids = adversarial_logits(), torch.tensor([[0, 3, 3]] * 6)
    kwargs = dict(repetition_penalty=1.5, temperature=0.7, top_k=6, top_p=0.9, min_p=0.05)
    spies = {name: Spy(name, in_place=True) for name in
             ("apply_repetition_penalty", "apply_temperature", "top_k_filter", "top_p_filter", "min_p_filter")}
    before = logits.clone()
    assert torch.equal(D.process_logits(logits, ids, **spies, **kwargs), D.process_logits(logits, ids, **kwargs))
    assert torch.equal(logits, before)  # copied before an in-place replacement could touch it
    assert all(spy.calls == 1 for spy in spies.values())
    with pytest.raises(TypeError, match="top_k_fliter"):  # a misspelt name is refused, not ignored
        D.process_logits(logits, ids, top_k_fliter=D.top_k_filter, top_k=3)


def test_generate_and_beam_search_run_the_functions_they_are_given(models):
    model, _ = models
    x = prompts()
    top_k, calls = Spy("top_k_filter"), []
    sampled = D.generate(model, x, 6, do_sample=True, top_k=4, generator=torch.Generator().manual_seed(0),
                         top_k_filter=top_k)
    # its setting is checked once, up front, then it runs once per step
    assert top_k.calls == 1 + 6 and torch.equal(sampled, D.generate(model, x, 6, do_sample=True, top_k=4,
                                                                generator=torch.Generator().manual_seed(0)))

    def beam_search(*args, **kwargs):
        calls.append(kwargs)
        return D.beam_search(*args, **kwargs)

    beams = D.generate(model, x, 6, num_beams=3, length_penalty=2.0, beam_search=beam_search)
    assert len(calls) == 1 and calls[0]["length_penalty"] == 2.0
    assert torch.equal(beams, D.generate(model, x, 6, num_beams=3, length_penalty=2.0))


# ------------------------------------------------------------------ greedy and sampling vs HF generate


def test_greedy_matches_hf_and_the_plain_loop(models):
    model, hf = models
    x = prompts()
    ours = D.generate(model, x, 20)
    assert torch.equal(ours, hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False))
    assert torch.equal(D.greedy_search(model, x, 20), ours)
    assert torch.equal(D.generate(model, x, 20, use_cache=False), ours)
    assert torch.equal(D.generate(model, x, 20, num_beams=1), ours)  # num_beams=1 is greedy


def test_greedy_with_eos_per_row_matches_hf(models):
    model, hf = models
    x = prompts()
    free = D.generate(model, x, 20)
    eos = int(free[0, 8])  # a token row 0 produces mid-way: it finishes early, the others may not
    ours = D.generate(model, x, 20, eos_token_id=eos, pad_token_id=11)
    theirs = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False,
                         eos_token_id=eos, pad_token_id=11)
    assert torch.equal(ours, theirs)
    assert torch.equal(D.greedy_search(model, x, 20, eos_token_id=eos, pad_token_id=11), ours)
    row0 = ours[0, 5:].tolist()
    end = row0.index(eos)
    assert set(row0[end + 1:]) <= {11}  # finished rows emit padding ...
    assert not torch.equal(ours[1:, 5 + end + 1:], torch.full_like(ours[1:, 5 + end + 1:], 11))  # ... the others go on


def test_generation_stops_when_all_rows_finish():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
    x = prompts()
    first = D.generate(model, x, 1)[:, -1]
    out = D.generate(model, x, 30, eos_token_id=first.tolist())  # every row ends at its first token
    assert out.shape == (3, 6)


def test_left_padded_batch_matches_hf_and_each_row_alone(models):
    model, hf = models
    x, mask = left_padded()
    ours = D.generate(model, x, 10, attention_mask=mask, pad_token_id=9)
    assert torch.equal(ours, hf.generate(x, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=9))
    for row in range(3):
        alone = x[row:row + 1, (mask[row] == 0).sum():]
        assert torch.equal(D.generate(model, alone, 10)[0, -10:], ours[row, -10:])
    assert torch.equal(D.generate(model, x, 10, attention_mask=mask, use_cache=False), ours)


@pytest.mark.parametrize("kwargs", [dict(), dict(temperature=0.7, top_k=5), dict(top_p=0.8),
                                    dict(min_p=0.1, temperature=1.5),
                                    dict(top_p=0.9, top_k=8, repetition_penalty=1.3, eos_token_id=3, pad_token_id=9)])
def test_seeded_sampling_matches_hf(models, kwargs):
    model, hf = models
    x, mask = left_padded()
    torch.manual_seed(5)
    ours = D.generate(model, x, 12, do_sample=True, attention_mask=mask, **kwargs)
    hf_kwargs = {"top_k": 0, "pad_token_id": 9, **kwargs}  # HF's default top_k is 50: switch it off
    torch.manual_seed(5)
    assert torch.equal(ours, hf.generate(x, attention_mask=mask, max_new_tokens=12, do_sample=True, **hf_kwargs))


def test_sampling_with_a_generator_is_reproducible_and_temperature_zero_is_greedy(models):
    model, _ = models
    x = prompts()
    a = D.sample(model, x, 10, generator=torch.Generator().manual_seed(1))
    b = D.sample(model, x, 10, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    assert torch.equal(D.sample(model, x, 10, temperature=0.0), D.generate(model, x, 10))


def test_stop_sequences_and_streamer(models):
    model, _ = models
    x = prompts()
    free = D.generate(model, x, 20)
    stop = free[1, 9:11].tolist()  # row 1 produces this pair at positions 9-10 (or earlier)
    streamed = []
    out = D.generate(model, x, 20, stop_sequences=[stop], pad_token_id=12, streamer=lambda t: streamed.append(t.clone()))
    for row in range(3):
        ends = [t for t in range(6, free.shape[1] + 1) if free[row, t - 2:t].tolist() == stop]
        end = ends[0] if ends else free.shape[1]
        assert torch.equal(out[row, :end], free[row, :end])
        assert set(out[row, end:].tolist()) <= {12}
    assert torch.equal(torch.stack(streamed, dim=1), out[:, 5:])


def test_frequency_penalty_changes_greedy_output_and_counts_generated_tokens_only(models):
    model, _ = models
    x = prompts()
    plain = D.generate(model, x, 20)
    penalised = D.generate(model, x, 20, frequency_penalty=2.0)
    assert not torch.equal(plain, penalised)
    # repeat rate of the generated part drops
    def repeats(out):
        return sum(len(r) - len(set(r)) for r in out[:, 5:].tolist())
    assert repeats(penalised) < repeats(plain)


# ------------------------------------------------------------------ beam search vs HF generate


def _eos_for_beams(model, x, n):
    out = D.generate(model, x, n, num_beams=3)
    return int(out[0, x.shape[1] + 3])


@pytest.mark.parametrize("num_beams, length_penalty, early_stopping", [
    (2, 1.0, False), (2, 0.0, True), (2, 2.0, "never"), (3, -1.0, False), (3, 1.0, True), (3, 0.5, "never"),
    (5, 1.0, False), (5, 2.0, True), (5, 1.0, "never")])
def test_beam_search_matches_hf_with_eos(models, num_beams, length_penalty, early_stopping):
    model, hf = models
    x = prompts(2, 5)
    eos = _eos_for_beams(model, x, 10)
    kwargs = dict(num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
                  pad_token_id=12)
    ours = D.generate(model, x, 10, **kwargs)
    theirs = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False, **kwargs)
    assert ours.shape == theirs.shape and torch.equal(ours, theirs)


def test_beam_search_scores_match_hf(models):
    model, hf = models
    x, ended = prompts(2, 5), []
    for length_penalty in (1.0, 0.0):
        for eos in (_eos_for_beams(model, x, 10), int(D.generate(model, x, 10, num_beams=4)[1, 8])):
            ours, scores = D.beam_search(model, x, 10, 4, eos_token_id=eos, pad_token_id=12, length_penalty=length_penalty)
            theirs = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False, num_beams=4,
                                 eos_token_id=eos, pad_token_id=12, length_penalty=length_penalty, output_scores=True,
                                 return_dict_in_generate=True)
            assert torch.equal(ours, theirs.sequences)
            assert_parity(scores, theirs.sequences_scores)
            ended.append(bool((ours[:, 5:] == eos).any()))
    assert any(ended)  # some best hypotheses end with EOS: their scores count EOS in the length


def test_beam_search_left_padded_matches_hf_and_refuses_what_it_does_not_do(models):
    model, hf = models
    x, mask = left_padded()
    for kwargs in [dict(num_beams=3), dict(num_beams=2, eos_token_id=3, pad_token_id=9)]:
        ours = D.generate(model, x, 8, attention_mask=mask, **kwargs)
        theirs = hf.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False, **{"pad_token_id": 9, **kwargs})
        assert torch.equal(ours, theirs)
    for refused in [dict(repetition_penalty=1.5), dict(eos_token_id=[3, 4]), dict(do_sample=True)]:
        with pytest.raises(ValueError, match="num_beams=1"):
            D.generate(model, x, 8, attention_mask=mask, num_beams=2, **refused)
    with pytest.raises(ValueError, match="early_stopping"):
        D.beam_search(model, x, 8, 2, early_stopping="sometimes")
    with pytest.raises(ValueError, match="num_beams"):
        D.beam_search(model, x, 8, 0)


def test_one_rows_eos_does_not_end_other_rows_or_beams(models):
    model, _ = models
    x = prompts(2, 5)
    alone = [D.generate(model, x[i:i + 1], 10, num_beams=3, eos_token_id=_eos_for_beams(model, x[:1], 10),
                        pad_token_id=12) for i in range(2)]
    batched = D.generate(model, x, 10, num_beams=3, eos_token_id=_eos_for_beams(model, x[:1], 10), pad_token_id=12)
    for i in range(2):
        n = alone[i].shape[1]
        assert torch.equal(batched[i, :n], alone[i][0])
        assert set(batched[i, n:].tolist()) <= {12}


def test_beam_search_logits_processor_matches_hf_prefix_allowed_tokens_fn(models):
    """The hook chapter 15's beam search within a grammar runs on: each step's log-probs pass through the processor,
    which sees every beam's tokens, before the ranking; Hugging Face's beam search applies its prefix_allowed_tokens_fn
    (a PrefixConstrainedLogitsProcessor) at the same place. The rule here forbids, after a token t, t and t + 1 (mod V):
    a different mask per beam, prompt and left padding included."""
    model, hf = models
    x, mask = left_padded()

    def allowed(last: int) -> list:
        return [v for v in range(V) if v not in (last, (last + 1) % V)]

    def processor(tokens, log_probs):  # (B * K, t), (B * K, V)
        keep = torch.zeros_like(log_probs, dtype=torch.bool)
        for row, beam in enumerate(tokens[:, -1].tolist()):
            keep[row, allowed(beam)] = True
        return log_probs.masked_fill(~keep, float("-inf"))

    for kwargs in [dict(), dict(eos_token_id=3, pad_token_id=9, length_penalty=0.0)]:
        ours, scores = D.beam_search(model, x, 8, 3, attention_mask=mask, logits_processor=processor, **kwargs)
        theirs = hf.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False, num_beams=3,
                             prefix_allowed_tokens_fn=lambda batch, tokens: allowed(int(tokens[-1])),
                             output_scores=True, return_dict_in_generate=True, **{"pad_token_id": 9, **kwargs})
        assert torch.equal(ours, theirs.sequences)
        assert_parity(scores, theirs.sequences_scores)
        generated = ours[:, x.shape[1]:]
        assert all(b not in (a, (a + 1) % V) for row in torch.cat([x[:, -1:], generated], 1).tolist()
                   for a, b in zip(row, row[1:]) if b != 9)
        assert not torch.equal(ours, D.beam_search(model, x, 8, 3, attention_mask=mask, **kwargs)[0])  # it masked


def test_gnmt_length_penalty_by_formula():
    assert abs(D.gnmt_length_penalty(1, 1.0) - 1.0) < 1e-12 and abs(D.gnmt_length_penalty(7, 0.5) - 2 ** 0.5) < 1e-12


def test_beam_search_finds_the_brute_force_best_when_its_beams_hold_every_prefix():
    """Lookup-table GPTs (checks.table_gpt): with K = V ** 3 beams, 4 new tokens and early_stopping="never"
    nothing is pruned, so the result scores as the best of every continuation, enumerated in float64."""
    from course_lib import checks
    g = torch.Generator().manual_seed(7)
    for length_penalty in (1.0, 0.0, -0.5, 2.0):
        table = torch.randn(4, 4, generator=g) * 2
        _, best = checks.brute_force_beam_target(table, [1, 2], 4, 3, length_penalty)
        _, scores = D.beam_search(checks.table_gpt(table), torch.tensor([[1, 2]]), 4, 64, eos_token_id=3,
                                  length_penalty=length_penalty, early_stopping="never")
        assert abs(scores.item() - best) < 1e-4


# ------------------------------------------------------------------ the text metrics of the comparison


def test_distinct_n_and_repetition_rate_by_hand():
    texts = [[1, 2, 1, 2, 1], [3, 3, 3]]
    # bigrams: (1,2) (2,1) (1,2) (2,1) | (3,3) (3,3): 3 distinct of 6
    assert D.distinct_n(texts, 2) == 3 / 6
    # per text: 2 of 4 bigrams seen before in text 0, 1 of 2 in text 1
    assert D.repetition_rate(texts, 2) == 3 / 6
    assert D.distinct_n([[1]], 2) == 0.0 and D.repetition_rate([[1]], 4) == 0.0


def test_mean_log_likelihood_against_a_per_token_loop(models):
    model, _ = models
    idx = prompts(2, 9)
    with torch.no_grad():
        expected = torch.stack([torch.stack([model(idx[b:b + 1, :t])[0][0, -1].log_softmax(-1)[idx[b, t]]
                                             for t in range(4, 9)]).mean() for b in range(2)])
    assert_parity(D.mean_log_likelihood(model, idx, 4), expected)


def test_process_logits_runs_its_processors_in_the_documented_processor_order():
    """PROCESSOR_ORDER (printed in chapter 06) is what process_logits does: every processor switched on, each
    replaced by a spy that records its name, and the calls come in PROCESSOR_ORDER's order."""
    called = []

    def spy(name):
        def record(logits, *args):
            called.append(name)
            return logits
        return record

    function_of = {"repetition_penalty": "apply_repetition_penalty", "frequency_presence_penalty":
                   "apply_frequency_presence_penalty", "temperature": "apply_temperature", "top_k": "top_k_filter",
                   "top_p": "top_p_filter", "min_p": "min_p_filter"}
    keywords = inspect.signature(D.process_logits).parameters
    assert set(function_of) == set(D.PROCESSOR_ORDER)
    assert all(keywords[f].default is getattr(D, f) for f in function_of.values())  # each defaults to the course's own
    logits, ids = torch.randn(2, 11), torch.randint(0, 11, (2, 5))
    D.process_logits(logits, ids, ids[:, -2:], repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5,
                     temperature=0.7, top_k=4, top_p=0.9, min_p=0.05,
                     **{function_of[name]: spy(name) for name in D.PROCESSOR_ORDER})
    assert tuple(called) == D.PROCESSOR_ORDER
