"""The chat template renderer against transformers' `apply_chat_template` (text and ids recorded by
scripts/make_tokenizer_fixtures.py in the HF venv), its sources and its one-line refusals."""

from __future__ import annotations

import shutil

import pytest
from tokenizer_references import QWEN_BPE, reference, reference_folders

from metrale_jax.chat_template import ChatTemplateError, chat_messages, load_chat_template
from metrale_jax.tokenizer import load_tokenizer

REF = reference(QWEN_BPE)


@pytest.mark.parametrize("folder", reference_folders())
def test_text_and_ids_equal_transformers(folder):
    chats = reference(folder)["chats"]
    template, tok = load_chat_template(str(folder)), load_tokenizer(str(folder))
    wrong = [c for c in chats if template.render(c["messages"], **c["kwargs"]) != c["text"]]
    assert not wrong, wrong[0]
    assert [tok.encode(c["text"]) for c in chats] == [c["ids"] for c in chats]


def test_the_recorded_chats_cover_thinking_on_and_off_and_every_role():
    kinds = [c["kwargs"].get("enable_thinking") for c in REF["chats"]]
    assert True in kinds and False in kinds and None in kinds
    roles = {m["role"] for c in REF["chats"] for m in c["messages"]}
    assert roles == {"system", "user", "assistant"}
    off = [c["text"] for c in REF["chats"] if c["kwargs"].get("enable_thinking") is False]
    assert all(t.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for t in off)


def test_chat_messages_and_jinja_file_priority(tmp_path):
    assert chat_messages("hi") == [{"role": "user", "content": "hi"}]
    assert chat_messages("hi", "be kind")[0] == {"role": "system", "content": "be kind"}
    shutil.copy(QWEN_BPE / "tokenizer_config.json", tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ eos_token }}]{% endfor %}\n"
        "{{ {'k': 'ü'} | tojson }}{{ strftime_now('%Y')[:0] }}"
    )
    out = load_chat_template(str(tmp_path)).render(chat_messages("hi", "s"))
    assert out == '[system|s|<|im_end|>][user|hi|<|im_end|>]{"k": "ü"}'


@pytest.mark.parametrize(
    "template, match",
    [
        ("{% for m in messages %}", "does not compile \\(line 1"),
        ("{{ raise_exception('no system role') }}", "failed to render \\(TemplateError: no system role\\)"),
        ("{{ messages[0].content.__class__.__mro__[1].__subclasses__() }}", "failed to render"),
        ("{{ 1 / 0 }}", "failed to render \\(ZeroDivisionError"),
    ],
)
def test_bad_templates_are_one_line(tmp_path, template, match):
    (tmp_path / "chat_template.jinja").write_text(template)
    with pytest.raises(ChatTemplateError, match=match) as e:
        load_chat_template(str(tmp_path)).render(chat_messages("hi"))
    assert len(e.value.messages) == 1 and "\n" not in e.value.messages[0]


def test_missing_template_is_refused(tmp_path):
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        load_chat_template(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="has no chat_template"):
        load_chat_template(str(tmp_path))
