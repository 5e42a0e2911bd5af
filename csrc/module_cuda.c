/* module_cuda.c: the binding of the CUDA path (zero_cuda.h): cuda_available,
 * cuda_info and the cuda_* kernel calls of zero._C.
 *
 * A binding file of its own because module.c binds the CPU core and was
 * already past the size at which DESIGN.md asks for a split; the Buffer and
 * the common checks are in module_buffer.c, the tensor-argument checks of
 * these functions in module_cuda_args.c (module.h).
 *
 * Every argument is checked here, with its name ("grads[3]"), before the
 * driver is touched: device (all tensors CUDA tensors on one device), dtype,
 * size, contiguity (the Buffer's), writability, and no overlap between a
 * written buffer and any other. Only then does the core load the driver, so
 * a bad call raises TypeError/ValueError on any machine, and a good one on a
 * machine without CUDA raises RuntimeError saying why. Launches are
 * asynchronous on the given stream; see [Note: stream order] in
 * cuda_launch.c for why releasing the DLPack references before the kernels
 * run is safe.
 */
#include "module.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "zero_cuda.h"

/* The embedded kernels: zero_fatbin.c, generated at build time by
 * kernels/nvcc_build.py (zero_fatbin_size is 0 when built without nvcc). */
extern const unsigned char zero_fatbin[];
extern const size_t zero_fatbin_size;
extern const char zero_fatbin_archs[];
extern const char zero_fatbin_note[];

/* ---- errors ---------------------------------------------------------- */

/* The stream row of every cuda_* table. */
#define STREAM(T) ARG(T, stream, "stream", ARG_INT64, CHECK_STREAM, 0, 0)

static zero_cuda_where where_of(const cuda_arg *ref, int64_t stream)
{
    zero_cuda_where where = {ref->buf->device_id, (uintptr_t)stream};
    return where;
}

/* A failed CUDA call: RuntimeError (ValueError for a bad device or stream)
 * with the core's message, which names the CUDA call and error. */
static PyObject *raise_cuda(zero_status status, const char *what)
{
    if (status == ZERO_ERR_CUDA_UNAVAILABLE || status == ZERO_ERR_CUDA) {
        PyErr_Format(PyExc_RuntimeError, "%s: %s", what, zero_cuda_error());
        return NULL;
    }
    if (status == ZERO_ERR_INVALID_ARGUMENT) {
        PyErr_Format(PyExc_ValueError, "%s: %s", what, zero_cuda_error());
        return NULL;
    }
    return raise_status(status, what);
}

/* None for a launched call, else the exception. */
static PyObject *launched(zero_status status, const char *what)
{
    return status == ZERO_OK ? Py_NewRef(Py_None) : raise_cuda(status, what);
}

/* ---- availability ---------------------------------------------------- */

static zero_status probe(void)
{
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_cuda_probe();
    Py_END_ALLOW_THREADS
    return status;
}

static PyObject *zero_C_cuda_available(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyBool_FromLong(probe() == ZERO_OK);
}

static PyObject *zero_C_cuda_info(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    zero_status status = probe();
    PyObject *archs = PyUnicode_FromString(zero_fatbin_archs);
    PyObject *arch_list = archs ? PyUnicode_Split(archs, NULL, -1) : NULL;
    Py_XDECREF(archs);
    if (!arch_list) {
        return NULL;
    }
    int version = zero_cuda_driver_version();
    PyObject *driver = version ? PyLong_FromLong(version)
                               : Py_NewRef(Py_None);
    if (!driver) {
        Py_DECREF(arch_list);
        return NULL;
    }
    return Py_BuildValue(
        "{s:O,s:z,s:n,s:N,s:s,s:N}", "available",
        status == ZERO_OK ? Py_True : Py_False, "reason",
        status == ZERO_OK ? NULL : zero_cuda_error(), "fatbin_bytes",
        (Py_ssize_t)zero_fatbin_size, "archs", arch_list, "build",
        zero_fatbin_note, "driver_version", driver);
}

/* ---- Adam ------------------------------------------------------------ */

/* The tensor lists of an Adam call, in table order; for cuda_adam_step each
 * row is a single tensor, the same layout with one tensor per list. */
enum { A_PARAM, A_GRAD, A_EXP_AVG, A_EXP_AVG_SQ, A_COPY_OUT, A_LISTS };

typedef struct {
    PyObject *tensors[A_LISTS];
    PyObject *step, *found_inf;
    zero_adam_hparams hp;
    int64_t stream;
} adam_call;

/* A tensor row of an Adam call. */
#define ADAM_TENSOR(member, name, kind, flags)                               \
    ARG(adam_call, member, name, kind, CHECK_NONE, flags, 0)

/* The rows of both Adam functions, with their tensors' names. */
#define ADAM_ARGS(kind, param, grad, exp_avg, exp_avg_sq, copy_out)          \
    ADAM_TENSOR(tensors[A_PARAM], param, kind, ARG_WRITTEN),                 \
    ADAM_TENSOR(tensors[A_GRAD], grad, kind, ARG_HALF),                      \
    ADAM_TENSOR(tensors[A_EXP_AVG], exp_avg, kind, ARG_WRITTEN),             \
    ADAM_TENSOR(tensors[A_EXP_AVG_SQ], exp_avg_sq, kind, ARG_WRITTEN),       \
    ADAM_TENSOR(tensors[A_COPY_OUT], copy_out, kind,                         \
                ARG_WRITTEN | ARG_HALF | ARG_OPTIONAL),                      \
    ADAM_TENSOR(step, "step", ARG_TENSOR,                                    \
                ARG_REQUIRED | ARG_WRITTEN | ARG_SCALAR),                    \
    ADAM_TENSOR(found_inf, "found_inf", ARG_TENSOR,                          \
                ARG_OPTIONAL | ARG_SCALAR),                                  \
    ADAM_RATES(adam_call, hp),                                               \
    ARG(adam_call, hp.decoupled, "decoupled", ARG_BOOL, CHECK_NONE, 0, 1),   \
    ARG(adam_call, hp.grad_scale, "grad_scale", ARG_DOUBLE, CHECK_FINITE, 0, \
        1.0),                                                                \
    STREAM(adam_call)

static const arg_spec adam_step_args[] = {ADAM_ARGS(
    ARG_TENSOR, "param", "grad", "exp_avg", "exp_avg_sq", "copy_out")};
static const arg_spec multi_adam_args[] = {ADAM_ARGS(
    ARG_TENSORS, "params", "grads", "exp_avgs", "exp_avg_sqs", "copy_outs")};
static const signature adam_step_sig =
    SIGNATURE("cuda_adam_step", adam_step_args, 4, 5, adam_call);
static const signature multi_adam_sig =
    SIGNATURE("cuda_multi_tensor_adam", multi_adam_args, 4, 5, adam_call);

/* Tensor i of each list: float32 unless the row allows half, and the size
 * of params[i]. */
static int check_adam_lists(const signature *sig, const cuda_tensors *t)
{
    for (Py_ssize_t i = 0; i < t->count; i++) {
        const cuda_arg *param = &t->row[A_PARAM][i];
        for (int list = 0; list < A_LISTS; list++) {
            const cuda_arg *a = &t->row[list][i];
            int half_ok = (sig->args[list].flags & ARG_HALF) != 0;
            if ((!half_ok && check_float32(a)) ||
                check_numel_like(a, param)) {
                return -1;
            }
        }
    }
    const cuda_arg *step = t->row[A_LISTS];
    return check_device_and_access(&t->set, step) ||
                   check_args_no_overlap(&t->set)
               ? -1
               : 0;
}

static zero_cuda_adam_tensor *adam_tensors(const cuda_tensors *t)
{
    zero_cuda_adam_tensor *tensors =
        PyMem_Calloc((size_t)t->count + 1, sizeof *tensors);
    if (!tensors) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < t->count; i++) {
        Buffer *copy = t->row[A_COPY_OUT][i].buf;
        Buffer *grad = t->row[A_GRAD][i].buf;
        zero_cuda_adam_tensor *a = &tensors[i];
        a->param = t->row[A_PARAM][i].buf->data;
        a->grad = grad->data;
        a->grad_dtype = grad->dtype;
        a->exp_avg = t->row[A_EXP_AVG][i].buf->data;
        a->exp_avg_sq = t->row[A_EXP_AVG_SQ][i].buf->data;
        a->copy_out = copy ? copy->data : NULL;
        a->copy_dtype = copy ? copy->dtype : ZERO_F32;
        a->n = grad->numel;
    }
    return tensors;
}

static PyObject *adam_run(PyObject *module, PyObject *args, PyObject *kwargs,
                          const signature *sig)
{
    adam_call call;
    cuda_tensors t;
    PyObject *result = NULL;
    zero_cuda_adam_tensor *tensors = NULL;
    if (parse_cuda_args(module, sig, args, kwargs, &call, &t) ||
        check_adam_lists(sig, &t) || !(tensors = adam_tensors(&t))) {
        goto done;
    }
    call.hp.step = 1; /* not read: the step count is on the device */
    const cuda_arg *step = t.row[A_LISTS], *found_inf = t.row[A_LISTS + 1];
    zero_cuda_where where = where_of(step, call.stream);
    float *step_data = step->buf->data;
    const float *skip = found_inf->buf ? found_inf->buf->data : NULL;
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_cuda_adam_step(&where, tensors, (int)t.count, &call.hp,
                                 step_data, skip);
    Py_END_ALLOW_THREADS
    result = launched(status, sig->function);
done:
    PyMem_Free(tensors);
    args_free(&t.set);
    return result;
}

PyDoc_STRVAR(cuda_adam_step_doc,
"cuda_adam_step(param, grad, exp_avg, exp_avg_sq, copy_out=None, *, step,\n"
"               found_inf=None, lr, beta1, beta2, eps, weight_decay,\n"
"               decoupled=True, grad_scale=1.0, stream=0)\n"
"--\n\n"
"One fused Adam (decoupled=False) or AdamW step on the GPU over flat CUDA\n"
"buffers: param, exp_avg, exp_avg_sq float32; grad float32, bfloat16 or\n"
"float16, multiplied by grad_scale; copy_out (bfloat16, float16 or\n"
"float32) receives the updated parameters. step is a 1-element float32\n"
"tensor: the kernel adds 1 and uses it for the bias corrections. When\n"
"found_inf (1-element float32) is nonzero, nothing is changed, step\n"
"included. Launched on `stream` (a CUstream handle) without waiting.");

KEYWORD_FUNCTION(cuda_adam_step, adam_run, adam_step_sig)

PyDoc_STRVAR(cuda_multi_tensor_adam_doc,
"cuda_multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs,\n"
"                       copy_outs=None, *, step, found_inf=None, lr, beta1,\n"
"                       beta2, eps, weight_decay, decoupled=True,\n"
"                       grad_scale=1.0, stream=0)\n"
"--\n\n"
"cuda_adam_step over lists of tensors (equal lengths, tensor i of each\n"
"list the same size), up to 48 tensors per kernel launch; copy_outs may\n"
"hold None for tensors without a copy-out. One step count for all.");

KEYWORD_FUNCTION(cuda_multi_tensor_adam, adam_run, multi_adam_sig)

/* ---- norm, unscale ---------------------------------------------------- */

static zero_cuda_span *spans_of(const arg_set *set, Py_ssize_t count)
{
    zero_cuda_span *spans = PyMem_Calloc((size_t)count + 1, sizeof *spans);
    if (!spans) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Buffer *b = set->args[i].buf;
        spans[i] = (zero_cuda_span){b->data, b->dtype, b->numel};
    }
    return spans;
}

static PyObject *zero_C_cuda_norm_partials(PyObject *module, PyObject *arg)
{
    (void)module;
    PyObject *kept, **items;
    Py_ssize_t count;
    if (list_items(arg, "numels", &kept, &items, &count)) {
        Py_XDECREF(kept);
        return NULL;
    }
    long long total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        long long n = PyLong_AsLongLong(items[i]);
        if (n == -1 && PyErr_Occurred()) {
            Py_DECREF(kept);
            return NULL;
        }
        if (n < 0) {
            PyErr_Format(PyExc_ValueError, "numels[%zd] is negative: %lld",
                         i, n);
            Py_DECREF(kept);
            return NULL;
        }
        int64_t n64 = n;
        total += zero_cuda_norm_partials(&n64, 1);
    }
    Py_DECREF(kept);
    return PyLong_FromLongLong(total);
}

/* cuda_l2_norm and cuda_unscale_check: a list of tensors of any float
 * dtype, and a one-element float32 result (out, found_inf) whose device is
 * the call's. */
typedef struct {
    PyObject *tensors, *result, *partials;
    int squared;
    double scale;
    int64_t stream;
} span_call;

#define SPAN_TENSORS(flags)                                                  \
    ARG(span_call, tensors, "tensors", ARG_TENSORS, CHECK_NONE, flags, 0)
#define SPAN_RESULT(name)                                                    \
    ARG(span_call, result, name, ARG_TENSOR, CHECK_NONE,                     \
        ARG_WRITTEN | ARG_SCALAR, 0)

static const arg_spec norm_args[] = {
    SPAN_TENSORS(0),
    SPAN_RESULT("out"),
    ARG(span_call, partials, "partials", ARG_TENSOR, CHECK_NONE,
        ARG_WRITTEN | ARG_FLOAT32, 0),
    ARG(span_call, squared, "squared", ARG_BOOL, CHECK_NONE, 0, 0),
    STREAM(span_call),
};
static const signature norm_sig =
    SIGNATURE("cuda_l2_norm", norm_args, 3, 3, span_call);

static const arg_spec unscale_args[] = {
    SPAN_TENSORS(ARG_WRITTEN),
    SPAN_RESULT("found_inf"),
    ARG(span_call, scale, "scale", ARG_DOUBLE, CHECK_FINITE, ARG_REQUIRED, 0),
    STREAM(span_call),
};
static const signature unscale_sig =
    SIGNATURE("cuda_unscale_check", unscale_args, 2, 2, span_call);

/* The norm's scratch buffer holds a partial sum per chunk of the tensors. */
static int check_partials(const cuda_arg *partials,
                          const zero_cuda_span *spans, Py_ssize_t count)
{
    int64_t needed = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        needed += zero_cuda_norm_partials(&spans[i].n, 1);
    }
    if (partials->buf->numel < needed) {
        PyErr_Format(PyExc_ValueError,
                     "partials has %lld elements; these tensors need %lld "
                     "(cuda_norm_partials)",
                     (long long)partials->buf->numel, (long long)needed);
        return -1;
    }
    return 0;
}

static PyObject *span_run(PyObject *module, PyObject *args,
                          PyObject *kwargs, const signature *sig)
{
    int norm = sig == &norm_sig;
    span_call call;
    cuda_tensors t;
    PyObject *result = NULL;
    zero_cuda_span *spans = NULL;
    if (parse_cuda_args(module, sig, args, kwargs, &call, &t) ||
        !(spans = spans_of(&t.set, t.count)) ||
        (norm && check_partials(t.row[2], spans, t.count)) ||
        check_device_and_access(&t.set, t.row[1]) ||
        check_args_no_overlap(&t.set)) {
        goto done;
    }
    zero_cuda_where where = where_of(t.row[1], call.stream);
    float *out = t.row[1]->buf->data;
    float *partials = norm ? t.row[2]->buf->data : NULL;
    int count = (int)t.count;
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = norm ? zero_cuda_l2_norm(&where, spans, count, partials, out,
                                      call.squared)
                  : zero_cuda_unscale_check(&where, spans, count,
                                            (float)call.scale, out);
    Py_END_ALLOW_THREADS
    result = launched(status, sig->function);
done:
    PyMem_Free(spans);
    args_free(&t.set);
    return result;
}

PyDoc_STRVAR(cuda_l2_norm_doc,
"cuda_l2_norm(tensors, out, partials, *, squared=False, stream=0)\n--\n\n"
"out[0] = the L2 norm of all elements of the CUDA tensors (float32,\n"
"bfloat16, float16), or its square when squared. Deterministic: the same\n"
"bits on every call. partials is a float32 scratch buffer of at least\n"
"cuda_norm_partials([t.numel() for t in tensors]) elements.");

KEYWORD_FUNCTION(cuda_l2_norm, span_run, norm_sig)

PyDoc_STRVAR(cuda_unscale_check_doc,
"cuda_unscale_check(tensors, found_inf, *, scale, stream=0)\n--\n\n"
"Multiply every element of the CUDA tensors by scale in place (scale 1:\n"
"check only) and set found_inf[0] = 1.0 when a result is inf or nan.\n"
"found_inf (1-element float32) is never cleared here: zero it first.");

KEYWORD_FUNCTION(cuda_unscale_check, span_run, unscale_sig)

/* ---- pack, unpack ---------------------------------------------------- */

typedef struct {
    PyObject *tensors, *bucket, *offsets;
    double scale;
    int64_t stream;
} bucket_call;

/* Rows of pack's and unpack's tables. */
#define BUCKET_TENSORS(flags)                                                \
    ARG(bucket_call, tensors, "tensors", ARG_TENSORS, CHECK_NONE, flags, 0)
#define BUCKET(flags)                                                        \
    ARG(bucket_call, bucket, "bucket", ARG_TENSOR, CHECK_NONE, flags, 0)
#define OFFSETS                                                              \
    ARG(bucket_call, offsets, "offsets", ARG_OBJECT, CHECK_NONE, 0, 0)

static const arg_spec pack_args[] = {
    BUCKET_TENSORS(0),
    BUCKET(ARG_WRITTEN),
    OFFSETS,
    ARG(bucket_call, scale, "scale", ARG_DOUBLE, CHECK_FINITE, 0, 1.0),
    STREAM(bucket_call),
};
static const signature pack_sig =
    SIGNATURE("cuda_pack", pack_args, 2, 2, bucket_call);

static const arg_spec unpack_args[] = {
    BUCKET(0),
    BUCKET_TENSORS(ARG_WRITTEN),
    OFFSETS,
    STREAM(bucket_call),
};
static const signature unpack_sig =
    SIGNATURE("cuda_unpack", unpack_args, 2, 2, bucket_call);

/* Pack (tensors -> bucket slices) or unpack (bucket slices -> tensors). */
static PyObject *bucket_copy(PyObject *module, PyObject *args,
                             PyObject *kwargs, const signature *sig)
{
    int pack = sig == &pack_sig;
    bucket_call call;
    cuda_tensors t;
    PyObject *result = NULL;
    int64_t *offsets = NULL;
    extent *extents = NULL;
    zero_cuda_copy *copies = NULL;
    Py_ssize_t count = 0;
    cuda_arg *bucket = NULL;
    if (parse_cuda_args(module, sig, args, kwargs, &call, &t)) {
        goto done;
    }
    if (!pack) {
        call.scale = 1.0; /* unpack has no scale */
    }
    count = t.count;
    bucket = t.row[pack ? 1 : 0];
    if (check_device_and_access(&t.set, bucket)) {
        goto done;
    }
    offsets = PyMem_Calloc((size_t)count + 1, sizeof *offsets);
    extents = PyMem_Calloc(2 * (size_t)count + 1, sizeof *extents);
    copies = PyMem_Calloc((size_t)count + 1, sizeof *copies);
    if (!offsets || !extents || !copies) {
        PyErr_NoMemory();
        goto done;
    }
    if (bucket_offsets(call.offsets, &t.set, count, bucket->buf, offsets)) {
        goto done;
    }
    Py_ssize_t n = extents_of_args(&t.set, bucket, extents);
    for (Py_ssize_t i = 0; i < count; i++) {
        const Buffer *x = t.set.args[i].buf, *b = bucket->buf;
        extent_of(&extents[n], b, offsets[i], x->numel, pack);
        snprintf(extents[n].name, sizeof extents[n].name,
                 "bucket[%lld:%lld] (tensors[%zd])", (long long)offsets[i],
                 (long long)(offsets[i] + x->numel), i);
        n++;
        void *slice = (char *)b->data + offsets[i] * zero_dtype_size(b->dtype);
        copies[i] = pack ? (zero_cuda_copy){slice, x->data, b->dtype,
                                            x->dtype, x->numel}
                         : (zero_cuda_copy){x->data, slice, x->dtype,
                                            b->dtype, x->numel};
    }
    if (check_no_overlap(extents, n)) {
        goto done;
    }
    zero_cuda_where where = where_of(bucket, call.stream);
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_cuda_cast_copy(&where, copies, (int)count,
                                 (float)call.scale);
    Py_END_ALLOW_THREADS
    result = launched(status, sig->function);
done:
    PyMem_Free(offsets);
    PyMem_Free(extents);
    PyMem_Free(copies);
    args_free(&t.set);
    return result;
}

PyDoc_STRVAR(cuda_pack_doc,
"cuda_pack(tensors, bucket, *, offsets=None, scale=1.0, stream=0)\n--\n\n"
"Copy each CUDA tensor, times scale and cast to the bucket's dtype, into\n"
"bucket[offsets[i]:offsets[i] + numel] (offsets None: back to back).");

KEYWORD_FUNCTION(cuda_pack, bucket_copy, pack_sig)

PyDoc_STRVAR(cuda_unpack_doc,
"cuda_unpack(bucket, tensors, *, offsets=None, stream=0)\n--\n\n"
"Copy bucket[offsets[i]:offsets[i] + numel], cast to each tensor's dtype,\n"
"into the CUDA tensors (offsets None: back to back).");

KEYWORD_FUNCTION(cuda_unpack, bucket_copy, unpack_sig)

/* ---- registration ---------------------------------------------------- */

static PyMethodDef cuda_methods[] = {
    {"cuda_available", zero_C_cuda_available, METH_NOARGS,
     "cuda_available() -> bool\n--\n\nWhether the CUDA kernels can run here "
     "(cuda_info()['reason'] says why not). Loads the driver on first use; "
     "creates no CUDA context."},
    {"cuda_info", zero_C_cuda_info, METH_NOARGS,
     "cuda_info() -> dict\n--\n\navailable, reason (None when available), "
     "fatbin_bytes, archs, build (how the kernels were built) and "
     "driver_version (None until the driver is loaded)."},
    KEYWORD_METHOD(cuda_adam_step),
    KEYWORD_METHOD(cuda_multi_tensor_adam),
    {"cuda_norm_partials", zero_C_cuda_norm_partials, METH_O,
     "cuda_norm_partials(numels) -> int\n--\n\nElements of the partials "
     "buffer cuda_l2_norm needs for tensors of these sizes."},
    KEYWORD_METHOD(cuda_l2_norm),
    KEYWORD_METHOD(cuda_unscale_check),
    KEYWORD_METHOD(cuda_pack),
    KEYWORD_METHOD(cuda_unpack),
    {NULL, NULL, 0, NULL},
};

int add_cuda_functions(PyObject *module)
{
    zero_cuda_image image = {zero_fatbin, zero_fatbin_size, zero_fatbin_archs,
                             zero_fatbin_note};
    zero_cuda_set_image(&image);
    return PyModule_AddFunctions(module, cuda_methods);
}
