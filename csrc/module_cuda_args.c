/* module_cuda_args.c: the tensor arguments of the cuda_* functions (see
 * module.h): names with their list index ("grads[3]"), list arguments,
 * dtype and size checks, one device per call, and the overlap check that
 * keeps a buffer a kernel writes apart from every other buffer of the call;
 * and where each tensor of cuda_pack/cuda_unpack sits in the bucket.
 */
#include "module.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- tensor arguments ------------------------------------------------- */

/* "grads[3]", or "step" for an argument that is not a list. */
const char *arg_name(const cuda_arg *a, char *out, size_t size)
{
    if (a->index < 0) {
        snprintf(out, size, "%s", a->name);
    } else {
        snprintf(out, size, "%s[%zd]", a->name, a->index);
    }
    return out;
}

int args_alloc(arg_set *set, Py_ssize_t count)
{
    set->count = 0;
    set->args = PyMem_Calloc((size_t)count + 1, sizeof(cuda_arg));
    if (!set->args) {
        PyErr_NoMemory();
        return -1;
    }
    set->count = count;
    return 0;
}

void args_free(arg_set *set)
{
    for (Py_ssize_t i = 0; i < set->count; i++) {
        Py_XDECREF(set->args[i].buf);
    }
    PyMem_Free(set->args);
    set->args = NULL;
}

/* A CUDA Buffer for obj into *a (None or NULL: absent, when optional). */
int take_arg(PyObject *module, cuda_arg *a, const char *name,
             Py_ssize_t index, PyObject *obj, int written, int optional)
{
    char shown[96];
    a->name = name;
    a->index = index;
    a->written = written;
    if (!obj || obj == Py_None) {
        if (optional) {
            return 0;
        }
        PyErr_Format(PyExc_TypeError, "%s must be a CUDA tensor, not None",
                     arg_name(a, shown, sizeof shown));
        return -1;
    }
    a->buf = as_cuda_buffer(module, obj, arg_name(a, shown, sizeof shown));
    return a->buf ? 0 : -1;
}

/* See module.h: a tuple copy, so Python code run while the items are
 * read cannot change them. */
int list_items(PyObject *obj, const char *name, PyObject **kept,
               PyObject ***items, Py_ssize_t *count)
{
    *kept = NULL;
    if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a list or tuple of tensors, not %.100s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    *kept = PySequence_Tuple(obj);
    if (!*kept) {
        return -1;
    }
    *items = PySequence_Fast_ITEMS(*kept);
    *count = PyTuple_GET_SIZE(*kept);
    if (*count > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "%s has too many tensors", name);
        return -1;
    }
    return 0;
}

/* indexed 0: a single tensor passed as a 1-tuple, named without "[0]". */
int take_list(PyObject *module, cuda_arg *args, const char *name,
              PyObject *const *items, Py_ssize_t count, int written,
              int optional, int indexed)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        if (take_arg(module, &args[i], name, indexed ? i : -1, items[i],
                     written, optional)) {
            return -1;
        }
    }
    return 0;
}

int check_float32(const cuda_arg *a)
{
    char shown[96];
    if (a->buf && a->buf->dtype != ZERO_F32) {
        PyErr_Format(PyExc_TypeError, "%s must be float32, got %s",
                     arg_name(a, shown, sizeof shown),
                     zero_dtype_name(a->buf->dtype));
        return -1;
    }
    return 0;
}

int check_numel_like(const cuda_arg *a, const cuda_arg *ref)
{
    char shown[96], ref_shown[96];
    if (a->buf && a->buf->numel != ref->buf->numel) {
        PyErr_Format(PyExc_ValueError, "%s has %lld elements, %s has %lld",
                     arg_name(a, shown, sizeof shown),
                     (long long)a->buf->numel,
                     arg_name(ref, ref_shown, sizeof ref_shown),
                     (long long)ref->buf->numel);
        return -1;
    }
    return 0;
}

/* A one-element float32 flag or counter (step, found_inf, out). */
int check_scalar_tensor(const cuda_arg *a)
{
    char shown[96];
    if (check_float32(a) != 0) {
        return -1;
    }
    if (a->buf && a->buf->numel != 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s must have 1 element, it has %lld",
                     arg_name(a, shown, sizeof shown),
                     (long long)a->buf->numel);
        return -1;
    }
    return 0;
}

int check_lengths(const char *name, Py_ssize_t count,
                  const char *ref_name, Py_ssize_t ref_count)
{
    if (count != ref_count) {
        PyErr_Format(PyExc_ValueError, "%s has %zd tensors, %s has %zd",
                     name, count, ref_name, ref_count);
        return -1;
    }
    return 0;
}

/* Every tensor on device `device`, and writable where written. */
int check_device_and_access(const arg_set *set, const cuda_arg *ref)
{
    char shown[96], ref_shown[96];
    for (Py_ssize_t i = 0; i < set->count; i++) {
        const cuda_arg *a = &set->args[i];
        if (!a->buf) {
            continue;
        }
        if (a->buf->device_id != ref->buf->device_id) {
            PyErr_Format(PyExc_ValueError,
                         "%s is on cuda:%d, %s on cuda:%d; every tensor of "
                         "a call must be on one device",
                         arg_name(a, shown, sizeof shown), a->buf->device_id,
                         arg_name(ref, ref_shown, sizeof ref_shown),
                         ref->buf->device_id);
            return -1;
        }
        if (a->written && a->buf->readonly) {
            PyErr_Format(PyExc_ValueError, "%s is read-only",
                         arg_name(a, shown, sizeof shown));
            return -1;
        }
    }
    return 0;
}

/* ---- overlap ------------------------------------------------------------ */

void extent_of(extent *e, const Buffer *b, int64_t offset,
               int64_t numel, int written)
{
    size_t item = zero_dtype_size(b->dtype);
    e->begin = (uintptr_t)b->data + (uintptr_t)offset * item;
    e->end = e->begin + (uintptr_t)numel * item;
    e->written = written;
}

static int by_begin(const void *x, const void *y)
{
    const extent *a = x, *b = y;
    return a->begin < b->begin ? -1 : a->begin > b->begin;
}

/* No written extent overlaps any other extent. Sorted by start, an extent
 * overlaps an earlier one exactly when it starts before that one's end, so
 * one pass keeping the furthest end (of all, and of the written) finds any
 * such pair. Sorts the extents. */
int check_no_overlap(extent *extents, Py_ssize_t count)
{
    qsort(extents, (size_t)count, sizeof *extents, by_begin);
    const extent *far = NULL, *far_written = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        const extent *e = &extents[i];
        if (e->begin == e->end) {
            continue;
        }
        const extent *hit = NULL;
        if (e->written && far && e->begin < far->end) {
            hit = far;
        } else if (far_written && e->begin < far_written->end) {
            hit = far_written;
        }
        if (hit) {
            PyErr_Format(PyExc_ValueError,
                         "%s and %s overlap in memory; a buffer a kernel "
                         "writes needs storage of its own",
                         e->name, hit->name);
            return -1;
        }
        if (!far || e->end > far->end) {
            far = e;
        }
        if (e->written && (!far_written || e->end > far_written->end)) {
            far_written = e;
        }
    }
    return 0;
}

/* The extents of the present arguments, except `skip` (a bucket whose
 * slices the caller adds), into extents[]; returns how many. */
Py_ssize_t extents_of_args(const arg_set *set, const cuda_arg *skip,
                           extent *extents)
{
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < set->count; i++) {
        const cuda_arg *a = &set->args[i];
        if (!a->buf || a == skip) {
            continue;
        }
        extent_of(&extents[n], a->buf, 0, a->buf->numel, a->written);
        arg_name(a, extents[n].name, sizeof extents[n].name);
        n++;
    }
    return n;
}

int check_args_no_overlap(const arg_set *set)
{
    extent *extents = PyMem_Calloc((size_t)set->count + 1, sizeof(extent));
    if (!extents) {
        PyErr_NoMemory();
        return -1;
    }
    int result = check_no_overlap(extents,
                                  extents_of_args(set, NULL, extents));
    PyMem_Free(extents);
    return result;
}

/* ---- a call's tensor rows ------------------------------------------- */

static PyObject *row_object(const arg_spec *a, const void *call)
{
    PyObject *obj = *(PyObject *const *)((const char *)call + a->offset);
    return obj ? obj : Py_None;
}

static int is_absent(const arg_spec *a, PyObject *obj)
{
    return (a->flags & ARG_OPTIONAL) && obj == Py_None;
}

/* The list rows' items and their common length, checked as adam_step
 * always did: every list's type first, then every length against the
 * first list's. An optional list left out is not present. */
static int list_rows(const signature *sig, const void *call,
                     PyObject *kept[], PyObject **items[], int present[],
                     Py_ssize_t *count, Py_ssize_t *lists)
{
    Py_ssize_t counts[MAX_ROWS] = {0};
    int first = -1;
    *lists = 0;
    for (int r = 0; r < sig->count; r++) {
        const arg_spec *a = &sig->args[r];
        PyObject *obj = row_object(a, call);
        present[r] = a->kind == ARG_TENSORS && !is_absent(a, obj);
        if (present[r] &&
            list_items(obj, a->name, &kept[r], &items[r], &counts[r])) {
            return -1;
        }
    }
    for (int r = 0; r < sig->count; r++) {
        const arg_spec *a = &sig->args[r];
        if (a->kind != ARG_TENSORS) {
            continue;
        }
        (*lists)++;
        if (first < 0) {
            first = r;
            *count = counts[r];
        } else if (present[r] && check_lengths(a->name, counts[r],
                                               sig->args[first].name,
                                               *count)) {
            return -1;
        }
    }
    return 0;
}

static int parse_with_lists(PyObject *module, const signature *sig,
                            PyObject *args, PyObject *kwargs, void *call,
                            cuda_tensors *t, PyObject *kept[]);

int parse_cuda_args(PyObject *module, const signature *sig, PyObject *args,
                    PyObject *kwargs, void *call, cuda_tensors *t)
{
    PyObject *kept[MAX_ROWS] = {NULL}; /* the lists' tuple copies */
    int status = parse_with_lists(module, sig, args, kwargs, call, t, kept);
    for (int r = 0; r < MAX_ROWS; r++) {
        Py_XDECREF(kept[r]);
    }
    return status;
}

static int parse_with_lists(PyObject *module, const signature *sig,
                            PyObject *args, PyObject *kwargs, void *call,
                            cuda_tensors *t, PyObject *kept[])
{
    PyObject **items[MAX_ROWS] = {NULL};
    int present[MAX_ROWS] = {0};
    Py_ssize_t lists, singles = 0;
    memset(t, 0, sizeof *t);
    t->count = 1;
    if (parse_args(sig, args, kwargs, call) != 0 ||
        list_rows(sig, call, kept, items, present, &t->count, &lists)) {
        return -1;
    }
    for (int r = 0; r < sig->count; r++) {
        singles += sig->args[r].kind == ARG_TENSOR;
    }
    if (args_alloc(&t->set, lists * t->count + singles)) {
        return -1;
    }
    cuda_arg *next = t->set.args;
    for (int r = 0; r < sig->count; r++) {
        const arg_spec *a = &sig->args[r];
        int written = (a->flags & ARG_WRITTEN) != 0;
        int optional = (a->flags & ARG_OPTIONAL) != 0;
        if (a->kind != ARG_TENSORS) {
            continue;
        }
        t->row[r] = next;
        for (Py_ssize_t i = 0; i < t->count && !present[r]; i++) {
            next[i].name = a->name;
            next[i].index = i;
        }
        if (present[r] && take_list(module, next, a->name, items[r], t->count,
                                  written, optional, 1)) {
            return -1;
        }
        next += t->count;
    }
    for (int r = 0; r < sig->count; r++) {
        const arg_spec *a = &sig->args[r];
        if (a->kind != ARG_TENSOR) {
            continue;
        }
        t->row[r] = next;
        if (take_arg(module, next++, a->name, -1, row_object(a, call),
                     (a->flags & ARG_WRITTEN) != 0,
                     (a->flags & ARG_OPTIONAL) != 0)) {
            return -1;
        }
    }
    for (int r = 0; r < sig->count; r++) {
        const arg_spec *a = &sig->args[r];
        if (a->kind == ARG_TENSOR &&
            (((a->flags & ARG_SCALAR) && check_scalar_tensor(t->row[r])) ||
             ((a->flags & ARG_FLOAT32) && check_float32(t->row[r])))) {
            return -1;
        }
    }
    return 0;
}

/* ---- bucket offsets (cuda_pack, cuda_unpack) ------------------------- */

/* Where tensor i sits in the bucket: offsets[i] (items, a tuple's), or
 * back to back when items is NULL. Checks that every slice lies inside the
 * bucket. */
static int place_slices(PyObject *const *items, const arg_set *set,
                        Py_ssize_t count, const Buffer *bucket,
                        int64_t *offsets)
{
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

/* place_slices with offsets_obj (None, or a list or tuple of ints), read
 * from a tuple copy: an item's __index__ may change a list. */
int bucket_offsets(PyObject *offsets_obj, const arg_set *set,
                          Py_ssize_t count, const Buffer *bucket,
                          int64_t *offsets)
{
    if (!offsets_obj || offsets_obj == Py_None) {
        return place_slices(NULL, set, count, bucket, offsets);
    }
    if (!PyList_Check(offsets_obj) && !PyTuple_Check(offsets_obj)) {
        PyErr_Format(PyExc_TypeError,
                     "offsets must be a list or tuple of ints, not %.100s",
                     Py_TYPE(offsets_obj)->tp_name);
        return -1;
    }
    PyObject *kept = PySequence_Tuple(offsets_obj);
    if (!kept) {
        return -1;
    }
    int status = -1;
    if (PyTuple_GET_SIZE(kept) != count) {
        PyErr_Format(PyExc_ValueError,
                     "offsets has %zd entries, tensors has %zd",
                     PyTuple_GET_SIZE(kept), count);
    } else {
        status = place_slices(PySequence_Fast_ITEMS(kept), set, count, bucket,
                              offsets);
    }
    Py_DECREF(kept);
    return status;
}
