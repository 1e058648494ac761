"""Every number in a chapter's prose is shown by a cell of that chapter, or cited (tests/prose.py says how)."""
from __future__ import annotations

import pytest

from course_lib import grading
from tests.helpers import ROOT
from tests.prose import is_shown, prose_numbers, shown_values, unshown_numbers

#: Per chapter: numbers the prose cites rather than computes, each with its source.
CITED: dict[str, dict[str, str]] = {
    "00-orientation": {
    },

    "01-attention": {
    },

    "02-multihead": {
    },

    "03-transformer": {
    },

    "04-gpt": {
        "0.01": "OpenAI's released GPT-2 code, github.com/openai/gpt-2 src/model.py: wpe drawn with "
                "tf.random_normal_initializer(stddev=0.01)",
    },

    "05-kv-cache": {
        "4096": "Jiang et al. (2023), Mistral 7B, arXiv:2310.06825, section 2 and table 1: window size W = 4096",
        "5 %": "Ainslie et al. (2023), GQA: Training Generalized Multi-Query Transformer Models from Multi-Head "
               "Checkpoints, arXiv:2305.13245, abstract and section 2.1: mean-pooled key/value heads, then uptraining "
               "with 5% of the original pre-training compute (alpha = 0.05, section 3.1)",
    },

    "06-decoding": {
    },

    "07-speculative": {
    },

    "08-memory-bound": {
    },

    "09-tokenization": {
        "50,000": "Radford et al. (2019), Language Models are Unsupervised Multitask Learners, section 2.2 (byte-level "
                  "BPE, a vocabulary of 50,257); OpenAI's released vocabulary, github.com/openai/gpt-2 (vocab.bpe: "
                  "50,000 merges; encoder.json: 50,257 = 256 bytes + 50,000 merges + <|endoftext|>)",
    },

    "10-scaling-laws": {
        "0.076": "Kaplan et al. (2020), Scaling Laws for Neural Language Models, equation (1.1): alpha_N = 0.076",
        "410.7": "Hoffmann et al. (2022), Training Compute-Optimal Large Language Models, arXiv:2203.15556, "
                 "equation (10) (Approach 3): E = 1.69, A = 406.4, B = 410.7, alpha = 0.34, beta = 0.28",
        "0.28": "Hoffmann et al. (2022), equation (10) (Approach 3): beta = 0.28",
        "0.46": "Hoffmann et al. (2022), table 2: N_opt ~ C^a with a = 0.46 for Approach 3",
        "0.50": "Hoffmann et al. (2022), table 2: a = 0.50 for Approach 1",
        "0.49": "Hoffmann et al. (2022), table 2: a = 0.49 for Approach 2",
        "0.5": "Hoffmann et al. (2022), table 2: a = 0.50 and 0.49 for Approaches 1 and 2, parameters and tokens scaled equally",
        "0.73": "Kaplan et al. (2020), section 6.1 and figure 14: N ~ C_min^0.73; compared with Chinchilla by Pearce and "
                "Song (2024), Reconciling Kaplan and Chinchilla Scaling Laws, arXiv:2406.12907",
    },

    "11-modern-decoder": {
        "13B": "Touvron et al. (2023b), Llama 2: Open Foundation and Fine-Tuned Chat Models, arXiv:2307.09288, table 1 "
               "(7B, 13B, 70B released; grouped-query attention in 34B and 70B only); Llama 2 13B's params.json: dim 5120, "
               "multiple_of 256, no ffn_dim_multiplier (F = 13,824, about 8C/3)",
        "1.3": "Meta's Llama 2 70B and Llama 3 8B params.json (github.com/meta-llama/llama, llama3): ffn_dim_multiplier 1.3, "
               "multiple_of 4096 (Llama 2 70B, dim 8192) and 1024 (Llama 3 8B, dim 4096): intermediate sizes 28,672 and 14,336",
        "14,336": "Jiang et al. (2023), Mistral 7B, arXiv:2310.06825, table 1: dim 4096, hidden_dim 14336, n_kv_heads 8",
        "500,000": "Llama Team (2024), The Llama 3 Herd of Models, arXiv:2407.21783, section 3.2 and table 3: RoPE base "
                   "frequency 500,000",
        "3.1": "Llama Team (2024), The Llama 3 Herd of Models, arXiv:2407.21783: the Llama 3.1 models; their RoPE scaling is "
               "rope_type llama3 in Hugging Face's LlamaConfig (transformers modeling_rope_utils)",
    },

    "13-heads": {
    },

    "14-tiled-attention": {
        "768": "PyTorch, aten/src/ATen/native/cpu/FlashAttentionKernel.cpp (the CPU kernel of "
               "_scaled_dot_product_flash_attention_for_cpu): q_split_size = 256 if q_seq_len >= 768, 64 if q_seq_len >= "
               "192, else 32; kv_split_size = 512 (so 256 x 512 tiles at T = 1024)",
    },

    "16-tensor-parallel": {
    },

}

CHAPTERS = grading.chapters(ROOT)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_number_in_the_prose_is_shown_by_a_cell_or_cited(chapter):
    problems = [p for path in sorted((ROOT / "solutions" / chapter).glob("*.ipynb"))
                for p in unshown_numbers(path, CITED.get(chapter, {}))]
    assert not problems, "\n".join(problems)


def test_the_check_reads_numbers_as_a_reviewer_would():
    found = [n.text for n in prose_numbers(
        "The baseline has 104,973 parameters (Bahdanau et al., 2015, chapter 05), 38.6 M in all, "
        "std ×7.84, 61 % of [the roof](https://x.org/2.5), eps 1e-5, float32, GPT-2, 3 heads, 100 steps, 24 layers.")]
    assert found == ["104,973", "38.6 M", "7.84", "61 %", "1e-5", "24"]


@pytest.mark.parametrize("prose,shown,ok", [
    ("38.6 M parameters", "38,597,376", True),      # read in the prose's unit
    ("61 % of the bound", "0.613", True),            # a fraction shown as a percentage
    ("61 % of the bound", "61.3%", True),
    ("about 2.3", "2.26", True),                     # rounded as the prose writes it
    ("about 2.3", "2.36", False),
    ("eps 1e-5", "eps=1e-05", True),
    ("eps 1e-5", "2e-05", False),                    # chapter 03's finding: the prose said 1e-5, the cell printed 2e-5
    ("104,973 parameters", "92,621", False),
])
def test_a_number_is_shown_only_by_a_value_that_rounds_to_it(prose, shown, ok):
    (number,) = prose_numbers(prose)
    assert is_shown(number, shown_values([shown])) is ok
