"""Incremental detokenizer: UTF-8 safe deltas equal to the full decode, stop strings (vLLM semantics).

Run as a module for the cost per token on SmolLM2's tokenizer (from the repository root):
``python -m tests.unit.test_detokenizer``.
"""

from __future__ import annotations

import random
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.engine.detokenizer import IncrementalDetokenizer, _ByteTable
from worker.engine.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
STRATEGIES = ("byte_level", "window")

TEXTS = [
    "大型语言模型的推理服务需要高效地管理显存。你好，世界！",
    "Emoji: 🚀🔥😀👍🎉 family 👨‍👩‍👧 flag 🇫🇷 and accents: café, naïve, Ångström, Straße.",
    "def main():\n    print('hello world')  # 注释 ✓\n    return 0\n",
    "日本語のテキスト、한국어 텍스트, Ελληνικά, русский текст, עברית, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
]


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


def full_decode(tokenizer, ids, skip_special_tokens=True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def feed(detok: IncrementalDetokenizer, ids, chunks=None) -> list[str]:
    """Feed `ids` one at a time (or in the given chunk sizes); return the deltas, flush last."""
    deltas, i = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.update(ids[i : i + size]))
        i += size
    deltas.append(detok.flush())
    return deltas


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# --- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("text", TEXTS, ids=["chinese", "emoji", "code", "scripts"])
def test_multibyte_text_round_trips_token_by_token(tok, strategy, text):
    ids = encode(tok, text)
    assert full_decode(tok, ids) == text
    detok = IncrementalDetokenizer(tok, strategy=strategy)
    emitted = ""
    for k, token_id in enumerate(ids, start=1):
        delta = detok.update(token_id)
        assert REPLACEMENT not in delta
        emitted += delta
        # nothing is held back longer than needed: a prefix that decodes cleanly is all out
        prefix = full_decode(tok, ids[:k])
        if not prefix.endswith(REPLACEMENT):
            assert emitted == prefix
    assert detok.flush() == ""
    assert emitted == text == detok.output_text


def test_characters_split_across_tokens_are_held_back(tok):
    ids = encode(tok, "🚀")
    assert len(ids) > 1  # byte-level BPE splits the 4 bytes
    detok = IncrementalDetokenizer(tok)
    assert [detok.update(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.update(ids[-1]) == "🚀"


def test_auto_strategy_is_byte_level_for_byte_level_bpe(tok):
    assert type(IncrementalDetokenizer(tok)._stream).__name__ == "_ByteLevelStream"


def test_special_tokens_skipped_or_kept(tiny_tok):
    ids = [*encode(tiny_tok, "Hi "), tiny_tok.convert_tokens_to_ids("<|im_end|>"), *encode(tiny_tok, "你")]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tiny_tok, skip_special_tokens=skip)
        text = "".join(feed(detok, ids))
        assert text == full_decode(tiny_tok, ids, skip)
        assert ("<|im_end|>" in text) is not skip


def test_invalid_bytes_come_out_at_flush(tiny_tok):
    # the first two bytes of a three-byte character, then the end of output
    table = _ByteTable(tiny_tok.backend_tokenizer, True)
    byte_ids = {table[i]: i for i in range(len(tiny_tok)) if len(table[i]) == 1}
    ids = [*encode(tiny_tok, "ok "), byte_ids[b"\xe4"], byte_ids[b"\xb8"]]
    for strategy in STRATEGIES:
        detok = IncrementalDetokenizer(tiny_tok, strategy=strategy)
        deltas = feed(detok, ids)
        assert "".join(deltas[:-1]) == "ok "
        assert deltas[-1] == REPLACEMENT == full_decode(tiny_tok, ids)[-1]


def test_window_stays_bounded(smol_tok):
    ids = encode(smol_tok, " ".join(TEXTS) * 20)
    detok = IncrementalDetokenizer(smol_tok, strategy="window", stop=["never appears"])
    for i in ids:
        detok.update(i)
        assert len(detok._stream._ids) <= 8
        assert len(detok._tail) <= len("never appears") - 1
    # a long run of bytes that never become valid: the window is still capped
    detok = IncrementalDetokenizer(smol_tok, strategy="window")
    table = _ByteTable(smol_tok.backend_tokenizer, True)
    continuation = next(i for i in range(len(smol_tok)) if table[i] == b"\x80")
    deltas = feed(detok, [continuation] * 200)
    assert len(detok._stream._ids) <= detok._stream.MAX_HELD + 2
    assert "".join(deltas) == REPLACEMENT * 200 == full_decode(smol_tok, [continuation] * 200)


# --- random ids: deltas + flush == full decode ----------------------------------------------------


@cache
def interesting_ids(tokenizer) -> tuple[list[int], list[int]]:
    """(special ids, ids whose bytes include non-ASCII ones) of a tokenizer."""
    table = _ByteTable(tokenizer.backend_tokenizer, False)
    special = sorted(tokenizer.backend_tokenizer.get_added_tokens_decoder())
    high = [i for i in range(len(tokenizer)) if any(b >= 0x80 for b in table[i])]
    return special, high


@st.composite
def id_sequences(draw, tokenizer, out_of_range: bool = False):
    special, high = interesting_ids(tokenizer)
    top = len(tokenizer) + (5 if out_of_range else 0)
    one = st.one_of(st.integers(0, top - 1), st.sampled_from(special), st.sampled_from(high))
    ids = draw(st.lists(one, max_size=24))
    chunks = []
    left = len(ids)
    while left:
        chunks.append(draw(st.integers(1, min(4, left))))
        left -= chunks[-1]
    return ids, chunks


def check_random_ids(tokenizer, ids, chunks, skip, strategy):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, strategy=strategy)
    deltas = feed(detok, ids, chunks)
    expected = full_decode(tokenizer, ids, skip)
    assert "".join(deltas) == expected == detok.output_text
    # a U+FFFD in a delta is one the full decode has at that place (implied by the equality), and
    # no delta stops inside a character unless that character is invalid in the full decode too
    pos = 0
    for delta in deltas[:-1]:
        pos += len(delta)
        if delta.endswith(REPLACEMENT):
            assert expected[pos - 1] == REPLACEMENT


_hyp = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("strategy", STRATEGIES)
@_hyp
@given(data=st.data(), skip=st.booleans())
def test_random_ids_tiny(tiny_tok, strategy, data, skip):
    ids, chunks = data.draw(id_sequences(tiny_tok, out_of_range=True))
    check_random_ids(tiny_tok, ids, chunks, skip, strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
@_hyp
@given(data=st.data(), skip=st.booleans())
def test_random_ids_smollm2(smol_tok, strategy, data, skip):
    ids, chunks = data.draw(id_sequences(smol_tok))
    check_random_ids(smol_tok, ids, chunks, skip, strategy)


# --- SentencePiece-style decoder (window strategy) --------------------------------------------------


@pytest.fixture(scope="module")
def sp_tok():
    """A Llama-2-like tokenizer: Metaspace words, byte fallback, the decoder strips one leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzHW,.!", "▁Hello", "▁world", "▁the", "▁end"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "H"), ("▁H", "e"), ("▁He", "l"), ("▁Hel", "l"), ("▁Hell", "o")]
    merges += [("▁", "w"), ("▁w", "o"), ("▁wo", "r"), ("▁wor", "l"), ("▁worl", "d")]
    merges += [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "e"), ("▁e", "n"), ("▁en", "d")]
    for piece in ["▁H", "▁He", "▁Hel", "▁Hell", "▁w", "▁wo", "▁wor", "▁worl", "▁t", "▁th", "▁e", "▁en"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_style_tokenizer_streams_like_its_decode(sp_tok):
    text = "Hello world, the end 你好 🚀!"
    ids = encode(sp_tok, text)
    assert type(IncrementalDetokenizer(sp_tok)._stream).__name__ == "_WindowStream"
    assert full_decode(sp_tok, ids) == text  # the decoder drops the leading "▁"
    detok = IncrementalDetokenizer(sp_tok)
    deltas = feed(detok, ids)
    assert "".join(deltas) == text
    assert deltas[0] == "Hello" and " world" in deltas  # spaces come from the context tokens
    assert all(REPLACEMENT not in d for d in deltas)


# --- stop strings --------------------------------------------------------------------------------


def reference_stop(text: str, stops: list[str], include: bool, after: int = 0) -> tuple[str, str | None]:
    """Text after stopping at the first stop string completed past character `after` (the longest on
    a tie), and which one."""
    for end in range(after + 1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def run_stops(tokenizer, text, stops, include=False, chunks=None, min_tokens=0):
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens)
    deltas = feed(detok, ids, chunks)
    return "".join(deltas), detok, deltas


def test_stop_string_spanning_token_boundaries(tiny_tok):
    text = "The quick brown fox jumps over the lazy dog. More"
    ids = encode(tiny_tok, text)
    pieces = [tiny_tok.decode([i]) for i in ids]
    assert "fox jumps" not in pieces  # the stop string is split across tokens
    out, detok, _ = run_stops(tiny_tok, text, ["fox jumps"])
    assert out == "The quick brown " == detok.output_text
    assert detok.stop_reason == "fox jumps" and detok.stopped and detok.finished
    out, detok, _ = run_stops(tiny_tok, text, ["fox jumps"], include=True)
    assert out == "The quick brown fox jumps"


def test_stop_string_at_the_very_start(tiny_tok):
    out, detok, deltas = run_stops(tiny_tok, "STOP and the rest", ["STOP"])
    assert out == "" and deltas == [""] * len(deltas) and detok.stop_reason == "STOP"
    out, detok, _ = run_stops(tiny_tok, "STOP and the rest", ["STOP"], include=True)
    assert out == "STOP"


def test_overlapping_and_multiple_stop_strings(tiny_tok):
    assert run_stops(tiny_tok, "xaaab yz", ["aab"])[0] == "xa"
    for stops in (["abc", "bcd"], ["bcd", "abc"]):
        out, detok, _ = run_stops(tiny_tok, "xabcde", stops)
        assert (out, detok.stop_reason) == ("x", "abc")
    for stops in (["abcdef", "cd"], ["cd", "abcdef"]):  # the first one completed wins
        out, detok, _ = run_stops(tiny_tok, "zabcdefg", stops)
        assert (out, detok.stop_reason) == ("zab", "cd")
    out, detok, _ = run_stops(tiny_tok, "abcde", ["cd", "bcd"], include=True)  # same end: longest
    assert (out, detok.stop_reason) == ("abcd", "bcd")


def test_no_stop_match_holds_back_then_flushes(tiny_tok):
    text = "The lazy dog sleeps."
    ids = encode(tiny_tok, text)
    detok = IncrementalDetokenizer(tiny_tok, stop=["zzzz", "sleepy"])
    emitted = "".join(detok.update(i) for i in ids)
    assert emitted == text[: len(text) - 5]  # len("sleepy") - 1 characters held
    assert detok.output_text == text
    assert emitted + detok.flush() == text and detok.stop_reason is None
    detok = IncrementalDetokenizer(tiny_tok, stop=["sleepy"], include_stop_str_in_output=True)
    assert "".join(detok.update(i) for i in ids) == text  # nothing to retract: no hold back


def test_after_a_stop_the_text_is_final(tiny_tok):
    detok = IncrementalDetokenizer(tiny_tok, stop=["fox"])
    feed(detok, encode(tiny_tok, "a fox"))
    assert detok.update(encode(tiny_tok, " jumps")) == "" and detok.flush() == ""
    assert detok.output_text == "a " and detok.stop_reason == "fox"


def test_stop_strings_with_multibyte_characters(smol_tok):
    text = "大型语言模型的推理服务需要高效地管理显存。🚀🔥 done"
    for include in (False, True):
        for stops in (["推理"], ["🔥"], ["存。🚀"], ["显存", "管理"]):
            out, detok, deltas = run_stops(smol_tok, text, stops, include)
            assert (out, detok.stop_reason) == reference_stop(text, stops, include)
            assert all(REPLACEMENT not in d for d in deltas)


def test_stop_strings_wait_for_min_tokens(tiny_tok):
    text = "ab ab ab"
    ids = encode(tiny_tok, text)
    first = next(k for k in range(1, len(ids) + 1) if full_decode(tiny_tok, ids[:k]).startswith("ab"))
    assert run_stops(tiny_tok, text, ["ab"], min_tokens=first - 1)[0] == ""
    out, detok, _ = run_stops(tiny_tok, text, ["ab"], min_tokens=first)
    assert (out, detok.stop_reason) == ("ab ", "ab")
    out, detok, _ = run_stops(tiny_tok, text, ["ab"], min_tokens=first, chunks=[len(ids)])
    assert (out, detok.stop_reason) == ("ab ", "ab")  # same when fed all at once


def test_from_sampling_params(smol_tok):
    params = SamplingParams(stop=["world"], include_stop_str_in_output=True, skip_special_tokens=False)
    detok = IncrementalDetokenizer.from_sampling_params(smol_tok, [1, 2, 3], params)
    ids = [*encode(smol_tok, "Hello"), smol_tok.eos_token_id, *encode(smol_tok, " world!")]
    assert "".join(feed(detok, ids)) == "Hello<|im_end|> world"


_ALPHABET = "ab c\n你"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(_ALPHABET, max_size=30),
    stops=st.lists(st.text(_ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    seed=st.integers(0, 2**16),
    min_tokens=st.sampled_from([0, 0, 1, 3, 8]),
)
def test_stop_strings_random(tiny_tok, text, stops, include, seed, min_tokens):
    ids = encode(tiny_tok, text)
    rng = random.Random(seed)
    chunks, left = [], len(ids)
    while left:
        chunks.append(rng.randint(1, min(3, left)))
        left -= chunks[-1]
    # characters settled by the first `min_tokens` tokens cannot end a stop string
    after = len(full_decode(tiny_tok, ids[:min_tokens]).rstrip(REPLACEMENT))
    expected = reference_stop(text, stops, include, after)
    for how in (None, chunks, [len(ids)] if ids else []):  # token by token, random chunks, all at once
        out, detok, _ = run_stops(tiny_tok, text, stops, include, how, min_tokens)
        assert (out, detok.stop_reason) == expected
        assert detok.output_text == out


# --- cost per token ------------------------------------------------------------------------------


def _bench() -> None:  # pragma: no cover - a measurement, not a test
    import time

    from tokenizers.decoders import DecodeStream
    from transformers import AutoTokenizer

    from worker.models.prepare import prepare

    tok = AutoTokenizer.from_pretrained(prepare("smollm2"))
    ids = encode(tok, " ".join(TEXTS) * 100)
    backend = tok.backend_tokenizer

    def per_token(make) -> float:
        best = float("inf")
        for _ in range(5):
            d = make()
            t0 = time.perf_counter()
            for i in ids:
                d.update(i)
            d.flush()
            best = min(best, time.perf_counter() - t0)
        return best / len(ids) * 1e6

    class Stream:  # tokenizers' DecodeStream, driven the same way (no flush of a held tail)
        def __init__(self) -> None:
            self.s = DecodeStream(skip_special_tokens=True)

        def update(self, i: int):
            return self.s.step(backend, i)

        def flush(self) -> None:
            pass

    print(f"SmolLM2 tokenizer, {len(ids)} tokens, mixed English / CJK / emoji, µs per token:")
    stops = ["</answer>", "STOP", "\n\n"]
    for strategy in STRATEGIES:
        plain = per_token(lambda s=strategy: IncrementalDetokenizer(tok, strategy=s))
        with_stops = per_token(lambda s=strategy: IncrementalDetokenizer(tok, strategy=s, stop=stops))
        print(f"  {strategy:10s} {plain:6.2f}")
        print(f"  {strategy:10s} {with_stops:6.2f}  (3 stop strings)")
    print(f"  DecodeStream {per_token(Stream):6.2f}")


if __name__ == "__main__":
    _bench()
