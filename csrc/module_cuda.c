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

/* ---- scalars and errors ---------------------------------------------- */

static int check_stream(long long stream)
{
    if (stream < 0) {
        PyErr_Format(PyExc_ValueError,
                     "stream must be a CUstream handle, an int >= 0 "
                     "(torch.cuda.current_stream(device).cuda_stream), "
                     "got %lld",
                     stream);
        return -1;
    }
    return 0;
}

static zero_cuda_where where_of(const cuda_arg *ref, long long stream)
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

/* The lists of an Adam call: params, grads, exp_avgs, exp_avg_sqs,
 * copy_outs. For cuda_adam_step each is a 1-tuple, named without index. */
enum { A_PARAM, A_GRAD, A_EXP_AVG, A_EXP_AVG_SQ, A_COPY_OUT, A_LISTS };

typedef struct {
    PyObject *lists[A_LISTS];     /* copy_outs may be NULL */
    const char *names[A_LISTS];
    int single;
    PyObject *step, *found_inf;
    zero_adam_hparams hp;
    long long stream;
} adam_request;

static int check_adam_hparams(const zero_adam_hparams *hp)
{
    return check_nonnegative("lr", hp->lr) || check_beta("beta1", hp->beta1) ||
                   check_beta("beta2", hp->beta2) ||
                   check_nonnegative("eps", hp->eps) ||
                   check_nonnegative("weight_decay", hp->weight_decay) ||
                   check_finite("grad_scale", hp->grad_scale)
               ? -1
               : 0;
}

/* args: [count tensors of each list, in list order] + step + found_inf. */
static int check_adam_args(const arg_set *set, Py_ssize_t count)
{
    const cuda_arg *step = &set->args[A_LISTS * count];
    if (check_scalar_tensor(step) || check_scalar_tensor(step + 1)) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        const cuda_arg *param = &set->args[A_PARAM * count + i];
        for (int list = 0; list < A_LISTS; list++) {
            const cuda_arg *a = &set->args[list * count + i];
            int any_float = list == A_GRAD || list == A_COPY_OUT;
            if ((!any_float && check_float32(a)) ||
                check_numel_like(a, param)) {
                return -1;
            }
        }
    }
    return check_device_and_access(set, step) ||
                   check_args_no_overlap(set)
               ? -1
               : 0;
}

static PyObject *adam_run(PyObject *module, adam_request *r,
                          const char *what)
{
    if (check_adam_hparams(&r->hp) || check_stream(r->stream)) {
        return NULL;
    }
    PyObject **items[A_LISTS] = {NULL};
    Py_ssize_t counts[A_LISTS] = {0};
    for (int list = 0; list < A_LISTS; list++) {
        if (r->lists[list] && r->lists[list] != Py_None &&
            list_items(r->lists[list], r->names[list], &items[list],
                       &counts[list])) {
            return NULL;
        }
    }
    Py_ssize_t count = counts[A_PARAM];
    for (int list = 1; list < A_LISTS; list++) {
        int absent_copies = list == A_COPY_OUT && !items[list];
        if (!absent_copies && check_lengths(r->names[list], counts[list],
                                            r->names[A_PARAM], count)) {
            return NULL;
        }
    }
    arg_set set;
    if (args_alloc(&set, A_LISTS * count + 2) != 0) {
        return NULL;
    }
    PyObject *result = NULL;
    zero_cuda_adam_tensor *tensors = NULL;
    for (int list = 0; list < A_LISTS; list++) {
        cuda_arg *first = &set.args[list * count];
        int written = list != A_GRAD;
        int optional = list == A_COPY_OUT;
        if (!items[list]) {
            for (Py_ssize_t i = 0; i < count; i++) {
                first[i].name = r->names[list];
                first[i].index = r->single ? -1 : i;
            }
        } else if (take_list(module, first, r->names[list], items[list],
                             count, written, optional, !r->single)) {
            goto done;
        }
    }
    cuda_arg *step = &set.args[A_LISTS * count];
    if (take_arg(module, step, "step", -1, r->step, 1, 0) ||
        take_arg(module, step + 1, "found_inf", -1, r->found_inf, 0, 1) ||
        check_adam_args(&set, count)) {
        goto done;
    }
    tensors = PyMem_Calloc((size_t)count + 1, sizeof *tensors);
    if (!tensors) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Buffer *copy = set.args[A_COPY_OUT * count + i].buf;
        Buffer *grad = set.args[A_GRAD * count + i].buf;
        zero_cuda_adam_tensor *t = &tensors[i];
        t->param = set.args[A_PARAM * count + i].buf->data;
        t->grad = grad->data;
        t->grad_dtype = grad->dtype;
        t->exp_avg = set.args[A_EXP_AVG * count + i].buf->data;
        t->exp_avg_sq = set.args[A_EXP_AVG_SQ * count + i].buf->data;
        t->copy_out = copy ? copy->data : NULL;
        t->copy_dtype = copy ? copy->dtype : ZERO_F32;
        t->n = grad->numel;
    }
    zero_cuda_where where = where_of(step, r->stream);
    float *step_data = step->buf->data;
    const float *found_inf = step[1].buf ? step[1].buf->data : NULL;
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_cuda_adam_step(&where, tensors, (int)count, &r->hp,
                                 step_data, found_inf);
    Py_END_ALLOW_THREADS
    result = launched(status, what);
done:
    PyMem_Free(tensors);
    args_free(&set);
    return result;
}

#define ADAM_KEYWORDS                                                        \
    "step", "found_inf", "lr", "beta1", "beta2", "eps", "weight_decay",      \
        "decoupled", "grad_scale", "stream", NULL
#define ADAM_FORMAT "|O$OOdddddpdL"

static int adam_require(const char *what, const adam_request *r)
{
    const zero_adam_hparams *hp = &r->hp;
    return require(what, "step", r->step == NULL) ||
           require(what, "lr", hp->lr == MISSING) ||
           require(what, "beta1", hp->beta1 == MISSING) ||
           require(what, "beta2", hp->beta2 == MISSING) ||
           require(what, "eps", hp->eps == MISSING) ||
           require(what, "weight_decay", hp->weight_decay == MISSING);
}

static void adam_request_init(adam_request *r)
{
    memset(r, 0, sizeof *r);
    zero_adam_hparams hp = {MISSING, MISSING, MISSING, MISSING, MISSING,
                            1, 0, 1, 1.0};
    r->hp = hp;
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

static PyObject *zero_C_cuda_adam_step(PyObject *module, PyObject *args,
                                       PyObject *kwargs)
{
    static char *keywords[] = {"param", "grad", "exp_avg", "exp_avg_sq",
                               "copy_out", ADAM_KEYWORDS};
    adam_request r;
    adam_request_init(&r);
    PyObject *tensors[A_LISTS] = {NULL};
    zero_adam_hparams *hp = &r.hp;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "OOOO" ADAM_FORMAT ":cuda_adam_step", keywords,
            &tensors[0], &tensors[1], &tensors[2], &tensors[3], &tensors[4],
            &r.step, &r.found_inf, &hp->lr, &hp->beta1, &hp->beta2, &hp->eps,
            &hp->weight_decay, &hp->decoupled, &hp->grad_scale, &r.stream)) {
        return NULL;
    }
    if (adam_require("cuda_adam_step", &r)) {
        return NULL;
    }
    static const char *names[A_LISTS] = {"param", "grad", "exp_avg",
                                         "exp_avg_sq", "copy_out"};
    PyObject *result = NULL;
    r.single = 1;
    for (int list = 0; list < A_LISTS; list++) {
        r.names[list] = names[list];
        r.lists[list] = PyTuple_Pack(1, tensors[list] ? tensors[list]
                                                      : Py_None);
        if (!r.lists[list]) {
            goto done;
        }
    }
    result = adam_run(module, &r, "cuda_adam_step");
done:
    for (int list = 0; list < A_LISTS; list++) {
        Py_XDECREF(r.lists[list]);
    }
    return result;
}

PyDoc_STRVAR(cuda_multi_tensor_adam_doc,
"cuda_multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs,\n"
"                       copy_outs=None, *, step, found_inf=None, lr, beta1,\n"
"                       beta2, eps, weight_decay, decoupled=True,\n"
"                       grad_scale=1.0, stream=0)\n"
"--\n\n"
"cuda_adam_step over lists of tensors (equal lengths, tensor i of each\n"
"list the same size), up to 48 tensors per kernel launch; copy_outs may\n"
"hold None for tensors without a copy-out. One step count for all.");

static PyObject *zero_C_cuda_multi_tensor_adam(PyObject *module,
                                               PyObject *args,
                                               PyObject *kwargs)
{
    static char *keywords[] = {"params", "grads", "exp_avgs", "exp_avg_sqs",
                               "copy_outs", ADAM_KEYWORDS};
    adam_request r;
    adam_request_init(&r);
    zero_adam_hparams *hp = &r.hp;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "OOOO" ADAM_FORMAT ":cuda_multi_tensor_adam",
            keywords, &r.lists[0], &r.lists[1], &r.lists[2], &r.lists[3],
            &r.lists[4], &r.step, &r.found_inf, &hp->lr, &hp->beta1,
            &hp->beta2, &hp->eps, &hp->weight_decay, &hp->decoupled,
            &hp->grad_scale, &r.stream)) {
        return NULL;
    }
    if (adam_require("cuda_multi_tensor_adam", &r)) {
        return NULL;
    }
    static const char *names[A_LISTS] = {"params", "grads", "exp_avgs",
                                         "exp_avg_sqs", "copy_outs"};
    memcpy(r.names, names, sizeof names);
    return adam_run(module, &r, "cuda_multi_tensor_adam");
}

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
    PyObject **items;
    Py_ssize_t count;
    if (list_items(arg, "numels", &items, &count)) {
        return NULL;
    }
    long long total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        long long n = PyLong_AsLongLong(items[i]);
        if (n == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (n < 0) {
            PyErr_Format(PyExc_ValueError, "numels[%zd] is negative: %lld",
                         i, n);
            return NULL;
        }
        int64_t n64 = n;
        total += zero_cuda_norm_partials(&n64, 1);
    }
    return PyLong_FromLongLong(total);
}

PyDoc_STRVAR(cuda_l2_norm_doc,
"cuda_l2_norm(tensors, out, partials, *, squared=False, stream=0)\n--\n\n"
"out[0] = the L2 norm of all elements of the CUDA tensors (float32,\n"
"bfloat16, float16), or its square when squared. Deterministic: the same\n"
"bits on every call. partials is a float32 scratch buffer of at least\n"
"cuda_norm_partials([t.numel() for t in tensors]) elements.");

static PyObject *zero_C_cuda_l2_norm(PyObject *module, PyObject *args,
                                     PyObject *kwargs)
{
    static char *keywords[] = {"tensors", "out", "partials", "squared",
                               "stream", NULL};
    PyObject *list, *out_obj, *partials_obj;
    int squared = 0;
    long long stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|$pL:cuda_l2_norm",
                                     keywords, &list, &out_obj,
                                     &partials_obj, &squared, &stream) ||
        check_stream(stream)) {
        return NULL;
    }
    arg_set set;
    PyObject *result = NULL;
    zero_cuda_span *spans = NULL;
    if (take_tensor_list(module, &set, list, "tensors", 0, 2)) {
        goto done;
    }
    Py_ssize_t count = set.count - 2;
    cuda_arg *out = &set.args[count], *partials = out + 1;
    if (take_arg(module, out, "out", -1, out_obj, 1, 0) ||
        take_arg(module, partials, "partials", -1, partials_obj, 1, 0) ||
        check_scalar_tensor(out) || check_float32(partials)) {
        goto done;
    }
    spans = spans_of(&set, count);
    if (!spans) {
        goto done;
    }
    int64_t needed = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        needed += zero_cuda_norm_partials(&spans[i].n, 1);
    }
    if (partials->buf->numel < needed) {
        PyErr_Format(PyExc_ValueError,
                     "partials has %lld elements; these tensors need %lld "
                     "(cuda_norm_partials)",
                     (long long)partials->buf->numel, (long long)needed);
        goto done;
    }
    if (check_device_and_access(&set, out) || check_args_no_overlap(&set)) {
        goto done;
    }
    zero_cuda_where where = where_of(out, stream);
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_cuda_l2_norm(&where, spans, (int)count, partials->buf->data,
                               out->buf->data, squared);
    Py_END_ALLOW_THREADS
    result = launched(status, "cuda_l2_norm");
done:
    PyMem_Free(spans);
    args_free(&set);
    return result;
}

PyDoc_STRVAR(cuda_unscale_check_doc,
"cuda_unscale_check(tensors, found_inf, *, scale, stream=0)\n--\n\n"
"Multiply every element of the CUDA tensors by scale in place (scale 1:\n"
"check only) and set found_inf[0] = 1.0 when a result is inf or nan.\n"
"found_inf (1-element float32) is never cleared here: zero it first.");

static PyObject *zero_C_cuda_unscale_check(PyObject *module, PyObject *args,
                                           PyObject *kwargs)
{
    static char *keywords[] = {"tensors", "found_inf", "scale", "stream",
                               NULL};
    PyObject *list, *flag_obj;
    double scale = MISSING;
    long long stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs,
                                     "OO|$dL:cuda_unscale_check", keywords,
                                     &list, &flag_obj, &scale, &stream) ||
        require("cuda_unscale_check", "scale", scale == MISSING) ||
        check_finite("scale", scale) || check_stream(stream)) {
        return NULL;
    }
    arg_set set;
    PyObject *result = NULL;
    zero_cuda_span *spans = NULL;
    if (take_tensor_list(module, &set, list, "tensors", 1, 1)) {
        goto done;
    }
    Py_ssize_t count = set.count - 1;
    cuda_arg *flag = &set.args[count];
    if (take_arg(module, flag, "found_inf", -1, flag_obj, 1, 0) ||
        check_scalar_tensor(flag) || check_device_and_access(&set, flag) ||
        check_args_no_overlap(&set)) {
        goto done;
    }
    spans = spans_of(&set, count);
    if (!spans) {
        goto done;
    }
    zero_cuda_where where = where_of(flag, stream);
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_cuda_unscale_check(&where, spans, (int)count, (float)scale,
                                     flag->buf->data);
    Py_END_ALLOW_THREADS
    result = launched(status, "cuda_unscale_check");
done:
    PyMem_Free(spans);
    args_free(&set);
    return result;
}

/* ---- pack, unpack ---------------------------------------------------- */

/* Where tensor i sits in the bucket: offsets[i], or back to back when
 * offsets is None. Checks that every slice lies inside the bucket. */
static int bucket_offsets(PyObject *offsets_obj, const arg_set *set,
                          Py_ssize_t count, const Buffer *bucket,
                          int64_t *offsets)
{
    PyObject **items = NULL;
    Py_ssize_t n = count;
    if (offsets_obj && offsets_obj != Py_None) {
        if (!PyList_Check(offsets_obj) && !PyTuple_Check(offsets_obj)) {
            PyErr_Format(PyExc_TypeError,
                         "offsets must be a list or tuple of ints, not "
                         "%.100s",
                         Py_TYPE(offsets_obj)->tp_name);
            return -1;
        }
        items = PySequence_Fast_ITEMS(offsets_obj);
        n = PySequence_Fast_GET_SIZE(offsets_obj);
        if (n != count) {
            PyErr_Format(PyExc_ValueError,
                         "offsets has %zd entries, tensors has %zd", n,
                         count);
            return -1;
        }
    }
    int64_t next = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t at = next;
        if (items) {
            at = PyLong_AsLongLong(items[i]);
            if (at == -1 && PyErr_Occurred()) {
                return -1;
            }
        }
        int64_t numel = set->args[i].buf->numel;
        if (at < 0 || at > bucket->numel || numel > bucket->numel - at) {
            PyErr_Format(PyExc_ValueError,
                         "tensors[%zd] (%lld elements) at offset %lld does "
                         "not fit in bucket (%lld elements)",
                         i, (long long)numel, (long long)at,
                         (long long)bucket->numel);
            return -1;
        }
        offsets[i] = at;
        next = at + numel;
    }
    return 0;
}

/* Pack (tensors -> bucket slices) or unpack (bucket slices -> tensors). */
static PyObject *bucket_copy(PyObject *module, PyObject *list,
                             PyObject *bucket_obj, PyObject *offsets_obj,
                             double scale, long long stream, int pack)
{
    const char *what = pack ? "cuda_pack" : "cuda_unpack";
    if (check_finite("scale", scale) || check_stream(stream)) {
        return NULL;
    }
    arg_set set;
    PyObject *result = NULL;
    int64_t *offsets = NULL;
    extent *extents = NULL;
    zero_cuda_copy *copies = NULL;
    if (take_tensor_list(module, &set, list, "tensors", !pack, 1)) {
        goto done;
    }
    Py_ssize_t count = set.count - 1;
    cuda_arg *bucket = &set.args[count];
    if (take_arg(module, bucket, "bucket", -1, bucket_obj, pack, 0) ||
        check_device_and_access(&set, bucket)) {
        goto done;
    }
    offsets = PyMem_Calloc((size_t)count + 1, sizeof *offsets);
    extents = PyMem_Calloc(2 * (size_t)count + 1, sizeof *extents);
    copies = PyMem_Calloc((size_t)count + 1, sizeof *copies);
    if (!offsets || !extents || !copies) {
        PyErr_NoMemory();
        goto done;
    }
    if (bucket_offsets(offsets_obj, &set, count, bucket->buf, offsets)) {
        goto done;
    }
    Py_ssize_t n = extents_of_args(&set, bucket, extents);
    for (Py_ssize_t i = 0; i < count; i++) {
        const Buffer *t = set.args[i].buf, *b = bucket->buf;
        extent_of(&extents[n], b, offsets[i], t->numel, pack);
        snprintf(extents[n].name, sizeof extents[n].name,
                 "bucket[%lld:%lld] (tensors[%zd])", (long long)offsets[i],
                 (long long)(offsets[i] + t->numel), i);
        n++;
        void *slice = (char *)b->data + offsets[i] * zero_dtype_size(b->dtype);
        copies[i] = pack ? (zero_cuda_copy){slice, t->data, b->dtype,
                                            t->dtype, t->numel}
                         : (zero_cuda_copy){t->data, slice, t->dtype,
                                            b->dtype, t->numel};
    }
    if (check_no_overlap(extents, n)) {
        goto done;
    }
    zero_cuda_where where = where_of(bucket, stream);
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_cuda_cast_copy(&where, copies, (int)count, (float)scale);
    Py_END_ALLOW_THREADS
    result = launched(status, what);
done:
    PyMem_Free(offsets);
    PyMem_Free(extents);
    PyMem_Free(copies);
    args_free(&set);
    return result;
}

PyDoc_STRVAR(cuda_pack_doc,
"cuda_pack(tensors, bucket, *, offsets=None, scale=1.0, stream=0)\n--\n\n"
"Copy each CUDA tensor, times scale and cast to the bucket's dtype, into\n"
"bucket[offsets[i]:offsets[i] + numel] (offsets None: back to back).");

static PyObject *zero_C_cuda_pack(PyObject *module, PyObject *args,
                                  PyObject *kwargs)
{
    static char *keywords[] = {"tensors", "bucket", "offsets", "scale",
                               "stream", NULL};
    PyObject *list, *bucket, *offsets = NULL;
    double scale = 1.0;
    long long stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|$OdL:cuda_pack",
                                     keywords, &list, &bucket, &offsets,
                                     &scale, &stream)) {
        return NULL;
    }
    return bucket_copy(module, list, bucket, offsets, scale, stream, 1);
}

PyDoc_STRVAR(cuda_unpack_doc,
"cuda_unpack(bucket, tensors, *, offsets=None, stream=0)\n--\n\n"
"Copy bucket[offsets[i]:offsets[i] + numel], cast to each tensor's dtype,\n"
"into the CUDA tensors (offsets None: back to back).");

static PyObject *zero_C_cuda_unpack(PyObject *module, PyObject *args,
                                    PyObject *kwargs)
{
    static char *keywords[] = {"bucket", "tensors", "offsets", "stream",
                               NULL};
    PyObject *list, *bucket, *offsets = NULL;
    long long stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|$OL:cuda_unpack",
                                     keywords, &bucket, &list, &offsets,
                                     &stream)) {
        return NULL;
    }
    return bucket_copy(module, list, bucket, offsets, 1.0, stream, 0);
}

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
    {"cuda_adam_step", (PyCFunction)(void (*)(void))zero_C_cuda_adam_step,
     METH_VARARGS | METH_KEYWORDS, cuda_adam_step_doc},
    {"cuda_multi_tensor_adam",
     (PyCFunction)(void (*)(void))zero_C_cuda_multi_tensor_adam,
     METH_VARARGS | METH_KEYWORDS, cuda_multi_tensor_adam_doc},
    {"cuda_norm_partials", zero_C_cuda_norm_partials, METH_O,
     "cuda_norm_partials(numels) -> int\n--\n\nElements of the partials "
     "buffer cuda_l2_norm needs for tensors of these sizes."},
    {"cuda_l2_norm", (PyCFunction)(void (*)(void))zero_C_cuda_l2_norm,
     METH_VARARGS | METH_KEYWORDS, cuda_l2_norm_doc},
    {"cuda_unscale_check",
     (PyCFunction)(void (*)(void))zero_C_cuda_unscale_check,
     METH_VARARGS | METH_KEYWORDS, cuda_unscale_check_doc},
    {"cuda_pack", (PyCFunction)(void (*)(void))zero_C_cuda_pack,
     METH_VARARGS | METH_KEYWORDS, cuda_pack_doc},
    {"cuda_unpack", (PyCFunction)(void (*)(void))zero_C_cuda_unpack,
     METH_VARARGS | METH_KEYWORDS, cuda_unpack_doc},
    {NULL, NULL, 0, NULL},
};

int add_cuda_functions(PyObject *module)
{
    zero_cuda_image image = {zero_fatbin, zero_fatbin_size, zero_fatbin_archs,
                             zero_fatbin_note};
    zero_cuda_set_image(&image);
    return PyModule_AddFunctions(module, cuda_methods);
}
