"""Chapter 15 served: chapter 12's engine and ``course serve`` with a per-request constraint (a regex, or a JSON
schema as ``structured.schema_regex`` writes it), constrained and free requests in one batch.

Oracles, none of them the engine: ``structured.constrained_generate`` (one row, the model's full forward pass, the
library's one loop ``gpt.extend``) for a constrained request alone, greedy or sampled at a temperature from a generator
seeded as the engine seeds that sequence; chapter 05's ``generate_cached`` for a free greedy request; the engine
running the request by itself for settings ``constrained_generate`` does not take (top-p); Python's ``re.fullmatch``
for a regex and ``json`` + ``jsonschema`` for a schema. The model is chapter 12's char-gpt (one character, one token:
a completion's text encodes back to exactly its tokens). Planted bugs (the mask not applied, one automaton state
shared by the forks of n > 1, EOS allowed in a non-accepting state, a request that does not finish when its language
is complete) each make the batch check fail.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import dataclasses
import json
import re
import threading
import time

import pytest
import torch

from course_lib import assets
from course_lib.kv_cache import generate_cached
from course_lib.serving import Engine, Request
from course_lib.serving import engine as engine_module
from course_lib.serving.request import Sequence
from course_lib.structured import (Constraint, IndexCache, TokenIndex, constrained_generate, schema_regex,
                                   vocabulary_bytes)
from tests.helpers import mutant

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "char-gpt"
PROMPT = "The cat sat on the mat. "
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Lyon", "Nice"]}, "name": {"type": "string", "minLength": 1, "maxLength": 6},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["city", "name"]}
CODE = r"\d{3}-[a-z]{3}"
ANSWER = r"(yes|no|maybe)!"


@pytest.fixture(scope="module")
def model():
    return assets.load(MODEL)


@pytest.fixture(scope="module")
def tokenizer():
    return assets.tokenizer(MODEL)


@pytest.fixture(scope="module")
def indexes(tokenizer):
    cache = IndexCache(vocabulary_bytes(tokenizer))
    return {"schema": cache.get(schema_regex(SCHEMA)), "code": cache.get(CODE), "answer": cache.get(ANSWER)}


def conforms(text: str, pattern: str, schema: dict | None) -> None:
    assert re.fullmatch(pattern, text), (text, pattern)
    if schema is not None:
        jsonschema.validate(json.loads(text), schema)


def constrained_alone(model, prompt: list, max_new: int, index: TokenIndex, sampling: dict | None,
                      seed: int) -> list:
    """The tokens constrained_generate gives the request alone (sampling: None or {"temperature": t} only)."""
    generator = torch.Generator().manual_seed(seed)
    greedy = sampling is None
    out = constrained_generate(model, torch.tensor([prompt]), max_new, Constraint(index), greedy=greedy,
                               temperature=1.0 if greedy else sampling["temperature"], generator=generator)
    return out[0, len(prompt):].tolist()


def eos_request(model, tokenizer) -> tuple:
    """(pattern, TokenIndex with an EOS, its EOS id): the EOS is the token the model puts first after PROMPT, so a
    mask that allows EOS in the non-accepting start state gets it at once; [a-z]{2,12} cannot spell it."""
    prompt = tokenizer.encode(PROMPT)
    eos = generate_cached(model, torch.tensor([prompt]), 1)[0, -1].item()
    assert not re.fullmatch("[a-z]", tokenizer.decode([eos])), "choose a prompt whose next character is no letter"
    pattern = "[a-z]{2,12}"
    return pattern, TokenIndex.build(pattern, vocabulary_bytes(tokenizer), eos).completable(), eos


def check_batch(model, tokenizer, indexes, num_blocks: int = 96, block_size: int = 4, token_budget: int = 12) -> dict:
    """Constrained and free requests in one engine batch (chunked prompts, preemption when the pool is tight): each
    request's tokens are its run alone; each constrained output is in its language, each schema's output valid."""
    prompt = tokenizer.encode(PROMPT)
    other = tokenizer.encode("Once upon a time")
    eos_pattern, eos_index, eos = eos_request(model, tokenizer)
    cases = [  # (request, pattern or None, schema or None)
        (Request("schema", prompt, 60, constraint=indexes["schema"]), schema_regex(SCHEMA), SCHEMA),
        (Request("free", prompt, 30), None, None),
        (Request("code", other, 20, sampling={"temperature": 0.9}, seed=5, n=3, constraint=indexes["code"]), CODE,
         None),
        (Request("free-sampled", other, 25, sampling={"temperature": 0.8, "top_k": 20}, seed=7), None, None),
        (Request("answer", other, 12, sampling={"temperature": 1.2, "top_p": 0.9}, seed=3,
                 constraint=indexes["answer"]), ANSWER, None),
        (Request("eos", prompt, 16, constraint=eos_index, arrival=2), eos_pattern, None),
        (Request("schema-sampled", other, 60, sampling={"temperature": 1.0}, seed=11, constraint=indexes["schema"],
                 logprobs=2), schema_regex(SCHEMA), SCHEMA),
    ]
    engine = Engine(model, num_blocks=num_blocks, block_size=block_size, token_budget=token_budget)
    results, _ = engine.run([request for request, _, _ in cases])
    for request, pattern, schema in cases:
        for i in range(request.n):
            name = request.name if i == 0 else f"{request.name}/{i}"
            result = results[name]
            assert result.error is None, result.error
            tokens = result.tokens
            if request.constraint is None and request.sampling is None:
                assert tokens == generate_cached(model, torch.tensor([request.prompt]), request.max_new_tokens)[
                    0, len(request.prompt):].tolist(), name
            elif request.constraint is None or set(request.sampling or {}) - {"temperature"}:  # the engine alone
                alone = dataclasses.replace(request, name="alone", arrival=0, n=1, seed=request.seed + i)
                assert tokens == Engine(model, num_blocks=64).run([alone])[0]["alone"].tokens, name
            else:
                assert tokens == constrained_alone(model, request.prompt, request.max_new_tokens, request.constraint,
                                                   request.sampling, request.seed + i), name
            if request.constraint is not None:
                assert result.finish_reason == "stop", (name, result.finish_reason, tokenizer.decode(tokens))
                text_tokens = tokens[:-1] if tokens[-1] == request.constraint.eos_token_id else tokens
                conforms(tokenizer.decode(text_tokens), pattern, schema)
            else:
                assert result.finish_reason == "length" and len(tokens) == request.max_new_tokens, name
    assert results["eos"].tokens[-1] == eos, "the EOS request should end with its EOS: the test lost its point"
    logprobs = results["schema-sampled"].logprobs  # from the masked distribution: the chosen token's is finite
    assert logprobs and all(lp > -float("inf") for lp, _ in logprobs)
    return results


@pytest.mark.parametrize("num_blocks,token_budget", [(96, 12), (24, 6)])  # roomy; tight (preemption, recompute)
def test_constrained_and_free_requests_in_one_batch_each_get_their_run_alone(model, tokenizer, indexes, num_blocks,
                                                                             token_budget):
    results = check_batch(model, tokenizer, indexes, num_blocks=num_blocks, token_budget=token_budget)
    assert (sum(r.preemptions for r in results.values()) > 0) == (num_blocks < 96)


def _unmasked(logits, constraint):
    return logits, int(logits.argmax())


PLANTED = {
    "the mask not applied": lambda mp: mp.setattr(engine_module, "constrain", _unmasked),
    "one state shared by the forks": lambda mp: mp.setattr(Sequence, "fork", mutant(
        Sequence.fork, ("child.constraint = Constraint(self.constraint.index, self.constraint.state)",
                        "child.constraint = self.constraint"))),
    "EOS allowed in a non-accepting state": lambda mp: mp.setattr(Constraint, "mask", mutant(
        Constraint.mask, ("self.state in self.index.dfa.accepting", "True"))),
    "not finished when the language is complete": lambda mp: mp.setattr(Engine, "step", mutant(
        Engine.step, ("complete = seq.constraint is not None and seq.constraint.finished", "complete = False"))),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_the_batch_check_fails_on_a_planted_bug(model, tokenizer, indexes, monkeypatch, bug):
    PLANTED[bug](monkeypatch)
    with pytest.raises(AssertionError):
        check_batch(model, tokenizer, indexes)


def mask_after_the_processors(monkeypatch) -> None:
    """Plant the mask after chapter 06's processors (top-k / top-p chosen among every token, then the forbidden
    ones removed), where vLLM and sampler.constrain put it before them."""
    from course_lib.serving import sampler

    held = {}

    def unmasked(logits, constraint):
        held["constraint"] = constraint
        return logits, sampler.constrain(logits, constraint)[1]

    def choose(row, top, tokens, prompt_len, sampling, generator, processors=None):
        if sampling is None:
            return top
        scores, drawn = sampler.scores_drawn_from(row, tokens, prompt_len, sampling, processors)
        return sampler._pick(held["constraint"].mask(scores[0])[None], drawn, generator)

    monkeypatch.setattr(engine_module, "constrain", unmasked)
    monkeypatch.setattr(engine_module, "choose_token", choose)


@pytest.mark.parametrize("planted", [False, True])
@pytest.mark.parametrize("sampling", [{"temperature": 0.7, "top_k": 1}, {"temperature": 1.3, "top_p": 1e-6},
                                      {"temperature": 1.0, "min_p": 1.0}])
def test_a_filter_that_keeps_only_the_most_likely_allowed_token_is_greedy_constrained_decoding(
        model, tokenizer, indexes, monkeypatch, sampling, planted):
    """The mask comes before the processors: top-k 1, a tiny top-p and min-p 1 then keep the most likely ALLOWED
    token, so a sampled constrained request is greedy constrained decoding (constrained_generate, the oracle). The
    batch check compares such requests with the engine alone, which a mask moved after the processors changes
    alike (temperature and the penalties commute with the mask, the filters do not): planted, this test fails."""
    if planted:
        mask_after_the_processors(monkeypatch)
    prompt = tokenizer.encode(PROMPT)
    want = constrained_alone(model, prompt, 20, indexes["code"], None, 0)
    results, _ = Engine(model, num_blocks=32).run([Request("x", prompt, 20, sampling=sampling, seed=5,
                                                           constraint=indexes["code"])])
    same = results["x"].error is None and results["x"].tokens == want
    assert same != planted, (results["x"].error, tokenizer.decode(results["x"].tokens), tokenizer.decode(want))


def test_a_free_request_never_touches_the_constraint_path(model, tokenizer, monkeypatch):
    def refuse(*args):
        raise AssertionError("constrain called for a free request")

    monkeypatch.setattr(engine_module, "constrain", refuse)
    prompt = tokenizer.encode(PROMPT)
    results, _ = Engine(model, num_blocks=32).run([Request("a", prompt, 8), Request("b", prompt, 8, n=2, seed=1,
                                                                                 sampling={"temperature": 1.0})])
    assert all(r.error is None and r.finish_reason == "length" for r in results.values())


def test_a_constraint_for_another_vocabulary_is_rejected_on_arrival(model, tokenizer):
    index = TokenIndex.build("ab", [b"a", b"b"])
    results, _ = Engine(model, num_blocks=32).run([Request("x", tokenizer.encode(PROMPT), 4, constraint=index),
                                                   Request("y", tokenizer.encode(PROMPT), 4)])
    assert "constraint must be None or a structured.TokenIndex built for the model's vocabulary of 103 tokens, " \
           "got 2" in results["x"].error
    assert results["y"].error is None


def test_index_cache_builds_once_per_pattern_and_keeps_the_most_recent():
    cache = IndexCache([b"a", b"b", b"c"], size=2)
    first = cache.get("a+")
    assert cache.get("a+") is first and cache.builds == 1
    cache.get("b+")
    cache.get("a+")  # now the most recent: "b+" is the least
    cache.get("c+")  # evicts "b+"
    assert list(cache.entries) == ["a+", "c+"] and cache.builds == 3
    cache.get("b+")
    assert cache.builds == 4 and list(cache.entries) == ["c+", "b+"]


def test_index_cache_builds_a_pattern_asked_by_two_threads_at_once_once(monkeypatch):
    from course_lib.structured import index as index_module

    build, started = TokenIndex.build, threading.Event()

    def slow_build(*args, **kwargs):
        started.set()
        time.sleep(0.3)  # the second thread asks while this build runs
        return build(*args, **kwargs)

    monkeypatch.setattr(index_module.TokenIndex, "build", slow_build)
    cache = IndexCache([b"a", b"b"])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(cache.get, "a+b")
        started.wait(5)
        second = pool.submit(cache.get, "a+b")
        assert first.result() is second.result() and cache.builds == 1
        bad = [pool.submit(cache.get, "a(") for _ in range(2)]  # a failed build: the waiter tries and fails too
        for future in bad:
            with pytest.raises(ValueError, match="missing \\)"):
                future.result()
    assert not cache.building and "a(" not in cache.entries


def test_an_index_past_max_walks_is_refused_before_it_is_built_and_the_cache_is_bounded_in_entries(monkeypatch):
    """A pattern of 19,000 states over bpe-gpt's 512 tokens built an index of 6.5 million entries (900 MB, 12 s), and
    the LRU kept 64 of them: TokenIndex.build refuses states x tokens past max_walks before any walk, and IndexCache
    drops the least recently used indexes while their entries together pass max_entries (the newest kept)."""
    from course_lib.structured import index as index_module

    vocab = [b"a", b"b", b"c", b"ab"]
    walked = []
    monkeypatch.setattr(index_module, "token_index", lambda dfa, tokens: walked.append(1) or [{} for _ in tokens])
    with pytest.raises(ValueError, match="101 DFA states x 4 tokens = 404 walks, more than 400"):
        TokenIndex.build("a{100}", vocab, max_walks=400)
    assert not walked
    monkeypatch.undo()
    assert TokenIndex.build("a{99}", vocab, max_walks=400).dfa.num_states == 100  # 400 walks: allowed
    cache = IndexCache(vocab, max_entries=12)
    sizes = {pattern: sum(map(len, cache.get(pattern).next)) for pattern in ("[ab]{3}", "c{4}", "[abc]{2}")}
    assert sizes == {"[ab]{3}": 8, "c{4}": 4, "[abc]{2}": 7}  # 3 + 3 + 2 entries (ab fits twice); 4 x 1; 4 + 3
    assert list(cache.entries) == ["c{4}", "[abc]{2}"]  # 8 + 4 + 6 > 12: the oldest went
    cache.get("c{4}")
    cache.get("[ab]{30}")  # alone over the bound: kept (the newest), every other dropped
    assert list(cache.entries) == ["[ab]{30}"] and cache.builds == 4


def test_completable_drops_the_tokens_whose_state_no_token_can_finish():
    vocab = [b"a", b"b", b"c", b"e"]  # no d: "cde" cannot be spelled, "abe" can
    index = TokenIndex.build("(ab|cd)e", vocab)
    assert set(index.next[0]) == {0, 2}  # by bytes alone, c leads to a live state
    kept = index.completable()
    assert set(kept.next[0]) == {0}
    with pytest.raises(ValueError, match="no string of the pattern can be written"):
        TokenIndex.build("cd", vocab).completable()


# ---------------------------------------------------------------------------------------------------- the server

for package in ("starlette", "uvicorn", "openai", "httpx"):  # found, not imported: openai (0.5 s) where it is used
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed: `pip install -e .` installs the server's pins", allow_module_level=True)

from course_lib.server import Server  # noqa: E402


@pytest.fixture(scope="module")
def server():
    with Server(MODEL, num_blocks=128, block_size=8, token_budget=32) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    import openai
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def complete(client, stream: bool, **kwargs) -> list:
    """[(text, finish_reason)] per choice, streamed or not."""
    if not stream:
        return [(c.text, c.finish_reason) for c in client.completions.create(model=MODEL, **kwargs).choices]
    n = kwargs.get("n") or 1
    texts, finishes = [""] * n, [None] * n
    for chunk in client.completions.create(model=MODEL, stream=True, **kwargs):
        for c in chunk.choices:
            assert finishes[c.index] is None, "a chunk after the choice's finish_reason"
            texts[c.index] += c.text
            finishes[c.index] = c.finish_reason
    return list(zip(texts, finishes))


def json_schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}}


def test_served_constrained_and_free_requests_together_each_get_their_run_alone(client, server, model, tokenizer):
    cases = [  # (keyword arguments, pattern or None, schema or None, stream)
        (dict(prompt=PROMPT, max_tokens=60, temperature=0, extra_body=json_schema_format(SCHEMA)),
         schema_regex(SCHEMA), SCHEMA, False),
        (dict(prompt=PROMPT, max_tokens=60, temperature=0, extra_body={"guided_json": SCHEMA}),
         schema_regex(SCHEMA), SCHEMA, True),
        (dict(prompt="Once upon a time", max_tokens=20, temperature=0.9, seed=5, n=2,
              extra_body={"structured_outputs": {"regex": CODE}}), CODE, None, True),
        (dict(prompt="Once upon a time", max_tokens=20, temperature=1.1, seed=8,
              extra_body={"guided_regex": ANSWER}), ANSWER, None, False),
        (dict(prompt="Hello, world", max_tokens=60, temperature=1.0, seed=9, n=2,
              extra_body={"structured_outputs": {"json": json.dumps(SCHEMA)}}), schema_regex(SCHEMA), SCHEMA, False),
        (dict(prompt=PROMPT, max_tokens=30, temperature=0), None, None, True),
        (dict(prompt="Hello, world", max_tokens=25, temperature=0.8, top_p=0.9, seed=4), None, None, False),
    ]
    cache = server.app.state.constraints
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:  # together: they share the engine's steps
        got = list(pool.map(lambda case: complete(client, case[3], **case[0]), cases))
    for (kwargs, pattern, schema, stream), choices in zip(cases, got):
        prompt = tokenizer.encode(kwargs["prompt"])
        sampling = None if kwargs["temperature"] == 0 else {"temperature": kwargs["temperature"]}
        assert len(choices) == kwargs.get("n", 1)
        for i, (text, finish) in enumerate(choices):
            if pattern is None and sampling is None:
                want = generate_cached(model, torch.tensor([prompt]), kwargs["max_tokens"])[0, len(prompt):].tolist()
            elif pattern is None:
                sampling["top_p"] = kwargs["top_p"]
                alone = Request("alone", prompt, kwargs["max_tokens"], sampling=sampling, seed=kwargs["seed"])
                want = Engine(model, num_blocks=64).run([alone])[0]["alone"].tokens
            else:
                want = constrained_alone(model, prompt, kwargs["max_tokens"], cache.get(pattern), sampling,
                                         kwargs.get("seed", 0) + i)
            assert tokenizer.encode(text) == want, (kwargs, i, text)
            if pattern is None:
                assert finish == "length"
            else:
                assert finish == "stop", (kwargs, text)
                conforms(text, pattern, schema)
    assert cache.builds == 3  # the schema (three ways), the code, the answer: each compiled once


BAD = [  # (extra_body, the param the 400 names, a word of its message)
    ({"guided_regex": "a("}, "guided_regex", "missing )"),
    ({"structured_outputs": {"regex": "(a{100}){300}"}}, "structured_outputs.regex", "more than 20000"),
    ({"structured_outputs": {"regex": "é+"}}, "structured_outputs.regex", "vocabulary"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs", "not supported"),
    (json_schema_format({"type": "object", "properties": {"x": {"type": "number"}}}),
     "response_format.json_schema.schema", "number"),
    (json_schema_format({"$ref": "#"}), "response_format.json_schema.schema", "recursion"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
     "response_format.json_schema.name", "name"),
    ({"response_format": {"type": "json_object"}}, "response_format", "nests without bound"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "guided_json": SCHEMA}, "guided_json", "at most one"),
    ({"guided_regex": "(?:)"}, "guided_regex", "only string is the empty string"),
    ({"guided_regex": "(?:)"}, "guided_regex", "only string is the empty string"),  # again: found compiled
    ({"guided_json": '{"type":"array","items":' * 5000 + "{}" + "}" * 5000}, "guided_json",
     "nested too deeply"),  # a 500 (RecursionError) before
    ({"structured_outputs": {"regex": "a" * 200_000}}, "structured_outputs.regex",
     "more than 100000"),  # parsed for seconds, then an answer as long as the pattern
]


def test_a_bad_constraint_is_a_400_naming_its_field_and_another_stream_goes_on(client, server, model, tokenizer,
                                                                              monkeypatch):
    import openai
    engine = server.engine_loop.engine
    step = engine.step

    def slow_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)  # the stream surely still runs while the bad requests come
    chunks, done = [], threading.Event()

    def stream():
        try:
            for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0,
                                                   stream=True, extra_body={"guided_regex": "[a-z ]{50}"}):
                chunks.append(chunk)
        finally:
            done.set()

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not chunks:
            assert time.monotonic() < deadline, "no first chunk"
            time.sleep(0.01)
        for extra_body, param, word in BAD:
            with pytest.raises(openai.BadRequestError) as caught:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, extra_body=extra_body)
            error = caught.value.body
            assert caught.value.status_code == 400 and error["param"] == param, (extra_body, error)
            assert error["type"] == "invalid_request_error" and word in error["message"], error
            assert len(error["message"]) < 1000, "a long pattern comes back whole in the message"
        assert not done.is_set(), "the stream ended before the bad requests were sent: slow the engine more"
    finally:
        thread.join(60)
    text = "".join(c.choices[0].text for c in chunks)
    prompt = tokenizer.encode(PROMPT)
    want = constrained_alone(model, prompt, 60, server.app.state.constraints.get("[a-z ]{50}"), None, 0)
    assert tokenizer.encode(text) == want and chunks[-1].choices[0].finish_reason == "stop"
    assert re.fullmatch("[a-z ]{50}", text)


def test_constraints_are_compiled_off_the_event_loop(client, server, monkeypatch):
    cache = server.app.state.constraints
    threads, get = [], cache.get

    def recording_get(pattern):
        threads.append(threading.current_thread().name)
        return get(pattern)

    monkeypatch.setattr(cache, "get", recording_get)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"guided_regex": "[0-9]{4}"})
    assert threads and "uvicorn" not in threads, threads  # uvicorn's thread runs the event loop


def arrived(condition, at_most: float = 10.0) -> None:
    """Wait until condition() holds (the requests seen waiting for their compiles, or answered), at most at_most
    seconds (a fixed second was the wait before there was a count to read: on a busy machine 15 requests took 0.9 s
    to arrive); what follows asserts what they did."""
    deadline = time.monotonic() + at_most
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_free_request_never_waits_for_constraints_being_compiled_and_too_many_waiting_are_a_429(server, monkeypatch):
    """Requests are parsed on the event loop's default executor (min(32, CPUs + 4) threads); constraints compiled
    there too let as many slow compiles (a?{1400}a{1400} took 20 s) stall every request, a free one included. Each
    compile now goes to the server's one compiling thread, MAX_COMPILES_WAITING at most waiting for it: the others
    are refused at once (429 naming the field), and a free request is answered while the compiles hang."""
    import os

    import httpx

    from course_lib import server as server_module

    cache, release, get = server.app.state.constraints, threading.Event(), server.app.state.constraints.get

    def hanging_get(pattern):
        if pattern.startswith("q"):
            release.wait(60)
        return get(pattern)

    monkeypatch.setattr(cache, "get", hanging_get)
    many = min(32, (os.cpu_count() or 1) + 4) + 2  # more than the default executor's threads
    url = server.url + "/completions"

    def post(body, timeout=90):
        return httpx.post(url, json={"prompt": PROMPT, "max_tokens": 2, **body}, timeout=timeout)

    with concurrent.futures.ThreadPoolExecutor(many) as pool:
        hanging = [pool.submit(post, {"guided_regex": f"q{i}[a-z]"}) for i in range(many)]
        try:
            waiting = server.app.state.waiting_for_compile  # they have arrived: each waits for its compile, or was refused
            arrived(lambda: sum(waiting.values()) + sum(f.done() for f in hanging) == many)
            start = time.monotonic()
            free = post({"temperature": 0}, timeout=20)
            assert free.status_code == 200 and time.monotonic() - start < 20
            assert not any(f.done() and f.result().status_code != 429 for f in hanging), "a hanging compile ended"
        finally:
            release.set()
        answers = [f.result() for f in hanging]
    refused = [a for a in answers if a.status_code == 429]
    assert len(refused) == many - (server_module.MAX_COMPILES_WAITING + 1), [a.status_code for a in answers]
    assert all(a.json()["error"]["param"] == "guided_regex" for a in refused)
    assert all(a.status_code == 200 for a in answers if a.status_code != 429)


def test_requests_for_a_pattern_being_compiled_join_its_compile_and_only_new_patterns_count_toward_the_429(server,
                                                                                                   monkeypatch):
    """The limit is on compiles, not requests: MAX_COMPILES_WAITING + 1 distinct patterns held compiling (one on the
    compiling thread, the others waiting for it), then more requests for those same patterns than the limit, all
    answered once the compiles end, each pattern compiled once; one more distinct pattern is a 429 at once."""
    import httpx

    from course_lib import server as server_module

    cache, release, get, calls = server.app.state.constraints, threading.Event(), server.app.state.constraints.get, []

    def hanging_get(pattern):
        calls.append(pattern)
        if pattern.startswith("j"):
            release.wait(60)
        return get(pattern)

    monkeypatch.setattr(cache, "get", hanging_get)
    patterns = [f"j{i}[a-z]" for i in range(server_module.MAX_COMPILES_WAITING + 1)]
    same = 3 * len(patterns)  # more requests than the limit, every one for a pattern already compiling or waiting

    def post(pattern, timeout=90):
        return httpx.post(server.url + "/completions", timeout=timeout,
                          json={"prompt": PROMPT, "max_tokens": 2, "guided_regex": pattern})

    with concurrent.futures.ThreadPoolExecutor(len(patterns) + same) as pool:
        first = [pool.submit(post, p) for p in patterns]
        waiting = server.app.state.waiting_for_compile
        try:
            # they have arrived: one compiling (hanging), the others waiting for the compiler
            arrived(lambda: sum(waiting.values()) == len(patterns))
            joined = [pool.submit(post, patterns[i % len(patterns)]) for i in range(same)]
            arrived(lambda: sum(waiting.values()) == len(patterns) + same)
            assert not any(f.done() for f in first + joined), [f.result().status_code for f in first + joined
                                                               if f.done()]
            refused = post("jnew[a-z]", timeout=20)
            assert refused.status_code == 429 and refused.json()["error"]["param"] == "guided_regex"
            assert f"{len(patterns)} other patterns are being compiled" in refused.json()["error"]["message"]
        finally:
            release.set()
        answers = [f.result() for f in first + joined]
    assert [a.status_code for a in answers] == [200] * len(answers)
    assert sorted(calls) == sorted(patterns)  # each compiled once, on the compiling thread; the joined compiled nothing


def test_requests_that_joined_a_compile_that_fails_each_get_a_400_naming_their_own_field_and_one_leaving_cancels_none(
        server, monkeypatch):
    """One pattern held compiling, asked for by guided_regex and by structured_outputs' regex (a request joins the
    compile of the first); a client that leaves while it waits changes nothing for the others. When the compile
    fails, each request's 400 names the field it sent, as the same request alone gets (a planted version that gives
    every joined request the first one's field fails here); compiled once."""
    import httpx

    cache, release, get, calls = server.app.state.constraints, threading.Event(), server.app.state.constraints.get, []

    def hanging_get(pattern):
        calls.append(pattern)
        if pattern.startswith("f"):
            release.wait(60)
            raise ValueError(f"planted: {pattern} does not compile")
        return get(pattern)

    monkeypatch.setattr(cache, "get", hanging_get)
    pattern, bodies = "fail[a-z]", [{"guided_regex": "fail[a-z]"}, {"structured_outputs": {"regex": "fail[a-z]"}}]

    def post(body, timeout=90):
        return httpx.post(server.url + "/completions", timeout=timeout,
                          json={"prompt": PROMPT, "max_tokens": 2, **body})

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        try:
            first = pool.submit(post, bodies[0])
            waiting = server.app.state.waiting_for_compile
            arrived(lambda: calls == [pattern] and waiting[pattern] == 1)  # it compiles (hanging)
            with pytest.raises(httpx.TimeoutException):
                post(bodies[0], timeout=0.5)  # joins, then leaves
            joined = pool.submit(post, bodies[1])
            time.sleep(0.5)
            assert not first.done() and not joined.done()
        finally:
            release.set()
        answers = [first.result(), joined.result()]
    assert calls == [pattern]
    assert [a.status_code for a in answers] == [400, 400]
    assert [a.json()["error"]["param"] for a in answers] == ["guided_regex", "structured_outputs.regex"]
    assert [post(body).json()["error"]["param"] for body in bodies] == ["guided_regex", "structured_outputs.regex"]
    assert all("planted: fail[a-z] does not compile" in a.json()["error"]["message"] for a in answers)
