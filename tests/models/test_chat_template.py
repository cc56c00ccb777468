"""The repair of the bundled 1.5B's chat template: its tool-call example shown with doubled braces, which the model
copied (issue 29). The real model cannot be downloaded here, so the templates below are written in the form of the
Qwen2.5 template's tools branch, once as the 1.5B's GGUF has it (doubled) and once as the 0.5B's (single)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from shipyard.models.bundled import BUNDLED, TEMPLATE_FILE, converted_dir, repair_chat_template
from shipyard.models.tokenizer import byte_tokenizer

TOOLS_BRANCH = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] }}\n"
    '    {{- "\\n\\n# Tools\\n\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\nEXAMPLE\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- endif %}\n"
    "{%- for message in messages[1:] %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n")
SINGLE = r'{\"name\": <function-name>, \"arguments\": <args-json-object>}'
DEFECTIVE = TOOLS_BRANCH.replace("EXAMPLE", "{" + SINGLE + "}")  # the 1.5B's: doubled braces inside the string literal
GOOD = TOOLS_BRANCH.replace("EXAMPLE", SINGLE)  # the 0.5B's
TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
MESSAGES = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix the bug."}]


def rendered(template: str, tokenizer=None) -> str:
    tok = tokenizer or byte_tokenizer()
    if tokenizer is None:
        tok.chat_template = template
    return tok.apply_chat_template(MESSAGES, tools=[TOOL], tokenize=False, add_generation_prompt=True)


def test_the_defective_template_shows_doubled_braces_and_the_repaired_one_single():
    assert '{{"name": <function-name>, "arguments": <args-json-object>}}' in rendered(DEFECTIVE)  # the defect, shown
    repaired = repair_chat_template(DEFECTIVE)
    assert repaired == GOOD
    prompt = rendered(repaired)
    assert '\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt
    assert '{{"name"' not in prompt and "<args-json-object>}}" not in prompt


@pytest.mark.parametrize("template", [
    GOOD,
    GOOD.replace(r"\"", "'").replace('"', "'"),  # another quoting, single braces
    "{{ messages[0]['content'] }}{{- '{{' }}",  # Jinja's own braces, and literal doubled braces that are no example
    '{{- "{{\\"name\\": <function-name>}}" }}',  # half an example
])
def test_a_template_without_the_defect_is_unchanged(template):
    assert repair_chat_template(template) == template


def test_the_example_in_single_quotes_is_repaired_too():
    defective = "{{- '<tool_call>\\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\\n</tool_call>' }}"
    assert repair_chat_template(defective) == \
        "{{- '<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' }}"


def test_a_cache_converted_before_the_repair_is_repaired_when_loaded(tmp_path, monkeypatch):
    """The converted directory of the 1.5B as an earlier shipyard left it (template defective): asking for it repairs
    its template file, and the tokenizer loaded from it renders the call example with single braces."""
    monkeypatch.setenv("SHIPYARD_HOME", str(tmp_path))
    out = tmp_path / "models" / "qwen2.5-coder-1.5b" / "hf"
    byte_tokenizer().save_pretrained(out)
    (out / TEMPLATE_FILE).write_text(DEFECTIVE)
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"")  # a converted directory: nothing is converted again
    said = []
    assert converted_dir(BUNDLED["qwen2.5-coder-1.5b"], said.append) == out
    assert (out / TEMPLATE_FILE).read_text() == GOOD and len(said) == 1 and "doubled braces" in said[0]
    prompt = rendered("", AutoTokenizer.from_pretrained(out))
    assert '\n{"name": <function-name>' in prompt and '{{"name"' not in prompt
    converted_dir(BUNDLED["qwen2.5-coder-1.5b"], said.append)
    assert len(said) == 1 and [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # once; no leftovers
