# Two commands: `make serve` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch 2.13.0 lies on local disk here; pin it so pip never pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
DEMO_DIR ?= .loraserve/demo
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?= -n 2

.PHONY: serve test venv demo bench clean wrk

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev,ray,s3,hub]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/loraserve demo --dir $(DEMO_DIR)

serve: demo
	$(VENV)/bin/loraserve serve --model $(DEMO_DIR)/qwen3 --catalog $(DEMO_DIR)/catalog --host $(HOST) --port $(PORT)

# wrk (Debian's package) drives `loraserve loadtest --client wrk`; its test needs it. Installed
# when missing and we may (CI runs as root); elsewhere install it yourself or that test skips.
wrk:
	@command -v wrk >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -q wrk >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
	    apt-get install -y -q wrk >/dev/null 2>&1; }; }; } || echo "wrk not installed: its loadtest test will skip"

# the Ray Serve tests start a local Ray on both cores: alone, after the rest
test: venv wrk
	$(PY) -m pytest -q $(PYTEST_ARGS) -m 'not ray' tests
	$(PY) -m pytest -q -m ray tests

clean:
	rm -rf $(VENV) .loraserve .pytest_cache
