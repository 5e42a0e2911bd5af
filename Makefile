# Makefile: the project's commands. `make test` is what CI runs (.ci/run).
PYTHON ?= python3
CC ?= gcc
SANITIZE = -fsanitize=address,undefined -fno-sanitize-recover=all
CORE_SOURCES = $(filter-out csrc/module%.c,$(wildcard csrc/*.c)) $(wildcard csrc/x86/*.c)

# nvcc, when it is on PATH or in $$CUDA_HOME/bin (empty otherwise).
NVCC := $(shell $(PYTHON) kernels/nvcc_build.py --which 2>/dev/null)

CXX ?= g++
# An emulated CUDA driver that runs the kernels' source on the CPU, for
# tests on machines without a GPU (tests/emulated_cuda, docs/cuda.md).
EMULATED_CUDA = tests/c/build/libzero_fake_cuda.so

.PHONY: deps install train rlhf test test-c test-cuda-build emulated-cuda test-py test-hf5 bench bench-train bench-checkpoint bench-offload bench-beyond-ram clean

# The pinned CPU build of torch and the test tools.
deps:
	$(PYTHON) -m pip install -q -r requirements-test.txt

install: deps
	$(PYTHON) -m pip install -q --no-build-isolation -e .

# C core alone, no Python, under AddressSanitizer and UBSan; the CUDA host
# code too (its loader's failure paths need no GPU).
test-c: $(EMULATED_CUDA)
	mkdir -p tests/c/build
	$(CC) -std=c11 -O1 -g -Wall -Wextra -Werror -Iinclude $(SANITIZE) -o tests/c/build/test_core \
		tests/c/test_core.c $(CORE_SOURCES) -lm -lpthread -ldl
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 tests/c/build/test_core
	# the gradient bucket plan and the accumulate kernel
	$(CC) -std=c11 -O1 -g -Wall -Wextra -Werror -Iinclude $(SANITIZE) -o tests/c/build/test_buckets \
		tests/c/test_buckets.c $(CORE_SOURCES) -lm -lpthread -ldl
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 tests/c/build/test_buckets
	$(CC) -std=c11 -O1 -g -Wall -Wextra -Werror -Iinclude $(SANITIZE) -o tests/c/build/test_bucket_gaps \
		tests/c/test_bucket_gaps.c $(CORE_SOURCES) -lm -lpthread -ldl
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 tests/c/build/test_bucket_gaps
	$(CC) -std=c11 -O1 -g -Wall -Wextra -Werror -Iinclude $(SANITIZE) -o tests/c/build/test_shared_buckets \
		tests/c/test_shared_buckets.c $(CORE_SOURCES) -lm -lpthread -ldl
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 tests/c/build/test_shared_buckets
	$(CC) -std=c11 -O1 -g -Wall -Wextra -Werror -Iinclude $(SANITIZE) -o tests/c/build/test_cuda \
		tests/c/test_cuda.c $(CORE_SOURCES) -lm -lpthread -ldl
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 tests/c/build/test_cuda $(EMULATED_CUDA)
	# the thread pool again, under ThreadSanitizer
	$(CC) -std=c11 -O1 -g -Wall -Wextra -Werror -Iinclude -fsanitize=thread -o tests/c/build/test_core_tsan \
		tests/c/test_core.c $(CORE_SOURCES) -lm -lpthread -ldl
	tests/c/build/test_core_tsan
	# the disk I/O engine, its fault hook compiled in, under both
	$(CC) -std=c11 -O1 -g -Wall -Wextra -Werror -Iinclude -DZERO_AIO_FAULTS $(SANITIZE) -o tests/c/build/test_aio \
		tests/c/test_aio.c $(CORE_SOURCES) -lm -lpthread -ldl
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 tests/c/build/test_aio
	$(CC) -std=c11 -O1 -g -Wall -Wextra -Werror -Iinclude -DZERO_AIO_FAULTS -fsanitize=thread -o tests/c/build/test_aio_tsan \
		tests/c/test_aio.c $(CORE_SOURCES) -lm -lpthread -ldl
	tests/c/build/test_aio_tsan

# The CUDA kernels through nvcc with every warning an error (no GPU needed);
# `make test` runs it wherever nvcc is found.
test-cuda-build:
	mkdir -p tests/c/build
	$(PYTHON) kernels/nvcc_build.py tests/c/build/zero_kernels.fatbin

# The main job: a small GPT trained with zero on 2 processes of this machine.
train: install
	$(PYTHON) -m torch.distributed.run --nproc_per_node 2 examples/train_gpt.py

emulated-cuda: $(EMULATED_CUDA)

$(EMULATED_CUDA): $(wildcard tests/emulated_cuda/*) $(wildcard kernels/*.cu*) $(wildcard include/zero/*.h)
	mkdir -p tests/c/build
	$(CXX) -std=c++17 -O2 -g -fPIC -shared -Wall -Wextra -Werror -Wno-unknown-pragmas \
		-Itests/emulated_cuda -Iinclude -o $@ tests/emulated_cuda/fake_cuda.cpp

test-py:
	$(PYTHON) -m pytest -q tests

# The HuggingFace tests again under transformers 5 (requirements-test.txt
# pins 4.57.6), in a venv that sees everything else installed here.
HF5_VENV = build/venv-transformers5
HF5_TESTS = tests/test_hf_trainer.py tests/test_hf_llama.py tests/test_hf_architectures.py \
	tests/test_peft_stage3.py \
	tests/distributed/test_hf_trainer_ranks.py tests/distributed/test_hf_trainer_tp.py \
	tests/distributed/test_generation.py
test-hf5: install
	$(PYTHON) -m venv --system-site-packages $(HF5_VENV)
	$(HF5_VENV)/bin/python -m pip install -q "transformers==5.18.0" "setuptools>=77"
	$(HF5_VENV)/bin/python -m pytest -q $(HF5_TESTS)

test: install test-c $(if $(NVCC),test-cuda-build) test-py test-hf5

rlhf: install
	$(PYTHON) -m torch.distributed.run --standalone --nproc_per_node 2 examples/rlhf/train.py

bench: install
	$(PYTHON) bench/optim_cpu.py

bench-train: install
	$(PYTHON) bench/train.py

bench-checkpoint: install
	$(PYTHON) bench/checkpoint.py

bench-offload: install
	$(PYTHON) bench/offload.py

# A GPT twice this machine's RAM (3.2B parameters, 47 GiB of model states)
# trained at stage 3 with parameters and states in files; needs about 60 GB
# of free disk under /tmp (--dir to choose another; --size 1b for a quick run).
bench-beyond-ram: install
	$(PYTHON) bench/beyond_ram.py --size 3b

clean:
	rm -rf build tests/c/build python/zero/*.so *.egg-info python/*.egg-info
