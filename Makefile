# raypar: `make demo` submits a DDP job to a local multi-node Ray cluster; `make test` runs every test;
# `make test-fast` the unit lane only (no Ray, under a minute: run it after every change); `make lint`.
# Both create .venv on first use. torch comes first as the pinned CPU wheel, so no multi-GB
# CUDA build is ever downloaded; the project's own torch range is then already satisfied.
# uv installs (into the venv, from pip's own find-links where set): a clean clone's set-up took
# ~60 s with pip, ~30 s with uv. Bytecode is compiled at install: where PYTHONDONTWRITEBYTECODE
# is set no process would ever cache it, and each would compile torch and Ray again.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.raypar-installed
UV_INSTALL := $(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode \
	$(foreach links,$(PIP_FIND_LINKS),--find-links $(links))

.PHONY: demo test test-fast lint format bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet 'uv>=0.9,<1'
	$(UV_INSTALL) torch==2.13.0
	$(UV_INSTALL) -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m cluster.demo

# Two pytest workers: a tiny Ray Train fit keeps ~1.5 of the 2 cores busy (process starts), but the
# multi-node tests mostly wait (a lost node is marked dead after ~15 s, the elastic policy looks
# every 20 s); tests/cluster stays on one worker (tests/conftest.py), overlapping the rest.
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup

test-fast: $(STAMP)
	$(PY) -m pytest tests/unit

lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: $(STAMP)
	$(UV_INSTALL) -e '.[test,bench]'
	$(PY) -m ray_jobs.bench --suite quick

clean:
	rm -rf $(VENV) runs
