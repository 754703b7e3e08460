"""fly_llm.common.fim without torch: which FIM family a vocabulary has, and the prompt's token layout
(prefix-suffix-middle, other files in the repository format or as text) against a hand-written reference."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fly_llm.common.errors import FimUnsupported, error_from_code
from fly_llm.common.fim import MAX_INFILL_FILES, Infill, InfillFile, fim_tokens, infill_ids
from fly_llm.common.protocol import MAX_PROMPT_CHARS, GenerateRequest, invalid

QWEN = {"<|fim_prefix|>": 100, "<|fim_suffix|>": 101, "<|fim_middle|>": 102, "<|repo_name|>": 103,
        "<|file_sep|>": 104, "<|endoftext|>": 105, "<|fim_pad|>": 106, "a": 1}
STARCODER = {"<fim_prefix>": 5, "<fim_suffix>": 6, "<fim_middle>": 7, "<file_sep>": 8, "<reponame>": 9}
CODELLAMA = {"▁<PRE>": 32007, "▁<SUF>": 32008, "▁<MID>": 32009, "▁<EOT>": 32010, "<s>": 1}


def chars(text: str) -> list[int]:
    """A stand-in plain-text encoder: one id per character (1000 + its code point)."""
    return [1000 + ord(c) for c in text]


def test_each_family_is_found_with_its_repository_tokens():
    qwen = fim_tokens(QWEN)
    assert (qwen.style, qwen.prefix, qwen.suffix, qwen.middle, qwen.repo_name, qwen.file_sep) == \
        ("qwen", 100, 101, 102, 103, 104)
    assert qwen.names == ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    assert qwen.ends == {103, 104, 105, 106}  # a new file, the end of the text, FIM padding end a middle
    star = fim_tokens(STARCODER)
    assert (star.style, star.prefix, star.repo_name, star.file_sep) == ("starcoder", 5, 9, 8)
    llama = fim_tokens(CODELLAMA)
    assert (llama.style, llama.middle, llama.repo_name, llama.file_sep, llama.ends) == \
        ("codellama", 32009, None, None, {32010})


@pytest.mark.parametrize("vocab", [{}, {"a": 1}, {"<|fim_prefix|>": 1, "<|fim_suffix|>": 2}])
def test_a_vocabulary_without_all_three_has_no_fim(vocab):
    assert fim_tokens(vocab) is None


def test_prefix_suffix_middle_with_prompt_after_the_prefix_and_a_lead():
    ids = infill_ids(Infill(prefix="ab", suffix="c", prompt="d"), fim_tokens(QWEN), chars, lead=[7])
    assert ids == [7, 100, *chars("abd"), 101, *chars("c"), 102]
    assert infill_ids(Infill(), fim_tokens(QWEN), chars) == [100, 101, 102]


def test_other_files_come_first_in_the_repository_format():
    infill = Infill(prefix="x", suffix="y", filename="main.py", repo_name="demo",
                    files=[InfillFile(filename="a.py", text="A"), InfillFile(filename="b.py", text="B")])
    assert infill_ids(infill, fim_tokens(QWEN), chars) == [
        103, *chars("demo\n"), 104, *chars("a.py\nA\n"), 104, *chars("b.py\nB\n"), 104, *chars("main.py\n"),
        100, *chars("x"), 101, *chars("y"), 102]
    assert infill_ids(infill, fim_tokens(CODELLAMA), chars) == [  # no separators: plain text before the prefix
        *chars("a.py\nA\nb.py\nB\n"), 32007, *chars("x"), 32008, *chars("y"), 32009]


def test_sizes_are_capped_and_the_code_travels():
    with pytest.raises(ValidationError) as caught:
        GenerateRequest(id="r", infill={"prefix": "x" * (MAX_PROMPT_CHARS // 2 + 1),
                                        "suffix": "y" * (MAX_PROMPT_CHARS // 2 + 1)})
    assert invalid(caught.value).code == "TOO_LONG"
    with pytest.raises(ValidationError) as caught:
        GenerateRequest(id="r", infill={"files": [{"text": ""}] * (MAX_INFILL_FILES + 1)})
    assert invalid(caught.value).code == "TOO_LONG"
    with pytest.raises(ValidationError):
        GenerateRequest(id="r", prompt="p", infill={"prefix": "x"})  # exactly one source
    assert isinstance(error_from_code("FIM_UNSUPPORTED", "m"), FimUnsupported)
