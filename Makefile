# mpformer developer entry points. `make demo` and `make test` install what they need themselves.
PYTHON     ?= python3
VENV       ?= .venv
BIN        := $(VENV)/bin
# CPU torch is pinned here (an unpinned torch resolves to a multi-GB CUDA build). GPU users install
# their own CUDA torch first and run `make venv TORCH_SPEC=` to keep it. Where PyPI's torch is a CUDA
# build (plain Linux x86_64 without a local CPU wheel), add TORCH_INDEX=https://download.pytorch.org/whl/cpu.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
DEMO_DATA  ?= demo_data
DEMO_RUN   ?= outputs/demo
DEMO_MOE_RUN ?= outputs/demo-moe
PYTEST_ARGS ?=

# Tests and the demo never reach a hub: tiny models are built locally, wandb runs offline.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export MPFORMER_DEMO_DIR := $(DEMO_DATA)

.PHONY: venv demo demo-moe test lint clean gpu-wheels gpu-wheels-check

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install --quiet \
		$(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install --quiet -e ".[test,lint]"
	touch $@

demo: venv
	$(BIN)/python -m mpformer.data.demo_corpus --out $(DEMO_DATA)
	rm -rf $(DEMO_RUN)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=2 pretrain/pretrain_gpt.py \
		experiment=demo hydra.run.dir=$(DEMO_RUN)
	$(BIN)/python tools/convert_checkpoint.py mpformer-to-hf --ckpt $(DEMO_RUN)/checkpoints --out $(DEMO_RUN)/hf
	$(BIN)/python tools/demo_report.py --run $(DEMO_RUN) --hf $(DEMO_RUN)/hf

# The same path for a mixture of experts: Mixtral style, 8 experts top 2, dp=2 with the experts over both
# ranks (ep=2), load balancing on (configs/experiment/moe-demo.yaml); the report adds the expert load and
# checks the HF export's logits against the checkpoint's.
demo-moe: venv
	$(BIN)/python -m mpformer.data.demo_corpus --out $(DEMO_DATA)
	rm -rf $(DEMO_MOE_RUN)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=2 pretrain/pretrain_gpt.py \
		experiment=moe-demo hydra.run.dir=$(DEMO_MOE_RUN)
	$(BIN)/python tools/convert_checkpoint.py mpformer-to-hf --ckpt $(DEMO_MOE_RUN)/checkpoints --out $(DEMO_MOE_RUN)/hf
	$(BIN)/python tools/demo_report.py --run $(DEMO_MOE_RUN) --hf $(DEMO_MOE_RUN)/hf --ckpt $(DEMO_MOE_RUN)/checkpoints

test: venv
	$(BIN)/python -m pytest -q tests --durations=25 $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python tools/check_cycles.py  # every import, TYPE_CHECKING and lazy ones too: no module cycle
	$(BIN)/hadolint docker/Dockerfile

# What benchmarks/gpu_check.sh needs beyond torch on an offline GPU machine (it installs, from .whl/, only
# those the machine lacks), with everything they require, pinned to the versions installed here; antlr4
# 4.9 ships only as an sdist and is built. gpu-wheels-check installs the set with --no-index into a
# clean venv beside the CPU torch and runs the check's dry run there: the set is complete. Compiled wheels
# come for CPython 3.10-3.13 on x86_64 Linux too (a GPU image's Python need not be this one's); a pin with
# no wheel for one of them is named, and the check on such a Python fails in one line at install. A line
# with a marker (a package only another Python needs) is fetched without it (pip reads markers for itself).
GPU_WHEELS := hydra-core omegaconf antlr4-python3-runtime PyYAML pytest numpy transformers safetensors
WHEEL_VENV ?= /tmp/mpformer-wheel-venv

gpu-wheels: venv
	rm -rf .whl && mkdir -p .whl
	$(BIN)/python benchmarks/gpu_wheels.py $(GPU_WHEELS) > .whl/requirements.txt
	grep -v '^antlr4' .whl/requirements.txt | sed 's/;.*//' | xargs $(BIN)/python -m pip download --quiet --no-deps \
		--only-binary=:all: -d .whl
	for v in 3.10 3.11 3.12 3.13; do grep -v '^antlr4' .whl/requirements.txt | sed 's/;.*//' | xargs $(BIN)/python -m pip download \
		--quiet --no-deps --only-binary=:all: --python-version $$v --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
		|| echo "gpu-wheels: some pins have no CPython $$v wheel (a GPU image on $$v needs them installed)"; done
	$(BIN)/python -m pip wheel --quiet --no-deps -w .whl $$(grep '^antlr4' .whl/requirements.txt)
	du -sh .whl

gpu-wheels-check: gpu-wheels
	rm -rf $(WHEEL_VENV) && $(PYTHON) -m venv $(WHEEL_VENV)
	if [ -n "$(TORCH_SPEC)" ]; then $(WHEEL_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"; fi
	$(WHEEL_VENV)/bin/python -m pip install --quiet --no-index --find-links .whl -r .whl/requirements.txt
	PYTHON=$(WHEEL_VENV)/bin/python bash benchmarks/gpu_check.sh --dry-run $(WHEEL_VENV)/out

clean:
	rm -rf $(DEMO_RUN) $(DEMO_MOE_RUN) .pytest_cache .ruff_cache
