# make demo       set up, build shards (real data where found, else synthetic, saying so), train, draw the report
# make test       set up and run the whole test suite in TEST_JOBS processes (2); prints the 10 slowest tests
# make test-fast  all but the tests marked slow (most of those that launch torchrun or a trainer, or wait on deadlines)
# make bench      the loader benchmark (needs MNIST_ROOT and CIFAR_FOLDER)
# make gpu-check  every CUDA path on a GPU machine, a line per case (hand-over bytes, GPU JPEG decode, no sync, bf16, nccl), then figures
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DATA ?= data
CIFAR10_DIR ?=
NPROC ?= 2
DOWNLOAD ?=
SHARDS ?= shards
RUN ?= runs/demo
MNIST_ROOT ?= data
TEST_JOBS ?= 2
# loadgroup: tests that share an expensive module fixture (a torchrun run, the benchmark) run in one process
PYTEST := $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadgroup --durations=10
CIFAR_FOLDER ?= data/cifar10-jpg/train

.PHONY: setup demo test test-fast bench gpu-check rehearsal clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	@echo "make demo: writes shards into $(SHARDS)/ (replacing any there) and the run into $(RUN)/ (replacing it)"
	$(PY) tools/make_shards.py --root $(DATA) $(if $(CIFAR10_DIR),--datasets mnist --cifar10-dir $(CIFAR10_DIR)) \
	    $(if $(DOWNLOAD),--download) --fallback-synthetic --out $(SHARDS)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) -m pipeline.train \
	    --train mnist=$(SHARDS)/ --train cifar10=$(SHARDS)/ --eval mnist=$(SHARDS)/ --eval cifar10=$(SHARDS)/ \
	    --epochs 2 --epoch-samples 20000 --batch-size 128 --workers 1 --width 16 --log-every 20 \
	    --out $(RUN) --overwrite
	$(PY) tools/report.py $(RUN)

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m "not slow"

bench: setup
	$(PY) tools/bench_loader.py --mnist-root $(MNIST_ROOT) --cifar-folder $(CIFAR_FOLDER) --profile

gpu-check: setup
	$(PY) tools/gpu_check.py

rehearsal: setup
	$(PY) tools/rehearsal.py

clean:
	rm -rf $(VENV) runs bench-out
