/* module.c: the CPython binding of the CPU core's reductions, conversions,
 * SIMD and thread settings, and the module zero._C itself. With
 * module_buffer.c (Buffer, argument checks), module_args.c (keyword
 * arguments from a table), module_optim.c (the CPU optimizers),
 * module_aio.c (the disk I/O engine) and
 * module_cuda*.c (the CUDA kernels) it is one of the binding files, the only
 * files that include Python.h.
 *
 * Tensors arrive as DLPack capsules (or objects with __dlpack__) and are
 * held by a Buffer (module.h). Every argument from Python is validated here,
 * with a message that names it, before the core sees it; the GIL is
 * released around the core call.
 */
#include "module.h"

#include <string.h>

#include <stdlib.h>

/* ---- reductions and conversions ---------------------------------------- */

/* sum_squares (finite_only 0) or all_finite (1) of one tensor. */
static PyObject *reduce_tensor(PyObject *module, PyObject *arg,
                               int finite_only)
{
    Buffer *b = as_buffer(module, arg, "tensor");
    if (!b) {
        return NULL;
    }
    double sum = 0.0;
    int finite = 1;
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = finite_only
                 ? zero_check_finite(b->data, b->dtype, b->numel, &finite)
                 : zero_sum_squares(b->data, b->dtype, b->numel, &sum);
    Py_END_ALLOW_THREADS
    Py_DECREF(b);
    if (status != ZERO_OK) {
        return raise_status(status,
                            finite_only ? "all_finite" : "sum_squares");
    }
    return finite_only ? PyBool_FromLong(finite) : PyFloat_FromDouble(sum);
}

PyDoc_STRVAR(sum_squares_doc,
"sum_squares(tensor) -> float\n--\n\n"
"Sum of squares of all elements, accumulated in double precision over\n"
"fixed blocks (the same result for any thread count). inf or nan when the\n"
"data holds one.");

static PyObject *zero_C_sum_squares(PyObject *module, PyObject *arg)
{
    return reduce_tensor(module, arg, 0);
}

PyDoc_STRVAR(all_finite_doc,
"all_finite(tensor) -> bool\n--\n\n"
"True when no element is inf or nan.");

static PyObject *zero_C_all_finite(PyObject *module, PyObject *arg)
{
    return reduce_tensor(module, arg, 1);
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
    named_buffer bufs[2] = {{"dst", NULL, 1, 0}, {"src", NULL, 0, 0}};
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
    /* all three may be None here, so that a missing a or c gets the
     * message below */
    named_buffer bufs[3] = {{"a", NULL, 1, 1}, {"b", NULL, 0, 1},
                            {"c", NULL, 0, 1}};
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
    Py_ssize_t length;
    const char *name = PyUnicode_AsUTF8AndSize(arg, &length);
    if (!name) {
        return NULL;
    }
    zero_isa isa;
    /* the length too: "avx2\0junk" is no name ("avx2" to C's strcmp) */
    if ((size_t)length != strlen(name) || zero_isa_from_name(name, &isa) != 0) {
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
    if (add_buffer_type(module) != 0 || add_optim_functions(module) != 0 ||
        add_aio(module) != 0 || add_buckets(module) != 0 ||
        add_cuda_functions(module) != 0) {
        return -1;
    }
    const char *bad_env = zero_isa_env_error();
    if (bad_env) {
        /* the paths this CPU runs, named in the warning: "scalar, avx2" */
        char runs[64] = "";
        for (int isa = 0; isa < ZERO_ISA_COUNT; isa++) {
            if (zero_isa_supported((zero_isa)isa)) {
                if (runs[0]) {
                    strncat(runs, ", ", sizeof runs - strlen(runs) - 1);
                }
                strncat(runs, zero_isa_name((zero_isa)isa), sizeof runs - strlen(runs) - 1);
            }
        }
        if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                             "%s=%s is not a SIMD path zero has that this CPU "
                             "can run (zero has scalar, avx2 and avx512; this CPU "
                             "runs %s); using %s",
                             ZERO_SIMD_ENV, bad_env, runs,
                             zero_isa_name(zero_isa_active())) != 0) {
            return -1;
        }
    }
    return 0;
}

static int zero_C_traverse(PyObject *module, visitproc visit, void *arg)
{
    Py_VISIT(get_state(module)->buffer_type);
    Py_VISIT(get_state(module)->bucket_hook_type);
    return 0;
}

static int zero_C_clear(PyObject *module)
{
    Py_CLEAR(get_state(module)->buffer_type);
    Py_CLEAR(get_state(module)->bucket_hook_type);
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
