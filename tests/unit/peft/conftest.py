"""The peft tests' fixtures: ``lib`` is tests/helpers/peft_models.py (tiny Llamas and
adapters with non-zero weights), ``hf_llama_dir`` a random transformers Llama on disk."""
from __future__ import annotations

import pytest

from helpers import peft_models


@pytest.fixture
def hf_llama_dir(tmp_path):
    """A random fp32 transformers Llama saved to disk: (model, directory)."""
    pytest.importorskip("transformers")
    return peft_models.make_hf_llama(tmp_path / "base")


@pytest.fixture
def lib():
    """``lib.tiny_model()``, ``lib.lora_cfg(rank=8)``, ... (helpers/peft_models.py)."""
    return peft_models
