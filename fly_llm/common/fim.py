"""Fill-in-the-middle (FIM): the request (`Infill`: the code before and after the cursor, other files of the
repository), the FIM tokens a tokenizer has (`fim_tokens`) and the prompt built from them (`infill_ids`). No torch.

A code model trained for FIM completes `<prefix token> code before <suffix token> code after <middle token>`
with the code between (prefix-suffix-middle order, what Qwen2.5-Coder, StarCoder and CodeLlama take).
The prompt is built from token ids: each FIM token is its one id, and the user's text is encoded as plain
text by the caller's `encode` (special tokens split), so text that spells `<|fim_suffix|>` cannot inject one.
Other files come first, in the model's repository format where it has one (Qwen2.5-Coder's
`<|repo_name|>`/`<|file_sep|>`, StarCoder's `<reponame>`/`<file_sep>`), else as plain text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

MAX_INFILL_FILES = 64
"""Most other files (`Infill.files`) one request may carry (beyond: TOO_LONG)."""
MAX_INFILL_CHARS = 1024 * 1024
"""Most characters in one field of an infill request (the prompt's cap, MAX_PROMPT_CHARS, in total too)."""
REPO_NAME = "repository"
"""The repository name written where the model's format names one and the request does not."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InfillFile(_Strict):
    """Another file of the repository, given as context (llama.cpp's `input_extra` entry)."""

    filename: str = Field("", max_length=4096)
    text: str = Field(max_length=MAX_INFILL_CHARS)


class Infill(_Strict):
    """What to fill in: the code before the cursor (`prefix`, with `prompt` appended: llama.cpp's extra text
    after the prefix), after it (`suffix`), and other files of the repository as context."""

    prefix: str = Field("", max_length=MAX_INFILL_CHARS)
    suffix: str = Field("", max_length=MAX_INFILL_CHARS)
    prompt: str = Field("", max_length=MAX_INFILL_CHARS)
    files: list[InfillFile] = Field(default_factory=list, max_length=MAX_INFILL_FILES)
    filename: str = Field("", max_length=4096, description="The file being edited (named after the other files).")
    repo_name: str = Field("", max_length=4096)
    min_indent: int = Field(0, ge=0, le=4096, description=(
        "Stop at the first line after the first that is indented less than this (llama.cpp's n_indent); 0: off."))

    @property
    def chars(self) -> int:
        """Characters of all its text (checked against the prompt's character limit)."""
        return (len(self.prefix) + len(self.suffix) + len(self.prompt) + len(self.filename) + len(self.repo_name)
                + sum(len(f.filename) + len(f.text) for f in self.files))


@dataclass(frozen=True)
class FimTokens:
    """A tokenizer's FIM token ids (`style` names the family); `repo_name` and `file_sep` where it has them."""

    style: str
    names: tuple[str, str, str]
    """The prefix, suffix and middle tokens as the vocabulary spells them."""
    prefix: int
    suffix: int
    middle: int
    repo_name: int | None = None
    file_sep: int | None = None
    ends: frozenset[int] = frozenset()
    """Tokens that end generation (llama.cpp's end-of-generation set for the family): the end of the text,
    FIM padding, the start of another file. A middle ends with one; no chat answer has any."""


FIM_STYLES: tuple[tuple[str, tuple[str, str, str], tuple[str, str] | None, tuple[str, ...]], ...] = (
    ("qwen", ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<|repo_name|>", "<|file_sep|>"),
     ("<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")),
    ("starcoder", ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<reponame>", "<file_sep>"),
     ("<|endoftext|>", "<fim_pad>", "<reponame>", "<file_sep>")),
    ("codellama", ("▁<PRE>", "▁<SUF>", "▁<MID>"), None, ("▁<EOT>",)),
    ("codellama", ("<PRE>", "<SUF>", "<MID>"), None, ("<EOT>",)),
)
"""Each FIM family: its name, its prefix/suffix/middle tokens, its repository tokens (name, file separator)
and the tokens that end generation."""


def fim_tokens(vocab: Mapping[str, int]) -> FimTokens | None:
    """The FIM tokens of a vocabulary (token → id, added tokens included), or None if it has no family's three."""
    for style, (prefix, suffix, middle), repo, ends in FIM_STYLES:
        if all(t in vocab for t in (prefix, suffix, middle)):
            name, sep = (vocab.get(repo[0]), vocab.get(repo[1])) if repo else (None, None)
            return FimTokens(style, (prefix, suffix, middle), vocab[prefix], vocab[suffix], vocab[middle], name, sep,
                             frozenset(vocab[t] for t in ends if t in vocab))
    return None


def infill_ids(infill: Infill, tokens: FimTokens, encode: Callable[[str], list[int]],
               lead: list[int] = ()) -> list[int]:
    """The FIM prompt's token ids: `lead` (the tokenizer's BOS, if it adds one), the other files, then
    prefix-suffix-middle. `encode` must tokenize text as plain text (no special tokens, none parsed)."""
    ids = list(lead)
    if infill.files:
        ids += _files(infill, tokens, encode)
    ids += [tokens.prefix, *encode(infill.prefix + infill.prompt), tokens.suffix, *encode(infill.suffix), tokens.middle]
    return ids


def _files(infill: Infill, tokens: FimTokens, encode: Callable[[str], list[int]]) -> list[int]:
    """The other files in the model's repository format: `<repo_name>name\\n`, then `<file_sep>path\\ntext\\n`
    per file and `<file_sep>path\\n` of the edited file; without a file separator, `path\\ntext\\n` as plain text."""
    if tokens.file_sep is None:
        return encode("".join(f"{f.filename}\n{f.text}\n" if f.filename else f"{f.text}\n" for f in infill.files))
    ids = [] if tokens.repo_name is None else [tokens.repo_name, *encode((infill.repo_name or REPO_NAME) + "\n")]
    for file in infill.files:
        ids += [tokens.file_sep, *encode(f"{file.filename}\n{file.text}\n")]
    return ids + [tokens.file_sep, *encode(f"{infill.filename}\n")]
