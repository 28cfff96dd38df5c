"""The offline T5 tokenizer: deterministic, round-trips through save/load, never crashes on input."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer, T5Tokenizer, T5TokenizerFast

from models.common.tokenizer import MODEL_MAX_LENGTH, build_offline_t5_tokenizer, offline_vocab

PAD, EOS, UNK = 0, 1, 2

PROMPTS = [
    "A cat walks slowly across the beach at sunset.",
    "Aerial drone shot over snowy mountains, cinematic lighting, 4K",
    "Zebras galloping; close-up of a woman's smiling face (slow motion)",
]


def _random_unicode(rng: random.Random, n: int) -> str:
    # Mix ASCII, accented Latin, CJK, emoji, combining marks and odd whitespace: the text a user can paste.
    ranges = [(0x20, 0x7E), (0xC0, 0x17F), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F), (0x300, 0x36F), (0x2000, 0x200B)]
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


def test_layout_and_class():
    tok = build_offline_t5_tokenizer()
    # transformers 5: one tokenizers-backed class under both names, the one LTXPipeline's hint names.
    assert T5TokenizerFast is T5Tokenizer and isinstance(tok, T5Tokenizer)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (PAD, EOS, UNK)
    assert 300 <= len(tok) == len(offline_vocab()) <= 1000
    assert tok.model_max_length == MODEL_MAX_LENGTH


def test_ids_are_deterministic_and_pinned():
    a, b = build_offline_t5_tokenizer(), build_offline_t5_tokenizer()
    assert a(PROMPTS).input_ids == b(PROMPTS).input_ids
    # Pinned: a change here changes the default model's text path, which needs a FORMAT_VERSION bump.
    assert a(PROMPTS[0]).input_ids == [3, 346, 180, 219, 69, 28, 6, 128, 12, 103, 382, 1]
    tokens = a.convert_ids_to_tokens(a(PROMPTS[0]).input_ids)
    assert tokens[2:5] == ["▁cat", "▁walks", "▁slowly"] and tokens[-1] == "</s>"


@pytest.mark.parametrize("loader", [AutoTokenizer.from_pretrained, T5Tokenizer.from_pretrained])
def test_save_load_round_trip(tmp_path, loader):
    tok = build_offline_t5_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = loader(tmp_path)
    assert type(loaded) is T5Tokenizer
    texts = PROMPTS + [_random_unicode(random.Random(seed), 40) for seed in range(4)] + ["ﬁsh Ａ cat", ""]
    kwargs = dict(padding="max_length", max_length=24, truncation=True, return_attention_mask=True)
    before, after = tok(texts, **kwargs), loaded(texts, **kwargs)
    assert before.input_ids == after.input_ids
    assert before.attention_mask == after.attention_mask
    assert len(loaded) == len(tok) and loaded.model_max_length == tok.model_max_length


def test_arbitrary_unicode_does_not_crash():
    tok = build_offline_t5_tokenizer()
    rng = random.Random()  # fresh draw each run: any text must tokenize
    texts = [_random_unicode(rng, rng.randint(0, 200)) for _ in range(20)] + ["日本語 🎥", "\x00\ufffd", " \t\n"]
    for text in texts:
        ids = tok(text).input_ids
        assert ids[-1] == EOS and all(0 <= i < len(tok) for i in ids), text
    assert UNK in tok("日本語 🎥").input_ids


def test_padding_and_truncation_to_max_length():
    tok = build_offline_t5_tokenizer()
    long_text = " ".join(["camera"] * 50)
    out = tok(
        ["a cat", long_text],
        padding="max_length",
        max_length=10,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    assert tuple(out.input_ids.shape) == (2, 10)
    short, long = out.input_ids.tolist()
    # "a cat" -> ▁a ▁cat </s>, then padding; truncation keeps room for the trailing </s>.
    assert short[3:] == [PAD] * 7 and short[2] == EOS
    assert out.attention_mask[0].tolist() == [1, 1, 1] + [0] * 7
    assert long[-1] == EOS and PAD not in long and out.attention_mask[1].all()
    assert tok(long_text, add_special_tokens=False).input_ids[-1] != EOS
