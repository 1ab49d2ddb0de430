"""Fixtures of the end-to-end tests."""
import pytest


@pytest.fixture(scope="session")
def bad_input_assets(tmp_path_factory) -> dict:
    """The model, adapter, tokenizer and data every bad-input table names (built once)."""
    from helpers.bad_inputs import build_assets

    return build_assets(tmp_path_factory.mktemp("assets"))
