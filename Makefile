# attn_monitor developer tasks.  `make test` is the test command.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=

.PHONY: venv test wheel-check lint typecheck demo bench

venv: $(STAMP)

$(VPY):
	$(PYTHON) -m venv $(VENV)

# torch is pinned and installed first: an unpinned resolve could pull a
# multi-GB CUDA build, while 2.13.0 resolves to the local CPU wheel and then
# satisfies `torch>=2.4` in pyproject.toml, so pip leaves it alone.
$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install "torch==$(TORCH_VERSION)"
	$(VPY) -m pip install -e ".[dev]"
	touch $@

test: venv
	$(VPY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# The package as users get it: a wheel built from this tree, installed (not
# editable) with its hf extra into a fresh venv, checked from outside the checkout.
WHEEL_VENV := build/wheel-venv
wheel-check: venv
	rm -rf build/wheel build/lib $(WHEEL_VENV)  # setuptools would ship stale modules left in build/lib
	$(VPY) -m pip wheel --no-deps --no-build-isolation -w build/wheel .
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q "torch==$(TORCH_VERSION)"
	$(WHEEL_VENV)/bin/python -m pip install -q "$$(ls build/wheel/*.whl)[hf]"
	cd build && PATH="$(abspath $(WHEEL_VENV))/bin:$$PATH" $(abspath $(WHEEL_VENV))/bin/python \
		$(abspath .ci/wheel_smoke.py) $(abspath attn_monitor)

lint: venv
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .

typecheck: venv
	$(VPY) -m mypy

demo: venv
	$(VPY) examples/train_tiny_gpt.py

bench: venv
	$(VPY) benchmarks/run_all.py
