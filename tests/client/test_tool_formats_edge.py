"""Tool formats at the edge (issue 46): the format is chosen by the model's chat template, the parser
reports the blocks that did not parse, and no code outside fly_llm.common.tool_formats knows a tag."""

from __future__ import annotations

from pathlib import Path

import pytest

from fly_llm.common.tool_formats import FORMATS, format_for
from fly_llm.common.tool_formats.hermes import HERMES, TOOL_CLOSE, TOOL_OPEN, ToolCallStream

ROOT = Path(__file__).resolve().parents[2]
QWEN_LIKE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>\n{...}\n</tool_call>{% endif %}"


@pytest.mark.parametrize("template", [None, "", QWEN_LIKE, "{{ messages[0].content }}"])
def test_the_format_is_the_one_the_template_asks_for_else_hermes(template):
    assert format_for(template) is HERMES
    assert HERMES.written_by(QWEN_LIKE) and not HERMES.written_by("{{ messages[0].content }}")


def test_a_template_written_in_another_format_gets_that_format(monkeypatch):
    class Other:
        name, tags = "other", ("[CALL]",)

        def written_by(self, chat_template: str) -> bool:
            return "[CALL]" in chat_template

    other = Other()
    monkeypatch.setitem(FORMATS, "other", other)
    assert format_for("say [CALL] then the call") is other
    assert format_for(QWEN_LIKE) is HERMES


def test_blocks_that_do_not_parse_are_reported_with_the_name_they_give():
    stream = ToolCallStream()
    text = f'a {TOOL_OPEN}{{"name": "f", "arguments": 3}}{TOOL_CLOSE} b {TOOL_OPEN}\n{{"name": "g", "argu'
    shown, calls = stream.feed(text)
    rest, _ = stream.finish()
    assert not calls and TOOL_OPEN in shown + rest
    bad, cut = stream.unparsed
    assert (bad.name, bad.arguments) == ("f", '{"name": "f", "arguments": 3}') and "JSON object" in bad.error
    assert (cut.name, cut.arguments) == ("g", '{"name": "g", "argu') and "cut off" in cut.error


def test_a_parsed_call_is_not_reported_unparsed():
    stream = ToolCallStream()
    _, calls = stream.feed(f'{TOOL_OPEN}\n{{"name": "f", "arguments": {{}}}}\n{TOOL_CLOSE}')
    stream.finish()
    assert [c.name for c in calls] == ["f"] and stream.unparsed == []


@pytest.mark.parametrize("tree", ["fly_llm/client", "integrations", "daemon/fly_daemon"])
def test_no_code_outside_the_tool_formats_knows_a_tag(tree):
    tags = {tag for f in FORMATS.values() for tag in f.tags}
    for path in (ROOT / tree).rglob("*.py"):
        text = path.read_text()
        assert not [tag for tag in tags if tag in text], f"{path} names a tool-call format's tag"
