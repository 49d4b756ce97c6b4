# make demo: set up, build shards (real data if found under DATA, else synthetic), train end to end.
# make test: set up and run the test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DATA ?= data
NPROC ?= 2
DOWNLOAD ?=
SHARDS ?= shards
MNIST_ROOT ?= data
CIFAR_FOLDER ?= data/cifar10-jpg/train

.PHONY: setup demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) tools/make_shards.py --root $(DATA) $(if $(DOWNLOAD),--download) --fallback-synthetic --out $(SHARDS)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) -m pipeline.train \
	    --train mnist=$(SHARDS)/ --train cifar10=$(SHARDS)/ --eval mnist=$(SHARDS)/ --eval cifar10=$(SHARDS)/ \
	    --epochs 2 --epoch-samples 20000 --batch-size 128 --workers 1 --width 16 --log-every 20 \
	    --out runs/demo --overwrite

test: setup
	$(PY) -m pytest -q

# make bench MNIST_ROOT=../shared/data CIFAR_FOLDER=/tmp/cifar10-jpg/train
bench: setup
	$(PY) tools/bench_loader.py --mnist-root $(MNIST_ROOT) --cifar-folder $(CIFAR_FOLDER) --profile

clean:
	rm -rf $(VENV) runs
