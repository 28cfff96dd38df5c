"""An offline T5 tokenizer whose vocabulary lives in this file.

Invariants:
- The ids are a pure function of the text: the vocabulary and its scores are constants here, and the
  backend (a `tokenizers` Unigram model) has no randomness.
- Layout follows T5: `<pad>`=0, `</s>`=1, `<unk>`=2; every sequence ends in `</s>`; a character the
  vocabulary lacks becomes `<unk>` instead of raising.
- The tokenizer is exactly what `transformers.T5Tokenizer.__init__` rebuilds from a saved `tokenizer.json`,
  so `save_pretrained` followed by `from_pretrained` gives identical ids.

NOTE(normalizer): there is deliberately no NFKC normalizer. In transformers 5, `T5Tokenizer.from_pretrained`
rebuilds the backend from the saved vocabulary and keeps only a SentencePiece `Precompiled` normalizer; any
other normalizer is silently dropped, so NFKC would change ids across a save/load round trip.
"""

from __future__ import annotations

from transformers import T5Tokenizer

__all__ = ["MODEL_MAX_LENGTH", "build_offline_t5_tokenizer", "offline_vocab"]

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
