"""The shipped checkpoints: every recipe is shipped, each loads as its class, what its record claims is
recomputed from the shipped weights, and `course pretrain` is deterministic."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from course_lib import assets
from course_lib.data import RECORD_SCHEMA, CharTokenizer, Seq2SeqBatch, default_corpus, json_records, reversal_batch
from course_lib.encoder_decoder import Transformer
from course_lib.gpt import GPT, attention_maps, estimate_loss, text_nats
from course_lib.heads import ablate_head, copy_losses, induction_score, previous_token_score, repeated_random_tokens
from course_lib.llama import Llama
from course_lib.bpe import train_bpe
from course_lib.pretrain import RECIPES, VAL_FRACTION, bpe_corpus_splits, corpus_splits, pretrain, save_checkpoint
from course_lib.seq2seq import GRUSeq2Seq
from course_lib.train import fixed_batches

# one thread, as in the notebooks (pretrain() sets each recipe's own); the recorded figures are compared with tolerances
pytestmark = pytest.mark.usefixtures("one_thread")

CHAR_MODELS = sorted(name for name, recipe in RECIPES.items() if recipe.corpus)
RECORD_MODELS = sorted(name for name, recipe in RECIPES.items() if recipe.records)
BPE_MODELS = sorted(name for name, recipe in RECIPES.items() if recipe.bpe)
REVERSAL_MODELS = {"gru-reversal-baseline": GRUSeq2Seq, "gru-reversal-attention": GRUSeq2Seq, "transformer-reversal": Transformer}
INDUCTION_MODELS = ["induction-1l", "induction-2l"]
#: greedy decoding of the shipped weights on another CPU may flip a near-tie argmax; on the CPU that trained them
#: the counts are exact. At most this fraction of the held-out strings (or output digits) may come out otherwise.
FLIP_TOLERANCE = 0.002


@pytest.fixture(scope="module")
def splits():
    return corpus_splits()


def test_every_recipe_is_shipped():
    assert assets.names() == sorted(RECIPES)
    assert sorted([*REVERSAL_MODELS, *INDUCTION_MODELS]) == sorted(set(RECIPES) - set(CHAR_MODELS) - set(BPE_MODELS)
                                                                   - set(RECORD_MODELS))
    for name in RECIPES:
        assert (assets.FOLDER / f"{name}.json").is_file()


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_checkpoint_loads_as_its_class_and_its_record_repeats_its_recipe(name):
    recipe, record = RECIPES[name], assets.info(name)
    model = assets.load(name)
    assert type(model) is assets.MODEL_CLASSES[recipe.model] and not model.training
    assert all(p.dtype == torch.float32 for p in model.state_dict().values())
    assert record["parameters"] == sum(p.numel() for p in model.parameters())
    assert record["bytes"] == (assets.FOLDER / f"{name}.pt").stat().st_size < 5_000_000
    vocab = {"vocab_size": CharTokenizer(default_corpus()).vocab_size} if recipe.corpus else {
        "vocab_size": CharTokenizer(json_records()).vocab_size} if recipe.records else {}
    assert record["config"] == {**vocab, **recipe.config} == assets._checkpoint(name)["config"]
    assert (record["name"], record["model"], record["seed"], record["trainer"], record["threads"]) == (
        name, recipe.model, recipe.seed, recipe.train.__name__, recipe.threads)
    assert record["train"] == json.loads(json.dumps(recipe.train_args))  # (tuples are lists in json)


def test_another_class_can_hold_the_shipped_weights():
    class LearnersGPT(GPT):  # a class of the learner's, GPT-2's names (here the course's modules, under another class)
        pass

    model, course = assets.load("char-gpt-draft", gpt=LearnersGPT), assets.load("char-gpt-draft")
    assert assets.load("char-gpt-draft", LearnersGPT).config == course.config  # as the notebooks pass it
    assert type(model) is LearnersGPT and not model.training and model.config == course.config
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), course.state_dict().values()))
    with pytest.raises(RuntimeError, match="Missing key"):  # strict: a class without the checkpoint's names fails
        assets.load("char-gpt-draft", gpt=lambda config: torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="gpt holds GPT checkpoints only, this one holds a Llama"):
        assets.load("char-llama", gpt=LearnersGPT)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_saving_the_shipped_weights_again_gives_the_shipped_file(name, tmp_path):
    """The .pt file is exactly what pretrain's save_checkpoint writes for these weights (nothing else in it)."""
    checkpoint = assets._checkpoint(name)
    save_checkpoint(tmp_path / f"{name}.pt", assets.load(name), checkpoint["config"], checkpoint.get("vocab"),
                    checkpoint.get("merges"))
    assert (tmp_path / f"{name}.pt").read_bytes() == (assets.FOLDER / f"{name}.pt").read_bytes()


@pytest.mark.parametrize("name", CHAR_MODELS)
def test_char_model_validation_loss_is_the_recorded_one(name, splits):
    _, _, val = splits
    model = assets.load(name)
    record = assets.info(name)
    assert isinstance(model, (GPT, Llama))
    if isinstance(model, GPT):
        assert model.lm_head.weight is model.transformer.wte.weight
    else:  # Llama-style: an untied head
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert record["config"] == {**vars(model.config)}
    e = record["eval"]
    batches = fixed_batches(val, model.config.block_size, e["batch_size"], e["batches"], e["val_seed"])
    with torch.no_grad():
        val_loss = estimate_loss(model, batches)
    assert abs(val_loss - record["val_loss"]) < 0.02, (val_loss, record["val_loss"])
    assert record["val_loss"] < record["history"][0]["val"]  # training helped


def test_the_tokenizer_of_a_char_model_is_the_default_corpus_one():
    for name in CHAR_MODELS:
        assert assets.tokenizer(name).chars == CharTokenizer(default_corpus()).chars
    with pytest.raises(ValueError, match="not a character model"):
        assets.tokenizer("transformer-reversal")


# ----------------------------------------------------------------------------- the JSON model (chapter 15)


@pytest.mark.parametrize("name", RECORD_MODELS)
def test_json_model_reaches_the_recorded_validation_loss_on_its_records_with_their_tokenizer(name):
    """The records are valid for their schema (jsonschema); the model's tokenizer is theirs; its validation loss on
    the recorded fixed batches of the records' last 10 % is the recorded one, and training helped."""
    import json as json_module

    import jsonschema

    # what jsonschema.validate(record, RECORD_SCHEMA) does, but for 4,000 records: validate checks the schema against
    # its meta-schema and builds a validator on every call (7 s here); the schema is checked once, one validator kept
    validator_class = jsonschema.validators.validator_for(RECORD_SCHEMA)
    validator_class.check_schema(RECORD_SCHEMA)
    validator = validator_class(RECORD_SCHEMA)
    text = json_records()
    for line in text.splitlines():
        validator.validate(json_module.loads(line))
    assert assets.tokenizer(name).chars == CharTokenizer(text).chars
    model, record = assets.load(name), assets.info(name)
    _, _, val = corpus_splits(text)
    e = record["eval"]
    with torch.no_grad():
        val_loss = estimate_loss(model, fixed_batches(val, model.config.block_size, e["batch_size"], e["batches"], e["val_seed"]))
    assert abs(val_loss - record["val_loss"]) < 0.02, (val_loss, record["val_loss"])
    assert record["corpus"] == "json_records()" and record["val_loss"] < record["history"][0]["val"]


# ----------------------------------------------------------------------------- the BPE model (chapter 09)


def test_the_tokenizer_of_a_bpe_model_is_learned_from_the_training_text_alone():
    text = default_corpus()
    for name in BPE_MODELS:
        tokenizer = assets.tokenizer(name)
        assert tokenizer.merges == train_bpe(text[:int(len(text) * (1 - VAL_FRACTION))], assets.info(name)["config"]["vocab_size"])
        assert tokenizer.vocab_size == assets.load(name).config.vocab_size


@pytest.mark.parametrize("name", BPE_MODELS)
def test_bpe_model_reaches_the_recorded_losses_and_bits_per_character(name):
    model, record = assets.load(name), assets.info(name)
    tokenizer, _, val = bpe_corpus_splits(model.config.vocab_size)
    e = record["eval"]
    with torch.no_grad():
        val_loss = estimate_loss(model, fixed_batches(val, model.config.block_size, e["batch_size"], e["batches"], e["val_seed"]))
    assert abs(val_loss - record["val_loss"]) < 0.02, (val_loss, record["val_loss"])
    # bits per character on the whole validation text, recomputed here (written apart from pretrain's), both models
    text = default_corpus()
    val_text = text[int(len(text) * (1 - VAL_FRACTION)):]
    v = record["val_text"]
    first = tokenizer.encode(val_text)[0]
    assert v["skipped_chars"] == len(tokenizer.vocab[first].decode("utf-8")) and v["chars"] == len(val_text) - v["skipped_chars"]
    bits = text_nats(model, val, first=1) / (math.log(2) * v["chars"])
    char_model = assets.load(v["char_model"])
    char_ids = torch.tensor(assets.tokenizer(v["char_model"]).encode(val_text))
    char_bits = text_nats(char_model, char_ids, first=v["skipped_chars"]) / (math.log(2) * v["chars"])
    assert abs(bits - v["bpe_bits_per_char"]) < 0.002 and abs(char_bits - v["char_bits_per_char"]) < 0.002, (bits, char_bits, v)


def test_unknown_checkpoint_names_are_rejected():
    with pytest.raises(ValueError, match="name must be one of"):
        assets.load("gpt-5")


# ----------------------------------------------------------------------------- the reversal models


def held_out_strings(train: dict, held_out: dict) -> Seq2SeqBatch:
    """Written apart from pretrain's: the recorded candidates less every string of the replayed training batches."""
    replay = torch.Generator().manual_seed(train["seed"])
    seen = set()
    for _ in range(train["steps"]):
        batch = reversal_batch(train["batch_size"], generator=replay)
        seen.update(tuple(src[:n].tolist()) for src, n in zip(batch.src, batch.src_lengths.tolist()))
    candidates = reversal_batch(held_out["candidates"], generator=torch.Generator().manual_seed(held_out["candidate_seed"]))
    keep = [i for i, (src, n) in enumerate(zip(candidates.src, candidates.src_lengths.tolist())) if tuple(src[:n].tolist()) not in seen]
    return Seq2SeqBatch(candidates.src[keep], candidates.src_lengths[keep], candidates.tgt[keep])


def greedy_tokens(model, batch: Seq2SeqBatch) -> torch.Tensor:
    """Greedy output tokens (B, T) of either model class."""
    if isinstance(model, GRUSeq2Seq):
        return model.greedy_decode(batch.src, batch.src_lengths, max_len=batch.tgt.shape[1])[0]
    return model.generate(batch.src, max_len=batch.tgt.shape[1])


@pytest.mark.parametrize("name", sorted(REVERSAL_MODELS))
def test_reversal_model_reaches_the_recorded_exact_match_on_unseen_strings(name):
    model, record = assets.load(name), assets.info(name)
    claimed = record["held_out"]
    held_out = held_out_strings(record["train"], claimed)
    assert len(held_out.src) == claimed["strings"]
    tokens = greedy_tokens(model, held_out)
    # exact: every digit of the reversal and the EOS after it
    exact = torch.tensor([bool((tokens[b, : n + 1] == held_out.tgt[b, : n + 1]).all()) for b, n in enumerate(held_out.src_lengths.tolist())])
    tolerance = FLIP_TOLERANCE * claimed["strings"]
    assert abs(int(exact.sum()) - claimed["exact"]) <= tolerance, (int(exact.sum()), claimed["exact"])
    for n, strings in claimed["strings_by_length"].items():
        rows = held_out.src_lengths == int(n)
        assert int(rows.sum()) == strings
        assert abs(int(exact[rows].sum()) - claimed["exact_by_length"][n]) <= tolerance
    assert sum(claimed["exact_by_length"].values()) == claimed["exact"]
    assert record["losses"][-1] < record["losses"][0] / 5 and len(record["losses"]) == record["train"]["steps"]


def test_attention_alignment_is_the_recorded_one():
    """Alignment: over every output digit of every held-out string, the attention argmax is the digit being copied."""
    model, record = assets.load("gru-reversal-attention"), assets.info("gru-reversal-attention")
    held_out = held_out_strings(record["train"], record["held_out"])
    _, weights = model.greedy_decode(held_out.src, held_out.src_lengths, max_len=held_out.tgt.shape[1])
    hits = sum(int((weights[b, i].argmax() == n - 1 - i)) for b, n in enumerate(held_out.src_lengths.tolist()) for i in range(n))
    assert abs(hits / int(held_out.src_lengths.sum()) - record["held_out"]["alignment"]) <= FLIP_TOLERANCE
    assert "alignment" not in assets.info("gru-reversal-baseline")["held_out"]  # no attention, no alignment


# ----------------------------------------------------------------------------- the induction models (chapter 13)


def induction_figures_again(model, tokens, period):
    """Written apart from heads.induction_figures: induction scores (L, H), previous-token scores and copy losses."""
    with torch.no_grad():
        maps = attention_maps(model, tokens)
        return induction_score(maps, period), previous_token_score(maps), copy_losses(model, tokens, period)


@pytest.mark.parametrize("name", INDUCTION_MODELS)
def test_induction_model_reaches_the_recorded_scores_at_held_out_periods(name):
    model, record = assets.load(name), assets.info(name)
    held_out = record["held_out"]
    assert held_out["periods"] == RECIPES[name].evaluate["held_out_periods"]
    assert not set(held_out["periods"]) & set(record["train"]["periods"])  # never trained on
    for period in held_out["periods"]:
        claimed = held_out["by_period"][str(period)]
        tokens = repeated_random_tokens(16, period, held_out["batch"], torch.Generator().manual_seed(held_out["seed"]))
        induction, previous, (first, second) = induction_figures_again(model, tokens, period)
        torch.testing.assert_close(induction, torch.tensor(claimed["induction"], dtype=torch.float64), atol=2e-3, rtol=0)
        torch.testing.assert_close(previous.double(), torch.tensor(claimed["previous_token"], dtype=torch.float64), atol=2e-3, rtol=0)
        assert abs(first - claimed["first_copy_loss"]) < 2e-3 and abs(second - claimed["second_copy_loss"]) < 2e-3
        for key, ablated in claimed["ablated"].items():
            layer, head = map(int, key.split("."))
            with ablate_head(model, layer, head):
                induction, _, (first, second) = induction_figures_again(model, tokens, period)
            torch.testing.assert_close(induction, torch.tensor(ablated["induction"], dtype=torch.float64), atol=2e-3, rtol=0)
            assert abs(first - ablated["first_copy_loss"]) < 2e-3 and abs(second - ablated["second_copy_loss"]) < 2e-3


def test_two_layers_form_an_induction_head_and_one_layer_does_not():
    """The chapter's story, on the records (recomputed above): at every held-out period the two-layer model has a
    layer-2 head with a high induction score fed by a layer-1 previous-token head, and predicts the second copy far
    better than the first; the one-layer control has neither; ablating the previous-token head collapses the
    induction score."""
    two, one = assets.info("induction-2l")["held_out"], assets.info("induction-1l")["held_out"]
    for period in map(str, two["periods"]):
        t, o = two["by_period"][period], one["by_period"][period]
        induction_head = max(range(2), key=lambda h: t["induction"][1][h])
        previous_head = max(range(2), key=lambda h: t["previous_token"][0][h])
        assert t["induction"][1][induction_head] > 0.7 and t["previous_token"][0][previous_head] > 0.6, t
        assert t["second_copy_loss"] < t["first_copy_loss"] / 2 and t["first_copy_loss"] > math.log(16) - 0.1
        assert max(o["induction"][0]) < 0.1 and o["second_copy_loss"] > o["first_copy_loss"] - 0.1, o
        ablated = t["ablated"][f"0.{previous_head}"]
        assert ablated["induction"][1][induction_head] < 0.2 and ablated["second_copy_loss"] > t["first_copy_loss"] - 0.3, ablated


# ----------------------------------------------------------------------------- course pretrain


@pytest.fixture
def small_evaluation(monkeypatch):
    """A language model's pretrain evaluates on a tenth of the corpus and on one fixed batch per split (its training
    evaluations too): the same code, run twice, at a fraction of the cost (the evaluation, not the 3 steps, took the
    time)."""
    import course_lib.pretrain as module

    text = default_corpus()
    monkeypatch.setattr(module, "default_corpus", lambda: text[:len(text) // 10])
    monkeypatch.setattr(module, "EVAL_BATCHES", 1)
    monkeypatch.setattr(module, "json_records", lambda: json_records(400))
    for name in CHAR_MODELS + BPE_MODELS + RECORD_MODELS:
        monkeypatch.setitem(RECIPES, name, replace(RECIPES[name], train_args={**RECIPES[name].train_args, "eval_batches": 1}))


@pytest.mark.usefixtures("small_evaluation")
@pytest.mark.parametrize("name", ["char-gpt-draft", "char-llama", "bpe-gpt", "gru-reversal-attention", "transformer-reversal",
                                  "induction-2l", "json-gpt"])
def test_pretrain_is_deterministic(name, tmp_path):
    first = pretrain(name, tmp_path / "a", steps=3, progress=False)
    second = pretrain(name, tmp_path / "b", steps=3, progress=False)
    timing = ("seconds", "cpu_seconds")
    assert {k: v for k, v in first.items() if k not in timing} == {k: v for k, v in second.items() if k not in timing}
    assert (tmp_path / "a" / f"{name}.pt").read_bytes() == (tmp_path / "b" / f"{name}.pt").read_bytes()
    written = json.loads((tmp_path / "a" / f"{name}.json").read_text())
    assert written["train"]["steps"] == 3 and list(written) == list(assets.info(name))  # the shipped record's fields, in order
