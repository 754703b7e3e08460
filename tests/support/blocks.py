"""The reference of llama.cpp's n_indent (fly_llm.decoding.text.StopChecker's `min_indent`), for the tests."""

from __future__ import annotations


def left_block_at(text: str, min_indent: int) -> str:
    """`text` cut before the first line after the first whose indentation (spaces and tabs) is below `min_indent`
    and that has a character after it (a newline counts: a blank line ends the block too)."""
    lines = text.split("\n")
    kept = [lines[0]]
    for i, line in enumerate(lines[1:], 1):
        body = line.lstrip(" \t")
        complete = i < len(lines) - 1  # a newline follows
        if (body or complete) and len(line) - len(body) < min_indent:
            return "\n".join(kept) + "\n"
        kept.append(line)
    return text
