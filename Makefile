# The two commands: `make demo` and `make test`. Both create .venv and install everything on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FLOORS := .venv-floors
FLOORS_PY := $(FLOORS)/bin/python
FLOORS_STAMP := $(FLOORS)/.installed
# uv installs what pip would (the same versions: `pip freeze` of both venvs is identical) but reads no pip
# configuration: torch comes from pip first (its find-links hold the CPU wheel) and uv keeps it, and where uv fails
# (an index only pip.conf names, no route to PyPI) pip installs the rest itself. Bytecode is compiled at install, as
# pip does: with PYTHONDONTWRITEBYTECODE set (as on the CI box) every process would otherwise compile what it imports.
UV_INSTALL = $(1)/bin/uv pip install -q --python $(1)/bin/python --compile-bytecode $(2) || { \
	echo "uv could not install (above; it reads no pip.conf): pip installs instead"; $(1)/bin/python -m pip install -q $(2); }
# The fast suite: the core proofs (packing, masks, attention, doctor, ulysses, train, launch, the HF Trainer / TRL seam,
# datasets and streams, peft, trackers, PNG export). Left out: JupyterLab/Voila browser runs, notebook runs, fault and edge batteries (make test).
FAST := tests/test_packing.py tests/test_packing_rules.py tests/test_masks.py tests/test_attention.py \
	tests/test_doctor.py tests/test_ulysses.py tests/test_train.py tests/test_launch.py \
	tests/test_hf.py tests/test_datasets.py tests/test_peft.py tests/test_tracking.py tests/test_train_inputs.py \
	tests/test_doctor_battery.py::test_peft_lora_is_measured tests/test_browser.py::test_png_and_html_export
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-site test-fast test-floors bench docs serve-docs lab export clean-nbs git-filter

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv
	$(PY) -m pip install -q torch==2.13.0  # the CPU wheel on disk (pyproject's floor, see there): pip's find-links
	$(call UV_INSTALL,$(VENV),-e ".[dev]")  # the rest: 35 s where pip took 101 on the 2-core box
	$(PY) .ci/deepspeed_ops.py  # DeepSpeed's CPU comm op, compiled now rather than by the first test that starts it
	$(MAKE) --no-print-directory git-filter
	touch $(STAMP)

# Notebooks are committed without outputs: .gitattributes names the filter `nbstrip` for *.ipynb and this target tells
# git what it runs (.ci/strip_outputs.py), so the tutorials run in JupyterLab leave `git diff` empty and commit no
# output, while the files keep theirs (`git status` lists a run notebook until `git add`, which then stages nothing).
# The install above runs it; an older checkout runs `make git-filter` once.
git-filter:  ## strip notebook outputs on commit: git's clean filter for *.ipynb (the install configures it)
	@if git rev-parse --git-dir >/dev/null 2>&1; then git config filter.nbstrip.clean "$(PY) .ci/strip_outputs.py"; \
	else echo "not a git checkout: no notebook filter to configure"; fi

demo: $(STAMP)  ## the main job on the shipped data: prints the report and writes reports/demo.html
	$(PY) -m workbench.demo --out reports

test: $(STAMP)  ## pytest over tests/ and every notebook (one item each), less the site test (make test-site)
	$(PY) -m pytest -n 2 --dist worksteal -m "not site" --junitxml=test-artifacts/junit-suite.xml

# The site built as `make docs` builds it, read in headless Chromium offline (tests/test_docs.py, marked `site`). After
# `make test` every notebook's execution is cached and it takes about 2 minutes; alone it executes them all first.
test-site: $(STAMP)  ## the documentation site read in Chromium (after make test: from its cached executions)
	$(PY) -m pytest -m site tests/test_docs.py --junitxml=test-artifacts/junit-site.xml

test-fast: $(STAMP)  ## the fast suite (FAST above) in .venv
	$(PY) -m pytest -n 2 --dist worksteal $(FAST)

# A second venv with every `>=` floor of pyproject.toml installed exactly (.ci/floors.py turns them into pins).
$(FLOORS_STAMP): pyproject.toml .ci/floors.py
	rm -rf $(FLOORS) && $(PYTHON) -m venv $(FLOORS)
	$(FLOORS_PY) -m pip install -q --upgrade pip uv
	$(FLOORS_PY) .ci/floors.py pins > $(FLOORS)/floors.txt
	$(FLOORS_PY) -m pip install -q -c $(FLOORS)/floors.txt torch  # the CPU wheel on disk, as above
	$(call UV_INSTALL,$(FLOORS),-c $(FLOORS)/floors.txt -e ".[dev]")
	$(FLOORS_PY) -m pip check
	touch $(FLOORS_STAMP)

test-floors: $(FLOORS_STAMP)  ## the fast suite with every dependency at its declared floor (.venv-floors)
	$(FLOORS_PY) .ci/floors.py verify  # each floor installed exactly and importable, every time (the venv may have drifted)
	$(FLOORS_PY) -m pytest -n 2 --dist worksteal $(FAST) --junitxml=test-artifacts/junit-floors.xml

bench: $(STAMP)  ## benchmarks behind BENCHMARKS.md
	$(PY) -m workbench.bench

# `make docs` prints a line per notebook as it finishes (cached or executed, seconds); after `make test` every notebook
# is cached. No cell has a time limit unless TIMEOUT sets one (seconds per cell, e.g. `make docs TIMEOUT=1800`, for CI).
TIMEOUT ?=
docs: $(STAMP)  ## the site in site/ from the executed notebooks (docs/build.py; then make serve-docs); TIMEOUT=s: per-cell limit
	$(PY) docs/build.py $(if $(TIMEOUT),--timeout $(TIMEOUT))

SITE_PORT ?= 8000
serve-docs:  ## serve site/ (after make docs) at http://127.0.0.1:$(SITE_PORT): search needs it (a file:// page cannot read its index)
	@test -f site/index.html || { echo "no site yet: run make docs first"; exit 2; }
	python3 -m http.server $(SITE_PORT) --bind 127.0.0.1 -d site

# JupyterLab listens on 127.0.0.1 unless told otherwise (`make lab IP=0.0.0.0 PORT=9000`, only behind a firewall: the
# token is then all that guards a Python shell); the URL with its token is printed. Root (containers, GPU boxes) needs
# --allow-root.
IP ?= 127.0.0.1
PORT ?= 8888
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
lab: $(STAMP)  ## JupyterLab on nbs/ at http://$(IP):$(PORT); open the printed URL with its token (docs/site_and_lab.md: remote use)
	$(VENV)/bin/jupyter lab nbs --no-browser --ServerApp.ip=$(IP) --ServerApp.port=$(PORT) $(ALLOW_ROOT)

export: $(STAMP)  ## notebooks -> workbench/ and clean notebooks
	$(VENV)/bin/nbdev_export && $(VENV)/bin/nbdev_clean
