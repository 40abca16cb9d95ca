"""Fixtures the HTTP tests share."""

import pytest

from support.http_fakes import write_checkpoint_files


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tokenizer.json + tokenizer_config.json (with a chat template) of the fake engine's vocabulary."""
    return write_checkpoint_files(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="session")
def default_model_app():
    """The app over a real C = 1 engine on the shipped default model (started once: it takes seconds)."""
    from cluster.engine_setup import start_local_engine
    from cluster.engine_spec import EngineOptions
    from cluster.http_api.ingress import build_app
    from cluster.serve_settings import IngressSettings
    from model_workers.checkpoint.model_dir import PACKAGED_MODEL_DIR

    engine = start_local_engine(PACKAGED_MODEL_DIR, EngineOptions(num_pages=32, page_size=16))
    return build_app(engine, IngressSettings(model_dir=str(PACKAGED_MODEL_DIR)))
