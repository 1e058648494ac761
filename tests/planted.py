"""Planted bugs and accidents that more than one test file uses (test files never import each other)."""
from __future__ import annotations

import copy

from tests.helpers import nbgrader_cells
from tests.roundtrip import Chapter

CH01 = Chapter("01-attention", "attention")
SDPA = "scaled_dot_product_attention-solution"

# chapter 02: Hugging Face's RoPE pairing, correct for Hugging Face but not this course's layout
ROPE_ROTATE_HALF = '''
def apply_rope(x, positions=None, base=10000.0):  # Hugging Face's pairing (i, i + Dh/2): not this course's
    half = x.shape[-1] // 2
    if positions is None:
        positions = torch.arange(x.shape[-2])
    angle = positions[..., None].float() * base ** (-torch.arange(half).float() * 2 / x.shape[-1])
    cos, sin = torch.cat([angle.cos()] * 2, dim=-1), torch.cat([angle.sin()] * 2, dim=-1)
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
'''

# chapter 05: the classic bug as learners write it: prefill, then a loop that starts by feeding the last prompt token (again)
DOUBLE_FEED = '''
@torch.inference_mode()
def generate_cached(model, idx, max_new_tokens, attention_mask=None):
    B, T = idx.shape
    cache = KVCache.for_model(model, B, T + max_new_tokens + 1)
    mask = None if attention_mask is None else torch.cat([attention_mask, attention_mask.new_ones(B, max_new_tokens + 1)], dim=1)
    positions = position_ids(attention_mask, 0, T, B, idx.device)
    cached_forward(model, idx, cache, None if mask is None else mask[:, :T], positions)  # prefill
    token, position, out = idx[:, -1:], positions[:, -1:] + 1, idx
    for t in range(T, T + max_new_tokens):
        logits = cached_forward(model, token, cache, None if mask is None else mask[:, :t + 1], position)
        token = logits[:, -1:].argmax(-1)
        out = torch.cat([out, token], dim=1)
        position = position + 1
    return out
'''


# chapter 01: the accidents a learner makes, which must cost nothing
def accidents() -> dict:
    """A perfect notebook with the accidents learners make: the masked_softmax answer copied and pasted below
    itself (JupyterLab keeps its nbgrader metadata) and broken in the copy, a test cell pasted too, a cell with
    another course's nbgrader metadata, the scaled_dot_product_attention answer switched to markdown, and an
    extra cell at the end that raises."""
    notebook = CH01.solved()
    cells = nbgrader_cells(notebook)
    index = notebook["cells"].index(cells["masked_softmax-solution"])
    pasted = copy.deepcopy(cells["masked_softmax-solution"])
    pasted["id"], pasted["source"] = "pasted-answer", "def masked_softmax(scores, mask=None):\n    return scores * 0\n"
    pasted_test = copy.deepcopy(cells["masked_softmax-visible"])
    pasted_test["id"] = "pasted-test"
    notebook["cells"][index + 1:index + 1] = [pasted, pasted_test]
    foreign = {"id": "foreign", "cell_type": "code", "execution_count": None, "outputs": [], "source": "1 / 0",
               "metadata": {"nbgrader": {"grade": True, "grade_id": "q1-tests", "locked": True, "points": 5, "solution": False}}}
    sdpa = cells[SDPA]
    sdpa["cell_type"] = "markdown"
    del sdpa["outputs"], sdpa["execution_count"]
    raising = {"id": "scratch", "cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
               "source": "raise RuntimeError('trying something')"}
    notebook["cells"] += [foreign, raising]
    return notebook


ACCIDENT_NOTES = ["a copy of masked_softmax-solution was ignored", "a copy of masked_softmax-visible was ignored",
                  "a cell with nbgrader metadata the course does not have (grade id 'q1-tests') was ignored",
                  f"{SDPA} had been switched to markdown: it was graded as the code it holds"]

# chapter 09: a learner's naive BPE trainer (recounts every pair after every merge): correct, slow; planted bugs edit it
NAIVE_TRAINER = '''def train_bpe(text, vocab_size):
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be at least 256, got {vocab_size}")
    words = [[list(chunk.encode("utf-8")), n] for chunk, n in Counter(pretokenize(text)).items()]
    merges = {}
    while len(merges) < vocab_size - 256:
        counts = {}
        for ids, n in words:
            count_pairs(ids, counts, n)
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        merges[pair] = 256 + len(merges)
        for word in words:
            word[0] = bpe_merge(word[0], pair, merges[pair])
    return merges
'''
