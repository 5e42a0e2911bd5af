/* fake_cuda.cpp: an emulated CUDA driver (libzero_fake_cuda.so) for tests on
 * machines without a GPU. It exports the driver functions csrc/cuda_driver.c
 * looks up, with the driver's ABI, and runs the real kernel source
 * (kernels/kernels.cu, compiled here by g++ with emulation.h) on the CPU,
 * synchronously, on "device memory" that is host memory.
 *
 * Loaded through ZERO_CUDA_DRIVER=<path to the .so>; tests/gpu then runs on
 * CPU tensors presented as CUDA tensors (tests/test_cuda_emulated.py). It
 * checks what a driver would refuse: a launch without a current context, a
 * block shape other than ZERO_K_THREADS, an unknown kernel name, and a
 * __syncthreads() that not every thread of a block reaches.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <functional>

#include "emulation.h"

#include "../../kernels/kernels.cu"

/* ---- threads of a block as coroutines -------------------------------- */

emu_dim3 blockIdx, threadIdx;

namespace {

enum { READY, AT_BARRIER, DONE };
const size_t STACK_BYTES = 256 * 1024;

ucontext_t scheduler;
ucontext_t threads[ZERO_K_THREADS];
char *stacks[ZERO_K_THREADS];
int states[ZERO_K_THREADS];
int current;
const std::function<void()> *body;

void thread_main()
{
    (*body)();
    states[current] = DONE;
}

/* Run fn as every thread of block `block`; false when the threads did not
 * all meet at the same barriers. */
bool run_block(unsigned int block, const std::function<void()> &fn)
{
    body = &fn;
    blockIdx.x = block;
    for (int t = 0; t < ZERO_K_THREADS; t++) {
        if (!stacks[t]) {
            stacks[t] = static_cast<char *>(malloc(STACK_BYTES));
        }
        getcontext(&threads[t]);
        threads[t].uc_stack.ss_sp = stacks[t];
        threads[t].uc_stack.ss_size = STACK_BYTES;
        threads[t].uc_link = &scheduler;
        makecontext(&threads[t], thread_main, 0);
        states[t] = READY;
    }
    for (;;) {
        int at_barrier = 0, done = 0;
        for (int t = 0; t < ZERO_K_THREADS; t++) {
            if (states[t] == READY) {
                current = t;
                threadIdx.x = (unsigned int)t;
                swapcontext(&scheduler, &threads[t]);
            }
            at_barrier += states[t] == AT_BARRIER;
            done += states[t] == DONE;
        }
        if (done == ZERO_K_THREADS) {
            return true;
        }
        if (done > 0) {
            return false; /* some threads left, others wait at a barrier */
        }
        for (int t = 0; t < ZERO_K_THREADS; t++) {
            states[t] = READY;
        }
    }
}

}  // namespace

void emu_syncthreads(void)
{
    states[current] = AT_BARRIER;
    swapcontext(&threads[current], &scheduler);
}

/* ---- the kernels, by name -------------------------------------------- */

namespace {

typedef bool (*launcher)(void **params, unsigned int grid);

template <typename Args, void (*Kernel)(Args)>
bool launch(void **params, unsigned int grid)
{
    Args args;
    memcpy(&args, params[0], sizeof args);
    std::function<void()> fn = [&args] { Kernel(args); };
    for (unsigned int b = 0; b < grid; b++) {
        if (!run_block(b, fn)) {
            return false;
        }
    }
    return true;
}

struct kernel_entry {
    const char *name;
    launcher run;
};

#define EMULATED_KERNEL(name, args) {#name, launch<args, name>},
const kernel_entry kernel_table[] = {ZERO_K_LIST(EMULATED_KERNEL)};
#undef EMULATED_KERNEL

/* ---- driver state ---------------------------------------------------- */

enum {
    SUCCESS = 0,
    ERROR_INVALID_VALUE = 1,
    ERROR_INVALID_DEVICE = 101,
    ERROR_INVALID_CONTEXT = 201,
    ERROR_NOT_FOUND = 500,
    ERROR_LAUNCH_FAILED = 719,
};

const int DEVICES = 2;
int contexts[DEVICES];         /* their addresses are the handles */
int retained[DEVICES];
int other_context;             /* owner of BAD_STREAM */
void *context_stack[16];
int depth;
int module_token;
long launches;
/* A stream handle the tests use for "a stream of another device". */
const uintptr_t BAD_STREAM = 0xbad0;

}  // namespace

extern "C" {

int cuInit(unsigned int flags)
{
    return flags == 0 ? SUCCESS : ERROR_INVALID_VALUE;
}

int cuDriverGetVersion(int *version)
{
    *version = 13000;
    return SUCCESS;
}

int cuDeviceGetCount(int *count)
{
    *count = DEVICES;
    return SUCCESS;
}

int cuDeviceGet(int *device, int ordinal)
{
    if (ordinal < 0 || ordinal >= DEVICES) {
        return ERROR_INVALID_DEVICE;
    }
    *device = ordinal;
    return SUCCESS;
}

int cuDeviceGetAttribute(int *value, int attribute, int device)
{
    if (device < 0 || device >= DEVICES) {
        return ERROR_INVALID_DEVICE;
    }
    switch (attribute) {
    case 16: /* multiprocessors */
        *value = 4;
        return SUCCESS;
    case 75: /* compute capability */
        *value = 9;
        return SUCCESS;
    case 76:
        *value = 0;
        return SUCCESS;
    }
    return ERROR_INVALID_VALUE;
}

int cuDevicePrimaryCtxRetain(void **context, int device)
{
    if (device < 0 || device >= DEVICES) {
        return ERROR_INVALID_DEVICE;
    }
    retained[device]++;
    *context = &contexts[device];
    return SUCCESS;
}

int cuDevicePrimaryCtxRelease_v2(int device)
{
    if (device < 0 || device >= DEVICES || retained[device] == 0) {
        return ERROR_INVALID_CONTEXT;
    }
    retained[device]--;
    return SUCCESS;
}

int cuCtxPushCurrent_v2(void *context)
{
    if (!context || depth == 16) {
        return ERROR_INVALID_CONTEXT;
    }
    context_stack[depth++] = context;
    return SUCCESS;
}

int cuCtxPopCurrent_v2(void **context)
{
    if (depth == 0) {
        return ERROR_INVALID_CONTEXT;
    }
    *context = context_stack[--depth];
    return SUCCESS;
}

int cuModuleLoadData(void **module, const void *image)
{
    if (!image || depth == 0) {
        return image ? ERROR_INVALID_CONTEXT : ERROR_INVALID_VALUE;
    }
    *module = &module_token;
    return SUCCESS;
}

int cuModuleUnload(void *module)
{
    return module == &module_token ? SUCCESS : ERROR_INVALID_VALUE;
}

int cuModuleGetFunction(void **function, void *module, const char *name)
{
    if (module != &module_token) {
        return ERROR_INVALID_VALUE;
    }
    for (const kernel_entry &k : kernel_table) {
        if (strcmp(k.name, name) == 0) {
            *function = const_cast<kernel_entry *>(&k);
            return SUCCESS;
        }
    }
    return ERROR_NOT_FOUND;
}

int cuLaunchKernel(void *function, unsigned int grid_x, unsigned int grid_y,
                   unsigned int grid_z, unsigned int block_x,
                   unsigned int block_y, unsigned int block_z,
                   unsigned int shared, void *stream, void **params,
                   void **extra)
{
    (void)stream;
    if (depth == 0) {
        return ERROR_INVALID_CONTEXT;
    }
    if (!function || !params || extra || grid_x == 0 || grid_y != 1 ||
        grid_z != 1 || block_x != ZERO_K_THREADS || block_y != 1 ||
        block_z != 1 || shared != 0) {
        return ERROR_INVALID_VALUE;
    }
    launches++;
    const kernel_entry *k = static_cast<const kernel_entry *>(function);
    return k->run(params, grid_x) ? SUCCESS : ERROR_LAUNCH_FAILED;
}

int cuStreamGetCtx(void *stream, void **context)
{
    if ((uintptr_t)stream == BAD_STREAM) {
        *context = &other_context;
    } else {
        *context = depth ? context_stack[depth - 1] : &contexts[0];
    }
    return SUCCESS;
}

int cuGetErrorName(int error, const char **name)
{
    switch (error) {
    case SUCCESS:
        *name = "CUDA_SUCCESS";
        return SUCCESS;
    case ERROR_INVALID_VALUE:
        *name = "CUDA_ERROR_INVALID_VALUE";
        return SUCCESS;
    case ERROR_INVALID_DEVICE:
        *name = "CUDA_ERROR_INVALID_DEVICE";
        return SUCCESS;
    case ERROR_INVALID_CONTEXT:
        *name = "CUDA_ERROR_INVALID_CONTEXT";
        return SUCCESS;
    case ERROR_NOT_FOUND:
        *name = "CUDA_ERROR_NOT_FOUND";
        return SUCCESS;
    case ERROR_LAUNCH_FAILED:
        *name = "CUDA_ERROR_LAUNCH_FAILED";
        return SUCCESS;
    }
    return ERROR_INVALID_VALUE;
}

int cuGetErrorString(int error, const char **text)
{
    const char *name;
    if (cuGetErrorName(error, &name) != SUCCESS) {
        return ERROR_INVALID_VALUE;
    }
    *text = error == ERROR_LAUNCH_FAILED
                ? "emulated launch failed: threads of a block diverged at "
                  "a __syncthreads()"
                : "emulated driver error";
    return SUCCESS;
}

/* For the tests: launches so far, contexts still pushed, retains. */
long fake_cuda_launches(void)
{
    return launches;
}

int fake_cuda_context_depth(void)
{
    return depth;
}

int fake_cuda_retained(int device)
{
    return retained[device];
}

}  // extern "C"
