/* module.h: what the binding files (module*.c, the only files that include
 * Python.h) share: the module state, the Buffer that holds a DLPack tensor,
 * and the argument checks that name the argument in their messages.
 *
 * module_buffer.c defines the Buffer and the common checks, module_args.c
 * the table-driven keyword parsing every function uses, module_cuda_args.c
 * the CUDA functions' tensor arguments; module.c binds the CPU core and
 * holds the module, module_optim.c the CPU optimizers, module_cuda.c the
 * CUDA kernels, module_buckets.c and module_grad_buckets.c the gradient
 * buckets' hook and type. Functions that can fail
 * return 0 / a new reference on success and -1 / NULL with a Python
 * exception set.
 */
#ifndef ZERO_MODULE_H
#define ZERO_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <stddef.h>

#include "dlpack_abi.h"
#include "zero.h"

typedef struct {
    PyTypeObject *buffer_type;
    PyTypeObject *bucket_hook_type; /* module_buckets.c */
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
    int optional;          /* None (or not given) leaves buf NULL */
} named_buffer;

/* float32 unless allow_half (then any of float32, bfloat16, float16). */
int check_dtype(const named_buffer *b, int allow_half);
/* Sizes equal, written buffers writable, and no two buffers overlapping. */
int check_together(const named_buffer *bufs, int count);
void release_buffers(named_buffer *bufs, int count);
/* Convert the objects to CPU Buffers; NULL or None leaves an optional one
 * absent. */
int collect_buffers(PyObject *module, named_buffer *bufs, PyObject **objs,
                    int count);

/* ---- keyword arguments from a table (module_args.c) ------------------
 *
 * A binding function describes its arguments once, as a table of arg_spec
 * rows in the order of its Python signature; parse_args() then does for
 * every function what each used to spell out: the PyArg format and keyword
 * list, the defaults, "missing required keyword argument", and the range
 * checks of numbers, with the same messages everywhere. Values land in the
 * function's own call struct at each row's offset; a row's name is its
 * keyword. */

typedef enum {
    ARG_OBJECT,            /* PyObject *, borrowed; NULL when not given */
    ARG_TENSOR,            /* the same, a tensor the function takes */
    ARG_TENSORS,           /* the same, a list or tuple of tensors */
    ARG_DOUBLE,            /* double ("d") */
    ARG_BOOL,              /* int ("p") */
    ARG_INT64              /* int64_t ("L") */
} arg_kind;

typedef enum {
    CHECK_NONE,
    CHECK_FINITE,          /* "must be finite" */
    CHECK_NONNEGATIVE,     /* finite and >= 0 */
    CHECK_BETA,            /* in [0, 1) */
    CHECK_COUNT,           /* an integer >= 1 (a step count) */
    CHECK_STREAM,          /* an integer >= 0 (a CUstream handle) */
    CHECK_INDEX            /* an integer >= 0 (a descriptor, an offset) */
} arg_check;

/* Flags of a row. The tensor flags are read by the functions that take
 * the tensors (module_optim.c, module_cuda.c), not by parse_args. */
enum {
    ARG_REQUIRED = 1,      /* keyword-only without a default */
    ARG_WRITTEN = 2,       /* a tensor the call writes */
    ARG_HALF = 4,          /* a tensor that may be bfloat16 or float16 too */
    ARG_OPTIONAL = 8,      /* a tensor that may be None: left out */
    ARG_SCALAR = 16,       /* a tensor of 1 float32 element */
    ARG_FLOAT32 = 32       /* a tensor of float32 elements */
};

typedef struct {
    const char *name;      /* the keyword */
    arg_kind kind;
    arg_check check;
    int flags;
    double initial;        /* the default, unless ARG_REQUIRED */
    size_t offset;         /* of the value in the call struct */
} arg_spec;

/* A row whose value is the member `member` of call struct T. */
#define ARG(T, member, name, kind, check, flags, initial)                    \
    {name, kind, check, flags, initial, offsetof(T, member)}

/* The most rows a table may have (adam_step has 17). */
#define MAX_ROWS 20

typedef struct {
    const char *function;  /* the Python name, in messages */
    const arg_spec *args;
    int count;             /* rows of args */
    int required;          /* leading rows that are positional, no default */
    int positional;        /* leading rows that may be given by position */
    size_t size;           /* of the call struct */
} signature;

#define ARRAY_SIZE(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* The signature of `function`: the rows `args`, the first `required` of
 * them positional without a default, the first `positional` positional;
 * values go into a T. */
#define SIGNATURE(function, args, required, positional, T)                   \
    {function, args, ARRAY_SIZE(args), required, positional, sizeof(T)}

/* Zero *call, fill in the defaults, parse args and kwargs into it, then
 * check the required keywords and the rows' checks (all the float checks in
 * table order, then the integer ones). */
int parse_args(const signature *sig, PyObject *args, PyObject *kwargs,
               void *call);

/* Adam's hyperparameters whose rows adam_step and cuda_adam_step share:
 * the members of a zero_adam_hparams `hp` in call struct T. */
#define ADAM_RATES(T, hp)                                                    \
    ARG(T, hp.lr, "lr", ARG_DOUBLE, CHECK_NONNEGATIVE, ARG_REQUIRED, 0),     \
    ARG(T, hp.beta1, "beta1", ARG_DOUBLE, CHECK_BETA, ARG_REQUIRED, 0),      \
    ARG(T, hp.beta2, "beta2", ARG_DOUBLE, CHECK_BETA, ARG_REQUIRED, 0),      \
    ARG(T, hp.eps, "eps", ARG_DOUBLE, CHECK_NONNEGATIVE, ARG_REQUIRED, 0),   \
    ARG(T, hp.weight_decay, "weight_decay", ARG_DOUBLE, CHECK_NONNEGATIVE,   \
        ARG_REQUIRED, 0)

/* zero_C_<name>, a keyword function served by a shared path:
 * run(module, args, kwargs, &spec). */
#define KEYWORD_FUNCTION(name, run, spec)                                    \
    static PyObject *zero_C_##name(PyObject *module, PyObject *args,         \
                                   PyObject *kwargs)                         \
    {                                                                        \
        return run(module, args, kwargs, &spec);                             \
    }

/* A PyMethodDef of a keyword function zero_C_<name> documented by
 * <name>_doc. */
#define KEYWORD_METHOD(name)                                                 \
    {#name, (PyCFunction)(void (*)(void))zero_C_##name,                      \
     METH_VARARGS | METH_KEYWORDS, name##_doc}

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
/* A list or tuple argument as a new tuple (*kept, to release) and its
 * items and count. A copy, since reading an item can run Python code (its
 * __dlpack__ or __index__) that changes a list under the reader. (A tensor
 * is iterable too, so nothing but a list or tuple is accepted.) */
int list_items(PyObject *obj, const char *name, PyObject **kept,
               PyObject ***items, Py_ssize_t *count);
/* take_arg for each item; indexed 0 names them without "[i]" (a single
 * tensor passed as a 1-tuple). */
int take_list(PyObject *module, cuda_arg *args, const char *name,
              PyObject *const *items, Py_ssize_t count, int written,
              int optional, int indexed);
/* A cuda_* call's arguments: parse_args() into *call, then the tensors of
 * its ARG_TENSORS and ARG_TENSOR rows into *t (their flags: ARG_WRITTEN,
 * ARG_OPTIONAL, and for a single tensor ARG_SCALAR or ARG_FLOAT32, checked
 * here). The lists' items come first in t->set, list after list in table
 * order, then the single tensors in table order. */
typedef struct {
    arg_set set;
    Py_ssize_t count;          /* items of each list (1 without lists) */
    cuda_arg *row[MAX_ROWS];   /* a tensor row's entry, a list row's first;
                                  NULL for the other rows */
} cuda_tensors;

/* On failure too, args_free(&t->set) releases what was taken. */
int parse_cuda_args(PyObject *module, const signature *sig, PyObject *args,
                    PyObject *kwargs, void *call, cuda_tensors *t);

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
/* Where tensor i of set (count tensors) sits in bucket: offsets_obj[i] (a
 * list or tuple of ints), or back to back when offsets_obj is None; every
 * slice checked to lie inside the bucket. */
int bucket_offsets(PyObject *offsets_obj, const arg_set *set,
                   Py_ssize_t count, const Buffer *bucket, int64_t *offsets);

/* Register the CPU optimizers (module_optim.c), the disk I/O engine's
 * type and aio_info (module_aio.c) and the cuda_* functions
 * (module_cuda.c). */
int add_optim_functions(PyObject *module);
int add_aio(PyObject *module);
/* module_aio_requests.c: the descriptor is open, in a mode that allows the
 * transfer, and aligned as O_DIRECT needs when opened so (else an error
 * naming `function`); and the OSError of a failed request, from its
 * `held` entry (Buffer, fd, offset, nbytes, write) and its result. */
int check_descriptor(const char *function, int fd, int write,
                     const Buffer *b, int64_t offset, int64_t nbytes);
void raise_failure(PyObject *entry, const zero_aio_result *r);
/* zero._C.GradBuckets and its hook type (module_buckets.c). */
int add_buckets(PyObject *module);
int add_cuda_functions(PyObject *module);

#endif /* ZERO_MODULE_H */
