/* module_args.c: keyword arguments from a table (module.h, arg_spec). One
 * function, parse_args(), parses every keyword function of zero._C: the
 * PyArg format and keyword list are built from the table, the values go to
 * the offsets the table gives, then the required keywords and the range
 * checks of the numbers are checked, with one message per kind of check.
 */
#include "module.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* A required keyword-only argument is looked for in the call itself: the
 * PyArg format has no "required keyword-only" mark, and a sentinel value
 * (-DBL_MAX once) read lr=-1.8e308 as "missing" instead of out of range. */

/* [Note: one converter per row] Every row is parsed with "O&": PyArg then
 * takes a (converter, address) pair per row, so a table of any shape is
 * passed as MAX_ROWS pairs of the same two types (a variadic function
 * ignores the pairs its format does not use). Each converter hands the
 * object to PyArg_Parse with the format unit the row's kind stands for, so
 * a wrong type raises exactly what "d", "p" or "L" would raise. */
typedef int (*converter)(PyObject *, void *);

static int take_object(PyObject *obj, void *at)
{
    *(PyObject **)at = obj;
    return 1;
}

static int take_double(PyObject *obj, void *at)
{
    return PyArg_Parse(obj, "d", (double *)at);
}

static int take_bool(PyObject *obj, void *at)
{
    return PyArg_Parse(obj, "p", (int *)at);
}

static int take_int64(PyObject *obj, void *at)
{
    long long value;
    if (!PyArg_Parse(obj, "L", &value)) {
        return 0;
    }
    *(int64_t *)at = value;
    return 1;
}

static converter converter_of(arg_kind kind)
{
    switch (kind) {
    case ARG_DOUBLE:
        return take_double;
    case ARG_BOOL:
        return take_bool;
    case ARG_INT64:
        return take_int64;
    default:
        return take_object;
    }
}

static void set_default(const arg_spec *a, char *call)
{
    void *at = call + a->offset;
    int required = (a->flags & ARG_REQUIRED) != 0;
    switch (a->kind) {
    case ARG_DOUBLE:
        *(double *)at = required ? 0.0 : a->initial;
        break;
    case ARG_BOOL:
        *(int *)at = (int)a->initial;
        break;
    case ARG_INT64:
        *(int64_t *)at = required ? 0 : (int64_t)a->initial;
        break;
    default:
        *(PyObject **)at = NULL;
        break;
    }
}

/* Row i was not passed, by position or by name. */
static int is_missing(int i, const arg_spec *a, PyObject *args,
                      PyObject *kwargs)
{
    if (args && i < PyTuple_GET_SIZE(args)) {
        return 0;
    }
    /* parsed already, so a name here is one of the keywords: no error */
    return !kwargs || !PyDict_GetItemString(kwargs, a->name);
}

/* "lr must be ..., got -1.0": the value as Python writes a float. */
static int refuse_double(const char *name, const char *must, double value)
{
    PyObject *shown = PyFloat_FromDouble(value);
    PyErr_Format(PyExc_ValueError, "%s must be %s, got %R", name, must, shown);
    Py_XDECREF(shown);
    return -1;
}

static int check_double(const arg_spec *a, double value)
{
    /* the kernels compute in float: a finite double beyond FLT_MAX would
     * be an infinity there (grad_scale=1e39 turned every parameter NaN) */
    if (isfinite(value) && (a->check == CHECK_FINITE ? fabs(value) > FLT_MAX
                            : a->check == CHECK_NONNEGATIVE && value > FLT_MAX)) {
        return refuse_double(a->name, "at most 3.4e38 in size (the kernels "
                             "compute in float32)", value);
    }
    switch (a->check) {
    case CHECK_FINITE:
        return isfinite(value) ? 0 : refuse_double(a->name, "finite", value);
    case CHECK_NONNEGATIVE:
        return isfinite(value) && value >= 0.0
                   ? 0
                   : refuse_double(a->name, "a finite number >= 0", value);
    case CHECK_BETA:
        return value >= 0.0 && value < 1.0
                   ? 0
                   : refuse_double(a->name, "in [0, 1)", value);
    default:
        return 0;
    }
}

static int check_int64(const arg_spec *a, int64_t value)
{
    if (a->check == CHECK_COUNT && value < 1) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 1, got %lld", a->name,
                     (long long)value);
        return -1;
    }
    if (a->check == CHECK_INDEX && value < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be an int >= 0, got %lld",
                     a->name, (long long)value);
        return -1;
    }
    if (a->check == CHECK_STREAM && value < 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be a CUstream handle, an int >= 0 "
                     "(torch.cuda.current_stream(device).cuda_stream), "
                     "got %lld",
                     a->name, (long long)value);
        return -1;
    }
    return 0;
}

/* The PyArg format of sig: "O&" a row, "|" after the required ones, "$"
 * before the keyword-only ones, then ":function". */
static void build_format(const signature *sig, char *format, size_t size)
{
    size_t n = 0;
    for (int i = 0; i < sig->count; i++) {
        if (i == sig->required) {
            format[n++] = '|';
        }
        if (i == sig->positional) {
            format[n++] = '$';
        }
        format[n++] = 'O';
        format[n++] = '&';
    }
    snprintf(format + n, size - n, ":%s", sig->function);
}

static int check_values(const signature *sig, const char *call,
                        PyObject *args, PyObject *kwargs)
{
    for (int i = 0; i < sig->count; i++) {
        const arg_spec *a = &sig->args[i];
        if ((a->flags & ARG_REQUIRED) && is_missing(i, a, args, kwargs)) {
            PyErr_Format(PyExc_TypeError,
                         "%s() missing required keyword argument '%s'",
                         sig->function, a->name);
            return -1;
        }
    }
    for (int i = 0; i < sig->count; i++) {
        const arg_spec *a = &sig->args[i];
        if (a->kind == ARG_DOUBLE &&
            check_double(a, *(const double *)(call + a->offset))) {
            return -1;
        }
    }
    for (int i = 0; i < sig->count; i++) {
        const arg_spec *a = &sig->args[i];
        if (a->kind == ARG_INT64 &&
            check_int64(a, *(const int64_t *)(call + a->offset))) {
            return -1;
        }
    }
    return 0;
}

int parse_args(const signature *sig, PyObject *args, PyObject *kwargs,
               void *call)
{
    if (sig->count > MAX_ROWS) {
        PyErr_Format(PyExc_SystemError, "%s: %d arguments, at most %d",
                     sig->function, sig->count, MAX_ROWS);
        return -1;
    }
    char *base = call;
    memset(call, 0, sig->size);
    char format[3 * MAX_ROWS + 64];
    char *keywords[MAX_ROWS + 1] = {NULL};
    converter convert[MAX_ROWS];
    void *at[MAX_ROWS];
    for (int i = 0; i < MAX_ROWS; i++) {
        convert[i] = take_object;
        at[i] = NULL;
    }
    for (int i = 0; i < sig->count; i++) {
        const arg_spec *a = &sig->args[i];
        set_default(a, base);
        keywords[i] = (char *)a->name;
        convert[i] = converter_of(a->kind);
        at[i] = base + a->offset;
    }
    build_format(sig, format, sizeof format);
    _Static_assert(MAX_ROWS == 20, "PyArg below gets MAX_ROWS pairs");
#define PAIR(i) convert[i], at[i]
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, format, keywords, PAIR(0), PAIR(1), PAIR(2),
            PAIR(3), PAIR(4), PAIR(5), PAIR(6), PAIR(7), PAIR(8), PAIR(9),
            PAIR(10), PAIR(11), PAIR(12), PAIR(13), PAIR(14), PAIR(15),
            PAIR(16), PAIR(17), PAIR(18), PAIR(19))) {
        return -1;
    }
#undef PAIR
    return check_values(sig, base, args, kwargs);
}
