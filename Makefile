# Two commands, each doing its own set-up on a fresh machine:
#   make test   - create/reuse .venv, install the package + test extra, fetch Fashion-MNIST, run pytest
#   make demo   - same set-up, then run the main job (`accelerate-ssl demo`)
# and the documentation:
#   make docs   - same set-up + the docs extra; the generated tables checked against the result files, then the site
#                 built with warnings as errors (broken links and anchors included) into site/
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.accelerate-ssl-installed
DOCS_STAMP := $(VENV)/.accelerate-ssl-docs-installed
PYTEST_ARGS ?=

.PHONY: setup data test test-slow demo docs clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	@$(PY) -c "import torch, torchvision; torchvision.ops.nms" || { \
	  echo "torch/torchvision do not work together in $(VENV): reinstall them from PyPI, e.g."; \
	  echo "  $(PY) -m pip install --force-reinstall torch torchvision"; exit 1; }
	@touch $(STAMP)

setup: $(STAMP) data

data: $(STAMP)
	$(PY) -m accelerate_ssl.data.ensure

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/accelerate-ssl demo $(DEMO_ARGS)

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[test,docs]"
	@touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) benchmarks/render.py --check
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) build site *.egg-info
