"""One engine spec, resolved once: a process reads config.json once (the edge), a rank reads it never; and the
engine at C = 1 needs no Ray at all (`dsa-serve generate` runs in a Python where `import ray` fails)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: counts every open() of a file named config.json (an audit hook sees the
# builtin open, Path.read_text and json loaders alike), and with BLOCK_RAY makes `import ray` fail.
PRELUDE = textwrap.dedent("""
    import importlib.abc, os, sys
    OPENED = []
    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            if os.path.basename(os.fsdecode(args[0])) == "config.json":
                OPENED.append(os.fsdecode(args[0]))
    sys.addaudithook(hook)
    class NoRay(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "ray" or name.startswith("ray."):
                raise ImportError(f"{name} is blocked in this test")
    if os.environ.get("BLOCK_RAY"):
        sys.meta_path.insert(0, NoRay())
""")


def run_python(body: str, block_ray: bool = False) -> dict:
    """Runs PRELUDE + body in a new interpreter; body leaves its answer in RESULT; returns it with the reads."""
    code = PRELUDE + textwrap.dedent(body) + textwrap.dedent("""
        import json
        print("RESULT " + json.dumps({"result": RESULT, "config_reads": len(OPENED),
                                      "ray_imported": "ray" in sys.modules}))
    """)
    env = {"BLOCK_RAY": "1"} if block_ray else {}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


GENERATE = """
    import contextlib, io
    from cluster.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["generate", "--prompt-ids", "1,2,3,4", "--max-tokens", "3", "--json"{extra}])
    RESULT = {{"code": code, "lines": out.getvalue().splitlines()}}
"""


@pytest.mark.parametrize("extra", ["", ', "--cp-size", "1"'])
def test_generate_reads_config_json_once_and_runs_without_ray(extra):
    answer = run_python(GENERATE.format(extra=extra), block_ray=True)
    assert answer["result"]["code"] == 0 and not answer["ray_imported"]
    (line,) = answer["result"]["lines"]
    result = json.loads(line)
    assert len(result["token_ids"]) == 3
    if extra:
        assert result["cp_size"] == 1 and result["ep_size"] == 1
    assert answer["config_reads"] == 1


def test_generate_with_and_without_cp_size_1_gives_the_same_tokens():
    plain, cp1 = (json.loads(run_python(GENERATE.format(extra=e))["result"]["lines"][0])
                  for e in ("", ', "--cp-size", "1"'))
    assert plain["token_ids"] == cp1["token_ids"]


def test_a_local_engine_start_reads_config_json_once():
    answer = run_python("""
        from cluster.engine_setup import start_local_engine
        from cluster.engine_spec import EngineOptions
        engine = start_local_engine(None, EngineOptions(num_pages=8, page_size=16))
        RESULT = engine.model_info().max_model_len
    """, block_ray=True)
    assert answer["result"] > 0 and answer["config_reads"] == 1 and not answer["ray_imported"]


def test_a_rank_loads_from_its_spec_without_reading_config_json():
    """What a rank process does (cluster/launch.py: a CPWorker actor given the group's RankSpec): no config.json."""
    answer = run_python("""
        import pickle
        from model_workers.checkpoint.model_dir import read_model_spec
        from model_workers.spec import RankSpec
        rank = pickle.dumps(RankSpec(read_model_spec(None), "float32", num_pages=4, page_size=16))  # the edge
        OPENED.clear()
        from model_workers.cp_worker import CPWorker
        info = CPWorker(1, 2, num_threads=1).load(pickle.loads(rank))
        RESULT = info["cp_rank"]
    """)
    assert answer["result"] == 1 and answer["config_reads"] == 0


def test_a_serve_replica_resolves_its_engine_once():
    """A Serve engine replica's start up to its launch: the spec and the chat text, one read of config.json."""
    answer = run_python("""
        from cluster.replica_engine import replica_text, serve_engine_spec
        from cluster.serve_app import validate_args
        spec = serve_engine_spec(validate_args({"cp_size": 2}))
        text = replica_text(spec, validate_args({"cp_size": 2}))
        RESULT = [spec.rank.num_pages, text.chat_template is not None]
    """)
    assert answer["result"][0] > 0 and answer["config_reads"] == 1
