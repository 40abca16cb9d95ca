VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: install serve test bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/dsa-serve serve

test: install
	$(PY) -m pytest -q tests

# Every benchmark (about 40 minutes on a 2-core CPU machine), then BENCHMARKS.md and docs/bench/*.png.
BENCH_DIR ?= bench-results
bench: install
	mkdir -p $(BENCH_DIR)
	$(VENV)/bin/dsa-serve bench prefill --cp-size 2 --cp-strategy zigzag --cp-impl v2 --json > $(BENCH_DIR)/prefill_zigzag.json
	$(VENV)/bin/dsa-serve bench prefill --cp-size 2 --cp-strategy interleave --cp-impl v2 --prompt-len 8192,16384 --skip-equal-cores --json > $(BENCH_DIR)/prefill_interleave.json
	$(VENV)/bin/dsa-serve bench attention --json > $(BENCH_DIR)/attention.json
	$(VENV)/bin/dsa-serve bench decode --json > $(BENCH_DIR)/decode.json
	$(VENV)/bin/dsa-serve bench decode --ray --speculative-num-steps 0,2 --batch-size 8 --json > $(BENCH_DIR)/decode_ray.json
	$(VENV)/bin/dsa-serve bench serve --json > $(BENCH_DIR)/serve.json
	$(VENV)/bin/dsa-serve bench report --results $(BENCH_DIR) --out BENCHMARKS.md --plots-dir docs/bench --notes docs/bench_notes.md

clean:
	rm -rf $(VENV)
