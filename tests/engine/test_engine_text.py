"""Incremental detokenisation and stop strings (fly_llm.decoding.text)."""

from __future__ import annotations

from fly_llm.decoding.text import Detokenizer, StopChecker
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
