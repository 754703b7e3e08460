"""Incremental detokenisation and stop strings (pure Python, no torch).

`Detokenizer` turns token ids into text a few tokens at a time (the offsets scheme of vLLM/TGI:
decode a short window twice and keep the difference), never re-decoding the whole output, and
holds back the last tokens while they may form an incomplete UTF-8 character (decoded as U+FFFD):
at most 3 tokens, so output that really is U+FFFD still streams and every window stays short. `StopChecker` cuts the
text at the first stop string and releases only text that cannot be the start of one.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 6  # prompt tokens decoded with the first output tokens (leading-space rules)
_MAX_INCOMPLETE_TOKENS = 3
"""Most tokens the bytes of an incomplete UTF-8 character can span (it lacks at least one of at most 4)."""


class Detokenizer:
    """Text deltas for token ids appended one round at a time."""

    def __init__(self, tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self.prefix = 0  # start of the window decoded for context
        self.read = len(self.ids)  # end of the text already returned

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text ('' while a character is incomplete)."""
        self.ids.extend(token_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes as U+FFFD)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        end = len(self.ids)
        before, text = self._decode(self.read), self._decode(end)
        if final or _complete(text, before):
            return self._advance(end, text[len(before):])
        for cut in range(end - 1, max(self.read, end - _MAX_INCOMPLETE_TOKENS - 1), -1):
            shorter = self._decode(cut)  # a character still incomplete: release what precedes it
            if _complete(shorter, before):
                return self._advance(cut, shorter[len(before):])
        if end - self.read > _MAX_INCOMPLETE_TOKENS:  # too long to be one character's bytes: U+FFFD is the text
            return self._advance(end, text[len(before):])
        return ""

    def _decode(self, end: int) -> str:
        """The text of the window from `prefix` to `end` (a few tokens)."""
        return self.tokenizer.decode(self.ids[self.prefix:end], skip_special_tokens=True)

    def _advance(self, end: int, delta: str) -> str:
        self.prefix, self.read = self.read, end
        return delta


def _complete(text: str, before: str) -> bool:
    """Whether `text` adds to `before` and does not end in what may be an incomplete character."""
    return len(text) > len(before) and not text.endswith(_REPLACEMENT)


class StopChecker:
    """Accumulates a request's text, cuts it at the first stop string, releases safe deltas.

    With `min_indent` > 0 it also stops where a code completion leaves its block, as llama-server's `n_indent`
    does: at the first line after the first whose indentation (spaces and tabs) is below `min_indent` (a blank
    line included), the text cut before that line (its newline kept)."""

    def __init__(self, stops: list[str], min_indent: int = 0) -> None:
        self.stops = list(stops)
        self.longest = max((len(s) for s in stops), default=0)
        self.min_indent = min_indent
        self.text = ""
        self.released = 0
        self.hit = False  # a stop string was found; later text is ignored
        self._lines_from = -1  # where the lines after the first begin (after its newline); -1: none yet

    @property
    def active(self) -> bool:
        """Whether there are stop strings (or an indentation) to look for."""
        return bool(self.stops) or self.min_indent > 0

    def feed(self, delta: str) -> bool:
        """Add text; True (and the text cut before it) when a stop string now appears, or a line leaves the block."""
        if not delta or self.hit:
            return False
        start = max(0, len(self.text) - self.longest + 1)
        searched = len(self.text)
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if self.min_indent > 0:
            hits += self._dedents(searched)
        if hits:
            self.text = self.text[:min(hits)]
            self.hit = True
            return True
        return False

    def _dedents(self, searched: int) -> list[int]:
        """The start of the first line (after the first) that begins below `min_indent`, among those that have
        their first character other than a space or tab since `searched`; [] if none."""
        if self._lines_from < 0:
            first = self.text.find("\n")
            if first < 0:
                return []
            self._lines_from = first + 1
        line = max(self._lines_from, self.text.rfind("\n", 0, max(searched, self._lines_from)) + 1)
        while line < len(self.text):
            first = line  # the line's first character other than a space or tab
            while first < len(self.text) and self.text[first] in " \t":
                first += 1
            if first < len(self.text) and first - line < self.min_indent:
                return [line]
            end = self.text.find("\n", line)
            if end < 0:
                return []
            line = end + 1
        return []

    def release(self, finished: bool) -> str:
        """Text not yet released that no continuation can turn into a stop string (all if finished)."""
        end = len(self.text) if finished else len(self.text) - self._held_back()
        delta = self.text[self.released:end] if end > self.released else ""
        self.released = max(self.released, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string, or (with
        `min_indent`) the whitespace that begins a line after the first, which may yet leave the block."""
        if self.min_indent > 0 and self._lines_from >= 0:
            line = self.text.rfind("\n") + 1
            if line >= self._lines_from and not self.text[line:].strip(" \t"):
                return len(self.text) - line
        for n in range(min(self.longest - 1, len(self.text)), 0, -1):
            suffix = self.text[-n:]
            if any(s.startswith(suffix) for s in self.stops):
                return n
        return 0
