# The two commands: `make demo` and `make test`. Both create .venv and install everything on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test bench lab export clean-nbs

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0  # the CPU wheel on disk; pyproject declares torch>=2.9
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)  ## the main job on the shipped data: prints the report and writes reports/demo.html
	$(PY) -m workbench.demo --out reports

test: $(STAMP)  ## pytest over tests/ plus every notebook through nbdev's runner (one item per notebook)
	$(PY) -m pytest -n 2 --dist worksteal

bench: $(STAMP)  ## benchmarks behind BENCHMARKS.md
	$(PY) -m workbench.bench

lab: $(STAMP)  ## JupyterLab on nbs/
	$(VENV)/bin/jupyter lab nbs

export: $(STAMP)  ## notebooks -> workbench/ and clean notebooks
	$(VENV)/bin/nbdev_export && $(VENV)/bin/nbdev_clean
