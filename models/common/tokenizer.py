"""Offline tokenizers whose vocabularies live in this file: a T5 one (LTX-Video) and a Gemma one (LTX-2).

Invariants:
- The ids are a pure function of the text: the vocabularies, scores and merges are constants here, and the
  backends (a `tokenizers` Unigram model for T5, a BPE model for Gemma) have no randomness.
- T5 layout: `<pad>`=0, `</s>`=1, `<unk>`=2; every sequence ends in `</s>`; a character the vocabulary lacks
  becomes `<unk>` instead of raising.
- Gemma layout: `<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3, `<mask>`=4, then the 256 byte tokens `<0x00>`..
  `<0xFF>`; every sequence starts with `<bos>`; a character the vocabulary lacks falls back to its UTF-8 bytes,
  so no text ever becomes `<unk>` (Gemma's own byte fallback).
- Each tokenizer is exactly what its transformers class rebuilds from a saved `tokenizer.json`, so
  `save_pretrained` followed by `from_pretrained` gives identical ids.

NOTE(normalizer): there is deliberately no NFKC normalizer. In transformers 5, `T5Tokenizer.from_pretrained`
rebuilds the backend from the saved vocabulary and keeps only a SentencePiece `Precompiled` normalizer; any
other normalizer is silently dropped, so NFKC would change ids across a save/load round trip.
"""

from __future__ import annotations

from transformers import GemmaTokenizer, T5Tokenizer

__all__ = [
    "GEMMA_MODEL_MAX_LENGTH",
    "MODEL_MAX_LENGTH",
    "build_offline_gemma_tokenizer",
    "build_offline_t5_tokenizer",
    "offline_gemma_vocab",
    "offline_vocab",
]

# LTXPipeline's default max_sequence_length; the pipeline also reads it as tokenizer.model_max_length.
MODEL_MAX_LENGTH = 128

_SPECIALS = ("<pad>", "</s>", "<unk>")

# Whole words, each tokenized as one "▁word" piece. Chosen from what video prompts tend to say.
# (A block of text rather than a list literal: 250 quoted items would bury the words.)
_WORDS = """
a an the and or of in on at to from with without by for into onto over under above below near behind
through across along around between while as is are was were be been being it its this that these those
there here he she they his her their them we you i my your our who which what when where how very slowly
quickly gently softly slightly fully camera shot view angle close up wide aerial drone pan tilt zoom
tracking static handheld cinematic scene frame video clip film footage sequence moment light lighting
sun sunlight sunset sunrise moon night day morning evening dusk dawn sky cloud clouds rain snow fog mist
storm wind water sea ocean wave waves river lake beach sand shore mountain mountains hill forest tree trees
leaf leaves flower flowers grass field garden city street road car cars building buildings house room
window door wall table chair floor bed kitchen man woman person people child boy girl face eyes hair hand
hands arm smile dress shirt coat hat dog cat bird birds horse fish animal red orange yellow green blue
purple pink white black gray grey brown gold silver dark bright warm cold soft sharp blurry detailed
realistic beautiful small large big tall long short old young new walks walking runs running flies flying
moves moving turns turning looks looking stands standing sits sitting holds holding falls falling rises
flowing floating glowing shining dancing smiling talking background foreground left right top bottom
center front back side slow fast high low deep style color colors shadow shadows reflection fire smoke
glass metal wood stone ice space star stars planet earth world one two three four five
""".split()  # noqa: SIM905

# Word pieces without the leading "▁": the tails Unigram falls back on for words not listed above.
_SUBWORDS = """
es ed ing ly er est ion tion ation ness ment able ful less ive ous al ic ical ity ies en ers ings ish
re un in th ch sh st tr pr
""".split()  # noqa: SIM905

_LOWER = tuple("abcdefghijklmnopqrstuvwxyz")
_UPPER = tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
_DIGITS = tuple("0123456789")
_PUNCT = tuple(".,!?;:'\"-()[]{}/\\&%$#@*+=<>_~`^|")

# Unigram picks the segmentation with the highest summed log-probability; these make a listed word (one
# piece) beat any split of it, and a subword tail beat spelling the tail out letter by letter.
_SCORE_SPACE = -7.0
_SCORE_WORD = -8.0
_SCORE_SUBWORD = -9.0
_SCORE_CHAR = -10.0


def offline_vocab() -> list[tuple[str, float]]:
    """Return the (piece, log-probability) list, index = token id; the same list on every call."""
    vocab: list[tuple[str, float]] = [(piece, 0.0) for piece in _SPECIALS]
    vocab.append(("▁", _SCORE_SPACE))
    vocab += [("▁" + word, _SCORE_WORD) for word in _WORDS]
    vocab += [(piece, _SCORE_SUBWORD) for piece in _SUBWORDS]
    vocab += [(char, _SCORE_CHAR) for char in _LOWER + _UPPER + _DIGITS + _PUNCT]
    # A duplicate piece would shadow an id and make ids depend on the backend's tie-breaking.
    seen: set[str] = set()
    duplicates = sorted({piece for piece, _ in vocab if piece in seen or seen.add(piece)})
    assert not duplicates, f"duplicate vocabulary pieces: {duplicates}"
    return vocab


def build_offline_t5_tokenizer(model_max_length: int = MODEL_MAX_LENGTH) -> T5Tokenizer:
    """Build the tokenizer from the in-code vocabulary; no files, no network.

    In transformers 5, `T5Tokenizer` is the tokenizers-backed class and `T5TokenizerFast` is an alias of
    it, so this object is what `diffusers.LTXPipeline` expects for `tokenizer`.
    """
    if model_max_length < 1:
        raise ValueError(f"model_max_length={model_max_length} must be >= 1; LTXPipeline uses 128")
    # extra_ids=0: the T5 span-corruption sentinels are never used for text-to-video prompts, and leaving
    # them out keeps the vocabulary (and the text encoder's embedding table) small.
    return T5Tokenizer(vocab=offline_vocab(), extra_ids=0, model_max_length=model_max_length)


# --- Gemma (LTX-2's text encoder is a Gemma 3) ---

# LTX2Pipeline's default max_sequence_length; the pipeline pads every prompt to it (left), and the text
# connectors need it to be a multiple of their learnable-register count.
GEMMA_MODEL_MAX_LENGTH = 1024

_GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
_GEMMA_BYTES = tuple(f"<0x{byte:02X}>" for byte in range(256))


def offline_gemma_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Return the BPE (vocabulary, merges), the same on every call.

    The Gemma normalizer turns each space into "▁" and adds no prefix space, so every word but the first
    reaches BPE as "▁word". Each listed "▁word" is reached by a chain of merges through its prefixes (which
    are tokens too, as in any BPE vocabulary); the subword tails follow the same way. BPE applies the
    lowest-ranked merge first and every "▁" chain ranks before any other merge, so a listed word after a
    space always ends up as one token. The first word, and anything unlisted, is spelled from subword,
    character and byte pieces.
    """
    pieces: list[str] = [*_GEMMA_SPECIALS, *_GEMMA_BYTES, "▁", *_LOWER, *_UPPER, *_DIGITS, *_PUNCT]
    index = {piece: i for i, piece in enumerate(pieces)}
    assert len(index) == len(pieces), "duplicate base pieces"
    merges: list[tuple[str, str]] = []
    chains = [*("▁" + word for word in _WORDS), *_SUBWORDS]
    for word in chains:
        for end in range(2, len(word) + 1):
            if word[:end] not in index:
                index[word[:end]] = len(index)
                merges.append((word[: end - 1], word[end - 1]))
    return index, merges


def build_offline_gemma_tokenizer(model_max_length: int = GEMMA_MODEL_MAX_LENGTH) -> GemmaTokenizer:
    """Build the Gemma tokenizer from the in-code vocabulary; no files, no network.

    In transformers 5, `GemmaTokenizer` is the tokenizers-backed class and `GemmaTokenizerFast` is an alias
    of it, so this object is what `diffusers.LTX2Pipeline` expects for `tokenizer`.
    """
    if model_max_length < 1:
        raise ValueError(f"model_max_length={model_max_length} must be >= 1; LTX2Pipeline uses 1024")
    vocab, merges = offline_gemma_vocab()
    # add_bos_token explicitly: without it transformers installs no post-processor and no <bos> is added,
    # while Gemma checkpoints (and their tokenizer.json) always prepend it.
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, model_max_length=model_max_length)
