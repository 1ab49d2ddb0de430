"""A model's own chat template, rendered by a command (``lmforge generate --chat``), is named
in errors by the file it came from, not by the training config's data.template."""
from __future__ import annotations

import json

import pytest

from lmforge.data.errors import DataError
from lmforge.data.templates import JinjaTemplate
from lmforge.data.tokenizer import chat_template_origin, load_tokenizer, train_bpe

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def model_dir(tmp_path):
    train_bpe(["a small corpus of words"] * 20, 280).save(tmp_path)
    return tmp_path


def test_the_origin_is_chat_template_jinja_else_tokenizer_config(model_dir):
    assert chat_template_origin(model_dir) == f"{model_dir / 'tokenizer_config.json'}: " \
                                              f"chat_template"
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert chat_template_origin(model_dir) == str(model_dir / "chat_template.jinja")


def test_errors_of_a_labelled_template_name_its_file(model_dir):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('no users allowed') }}"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(model_dir)
    label = chat_template_origin(model_dir)
    template = JinjaTemplate(tok.chat_template, label=label)
    with pytest.raises(DataError, match=rf"^{label}: the chat template cannot render this "
                                        rf"conversation \(no users allowed\)$"):
        template.prompt_ids(USER, tok)
    with pytest.raises(DataError, match=rf"^{label}: the chat template cannot render"):
        template.end_of_turn_id(tok)
    with pytest.raises(DataError, match=r"/chat_template\.jinja: the chat template does not "
                                        r"parse"):
        JinjaTemplate("{% if %}", label=str(model_dir / "chat_template.jinja"))
