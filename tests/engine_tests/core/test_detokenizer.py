"""Incremental detokenization: the byte-table fast path emits exactly what the tokenizer path
emits (same chunks, same text), for the embedded byte tokenizer and a byte-level BPE with merges
and an added token; tokenizers it cannot reproduce fall back to the slow path."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from quire_engine.core.detokenizer import Detokenizer, byte_table
from quire_engine.model.tiny_model import build_tokenizer

TEXT = "Grüße aus Köln — naïve café, 東京タワー 🚀🚀 and plain ASCII words repeated words repeated"


def _trained_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.add_tokens(["<tool>"])  # an added, non-special token: decoded as its content
    return fast


def _sentencepiece_like() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "▁a": 1, "▁b": 2, "a": 3, "b": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _chunks(detok: Detokenizer, ids: list[int]) -> list[str]:
    return [detok.add(t) for t in ids]


@pytest.mark.parametrize("make", [build_tokenizer, _trained_bpe], ids=["bytes", "bpe"])
def test_fast_path_emits_what_the_tokenizer_path_emits(make: object) -> None:
    tokenizer: PreTrainedTokenizerBase = make()  # type: ignore[operator]
    assert byte_table(tokenizer) is not None
    rng = random.Random(0)
    size = len(tokenizer)
    text_ids = list(tokenizer(TEXT, add_special_tokens=False).input_ids)
    # Real text; noise; real tokens shuffled (ASCII pieces right after cut multibyte characters).
    cases = [
        text_ids,
        [rng.randrange(size + 4) for _ in range(300)],
        [rng.choice(text_ids) for _ in range(300)],
    ]
    for prompt_len in (0, 3):
        for ids in cases:
            prompt, gen = ids[:prompt_len] or [0], ids[prompt_len:]
            fast = Detokenizer(tokenizer, prompt)
            slow = Detokenizer(tokenizer, prompt)
            slow.table = None  # force the tokenizer path
            assert _chunks(fast, gen) == _chunks(slow, gen)
            assert fast.text == slow.text
    # Real text round-trips through the fast path.
    whole = Detokenizer(tokenizer, [0])
    _chunks(whole, text_ids)
    assert whole.text == TEXT


def test_tokenizers_the_table_cannot_reproduce_take_the_slow_path() -> None:
    tokenizer = _sentencepiece_like()
    assert byte_table(tokenizer) is None
    detok = Detokenizer(tokenizer, [1])
    assert [detok.add(t) for t in (2, 4, 1)] == [" b", "b", " a"]
    assert detok.text == " bb a"
