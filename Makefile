# wq: every target creates .venv and installs what it needs into it first: `make run`, `worker`
# and `producer` the broker and the commands (the broker and cli extras), the others everything
# the tests, lint and bench use (the dev extra).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed


.PHONY: install install-run run worker producer test test-slow test-all test-fast lint format bench beanstalkd clean proto proto-check node-deps browser screenshot docs docs-serve

install: $(STAMP)

install-run: $(RUN_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(RUN_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[broker,cli]'
	touch $(RUN_STAMP)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP) $(RUN_STAMP)

run: install-run
	$(PY) -m wqbroker $(ARGS)

worker: install-run
	$(VENV)/bin/wq-worker $(ARGS)

producer: install-run
	$(VENV)/bin/wq-producer $(ARGS)

# ruff (lint, format) and mypy --strict over wqbroker, wqclient, wqwire, tests, bench, examples
# and docs/hooks (the files are in pyproject.toml), as .pre-commit-config.yaml runs them; then
# import-linter: the layers and the packages' independence (pyproject.toml's contracts). Needs no
# Node.js (node-deps is only for the cross-language test in `make test`).
lint: install
	$(PY) -m ruff check wqbroker wqclient wqwire tests bench proto examples docs/hooks
	$(PY) -m ruff format --check wqbroker wqclient wqwire tests bench proto examples docs/hooks
	$(PY) -m mypy
	$(VENV)/bin/lint-imports --no-cache

format: install
	$(PY) -m ruff format wqbroker wqclient wqwire tests bench proto examples docs/hooks
	$(PY) -m ruff check --fix wqbroker wqclient wqwire tests bench proto examples docs/hooks

# The tests, in tiers (tests/conftest.py puts the markers on):
# - `make test-fast`, the loop's tier: no lint, npm, PostgreSQL or browser, no slow test, a fifth
#   of the Hypothesis examples (a minute or two);
# - `make test`, the README's: lint, then every test but the slow tier, over four pytest-xdist
#   workers (most tests wait on sockets and timers more than they compute: four keep two cores
#   busy), the ones marked serial one after the other on a worker of their own; every Hypothesis
#   example (the ci profile). About five minutes on two cores;
# - `make test-slow`, the rest (marked slow): the documentation's runnable pages and the
#   newcomer's fresh virtualenv, the wheel, kill -9 under load, the example project, the quick
#   start's timings, the durable stores' state machines (about five minutes, mostly waiting);
# - `make test-all`: both, as CI runs them (.ci/run).
# PYTEST_ARGS narrows any of them (`make test-fast PYTEST_ARGS=tests/http`).
JOBS ?= 4
PYTEST := $(PY) -m pytest -n $(JOBS) --dist loadgroup

test: install node-deps lint
	HYPOTHESIS_PROFILE=ci $(PYTEST) -m "not slow" $(PYTEST_ARGS)

test-slow: install node-deps
	HYPOTHESIS_PROFILE=ci $(PYTEST) -m slow $(PYTEST_ARGS)

test-all: test test-slow

test-fast: install
	HYPOTHESIS_PROFILE=dev $(PYTEST) -m "not pg and not browser and not node and not slow" \
		$(PYTEST_ARGS)

# The Node.js gRPC client used by the cross-language test (@grpc/grpc-js, @grpc/proto-loader).
NODE_STAMP := tests/node/node_modules/.installed
node-deps: $(NODE_STAMP)

$(NODE_STAMP): tests/node/package.json tests/node/package-lock.json
	npm ci --prefix tests/node --no-audit --no-fund --loglevel=error
	touch $(NODE_STAMP)

# Start brokers, drive them from processes of their own, print one table of figures (a few minutes).
bench: install beanstalkd
	$(PY) -m bench $(ARGS)

# beanstalkd, a peer the bench compares wq with (Debian's package; skipped when it cannot be had).
beanstalkd:
	@command -v beanstalkd >/dev/null || (test "$$(id -u)" = 0 && apt-get install -y -q beanstalkd >/dev/null) || echo "beanstalkd not installed: the bench skips it"

# Chromium from Debian's packages, for the dashboard's browser tests (tests/ui/test_dashboard.py,
# driven by Playwright; without it they skip, or fail when CI is set). As root; else says how.
CHROMIUM := /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || test "$$(id -u)" != 0 || \
		(apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null)
	@test -x $(CHROMIUM) || (echo "no $(CHROMIUM): run 'sudo apt-get install chromium' (the dashboard's browser tests skip without it)"; exit 1)

# Redraw docs/dashboard.png (the README's screenshot) with the overview test, in Chromium.
screenshot: install browser
	WQ_DOCS_SCREENSHOT=1 $(PY) -m pytest -q tests/ui/test_dashboard.py -k overview

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info tests/node/node_modules

# The documentation site (mkdocs.yml, docs/): `make docs` builds it into site/ in strict mode (a
# broken link or anchor, or a docstring the Python reference cannot render, fails it; the Reference
# pages are generated from the code as it builds); `make docs-serve` previews it, rebuilt on each
# change, on http://127.0.0.1:8000 (DOCS_ADDR to change).
DOCS_ADDR ?= 127.0.0.1:8000
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs

docs: install
	$(MKDOCS) build --strict -d site

docs-serve: install
	$(MKDOCS) serve -a $(DOCS_ADDR)

# Regenerate the gRPC/protobuf stubs in wqwire/pb from proto/wqwire/pb/broker.proto: protoc
# writes them at their import path, nothing is rewritten (committed; CI checks for drift).
proto: install
	$(PY) proto/generate.py

# Fails if the committed stubs differ from what `make proto` generates.
proto-check: proto
	git diff --exit-code -- wqwire/pb
	test -z "$$(git status --porcelain -- wqwire/pb)"
