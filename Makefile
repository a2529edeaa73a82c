# hybrid-exl3-fixes. `make install` sets up .venv; `make test` runs the CPU suite against
# aphrodite-engine 0.20.0 to 0.24.1 and without aphrodite (plus lint and the packaging check).
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

# Status against aphrodite 0.21.0 unpacked by make install, as a pip install has it: a tree of links
# to its sources plus its kernel library, which P3's probe reads (use your own environment's
# `hybrid-exl3-fixes status` where aphrodite is installed for real).
STATUS_SITE := .cache/aphrodite-status/0.21.0
status:
	@[ -e $(STATUS_SITE)/aphrodite/_C.abi3.so ] || { rm -rf $(STATUS_SITE) && mkdir -p $(STATUS_SITE) && \
	  cp -rs $(abspath .cache/aphrodite/0.21.0)/. $(STATUS_SITE)/ && \
	  ln -s $(abspath .cache/aphrodite-kernels/0.21.0/aphrodite/_C.abi3.so) $(STATUS_SITE)/aphrodite/; }
	PYTHONPATH=$(STATUS_SITE) $(VENV)/bin/hybrid-exl3-fixes status

clean:
	rm -rf $(VENV) .cache build *.egg-info
