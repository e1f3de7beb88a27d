# Two entry points on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck pytest install clean prometheus redis

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch is pinned and installed first: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvflow demo

lint: $(STAMP)
	$(VENV)/bin/ruff check kvflow tests benchmarks
	$(VENV)/bin/ruff format --check kvflow tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The exporter tests scrape kvflow with a real Prometheus (Debian package); they skip without it.
prometheus:
	@command -v prometheus >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
		|| echo "prometheus could not be installed: its exporter test will be skipped"

# The Redis tier's tests run real redis-server processes (single, ACL, TLS, cluster).
redis:
	@command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null) \
		|| echo "redis-server could not be installed: the Redis tier's tests will be skipped"

pytest: $(STAMP) prometheus redis
	$(PY) -m pytest -q

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build *.egg-info
