VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: install serve test test-slow bench soak clean

# constraints.txt: the versions the suite last passed with (clients such as openai change between releases)
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/dsa-serve serve

# The suite without the slow end-to-end runs (a short soak, the bench serve workloads against real servers,
# routing across two engine replicas, the Ray Serve deployments driven through drain, redeploy, replica failover, a
# second node, direct ingress and Ray's metrics export, the separate-placement Serve app, the GPU check's dry run,
# bench commands through Ray or without it, log forwarding under Ray and the heap over many forwards): those are
# `make test-slow`, so that `make test` stays under 25 minutes on CI. Rank recovery, the colocated Serve app end to
# end and every equality test stay in `make test`.
test: install
	$(PY) -m pytest -q -m "not slow" tests

test-slow: install
	$(PY) -m pytest -q -m slow tests

# Every benchmark, then BENCHMARKS.md and docs/bench/*.png: about 50-60 minutes on a 2-core CPU machine, the soak
# not included (`make soak`, about 13 more). On 2026-12-03 the commands other than attention, decode_draft_*,
# serve_colocated and serve_long took 31 minutes (prefill_zigzag 351 s of them); serve_colocated takes about 7
# and serve_long's timed runs about 11 (transformers' four 8k generates alone 415 s).
# `dsa-serve bench` is what the package installs; `python -m benchmarks` is the repository's measuring harness
# (the transformers baselines, the long workload, the report; docs/benchmarks.md).
BENCH_DIR ?= bench-results
DSA := $(VENV)/bin/dsa-serve
HARNESS := $(PY) -m benchmarks
bench: install
	mkdir -p $(BENCH_DIR)
	$(DSA) bench prefill --cp-size 2 --cp-strategy zigzag --cp-impl v2 --prompt-len 1024,2048,4096,8192,16384 --repeats 3 --json > $(BENCH_DIR)/prefill_zigzag.json
	$(DSA) bench prefill --cp-size 2 --cp-strategy zigzag --cp-impl v2 --prompt-len 32768 --repeats 3 --json > $(BENCH_DIR)/prefill_zigzag_32k.json
	$(DSA) bench prefill --cp-size 2 --cp-strategy interleave --cp-impl v2 --prompt-len 8192,16384 --repeats 3 --skip-equal-cores --json > $(BENCH_DIR)/prefill_interleave.json
	$(DSA) bench attention --json > $(BENCH_DIR)/attention.json
	$(DSA) bench decode --json > $(BENCH_DIR)/decode.json
	$(DSA) bench decode --ray --speculative-num-steps 0,2 --batch-size 8 --json > $(BENCH_DIR)/decode_ray.json
	$(DSA) bench decode --speculative-num-steps 0,2 --batch-size 1 --max-tokens 64 --speculative-token-map none --json > $(BENCH_DIR)/decode_draft_full_vocab.json
	$(DSA) bench decode --speculative-num-steps 0,2 --batch-size 1 --max-tokens 64 --json > $(BENCH_DIR)/decode_draft_vocab.json
	$(HARNESS) serve --engine-placement colocated --json > $(BENCH_DIR)/serve_colocated.json
	$(DSA) bench serve --engine-placement separate --concurrency 1,8,32 --skip-transformers --json > $(BENCH_DIR)/serve_separate.json
	$(DSA) bench serve --engine-placement colocated --no-direct-ingress --concurrency 1,8,32 --skip-transformers --json > $(BENCH_DIR)/serve_colocated_proxy.json
	$(HARNESS) serve --workload long --speculative-num-steps 2 --json > $(BENCH_DIR)/serve_long.json
	$(DSA) bench serve --workload shared-prefix --json > $(BENCH_DIR)/serve_shared_prefix.json
	$(DSA) bench ep --json > $(BENCH_DIR)/ep.json
	$(DSA) bench ep-exchange --json > $(BENCH_DIR)/ep_exchange.json
	$(DSA) bench kv-cache --json > $(BENCH_DIR)/kv_cache.json
	$(DSA) bench structured --json > $(BENCH_DIR)/structured.json
	$(DSA) bench pd --json > $(BENCH_DIR)/pd.json
	$(DSA) bench prefill --cp-size 2 --cp-strategy zigzag --cp-impl v2 --prompt-len 4096 --kv-cache-dtype bfloat16 --repeats 2 --skip-equal-cores --json > $(BENCH_DIR)/prefill_kv_bfloat16.json
	$(DSA) bench prefill --cp-size 2 --cp-strategy zigzag --cp-impl v2 --prompt-len 4096 --kv-cache-dtype fp8_e4m3 --repeats 2 --skip-equal-cores --json > $(BENCH_DIR)/prefill_kv_fp8_e4m3.json
	$(DSA) bench decode --speculative-num-steps 0 --batch-size 1,8,32 --max-tokens 32 --json > $(BENCH_DIR)/decode_plain_pair.json
	$(DSA) bench decode --speculative-num-steps 0 --batch-size 1,8,32 --max-tokens 32 --enable-deterministic-inference --json > $(BENCH_DIR)/decode_deterministic.json
	$(DSA) bench prefill --cp-size 2 --prompt-len 8192 --skip-equal-cores --json > $(BENCH_DIR)/prefill_plain_pair.json
	$(DSA) bench prefill --cp-size 2 --prompt-len 8192 --skip-equal-cores --enable-deterministic-inference --json > $(BENCH_DIR)/prefill_deterministic.json
	$(DSA) random-checkpoint --out build/v4_small --shape small
	$(DSA) bench prefill --model build/v4_small --cp-size 2 --cp-strategy interleave --cp-impl v2 --prompt-len 1024,2048,4096 --repeats 2 --json > $(BENCH_DIR)/prefill_v4.json
	$(HARNESS) report --results $(BENCH_DIR) --out BENCHMARKS.md --plots-dir docs/bench --notes docs/bench_notes

# A real `dsa-serve serve` under SOAK_S seconds of mixed load with disconnects (10 minutes, plus about 2 of start,
# snapshots and stop), the test tests/soak/test_soak.py (not part of `make test`): the harness's JSON in
# $(BENCH_DIR)/soak.json, the server's log in $(BENCH_DIR)/soak_server.log, and the test fails if a check fails.
SOAK_S ?= 600
soak: install
	mkdir -p $(BENCH_DIR)
	DSA_SOAK_S=$(SOAK_S) DSA_SOAK_OUT=$(BENCH_DIR) $(PY) -m pytest -q -s -m soak tests/soak

clean:
	rm -rf $(VENV)
