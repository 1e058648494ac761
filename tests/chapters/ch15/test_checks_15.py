"""Chapter 15's learner-facing checks: the reference passes; each classic bug gets a specific message; correct
alternatives pass."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib import checks
from course_lib.structured import index as reference
from tests.helpers import mutant


def variant(function, *replacements):
    """The reference `function` with each (old, new) replacement applied to its source."""
    namespace = {"torch": torch, "ByteDFA": reference.ByteDFA, "KEPT": {}}
    return mutant(function, *replacements, namespace=namespace)


def test_reference_implementations_pass_every_visible_check(capsys):
    checks.check_token_index(reference.token_index)
    checks.check_constrained_mask(reference.constrained_mask)
    assert capsys.readouterr().out.count("all visible checks passed") == 2


WALK = "end = dfa.walk(state, data) if data else None"
RETURN = 'return logits.masked_fill(~keep, float("-inf"))'
TI, CM = reference.token_index, reference.constrained_mask


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_token_index, variant(TI, (WALK, "end = (dfa.walk(state, data) or dfa.walk(state, data[:1])) if data else None")),
     "only its first byte leads on"),
    (checks.check_token_index, variant(TI, ("allowed[token] = end", "allowed[token] = dfa.walk(state, data[:1])")),
     "lands where its first byte does; the state must advance"),
    (checks.check_token_index, variant(TI, (WALK, 'data = data.decode("utf-8", errors="replace").encode()\n            ' + WALK)),
     "build the index over bytes, not characters"),
    (checks.check_token_index, variant(TI, (WALK, "end = dfa.walk(state, data)")), "the empty token is allowed"),
    (checks.check_token_index, variant(TI, ("index.append(allowed)", "index.append(allowed) if allowed else None")),
     "must return a list of dfa.num_states"),
    (checks.check_token_index, variant(TI, ("allowed[token] = end", "allowed[token] = end + 1")), "lands in"),
    (checks.check_token_index, variant(TI, (WALK, "end = state if data else None\n            for byte in data:\n"
                                                  "                end = dfa.transitions[end][byte]")),
     "a byte missing from dfa.transitions.state. leads nowhere"),
    (checks.check_constrained_mask, variant(CM, ("if accepting and eos_token_id is not None:", "if eos_token_id is not None:")),
     "EOS is allowed in a state that is not accepting"),
    (checks.check_constrained_mask, variant(CM, ("if accepting and eos_token_id is not None:", "if False:")),
     r"EOS \(token 11\) must keep its logit .* in an accepting state"),
    (checks.check_constrained_mask, variant(CM, ("if accepting and eos_token_id is not None:", "if accepting:")),
     r"with eos_token_id None no token is EOS, and a tensor indexed with None is all of it"),
    (checks.check_constrained_mask, variant(CM, (RETURN, "return logits.masked_fill(~keep, -1e9)")), "not -inf"),
    (checks.check_constrained_mask, variant(CM, (RETURN, 'return logits.masked_fill_(~keep, float("-inf"))')),
     "changed the logits it was given"),
    (checks.check_constrained_mask, variant(CM, (RETURN, 'return torch.log_softmax(logits.masked_fill(~keep, float("-inf")), -1)')),
     "must keep its logit"),
    (checks.check_token_index, variant(TI, ("index.append(allowed)", "index.append(set(allowed))")),
     "a row is a set: make each row a dict from token id to where the token lands"),
    (checks.check_token_index, variant(TI, ("allowed[token] = end", "allowed[data] = end")),
     r"a row has the key b'a', not a token id"),
    (checks.check_constrained_mask, variant(CM, ("keep[list(allowed)] = True", "if accepting and eos_token_id is not None:\n"
                                                 "        allowed[eos_token_id] = None\n    keep[list(allowed)] = True")),
     "changed the dict `allowed`"),
    (checks.check_constrained_mask, variant(CM, ("keep = torch.zeros(logits.shape[-1], dtype=torch.bool)",
                                                 "keep = KEPT.setdefault(logits.shape[-1], torch.zeros(logits.shape[-1], dtype=torch.bool))")),
     "something is kept between calls"),
    (checks.check_constrained_mask, variant(CM, ("keep[list(allowed)] = True", "keep[torch.tensor(list(allowed))] = True")),
     "an empty row: the state allows no token"),
], ids=["first byte", "not advanced", "characters", "empty token", "rows missing", "wrong landing", "missing byte", "EOS always",
        "EOS never", "EOS id None used as an index", "-1e9", "in place", "renormalised", "rows as sets", "keyed by bytes", "allowed written",
        "mask kept between calls", "empty row"])
def test_each_classic_bug_gets_its_message(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)


def by_transitions(dfa, token_bytes):
    """Correct: the transitions read directly, one byte at a time."""
    index = []
    for state in range(dfa.num_states):
        row = {}
        for token, data in enumerate(token_bytes):
            at = state if data else None
            for byte in data:
                at = dfa.transitions[at].get(byte) if at is not None else None
            if at is not None:
                row[token] = at
        index.append(row)
    return index


def by_trie(dfa, token_bytes):
    """Correct: the vocabulary as a trie of bytes, walked once per state (a shared prefix read once); landings as
    numpy integers."""
    trie: dict = {}
    for token, data in enumerate(token_bytes):
        node = trie
        for byte in data:
            node = node.setdefault(byte, {})
        if data:
            node.setdefault(None, []).append(token)
    index = []
    for state in range(dfa.num_states):
        row, todo = {}, [(trie, state)]
        while todo:
            node, at = todo.pop()
            for key, child in node.items():
                if key is None:
                    row.update({token: np.int64(at) for token in child})
                elif key in dfa.transitions[at]:
                    todo.append((child, dfa.transitions[at][key]))
        index.append(row)
    return index


def copy_allowed(logits, allowed, accepting, eos_token_id):
    """Correct: a tensor of -inf with the allowed logits copied in."""
    ids = sorted(allowed) + ([eos_token_id] if accepting and eos_token_id is not None else [])
    out = torch.full_like(logits, float("-inf"))
    out[ids] = logits[ids]
    return out


def test_correct_alternatives_pass(capsys):
    checks.check_token_index(by_transitions)
    checks.check_token_index(by_trie)
    checks.check_constrained_mask(copy_allowed)
    assert capsys.readouterr().out.count("all visible checks passed") == 3


def test_an_unfinished_exercise_is_not_written_yet():
    def unfinished(*args):
        raise NotImplementedError

    for check in (checks.check_token_index, checks.check_constrained_mask):
        with pytest.raises(checks.NotWrittenYet):
            check(unfinished)
