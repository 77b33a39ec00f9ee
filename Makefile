# Two commands set everything up on a fresh machine (Python 3.10+ and Java 17+):
#   make run    builds .venv, installs the package, runs jobs/demo.py on local Spark
#   make test   builds .venv, installs the package, runs the test suite
#   make test-fast   the tests that need no JVM (the quick loop)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast lint bench clean bytecode browser

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[spark,dev]"
	touch $(STAMP)

# The package's bytecode, written once: an editable install leaves it to be compiled on import, and where
# PYTHONDONTWRITEBYTECODE is set (as on many CI machines) every Python process, each of Spark's Python workers
# among them, would compile the package's modules from source again (about 0.3 s of CPU each).
bytecode: $(STAMP)
	$(PY) -m compileall -q spark_credit_shuffle

run: bytecode
	$(PY) jobs/demo.py

# Three test processes, each with its own SparkSession: the suite waits on Spark's scheduling, on sleeping
# slow consumers and on subprocesses between its bursts of CPU, and a third process fills those gaps on two
# cores (docs/development.md: 272.6 s against 295.9 s with two, back to back). Each test module runs in one
# process (--dist loadscope): its module fixtures, such as the local-cluster application, are built once;
# modules go out in collection order (tests/conftest.py collects the longest ones first).
TEST_WORKERS ?= 3

# Spark's classes as the tests' JVMs load them, archived once per virtual environment (tests/jvm_class_archive.py):
# every Spark JVM the tests start maps them instead of loading and verifying them again.
JVM_ARCHIVE := $(VENV)/spark-classes.jsa

$(JVM_ARCHIVE): $(STAMP)
	$(PY) tests/jvm_class_archive.py $@ || echo "no class archive: the tests' JVMs load Spark's classes themselves"

# Debian's chromium and chromium-driver, for the web view's browser test (tests/test_web.py): installed with
# apt-get where they are missing and make runs as root (as on CI); elsewhere install them yourself, or that test
# fails naming them. Never a browser downloaded by selenium or anything else.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  echo "installing chromium and chromium-driver for tests/test_web.py (apt-get)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } >/dev/null \
	    || echo "could not install chromium and chromium-driver: tests/test_web.py will fail naming them"; \
	else echo "chromium and chromium-driver are missing (apt-get install chromium chromium-driver): tests/test_web.py will fail naming them"; fi

# nbmake's pytest plugin (installed with the dev extra, for running notebooks by hand: pytest --nbmake) is not
# loaded: the suite runs the notebooks itself (tests/test_notebooks.py), and loading it imports Jupyter's client
# in every test process (about 0.15 s of CPU each).
PYTEST_PLUGINS_OFF := -p no:nbmake

test: bytecode $(JVM_ARCHIVE) browser
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_PLUGINS_OFF)

# The quick loop: every test that needs no JVM (no SparkSession, spark-submit or java).
test-fast: bytecode
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not spark" $(PYTEST_PLUGINS_OFF)

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis spark-warehouse
