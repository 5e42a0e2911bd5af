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

.PHONY: deps install train rlhf test test-c core-objects test-cuda-build emulated-cuda test-py test-hf5 bench bench-train bench-checkpoint bench-offload bench-beyond-ram clean

# The pinned CPU build of torch and the test tools.
deps:
	$(PYTHON) -m pip install -q -r requirements-test.txt

install: deps
	$(PYTHON) -m pip install -q --no-build-isolation -e .

# C core alone, no Python, under AddressSanitizer and UBSan; the CUDA host
# code too (its loader's failure paths need no GPU). The core is compiled
# once per sanitizer build (in parallel), then linked into each test.
C_TEST_FLAGS = -std=c11 -O1 -g -Wall -Wextra -Werror -Iinclude
CORE_HEADERS = $(wildcard csrc/*.h csrc/x86/*.h include/zero/*.h)
CORE_BUILD = tests/c/build/core
core_objects = $(patsubst %.c,$(CORE_BUILD)/$(1)/%.o,$(CORE_SOURCES))
FLAVOR_FLAGS_asan = $(SANITIZE)
FLAVOR_FLAGS_tsan = -fsanitize=thread
# the disk I/O engine's fault hook compiled in (tests/c/test_aio.c)
FLAVOR_FLAGS_asan-faults = $(SANITIZE) -DZERO_AIO_FAULTS
FLAVOR_FLAGS_tsan-faults = -fsanitize=thread -DZERO_AIO_FAULTS
CORE_FLAVORS = asan tsan asan-faults tsan-faults
ASAN_RUN = ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1

define core_object_rule
$(CORE_BUILD)/$(1)/%.o: %.c $(CORE_HEADERS)
	@mkdir -p $$(@D)
	$(CC) $(C_TEST_FLAGS) $(FLAVOR_FLAGS_$(1)) -c -o $$@ $$<
endef
$(foreach f,$(CORE_FLAVORS),$(eval $(call core_object_rule,$(f))))

core-objects: $(foreach f,$(CORE_FLAVORS),$(call core_objects,$(f)))

# test_<name> against the core of one build: $(call c_test,name,flavor,binary)
define c_test
	$(CC) $(C_TEST_FLAGS) $(FLAVOR_FLAGS_$(2)) -o tests/c/build/$(3) tests/c/$(1).c \
		$(call core_objects,$(2)) -lm -lpthread -ldl
endef

test-c: $(EMULATED_CUDA)
	$(MAKE) -j$$(nproc) core-objects
	$(call c_test,test_core,asan,test_core)
	$(ASAN_RUN) tests/c/build/test_core
	# the gradient bucket plan and the accumulate kernel
	$(call c_test,test_buckets,asan,test_buckets)
	$(ASAN_RUN) tests/c/build/test_buckets
	$(call c_test,test_bucket_gaps,asan,test_bucket_gaps)
	$(ASAN_RUN) tests/c/build/test_bucket_gaps
	$(call c_test,test_shared_buckets,asan,test_shared_buckets)
	$(ASAN_RUN) tests/c/build/test_shared_buckets
	$(call c_test,test_cuda,asan,test_cuda)
	$(ASAN_RUN) tests/c/build/test_cuda $(EMULATED_CUDA)
	# the thread pool again, under ThreadSanitizer
	$(call c_test,test_core,tsan,test_core_tsan)
	tests/c/build/test_core_tsan
	# the disk I/O engine, its fault hook compiled in, under both
	$(call c_test,test_aio,asan-faults,test_aio)
	$(ASAN_RUN) tests/c/build/test_aio
	$(call c_test,test_aio,tsan-faults,test_aio_tsan)
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

# pytest on PYTEST_WORKERS processes (pytest-xdist), a whole file to a
# worker (a module's fixture starts its ranks once); then, alone, the tests
# marked serial, whose timeouts of seconds a loaded machine could trip.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL = -n $(PYTEST_WORKERS) --dist loadfile
test-py:
	$(PYTHON) -m pytest -q $(PYTEST_PARALLEL) -m "not serial" tests
	$(PYTHON) -m pytest -q -m serial tests

# The HuggingFace tests again under transformers 5 (requirements-test.txt
# pins 4.57.6), in a venv that sees everything else installed here.
HF5_VENV = build/venv-transformers5
HF5_TESTS = tests/test_hf_trainer.py tests/test_hf_llama.py tests/test_hf_architectures.py \
	tests/test_peft_stage3.py \
	tests/distributed/test_hf_trainer_ranks.py tests/distributed/test_hf_trainer_tp.py \
	tests/distributed/test_generation.py
# (in one process: on the xdist workers it took 107 s against 79 s, its
# files being few and mostly ranks of their own)
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
