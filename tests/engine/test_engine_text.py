"""Incremental detokenisation and stop strings (fly_llm.decoding.text)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fly_llm.decoding.text import Detokenizer, StopChecker
from support.blocks import left_block_at
from support.tiny_models import make_tokenizer


def test_detokenizer_holds_back_incomplete_utf8():
    tokenizer = make_tokenizer()
    text = "a 🙂 é def add"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # the emoji is split into byte tokens
    detok = Detokenizer(tokenizer, tokenizer.encode("x = "))
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert "" in deltas  # something was held back while a character was incomplete


def test_detokenizer_matches_full_decode_in_chunks():
    tokenizer = make_tokenizer()
    ids = tokenizer.encode("def fibonacci(n):\n    return n <|im_end|>")
    detok = Detokenizer(tokenizer, [])
    deltas = [detok.add(ids[i:i + 3]) for i in range(0, len(ids), 3)] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_checker_cuts_and_holds_back_prefixes():
    checker = StopChecker(["STOP", "\n\n"])
    assert not checker.feed("hello ST")
    assert checker.release(False) == "hello "  # "ST" could start "STOP"
    assert not checker.feed("ay S")
    assert checker.release(False) == "STay "
    assert checker.feed("TOP and more")  # the held-back "S" was the start of the stop string
    assert checker.text == "hello STay "
    assert checker.release(True) == ""
    assert not checker.feed("ignored after the stop")
    assert checker.text == "hello STay "


def test_stop_checker_without_stops_releases_everything():
    checker = StopChecker([])
    assert not checker.active
    assert not checker.feed("abc")
    assert checker.release(False) == "abc"


class _ReplacementTokenizer:
    """Every token decodes to U+FFFD (as a byte-level tokenizer decodes stray bytes); records each window."""

    def __init__(self) -> None:
        self.windows: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.windows.append(len(ids))
        return "\ufffd" * len(ids)


def test_text_of_replacement_characters_advances_in_bounded_windows():
    """Issue 33 finding 11: U+FFFD output was held back to the end, each add re-decoding all of it."""
    tokenizer = _ReplacementTokenizer()
    detok = Detokenizer(tokenizer, [])
    deltas = [detok.add([7]) for _ in range(2000)]
    assert sum(1 for d in deltas if d) >= 2000 // 5  # released every few tokens, not only at the end
    assert "".join(deltas) + detok.flush() == "\ufffd" * 2000
    assert max(tokenizer.windows) <= 12  # each add decodes a window of a few tokens, not all the output


def test_a_long_run_of_replacement_characters_in_one_add_is_released():
    tokenizer = _ReplacementTokenizer()
    detok = Detokenizer(tokenizer, [])
    assert detok.add([7] * 50) == "\ufffd" * 50
    assert detok.add([7] * 3) == ""  # a short run may still be a character's first bytes
    assert detok.add([7] * 3) == "\ufffd" * 6


def test_a_character_split_across_a_speculative_round_is_not_cut():
    tokenizer = make_tokenizer()
    text = "ab 🙂 cd 🙂"
    ids = tokenizer.encode(text)
    emoji = tokenizer.encode("🙂")
    assert len(emoji) > 1
    detok = Detokenizer(tokenizer, [])
    cut = len(ids) - len(emoji) + 1  # the round ends inside the last emoji
    deltas = [detok.add(ids[:cut]), detok.add(ids[cut:]), detok.flush()]
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == text
    assert deltas[0].startswith("ab 🙂 cd")  # what precedes the incomplete character is not held back


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.sampled_from("ab \t\n"), max_size=40), min_indent=st.integers(1, 5),
       cuts=st.lists(st.integers(0, 40), max_size=8), stops=st.sampled_from([[], ["ab"]]))
def test_a_completion_stops_where_it_leaves_its_block_however_its_text_arrives(text, min_indent, cuts, stops):
    """llama.cpp's n_indent (issue 64): fed in any pieces, the released text is the reference's cut (with a stop
    string too: whichever comes first), and nothing past the cut was ever released."""
    checker = StopChecker(stops, min_indent)
    released, start = "", 0
    for end in sorted({c for c in cuts if c <= len(text)} | {len(text)}):
        hit = checker.feed(text[start:end])
        released += checker.release(False)
        start = end
        if hit:
            break
    released += checker.release(True)
    expected = left_block_at(text, min_indent)
    for stop in stops:
        at = expected.find(stop)
        expected = expected if at < 0 else expected[:at]
    assert released == expected


def test_a_blank_line_or_a_dedent_ends_the_block_not_the_first_line():
    for pieces, expected in [(["return a", " + b\n", "\n", "x = 1"], "return a + b\n"),
                             (["return a + b\n    y", " = 2\nz"], "return a + b\n    y = 2\n"),
                             (["x\n  ", "  b\n  ", "c"], "x\n    b\n"), (["no newline at all"], "no newline at all")]:
        checker, out = StopChecker([], 4), ""
        for piece in pieces:
            checker.feed(piece)  # after the cut, text is ignored
            out += checker.release(False)
        assert out + checker.release(True) == expected, pieces
