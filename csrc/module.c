/* module.c: the CPython binding of the CPU core, zero._C, and the module
 * itself. With module_buffer.c (Buffer, argument checks) and
 * module_cuda*.c (the CUDA kernels) it is one of the binding files, the only
 * files that include Python.h.
 *
 * Tensors arrive as DLPack capsules (or objects with __dlpack__) and are
 * held by a Buffer (module.h). Every argument from Python is validated here,
 * with a message that names it, before the core sees it; the GIL is
 * released around the core call.
 */
#include "module.h"

#include <math.h>
#include <string.h>

/* Resolve [start, stop) against n; stop < 0 means n. */
static int check_range(int64_t n, long long start, long long *stop)
{
    if (*stop < 0) {
        *stop = n;
    }
    if (start < 0 || start > *stop || *stop > n) {
        PyErr_Format(PyExc_ValueError,
                     "start=%lld, stop=%lld is not a range within the %lld "
                     "elements",
                     start, *stop, (long long)n);
        return -1;
    }
    return 0;
}

/* A zero_flat over [start, stop) of the buffers. */
static zero_flat flat_range(Buffer *param, Buffer *grad, Buffer *copy_out,
                            long long start, long long stop)
{
    zero_flat f;
    f.param = (float *)param->data + start;
    f.grad = (const char *)grad->data + start * zero_dtype_size(grad->dtype);
    f.grad_dtype = grad->dtype;
    f.copy_out = copy_out ? (char *)copy_out->data +
                                start * zero_dtype_size(copy_out->dtype)
                          : NULL;
    f.copy_dtype = copy_out ? copy_out->dtype : ZERO_F32;
    f.n = stop - start;
    return f;
}

static float *state_at(Buffer *b, long long start)
{
    return b ? (float *)b->data + start : NULL;
}

/* Validate dtypes and sizes of an optimizer call's buffers: bufs[0] is the
 * param, bufs[1] the grad, the last the copy-out; the rest are states. */
static int check_optim_buffers(named_buffer *bufs, int count)
{
    for (int i = 0; i < count; i++) {
        if (!bufs[i].buf) {
            continue;
        }
        int half_ok = i == 1 || i == count - 1;
        if (check_dtype(&bufs[i], half_ok) != 0) {
            return -1;
        }
    }
    return check_together(bufs, count);
}

/* ---- optimizer functions ----------------------------------------------- */

PyDoc_STRVAR(adam_step_doc,
"adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq=None,\n"
"          copy_out=None, *, lr, beta1, beta2, eps, weight_decay, step,\n"
"          decoupled=True, amsgrad=False, grad_scale=1.0, start=0, stop=-1)\n"
"--\n\n"
"One Adam (decoupled=False) or AdamW step over [start, stop) of flat\n"
"buffers, in place. grad may be float32, bfloat16 or float16 and is\n"
"multiplied by grad_scale; copy_out, when given, receives the updated\n"
"parameters cast with round-to-nearest-even.");

static PyObject *zero_C_adam_step(PyObject *module, PyObject *args,
                                  PyObject *kwargs)
{
    static char *keywords[] = {"param", "grad", "exp_avg", "exp_avg_sq",
                               "max_exp_avg_sq", "copy_out", "lr", "beta1",
                               "beta2", "eps", "weight_decay", "step",
                               "decoupled", "amsgrad", "grad_scale", "start",
                               "stop", NULL};
    PyObject *objs[6] = {NULL};
    double lr = MISSING, beta1 = MISSING, beta2 = MISSING, eps = MISSING,
           weight_decay = MISSING, grad_scale = 1.0;
    long long step = MISSING_INT, start = 0, stop = -1;
    int decoupled = 1, amsgrad = 0;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "OOOO|OO$dddddLppdLL:adam_step", keywords, &objs[0],
            &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &lr, &beta1,
            &beta2, &eps, &weight_decay, &step, &decoupled, &amsgrad,
            &grad_scale, &start, &stop)) {
        return NULL;
    }
    if (require("adam_step", "lr", lr == MISSING) ||
        require("adam_step", "beta1", beta1 == MISSING) ||
        require("adam_step", "beta2", beta2 == MISSING) ||
        require("adam_step", "eps", eps == MISSING) ||
        require("adam_step", "weight_decay", weight_decay == MISSING) ||
        require("adam_step", "step", step == MISSING_INT)) {
        return NULL;
    }
    if (check_nonnegative("lr", lr) || check_beta("beta1", beta1) ||
        check_beta("beta2", beta2) || check_nonnegative("eps", eps) ||
        check_nonnegative("weight_decay", weight_decay) ||
        check_finite("grad_scale", grad_scale)) {
        return NULL;
    }
    if (step < 1) {
        PyErr_Format(PyExc_ValueError, "step must be >= 1, got %lld", step);
        return NULL;
    }
    if (amsgrad && (!objs[4] || objs[4] == Py_None)) {
        PyErr_SetString(PyExc_ValueError,
                        "amsgrad=True needs the max_exp_avg_sq buffer");
        return NULL;
    }
    named_buffer bufs[6] = {{"param", NULL, 1},      {"grad", NULL, 0},
                            {"exp_avg", NULL, 1},    {"exp_avg_sq", NULL, 1},
                            {"max_exp_avg_sq", NULL, 1},
                            {"copy_out", NULL, 1}};
    if (collect_buffers(module, bufs, objs, 6) != 0) {
        return NULL;
    }
    PyObject *result = NULL;
    if (check_optim_buffers(bufs, 6) != 0 ||
        check_range(bufs[0].buf->numel, start, &stop) != 0) {
        goto done;
    }
    zero_flat flat = flat_range(bufs[0].buf, bufs[1].buf, bufs[5].buf, start,
                                stop);
    zero_adam_state state = {state_at(bufs[2].buf, start),
                             state_at(bufs[3].buf, start),
                             amsgrad ? state_at(bufs[4].buf, start) : NULL};
    zero_adam_hparams hp = {lr, beta1, beta2, eps, weight_decay, decoupled,
                            amsgrad, step, grad_scale};
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_adam_step(&flat, &state, &hp);
    Py_END_ALLOW_THREADS
    if (status != ZERO_OK) {
        raise_status(status, "adam_step");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release_buffers(bufs, 6);
    return result;
}

PyDoc_STRVAR(sgd_step_doc,
"sgd_step(param, grad, momentum_buffer=None, copy_out=None, *, lr,\n"
"         momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,\n"
"         first_step=False, grad_scale=1.0, start=0, stop=-1)\n"
"--\n\n"
"One SGD step in place. With momentum, first_step=True starts the\n"
"momentum buffer as the gradient, as torch.optim.SGD does.");

static PyObject *zero_C_sgd_step(PyObject *module, PyObject *args,
                                 PyObject *kwargs)
{
    static char *keywords[] = {"param", "grad", "momentum_buffer", "copy_out",
                               "lr", "momentum", "dampening", "weight_decay",
                               "nesterov", "first_step", "grad_scale",
                               "start", "stop", NULL};
    PyObject *objs[4] = {NULL};
    double lr = MISSING, momentum = 0.0, dampening = 0.0,
           weight_decay = 0.0, grad_scale = 1.0;
    int nesterov = 0, first_step = 0;
    long long start = 0, stop = -1;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "OO|OO$ddddppdLL:sgd_step", keywords, &objs[0],
            &objs[1], &objs[2], &objs[3], &lr, &momentum, &dampening,
            &weight_decay, &nesterov, &first_step, &grad_scale, &start,
            &stop)) {
        return NULL;
    }
    if (require("sgd_step", "lr", lr == MISSING)) {
        return NULL;
    }
    if (check_nonnegative("lr", lr) ||
        check_nonnegative("momentum", momentum) ||
        check_finite("dampening", dampening) ||
        check_nonnegative("weight_decay", weight_decay) ||
        check_finite("grad_scale", grad_scale)) {
        return NULL;
    }
    if (nesterov && (momentum <= 0.0 || dampening != 0.0)) {
        PyErr_SetString(PyExc_ValueError,
                        "nesterov=True needs momentum > 0 and dampening 0");
        return NULL;
    }
    if (momentum != 0.0 && (!objs[2] || objs[2] == Py_None)) {
        PyErr_SetString(PyExc_ValueError,
                        "momentum != 0 needs the momentum_buffer");
        return NULL;
    }
    named_buffer bufs[4] = {{"param", NULL, 1},
                            {"grad", NULL, 0},
                            {"momentum_buffer", NULL, 1},
                            {"copy_out", NULL, 1}};
    if (collect_buffers(module, bufs, objs, 4) != 0) {
        return NULL;
    }
    PyObject *result = NULL;
    if (check_optim_buffers(bufs, 4) != 0 ||
        check_range(bufs[0].buf->numel, start, &stop) != 0) {
        goto done;
    }
    zero_flat flat = flat_range(bufs[0].buf, bufs[1].buf, bufs[3].buf, start,
                                stop);
    zero_sgd_hparams hp = {lr, momentum, dampening, weight_decay, nesterov,
                           first_step, grad_scale};
    float *momentum_buffer = state_at(bufs[2].buf, start);
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_sgd_step(&flat, momentum_buffer, &hp);
    Py_END_ALLOW_THREADS
    if (status != ZERO_OK) {
        raise_status(status, "sgd_step");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release_buffers(bufs, 4);
    return result;
}

PyDoc_STRVAR(lion_step_doc,
"lion_step(param, grad, exp_avg, copy_out=None, *, lr, beta1, beta2,\n"
"          weight_decay=0.0, grad_scale=1.0, start=0, stop=-1)\n"
"--\n\n"
"One Lion step in place (Chen et al. 2023, decoupled weight decay).");

static PyObject *zero_C_lion_step(PyObject *module, PyObject *args,
                                  PyObject *kwargs)
{
    static char *keywords[] = {"param", "grad", "exp_avg", "copy_out", "lr",
                               "beta1", "beta2", "weight_decay",
                               "grad_scale", "start", "stop", NULL};
    PyObject *objs[4] = {NULL};
    double lr = MISSING, beta1 = MISSING, beta2 = MISSING,
           weight_decay = 0.0, grad_scale = 1.0;
    long long start = 0, stop = -1;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "OOO|O$dddddLL:lion_step", keywords, &objs[0],
            &objs[1], &objs[2], &objs[3], &lr, &beta1, &beta2, &weight_decay,
            &grad_scale, &start, &stop)) {
        return NULL;
    }
    if (require("lion_step", "lr", lr == MISSING) ||
        require("lion_step", "beta1", beta1 == MISSING) ||
        require("lion_step", "beta2", beta2 == MISSING)) {
        return NULL;
    }
    if (check_nonnegative("lr", lr) || check_beta("beta1", beta1) ||
        check_beta("beta2", beta2) ||
        check_nonnegative("weight_decay", weight_decay) ||
        check_finite("grad_scale", grad_scale)) {
        return NULL;
    }
    named_buffer bufs[4] = {{"param", NULL, 1},
                            {"grad", NULL, 0},
                            {"exp_avg", NULL, 1},
                            {"copy_out", NULL, 1}};
    if (collect_buffers(module, bufs, objs, 4) != 0) {
        return NULL;
    }
    PyObject *result = NULL;
    if (check_optim_buffers(bufs, 4) != 0 ||
        check_range(bufs[0].buf->numel, start, &stop) != 0) {
        goto done;
    }
    zero_flat flat = flat_range(bufs[0].buf, bufs[1].buf, bufs[3].buf, start,
                                stop);
    zero_lion_hparams hp = {lr, beta1, beta2, weight_decay, grad_scale};
    float *exp_avg = state_at(bufs[2].buf, start);
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_lion_step(&flat, exp_avg, &hp);
    Py_END_ALLOW_THREADS
    if (status != ZERO_OK) {
        raise_status(status, "lion_step");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release_buffers(bufs, 4);
    return result;
}

PyDoc_STRVAR(adagrad_step_doc,
"adagrad_step(param, grad, state_sum, copy_out=None, *, lr, lr_decay=0.0,\n"
"             weight_decay=0.0, eps=1e-10, step, grad_scale=1.0, start=0,\n"
"             stop=-1)\n"
"--\n\n"
"One Adagrad step in place, as torch.optim.Adagrad.");

static PyObject *zero_C_adagrad_step(PyObject *module, PyObject *args,
                                     PyObject *kwargs)
{
    static char *keywords[] = {"param", "grad", "state_sum", "copy_out",
                               "lr", "lr_decay", "weight_decay", "eps",
                               "step", "grad_scale", "start", "stop", NULL};
    PyObject *objs[4] = {NULL};
    double lr = MISSING, lr_decay = 0.0, weight_decay = 0.0, eps = 1e-10,
           grad_scale = 1.0;
    long long step = MISSING_INT, start = 0, stop = -1;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "OOO|O$ddddLdLL:adagrad_step", keywords, &objs[0],
            &objs[1], &objs[2], &objs[3], &lr, &lr_decay, &weight_decay, &eps,
            &step, &grad_scale, &start, &stop)) {
        return NULL;
    }
    if (require("adagrad_step", "lr", lr == MISSING) ||
        require("adagrad_step", "step", step == MISSING_INT)) {
        return NULL;
    }
    if (check_nonnegative("lr", lr) ||
        check_nonnegative("lr_decay", lr_decay) ||
        check_nonnegative("weight_decay", weight_decay) ||
        check_nonnegative("eps", eps) ||
        check_finite("grad_scale", grad_scale)) {
        return NULL;
    }
    if (step < 1) {
        PyErr_Format(PyExc_ValueError, "step must be >= 1, got %lld", step);
        return NULL;
    }
    named_buffer bufs[4] = {{"param", NULL, 1},
                            {"grad", NULL, 0},
                            {"state_sum", NULL, 1},
                            {"copy_out", NULL, 1}};
    if (collect_buffers(module, bufs, objs, 4) != 0) {
        return NULL;
    }
    PyObject *result = NULL;
    if (check_optim_buffers(bufs, 4) != 0 ||
        check_range(bufs[0].buf->numel, start, &stop) != 0) {
        goto done;
    }
    zero_flat flat = flat_range(bufs[0].buf, bufs[1].buf, bufs[3].buf, start,
                                stop);
    zero_adagrad_hparams hp = {lr, lr_decay, weight_decay, eps, step,
                               grad_scale};
    float *state_sum = state_at(bufs[2].buf, start);
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_adagrad_step(&flat, state_sum, &hp);
    Py_END_ALLOW_THREADS
    if (status != ZERO_OK) {
        raise_status(status, "adagrad_step");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release_buffers(bufs, 4);
    return result;
}

/* ---- reductions and conversions ---------------------------------------- */

PyDoc_STRVAR(sum_squares_doc,
"sum_squares(tensor) -> float\n--\n\n"
"Sum of squares of all elements, accumulated in double precision over\n"
"fixed blocks (the same result for any thread count). inf or nan when the\n"
"data holds one.");

static PyObject *zero_C_sum_squares(PyObject *module, PyObject *arg)
{
    Buffer *b = as_buffer(module, arg, "tensor");
    if (!b) {
        return NULL;
    }
    double sum = 0.0;
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_sum_squares(b->data, b->dtype, b->numel, &sum);
    Py_END_ALLOW_THREADS
    Py_DECREF(b);
    if (status != ZERO_OK) {
        return raise_status(status, "sum_squares");
    }
    return PyFloat_FromDouble(sum);
}

PyDoc_STRVAR(all_finite_doc,
"all_finite(tensor) -> bool\n--\n\n"
"True when no element is inf or nan.");

static PyObject *zero_C_all_finite(PyObject *module, PyObject *arg)
{
    Buffer *b = as_buffer(module, arg, "tensor");
    if (!b) {
        return NULL;
    }
    int finite = 1;
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_check_finite(b->data, b->dtype, b->numel, &finite);
    Py_END_ALLOW_THREADS
    Py_DECREF(b);
    if (status != ZERO_OK) {
        return raise_status(status, "all_finite");
    }
    return PyBool_FromLong(finite);
}

PyDoc_STRVAR(convert_doc,
"convert(dst, src)\n--\n\n"
"dst[i] = src[i] cast to dst's dtype (float32, bfloat16, float16);\n"
"narrowing rounds to nearest even.");

static PyObject *zero_C_convert(PyObject *module, PyObject *args)
{
    PyObject *objs[2];
    if (!PyArg_ParseTuple(args, "OO:convert", &objs[0], &objs[1])) {
        return NULL;
    }
    named_buffer bufs[2] = {{"dst", NULL, 1}, {"src", NULL, 0}};
    if (collect_buffers(module, bufs, objs, 2) != 0) {
        return NULL;
    }
    PyObject *result = NULL;
    if (check_together(bufs, 2) == 0) {
        Buffer *dst = bufs[0].buf, *src = bufs[1].buf;
        zero_status status;
        Py_BEGIN_ALLOW_THREADS
        status = zero_convert(dst->data, dst->dtype, src->data, src->dtype,
                              dst->numel);
        Py_END_ALLOW_THREADS
        result = status == ZERO_OK ? Py_NewRef(Py_None)
                                   : raise_status(status, "convert");
    }
    release_buffers(bufs, 2);
    return result;
}

PyDoc_STRVAR(stream_triad_doc,
"stream_triad(a, b, c, scalar)\n--\n\n"
"a[i] = b[i] + scalar * c[i] over float32 buffers (non-temporal stores),\n"
"or in place, a[i] = a[i] + scalar * c[i], when b is None: the memory-\n"
"bandwidth ceilings the benchmarks measure against.");

static PyObject *zero_C_stream_triad(PyObject *module, PyObject *args)
{
    PyObject *objs[3];
    double scalar;
    if (!PyArg_ParseTuple(args, "OOOd:stream_triad", &objs[0], &objs[1],
                          &objs[2], &scalar)) {
        return NULL;
    }
    named_buffer bufs[3] = {{"a", NULL, 1}, {"b", NULL, 0}, {"c", NULL, 0}};
    if (collect_buffers(module, bufs, objs, 3) != 0) {
        return NULL;
    }
    PyObject *result = NULL;
    int ok = 1;
    for (int i = 0; i < 3 && ok; i++) {
        ok = !bufs[i].buf || check_dtype(&bufs[i], 0) == 0;
    }
    /* check_together skips an absent b; a and c are always there */
    if (ok && bufs[0].buf && bufs[2].buf && check_together(bufs, 3) == 0) {
        const float *b = bufs[1].buf ? bufs[1].buf->data : NULL;
        zero_status status;
        Py_BEGIN_ALLOW_THREADS
        status = zero_stream_triad(bufs[0].buf->data, b, bufs[2].buf->data,
                                   (float)scalar, bufs[0].buf->numel);
        Py_END_ALLOW_THREADS
        result = status == ZERO_OK ? Py_NewRef(Py_None)
                                   : raise_status(status, "stream_triad");
    } else if (ok) {
        PyErr_SetString(PyExc_TypeError, "a and c are required");
    }
    release_buffers(bufs, 3);
    return result;
}

/* ---- CPU and threads --------------------------------------------------- */

static PyObject *zero_C_cpu_info(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    PyObject *available = PyList_New(0);
    if (!available) {
        return NULL;
    }
    for (int i = 0; i < ZERO_ISA_COUNT; i++) {
        if (zero_isa_supported((zero_isa)i)) {
            PyObject *name = PyUnicode_FromString(zero_isa_name((zero_isa)i));
            if (!name || PyList_Append(available, name) != 0) {
                Py_XDECREF(name);
                Py_DECREF(available);
                return NULL;
            }
            Py_DECREF(name);
        }
    }
    const char *env = getenv(ZERO_SIMD_ENV);
    return Py_BuildValue("{s:s,s:s,s:s,s:N,s:i,s:s,s:z}", "features",
                         zero_cpu_features(), "simd",
                         zero_isa_name(zero_isa_active()), "best",
                         zero_isa_name(zero_isa_best()), "available",
                         available, "threads", zero_threads_get(),
                         "simd_env_var", ZERO_SIMD_ENV, "simd_env", env);
}

PyDoc_STRVAR(set_simd_doc,
"set_simd(name) -> str\n--\n\n"
"Use the SIMD path `name` ('scalar', 'avx2', 'avx512') from now on;\n"
"returns the previous one. The ZERO_SIMD environment variable does the\n"
"same at import.");

static PyObject *zero_C_set_simd(PyObject *module, PyObject *arg)
{
    (void)module;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) {
        return NULL;
    }
    zero_isa isa;
    if (zero_isa_from_name(name, &isa) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "name must be 'scalar', 'avx2' or 'avx512', got %R", arg);
        return NULL;
    }
    zero_isa previous = zero_isa_active();
    if (zero_isa_set(isa) != ZERO_OK) {
        PyErr_Format(PyExc_ValueError,
                     "this CPU cannot run the %s path (features: %s)", name,
                     zero_cpu_features());
        return NULL;
    }
    return PyUnicode_FromString(zero_isa_name(previous));
}

static PyObject *zero_C_set_num_threads(PyObject *module, PyObject *arg)
{
    (void)module;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 0 || n > 4096) {
        PyErr_Format(PyExc_ValueError,
                     "n (the thread count) must be between 0 (all CPUs "
                     "this process may use) and 4096, got %ld",
                     n);
        return NULL;
    }
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_threads_set((int)n);
    Py_END_ALLOW_THREADS
    if (status != ZERO_OK) {
        return raise_status(status, "set_num_threads");
    }
    Py_RETURN_NONE;
}

static PyObject *zero_C_get_num_threads(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return PyLong_FromLong(zero_threads_get());
}

static PyMethodDef zero_C_methods[] = {
    {"adam_step", (PyCFunction)(void (*)(void))zero_C_adam_step,
     METH_VARARGS | METH_KEYWORDS, adam_step_doc},
    {"sgd_step", (PyCFunction)(void (*)(void))zero_C_sgd_step,
     METH_VARARGS | METH_KEYWORDS, sgd_step_doc},
    {"lion_step", (PyCFunction)(void (*)(void))zero_C_lion_step,
     METH_VARARGS | METH_KEYWORDS, lion_step_doc},
    {"adagrad_step", (PyCFunction)(void (*)(void))zero_C_adagrad_step,
     METH_VARARGS | METH_KEYWORDS, adagrad_step_doc},
    {"sum_squares", zero_C_sum_squares, METH_O, sum_squares_doc},
    {"all_finite", zero_C_all_finite, METH_O, all_finite_doc},
    {"convert", zero_C_convert, METH_VARARGS, convert_doc},
    {"stream_triad", zero_C_stream_triad, METH_VARARGS, stream_triad_doc},
    {"cpu_info", zero_C_cpu_info, METH_NOARGS,
     "cpu_info() -> dict\n--\n\nDetected CPU features and the SIMD path in "
     "use."},
    {"set_simd", zero_C_set_simd, METH_O, set_simd_doc},
    {"set_num_threads", zero_C_set_num_threads, METH_O,
     "set_num_threads(n)\n--\n\nThreads the core uses, the caller included; "
     "0 means every CPU this process may use."},
    {"get_num_threads", zero_C_get_num_threads, METH_NOARGS,
     "get_num_threads() -> int\n--\n\nThreads the core uses."},
    {NULL, NULL, 0, NULL},
};

static int zero_C_exec(PyObject *module)
{
    if (add_buffer_type(module) != 0 || add_cuda_functions(module) != 0) {
        return -1;
    }
    const char *bad_env = zero_isa_env_error();
    if (bad_env) {
        if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                             "%s=%s is not a SIMD path this CPU can run "
                             "(choose scalar, avx2 or avx512); using %s",
                             ZERO_SIMD_ENV, bad_env,
                             zero_isa_name(zero_isa_active())) != 0) {
            return -1;
        }
    }
    return 0;
}

static int zero_C_traverse(PyObject *module, visitproc visit, void *arg)
{
    Py_VISIT(get_state(module)->buffer_type);
    return 0;
}

static int zero_C_clear(PyObject *module)
{
    Py_CLEAR(get_state(module)->buffer_type);
    return 0;
}

static void zero_C_free(void *module)
{
    zero_C_clear((PyObject *)module);
}

static PyModuleDef_Slot zero_C_slots[] = {
    {Py_mod_exec, zero_C_exec},
    {0, NULL},
};

static struct PyModuleDef zero_C_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zero._C",
    .m_doc = "zero's C core: CPU optimizers, reductions, conversions.",
    .m_size = sizeof(module_state),
    .m_methods = zero_C_methods,
    .m_slots = zero_C_slots,
    .m_traverse = zero_C_traverse,
    .m_clear = zero_C_clear,
    .m_free = zero_C_free,
};

PyMODINIT_FUNC PyInit__C(void)
{
    return PyModuleDef_Init(&zero_C_module);
}
