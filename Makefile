# The course's two commands:
#   make lab    set up (once) and open JupyterLab on the notebooks
#   make test   set up (once) and run the whole test suite
# The course as a website and a PDF: make book | make pdf
# Helpers: make e2e | make notebooks | make images | make grade | make stability |
#   make record | make gpu-check | make lint | make clean
# Other torch versions and GPU machines: make compat | make wheelhouse | make gpu-lines

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup lab test compat wheelhouse gpu-lines e2e notebooks images grade stability record gpu-check lint clean

setup: $(STAMP)

# Re-runs only when the requirements or the package description change.
# A torch already in the venv inside the supported range (pyproject.toml) is
# kept: course_utils/compat.py leaves its pin out. VENV_ARGS=--system-site-packages
# makes a new venv that sees this Python's own torch (a cluster's, say).
VENV_ARGS ?=

$(STAMP): requirements.txt requirements-gpu.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) course_utils/compat.py requirements requirements.txt > $(VENV)/requirements.txt
	$(PY) -m pip install --quiet -r $(VENV)/requirements.txt
	@# setuptools warns, in a frame that reads like a failure, that the folder
	@# course_utils/ here shadows the installed one: that is what we want
	PYTHONWARNINGS=ignore::UserWarning $(PY) -m pip install --quiet --no-deps -e .
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "nvidia-smi found: trying the GPU extras (requirements-gpu.txt)"; \
	  for pkg in $$(grep -v '^#' requirements-gpu.txt); do \
	    $(PY) -m pip install --quiet "$$pkg" \
	      || echo "WARNING: $$pkg did not install (is the CUDA toolkit on PATH?); every chapter still runs without it"; \
	  done; \
	else \
	  echo "no nvidia-smi: CPU set-up (GPU cells show published and predicted GPU figures)"; \
	fi
	@# JupyterLab: never offer to fetch news from the internet (the course is offline)
	@mkdir -p $(VENV)/share/jupyter/lab/settings
	@echo '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}}' \
	  > $(VENV)/share/jupyter/lab/settings/overrides.json
	@touch $(STAMP)

# Jupyter refuses to run as root unless told; containers and cloud notebooks
# often run as root, so say it for them. The token login stays on.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

# Opens on the start page, with notebooks/ as the file browser's root. The
# default URL makes the link that Jupyter prints open the start page too (on a
# remote machine or in a container that link is all a learner has).
LAB_FLAGS := --ServerApp.root_dir=notebooks --LabApp.default_url=/lab/tree/START_HERE.ipynb

lab: setup
	@$(PY) -m course_utils.build > /dev/null  # stamps this Python's version
	$(VENV)/bin/jupyter lab $(ROOT_FLAG) $(LAB_FLAGS) $(LAB_EXTRA)

# Most tests wait (for processes to start, for a timeout to expire) more than
# they compute: two workers, each running whole test files, keep both cores of
# a small machine busy. TEST_WORKERS=0 runs them in this process, one by one.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# The whole suite on another supported torch, in a venv of its own outside the
# repository: make compat TORCH=2.11.0 (the index's wheel brings its CUDA
# libraries, several GB, once per version). CONTRIBUTING.md has the results.
COMPAT_VENV ?= /tmp/compat-$(TORCH)

compat:
	@test -n "$(TORCH)" || { echo "usage: make compat TORCH=2.11.0"; exit 2; }
	@test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet "torch==$(TORCH)"
	$(COMPAT_VENV)/bin/python course_utils/compat.py check
	$(MAKE) test VENV=$(COMPAT_VENV) TEST_WORKERS=$(or $(COMPAT_WORKERS),0)

notebooks: setup
	$(PY) -m course_utils.build

# The diagrams in images/, drawn from code (course_utils/images.py).
images: setup
	$(PY) -m course_utils.images
	$(PY) -m course_utils.build

# For instructors: the course in a real browser (JupyterLab in headless
# Chromium, driven by Playwright). Needs the system's chromium.
e2e: setup
	$(PY) -m pip install --quiet -r requirements-e2e.txt
	$(PY) -m pytest e2e -q

# The course as a website, build/book/ (the start page and every chapter with
# the outputs of a real run on this machine, exercises unsolved), and as one
# PDF, build/course.pdf (printed by the system's chromium). Each chapter runs
# once: a second make book, or make pdf after it, reuses the kept runs
# (build/book-runs/) unless a chapter or course_utils changed.
.PHONY: book pdf
BOOK_STAMP := $(VENV)/.book-installed

$(BOOK_STAMP): requirements-book.txt $(STAMP)
	$(PY) -m pip install --quiet -r requirements-book.txt
	@touch $@

book: setup $(BOOK_STAMP)
	$(PY) -m course_utils.book

pdf: setup $(BOOK_STAMP)
	$(PY) -m pip install --quiet -r requirements-e2e.txt
	$(PY) -m course_utils.book --pdf

grade: setup
	$(PY) -m course_utils.grade

# Every check ten times on the placeholder and ten on the solution (run it while
# another program keeps a core busy). STABILITY_ARGS=--record instead times each
# solution's check on a quiet machine: the times the checkers' limits derive from.
stability: setup
	$(PY) -m course_utils.stability $(STABILITY_ARGS)

# On a GPU machine: run every chapter (with its solutions) with recording on;
# the results land in course_utils/reference_data/ (commit them).
record: setup
	$(PY) -m course_utils.gpu_check --record $(if $(QUICK),--quick,)

# On any GPU machine: does every chapter's GPU path run? Records nothing.
# QUICK=1 runs only the cells that differ on a GPU (and what they need).
gpu-check: setup
	$(PY) -m course_utils.gpu_check $(if $(QUICK),--quick,)

# A GPU machine without internet or Jupyter: on a connected machine, write the
# wheels the check needs (all but torch, numpy, matplotlib and numba, which the
# GPU machine's Python has) for its Python version, at most 60 MB; copy the
# folder beside the course there and run, with that machine's python:
#   python -m course_utils.gpu_check --wheelhouse build/wheelhouse [--quick]
WHEELHOUSE     ?= build/wheelhouse
PYTHON_VERSION ?= 3.12

wheelhouse: setup
	$(PY) -m course_utils.gpu_check --make-wheelhouse $(WHEELHOUSE) \
	  --python-version $(PYTHON_VERSION)

# Every chapter as a script on this CPU under coverage: per chapter, the lines
# that only run with a GPU (the CPU runs leave them unexercised).
gpu-lines: setup
	$(PY) -m course_utils.gpu_check --lines

lint: setup
	$(VENV)/bin/ruff check course_utils tests source e2e

clean:
	rm -rf $(VENV) build .pytest_cache
