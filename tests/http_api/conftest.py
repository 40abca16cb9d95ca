"""Fixtures the HTTP tests share."""

import pytest

from support.http_fakes import write_checkpoint_files


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tokenizer.json + tokenizer_config.json (with a chat template) of the fake engine's vocabulary."""
    return write_checkpoint_files(tmp_path_factory.mktemp("ckpt"))
