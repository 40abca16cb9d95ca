VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: install serve test clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/dsa-serve serve

test: install
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV)
