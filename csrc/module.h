/* module.h: what the binding files (module*.c, the only files that include
 * Python.h) share: the module state, the Buffer that holds a DLPack tensor,
 * and the argument checks that name the argument in their messages.
 *
 * module_buffer.c defines these; module.c binds the CPU core, module_cuda.c
 * the CUDA kernels. Every function here returns 0 / a new reference on
 * success and -1 / NULL with a Python exception set on failure.
 */
#ifndef ZERO_MODULE_H
#define ZERO_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <limits.h>

#include "dlpack_abi.h"
#include "zero.h"

typedef struct {
    PyTypeObject *buffer_type;
} module_state;

static inline module_state *get_state(PyObject *module)
{
    return (module_state *)PyModule_GetState(module);
}

/* A DLPack tensor, consumed once and checked once: contiguous, a supported
 * float dtype, elements aligned. CPU (and CUDA pinned host) tensors serve
 * the CPU functions, CUDA tensors the cuda_* functions; each function
 * checks the device when it takes the Buffer. */
typedef struct {
    PyObject_HEAD
    void *data;            /* first element; a device address for CUDA */
    int64_t numel;
    zero_dtype dtype;
    int readonly;
    int device_type;       /* DL_CPU, DL_CUDA_HOST or DL_CUDA */
    int device_id;
    dl_managed *legacy;    /* exactly one of these two is set */
    dl_managed_versioned *versioned;
} Buffer;

/* Create the Buffer type and add it to the module. */
int add_buffer_type(PyObject *module);

/* A Buffer for an argument that must be a CPU tensor (as_buffer) or a CUDA
 * tensor (as_cuda_buffer): the given Buffer, or one made from a tensor or
 * capsule. */
Buffer *as_buffer(PyObject *module, PyObject *obj, const char *name);
Buffer *as_cuda_buffer(PyObject *module, PyObject *obj, const char *name);

typedef struct {
    const char *name;
    Buffer *buf;
    int written;
} named_buffer;

/* float32 unless allow_half (then any of float32, bfloat16, float16). */
int check_dtype(const named_buffer *b, int allow_half);
/* Sizes equal, written buffers writable, and no two buffers overlapping. */
int check_together(const named_buffer *bufs, int count);
void release_buffers(named_buffer *bufs, int count);
/* Convert the objects (NULL or None: absent) to CPU Buffers. */
int collect_buffers(PyObject *module, named_buffer *bufs, PyObject **objs,
                    int count);

int check_finite(const char *name, double value);
int check_nonnegative(const char *name, double value);
int check_beta(const char *name, double value);

/* Keyword-only arguments without a default start as MISSING: the
 * PyArg_Parse format has no "required keyword-only" mark. */
#define MISSING (-DBL_MAX)
#define MISSING_INT LLONG_MIN

int require(const char *function, const char *name, int missing);

/* Raise the exception that matches a core status; returns NULL. */
PyObject *raise_status(zero_status status, const char *what);

/* Register the cuda_* functions and constants (module_cuda.c). */
int add_cuda_functions(PyObject *module);

#endif /* ZERO_MODULE_H */
