"""Token texts and bytes for logprobs (`worker.engine.token_text`), on real tokenizers: SmolLM2's (byte-level
BPE, 49k tokens), the tiny test one (byte-level, 512 tokens) and a SentencePiece-style one with byte
fallback. The sampled tokens' texts concatenate to the detokenizer's text and their bytes to its UTF-8,
also for characters split over tokens and for bytes that never form a character."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_detokenizer import full_decode
from worker.engine.token_text import TokenTexts, for_tokenizer

TEXT = "Héllo wörld: 日本語のテキスト, emoji 🚀🔥👍🏽 and ℕ ≠ ∅. Straße!"


@pytest.fixture(scope="module")
def tiny_tok(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def smol_tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(params=["tiny", "smollm2"])
def tok(request):
    return request.getfixturevalue("tiny_tok" if request.param == "tiny" else "smol_tok")


def walk(table: TokenTexts, ids: list[int]) -> tuple[list[str], list[bytes], bytes]:
    texts, datas, held = [], [], b""
    for i in ids:
        text, data, held = table.sampled(held, i)
        texts.append(text)
        datas.append(data)
    return texts, datas, held


def test_a_character_split_over_tokens(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    table = for_tokenizer(tok)
    assert for_tokenizer(tok) is table, "one table per tokenizer"
    texts, datas, held = walk(table, ids)
    assert "".join(texts) == TEXT == full_decode(tok, ids) and held == b""
    assert b"".join(datas) == TEXT.encode()
    split = [i for i, (t, d) in enumerate(zip(texts, datas)) if t.encode() != d]
    assert split, "the text has characters that this tokenizer splits over tokens"
    first = next(i for i in split if texts[i] == "")  # a token inside a character: nothing decodes yet
    done = next(i for i in range(first + 1, len(ids)) if texts[i])  # the token completing it carries it
    assert "".join(texts[: done + 1]) == b"".join(datas[: done + 1]).decode()  # no partial character


def test_alternatives_are_what_they_would_add_there(smol_tok):
    table = for_tokenizer(smol_tok)
    ids = smol_tok.encode("日本", add_special_tokens=False)
    assert len(ids) >= 2
    text, data, held = table.sampled(b"", ids[0])
    assert text == "" and held == data
    assert table.alternative(held, ids[1]) == table.sampled(held, ids[1])[:2]
    full = table.alternative(held, ids[1])[0]
    assert full.startswith("日") or full == "日本"[: len(full)]
    assert table.alternative(held, smol_tok.convert_tokens_to_ids("a"))[0] == "\ufffda"  # never completes it
    assert table.alternative(b"", smol_tok.convert_tokens_to_ids("a")) == ("a", b"a")


def test_special_tokens_keep_their_text_and_leave_held_bytes(smol_tok):
    table = for_tokenizer(smol_tok)
    eos = smol_tok.convert_tokens_to_ids("<|im_end|>")
    assert table.sampled(b"", eos) == ("<|im_end|>", b"<|im_end|>", b"")
    assert table.sampled(b"\xe6", eos) == ("<|im_end|>", b"<|im_end|>", b"\xe6")


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_ids_agree_with_the_full_decode(tiny_tok, data):
    """Random output (a random model's): the texts of the non-special tokens concatenate to the decode
    of the ids, but for a character still incomplete at the end (U+FFFD in the text, in no token's)."""
    n = len(tiny_tok)
    ids = data.draw(st.lists(st.integers(0, n - 1), max_size=40))
    table = for_tokenizer(tiny_tok)
    special = {i for i in ids if table[i][3]}  # the output text skips special tokens
    texts, datas, held = walk(table, ids)
    body = [t for t, i in zip(texts, ids) if i not in special]
    want = full_decode(tiny_tok, ids)
    tail = "\ufffd" if held else ""
    assert "".join(body) + tail == want
    assert b"".join(d for d, i in zip(datas, ids) if i not in special).decode("utf-8", "replace") == want


def sentencepiece_tokenizer():
    """A Llama-2-style tokenizer: Metaspace pieces, byte-fallback tokens <0x..>, its decoder chain."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁Hello", "▁world", "é", "▁caf", "!"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


def test_a_sentencepiece_tokenizer_with_byte_fallback():
    tok = sentencepiece_tokenizer()
    table = TokenTexts(tok)
    ids = [tok.token_to_id(p) for p in ["▁Hello", "▁world", "▁caf", "é", "!"]]
    ids += [tok.token_to_id(f"<0x{b:02X}>") for b in "日".encode()]
    texts, datas, held = walk(table, ids)
    assert texts == [" Hello", " world", " caf", "é", "!", "", "", "日"] and held == b""
    assert datas[-3:] == [b"\xe6", b"\x97", b"\xa5"]
    assert "".join(texts).lstrip() == tok.decode(ids)  # the decoder drops the first token's space


def test_cost_per_token_is_a_lookup(smol_tok):
    """Timed for docs/gateway.md: a sampled token and 5 alternatives, warm table."""
    import time

    table = for_tokenizer(smol_tok)
    rng = random.Random(0)
    ids = smol_tok.encode(TEXT * 20, add_special_tokens=False)
    tops = [[rng.randrange(len(smol_tok)) for _ in range(5)] for _ in ids]
    walk(table, ids)
    for top in tops:
        for t in top:
            table.alternative(b"", t)
    t0 = time.perf_counter()
    held = b""
    for i, top in zip(ids, tops):
        _, _, h = table.sampled(held, i)
        [table.alternative(held, t) for t in top]
        held = h
    per_token_us = (time.perf_counter() - t0) / len(ids) * 1e6
    assert per_token_us < 50  # a loose bound for a busy CI machine; ~2-3 µs measured
