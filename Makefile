# hybrid-exl3-fixes. `make install` sets up .venv; `make test` runs the CPU suite against
# aphrodite-engine 0.20.0, 0.21.0, 0.24.1 and without aphrodite.
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install test test-gpu stubs status clean

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

# Status against aphrodite 0.21.0 unpacked by make install (use your own environment's
# `hybrid-exl3-fixes status` where aphrodite is installed for real).
status:
	PYTHONPATH=.cache/aphrodite/0.21.0 $(VENV)/bin/hybrid-exl3-fixes status

clean:
	rm -rf $(VENV) .cache build *.egg-info
