/* module.h: what the binding files (module*.c, the only files that include
 * Python.h) share: the module state, the Buffer that holds a DLPack tensor,
 * and the argument checks that name the argument in their messages.
 *
 * module_buffer.c defines the Buffer and the common checks,
 * module_cuda_args.c the CUDA functions' tensor arguments; module.c binds
 * the CPU core, module_cuda.c the CUDA kernels. Functions that can fail
 * return 0 / a new reference on success and -1 / NULL with a Python
 * exception set.
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

/* ---- the cuda_* functions' tensor arguments (module_cuda_args.c) ---- */

typedef struct {
    const char *name;      /* the argument */
    Py_ssize_t index;      /* position in a list argument, or -1 */
    Buffer *buf;           /* NULL: an optional argument left out */
    int written;
} cuda_arg;

/* All tensor arguments of one call, released together. */
typedef struct {
    cuda_arg *args;
    Py_ssize_t count;
} arg_set;

/* "grads[3]", or "step" for an argument that is not a list; returns out. */
const char *arg_name(const cuda_arg *a, char *out, size_t size);
int args_alloc(arg_set *set, Py_ssize_t count);
void args_free(arg_set *set);

/* A CUDA Buffer for obj into *a; None or NULL leaves *a absent when
 * optional. */
int take_arg(PyObject *module, cuda_arg *a, const char *name,
             Py_ssize_t index, PyObject *obj, int written, int optional);
/* A list or tuple argument's items, borrowed. (A tensor is iterable too,
 * so nothing else is accepted.) */
int list_items(PyObject *obj, const char *name, PyObject ***items,
               Py_ssize_t *count);
/* take_arg for each item; indexed 0 names them without "[i]" (a single
 * tensor passed as a 1-tuple). */
int take_list(PyObject *module, cuda_arg *args, const char *name,
              PyObject *const *items, Py_ssize_t count, int written,
              int optional, int indexed);
/* A list argument into set->args[0..count), with `extra` entries after. */
int take_tensor_list(PyObject *module, arg_set *set, PyObject *list,
                     const char *name, int written, Py_ssize_t extra);

/* Absent arguments pass these checks. */
int check_float32(const cuda_arg *a);
int check_numel_like(const cuda_arg *a, const cuda_arg *ref);
int check_scalar_tensor(const cuda_arg *a);  /* float32, 1 element */
int check_lengths(const char *name, Py_ssize_t count, const char *ref_name,
                  Py_ssize_t ref_count);
/* Every tensor on ref's device, and writable where written. */
int check_device_and_access(const arg_set *set, const cuda_arg *ref);

/* A byte range a kernel reads or writes. */
typedef struct {
    uintptr_t begin, end;
    int written;
    char name[96];
} extent;

void extent_of(extent *e, const Buffer *b, int64_t offset, int64_t numel,
               int written);
/* No written extent overlaps any other; sorts the extents. */
int check_no_overlap(extent *extents, Py_ssize_t count);
/* The present arguments' extents but skip's; returns how many. */
Py_ssize_t extents_of_args(const arg_set *set, const cuda_arg *skip,
                           extent *extents);
int check_args_no_overlap(const arg_set *set);

/* Register the cuda_* functions (module_cuda.c). */
int add_cuda_functions(PyObject *module);

#endif /* ZERO_MODULE_H */
