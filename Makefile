# hybrid-exl3-fixes. `make install` sets up .venv; `make test` runs the CPU suite against
# aphrodite-engine 0.20.0 to 0.24.1 and without aphrodite (plus lint and the packaging check).
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install test test-gpu stubs status readme clean

install:
	bash ci/setup.sh

test:
	PYTHON=$(PY) bash ci/test.sh

# The GPU suite on a machine with an NVIDIA GPU and aphrodite-engine 0.21.0 installed (python3 of
# that environment); log, results JSON and a markdown summary land in ./out.
test-gpu:
	bash ci/gpu.sh

# The libcuda stub for flashinfer's JIT link on WSL2 / conda CUDA: build/stubs/{libcuda.so,env.sh}
stubs:
	$(VENV)/bin/hybrid-exl3-fixes stubs --out build/stubs

# The patch table against one release unpacked by make install (RELEASE, default 0.21.0), as a pip install has it:
# a tree of links to its sources plus its kernel libraries, which P3's and P8's probes read (ci/status_site.py).
# In your own environment, where aphrodite is installed, `hybrid-exl3-fixes status` is the same table.
RELEASE ?= 0.21.0
status:
	@site=$$($(PY) ci/status_site.py $(RELEASE)) && PYTHONPATH=$$site $(VENV)/bin/hybrid-exl3-fixes status

# The README's generated tables (patches, releases, log lines) from the code that decides them
readme:
	$(PY) ci/readme_tables.py --write

clean:
	rm -rf $(VENV) .cache build *.egg-info
