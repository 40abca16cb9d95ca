"""`--attention-backend`: auto resolves by the rank's device, the Triton set runs on a CPU only in Triton's
interpreter and is refused with one line otherwise, deterministic inference runs on the batch-invariant torch set
only, and an unknown name names the allowed ones."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.engine_setup import start_local_engine
from cluster.engine_spec import EngineOptions
from model_workers.kernels.registry import resolve_backend


def test_auto_is_triton_on_cuda_and_torch_on_a_cpu():
    assert resolve_backend("auto", "cuda") == "triton"
    assert resolve_backend("auto", "cpu") == "torch"


def test_triton_runs_on_a_cpu_in_the_interpreter_only(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", "cpu") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="runs only in Triton's interpreter: set TRITON_INTERPRET=1"):
        resolve_backend("triton", "cpu")


def test_deterministic_inference_resolves_auto_to_torch_and_refuses_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", "cuda", deterministic=True) == "torch"
    with pytest.raises(ValueError, match="--enable-deterministic-inference runs on the attention_backend torch"):
        resolve_backend("triton", "cuda", deterministic=True)
    with pytest.raises(ValueError, match="--enable-deterministic-inference runs on the attention_backend torch"):
        start_local_engine(None, EngineOptions(deterministic=True, attention_backend="triton"))


def test_an_unknown_backend_names_the_allowed_ones():
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, triton, got 'flash'"):
        resolve_backend("flash", "cuda")


def test_generate_refuses_triton_on_a_cpu_without_the_interpreter_in_one_line():
    env_code = ("import os, sys; os.environ.pop('TRITON_INTERPRET', None); from cluster.cli import main; "
                "sys.exit(main(['generate', '--prompt-ids', '1,2', '--max-tokens', '1', '--attention-backend', "
                "'triton']))")
    done = subprocess.run([sys.executable, "-c", env_code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("dsa-serve generate: error: attention_backend='triton' on "
                                                         "a CPU runs only in Triton's interpreter")
