import os
import sys
from pathlib import Path

import pytest
import torch

# Without a CUDA device the Triton kernels run in Triton's interpreter, which has to be on before any kernel module
# is imported (the kernels are decorated then); the Triton kernel set is refused on a CPU otherwise.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.tiny_models import add_mtp_layer, reference_model, save_reference  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def reference_checkpoint(tmp_path_factory):
    """kind -> (transformers model, checkpoint folder), built once per session."""
    built = {}

    def get(kind: str, mtp: bool = False):
        key = (kind, mtp)
        if key not in built:
            model = reference_model(kind)
            folder = save_reference(model, tmp_path_factory.mktemp(f"{kind}{'_mtp' if mtp else ''}"))
            if mtp:
                add_mtp_layer(folder)
            built[key] = (model, folder)
        return built[key]

    return get
