/* module_grad_buckets.c: the zero._C.GradBuckets type: made from a flat
 * group's layout (the plan of buckets.c), the hooks it hands out, and the
 * calls the bucket reducer (sharding/_buckets.py) makes at the end of a
 * backward. The hook side is module_buckets.c.
 */
#include "module_buckets.h"

#include <string.h>

/* ---- GradBuckets -------------------------------------------------------- */

/* A list of ints as a new int64 array of *n entries. Read from a tuple
 * copy: an item's __index__ may change a list while it is read. */
static int64_t *int64_list(PyObject *list, const char *name, Py_ssize_t *n)
{
    if (!PySequence_Check(list)) {
        PyErr_Format(PyExc_TypeError, "%s must be a sequence of ints, not "
                     "%.100s", name, Py_TYPE(list)->tp_name);
        return NULL;
    }
    PyObject *seq = PySequence_Tuple(list);
    if (!seq) {
        return NULL;
    }
    *n = PySequence_Fast_GET_SIZE(seq);
    int64_t *out = PyMem_Calloc((size_t)(*n > 0 ? *n : 1), sizeof *out);
    if (!out) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t k = 0; k < *n; k++) {
        long long value = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, k));
        if (value == -1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "%s must hold ints", name);
            PyMem_Free(out);
            Py_DECREF(seq);
            return NULL;
        }
        out[k] = value;
    }
    Py_DECREF(seq);
    return out;
}

static int dtype_by_name(const char *name, zero_dtype *out, size_t *itemsize)
{
    if (strcmp(name, "float32") == 0) {
        *out = ZERO_F32;
        *itemsize = 4;
    } else if (strcmp(name, "bfloat16") == 0) {
        *out = ZERO_BF16;
        *itemsize = 2;
    } else if (strcmp(name, "float16") == 0) {
        *out = ZERO_F16;
        *itemsize = 2;
    } else {
        return -1;
    }
    return 0;
}

static void GradBuckets_dealloc(GradBuckets *self)
{
    PyTypeObject *type = Py_TYPE(self);
    if (self->plan) {
        drop_buffers(self);
    }
    zero_buckets_destroy(self->plan);
    PyMem_Free(self->param_numel);
    PyMem_Free(self->staging);
    PyMem_Free(self->late);
    Py_XDECREF(self->owner);
    Py_XDECREF(self->dtype);
    Py_XDECREF(self->tensor_type);
    Py_XDECREF(self->strided);
    Py_XDECREF(self->hook_type);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static PyObject *GradBuckets_new(PyTypeObject *type, PyObject *args,
                                 PyObject *kwargs)
{
    static char *keywords[] = {"param_units", "param_offsets", "param_numels",
                               "unit_spans", "bucket_elements", "owner",
                               "dtype", "tensor_type", "strided",
                               "unit_parts", "chunks", NULL};
    PyObject *units_obj, *offsets_obj, *numels_obj, *spans_obj, *owner = NULL,
        *dtype = NULL, *tensor_type = NULL, *strided = NULL,
        *parts_obj = Py_None;
    long long bucket_elements, chunks = 1;
    /* keyword-only arguments are optional to the parser: the four required
     * ones are checked by presence below */
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "OOOOL|$OOOOOL:GradBuckets", keywords, &units_obj,
            &offsets_obj, &numels_obj, &spans_obj, &bucket_elements, &owner,
            &dtype, &tensor_type, &strided, &parts_obj, &chunks)) {
        return NULL;
    }
    PyObject *required[] = {owner, dtype, tensor_type, strided};
    for (int k = 0; k < 4; k++) {
        if (!required[k]) {
            PyErr_Format(PyExc_TypeError,
                         "GradBuckets() missing required keyword argument '%s'",
                         keywords[5 + k]);
            return NULL;
        }
    }
    zero_dtype zdtype;
    size_t itemsize;
    PyObject *name = PyObject_Str(dtype);
    const char *text = name ? PyUnicode_AsUTF8(name) : NULL;
    if (!text) {
        Py_XDECREF(name);
        return NULL;
    }
    if (dtype_by_name(strncmp(text, "torch.", 6) == 0 ? text + 6 : text, &zdtype,
                      &itemsize) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "dtype must be float32, bfloat16 or float16, not %s", text);
        Py_DECREF(name);
        return NULL;
    }
    Py_DECREF(name);
    if (!PyType_Check(tensor_type)) {
        PyErr_SetString(PyExc_TypeError, "tensor_type must be a type");
        return NULL;
    }
    Py_ssize_t n_params = 0, n_offsets = 0, n_numels = 0, n_units = 0,
               n_parts = 0;
    int64_t *units = int64_list(units_obj, "param_units", &n_params);
    int64_t *offsets = units ? int64_list(offsets_obj, "param_offsets", &n_offsets) : NULL;
    int64_t *numels = offsets ? int64_list(numels_obj, "param_numels", &n_numels) : NULL;
    int64_t *spans = numels ? int64_list(spans_obj, "unit_spans", &n_units) : NULL;
    /* [Note: small units share a bucket] when the parts are given */
    int64_t *parts = NULL;
    if (spans && parts_obj != Py_None) {
        parts = int64_list(parts_obj, "unit_parts", &n_parts);
        if (!parts) {
            PyMem_Free(spans);
            spans = NULL;
        }
    }
    GradBuckets *self = NULL;
    if (spans && (n_offsets != n_params || n_numels != n_params)) {
        PyErr_SetString(PyExc_ValueError,
                        "param_units, param_offsets and param_numels must be "
                        "of one length");
    } else if (spans && parts && n_parts != n_units) {
        PyErr_SetString(PyExc_ValueError,
                        "unit_parts must hold one part per unit of unit_spans");
    } else if (spans && parts && chunks < 1) {
        PyErr_Format(PyExc_ValueError, "chunks must be >= 1, not %lld", chunks);
    } else if (spans &&
               zero_buckets_needed(n_units, spans, bucket_elements) == -2) {
        PyErr_Format(PyExc_ValueError,
                     "bucket_elements %lld cuts these units into more than "
                     "%lld buckets: make the buckets larger",
                     (long long)bucket_elements,
                     (long long)ZERO_BUCKETS_MAX_COUNT);
    } else if (spans) {
        zero_buckets *plan = NULL;
        zero_status status =
            zero_buckets_create_chunked(&plan, n_params, units, offsets, numels,
                                        n_units, spans, parts, chunks,
                                        bucket_elements);
        if (status == ZERO_ERR_INVALID_ARGUMENT) {
            PyErr_SetString(PyExc_ValueError,
                            "every parameter must lie inside its unit (unit in "
                            "range, offset and numel >= 0, offset + numel <= "
                            "the unit's span), no two may share an element, "
                            "bucket_elements must be > 0, and each unit's "
                            "chunks (unit_parts) must be >= 0 and cover its "
                            "span");
        } else if (status != ZERO_OK) {
            raise_status(status, "GradBuckets");
        } else {
            self = (GradBuckets *)type->tp_alloc(type, 0);
            int64_t nb = zero_buckets_count(plan);
            if (self) {
                self->plan = plan;
                plan = NULL;
                self->n_params = n_params;
                self->param_numel = numels;
                numels = NULL;
                self->staging = PyMem_Calloc((size_t)(nb > 0 ? nb : 1),
                                             sizeof *self->staging);
                self->late = PyMem_Calloc((size_t)(nb > 0 ? nb : 1),
                                          sizeof *self->late);
                self->owner = PyWeakref_NewRef(owner, NULL);
                self->dtype = Py_NewRef(dtype);
                self->tensor_type = Py_NewRef(tensor_type);
                self->strided = Py_NewRef(strided);
                self->zdtype = zdtype;
                self->itemsize = itemsize;
                PyObject *module = PyType_GetModule(type);
                self->hook_type = module ? Py_XNewRef(
                    (PyObject *)get_state(module)->bucket_hook_type) : NULL;
                if (!self->staging || !self->late || !self->owner ||
                    !self->hook_type) {
                    if (!PyErr_Occurred()) {
                        PyErr_NoMemory();
                    }
                    Py_CLEAR(self);
                }
            }
            zero_buckets_destroy(plan);
        }
    }
    PyMem_Free(units);
    PyMem_Free(offsets);
    PyMem_Free(numels);
    PyMem_Free(spans);
    PyMem_Free(parts);
    return (PyObject *)self;
}

static PyObject *GradBuckets_hook(GradBuckets *self, PyObject *arg)
{
    long long index = PyLong_AsLongLong(arg);
    if (index == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (index < 0 || index >= self->n_params) {
        PyErr_Format(PyExc_IndexError, "parameter index %lld out of range",
                     index);
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)self->hook_type;
    BucketHook *hook = (BucketHook *)type->tp_alloc(type, 0);
    if (!hook) {
        return NULL;
    }
    hook->buckets = (GradBuckets *)Py_NewRef(self);
    hook->index = index;
    return (PyObject *)hook;
}

static PyObject *GradBuckets_bucket(GradBuckets *self, PyObject *arg)
{
    long long b = PyLong_AsLongLong(arg);
    if (b == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int64_t unit, start, end;
    if (zero_buckets_range(self->plan, b, &unit, &start, &end) != ZERO_OK) {
        PyErr_Format(PyExc_IndexError, "bucket %lld out of range", b);
        return NULL;
    }
    return Py_BuildValue("(LLL)", (long long)unit, (long long)start,
                         (long long)end);
}

static PyObject *GradBuckets_bucket_units(GradBuckets *self, PyObject *arg)
{
    long long b = PyLong_AsLongLong(arg);
    if (b == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int64_t first, last;
    if (zero_buckets_units(self->plan, b, &first, &last) != ZERO_OK) {
        PyErr_Format(PyExc_IndexError, "bucket %lld out of range", b);
        return NULL;
    }
    return Py_BuildValue("(LL)", (long long)first, (long long)last);
}

static PyObject *GradBuckets_reset(GradBuckets *self, PyObject *arg)
{
    Py_buffer view = {0};
    if (arg != Py_None) {
        if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0) {
            return NULL;
        }
        if (view.len != self->n_params) {
            PyBuffer_Release(&view);
            PyErr_Format(PyExc_ValueError,
                         "expected must hold one byte per parameter (%lld), "
                         "not %zd", (long long)self->n_params, view.len);
            return NULL;
        }
    }
    zero_buckets_reset(self->plan, arg != Py_None ? view.buf : NULL);
    if (arg != Py_None) {
        PyBuffer_Release(&view);
    }
    drop_buffers(self);
    Py_RETURN_NONE;
}

static PyObject *GradBuckets_send_rest(GradBuckets *self, PyObject *unused)
{
    (void)unused;
    PyObject *owner = live_owner(self);
    if (!owner) {
        Py_RETURN_NONE;
    }
    int error = send_ready(self, owner, 1);
    Py_DECREF(owner);
    if (error) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *GradBuckets_take_late(GradBuckets *self, PyObject *arg)
{
    long long b = PyLong_AsLongLong(arg);
    if (b == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (b < 0 || b >= zero_buckets_count(self->plan)) {
        PyErr_Format(PyExc_IndexError, "bucket %lld out of range", b);
        return NULL;
    }
    PyObject *tensor = self->late[b].tensor;
    if (!tensor) {
        return Py_NewRef(Py_None);
    }
    /* a reference of our own: fill_gaps calls the owner's Python, which
     * may take this bucket's buffer itself (a call back in here) and
     * leave the slot's reference with its caller */
    Py_INCREF(tensor);
    PyObject *owner = live_owner(self); /* NULL: memset only */
    int error = fill_gaps(self, owner, (int64_t)b, 1);
    Py_XDECREF(owner);
    if (error) {
        Py_DECREF(tensor);
        return NULL;
    }
    if (self->late[b].tensor == tensor) {
        self->late[b].tensor = NULL;
        self->late[b].data = NULL;
        Py_DECREF(tensor); /* the slot's */
    }
    return tensor;
}

static PyObject *GradBuckets_late_buckets(GradBuckets *self, PyObject *unused)
{
    (void)unused;
    PyObject *out = PyList_New(0);
    int64_t n = zero_buckets_count(self->plan);
    for (int64_t b = 0; out && b < n; b++) {
        if (self->late[b].tensor) {
            PyObject *index = PyLong_FromLongLong(b);
            if (!index || PyList_Append(out, index) != 0) {
                Py_CLEAR(out);
            }
            Py_XDECREF(index);
        }
    }
    return out;
}

static PyObject *GradBuckets_arrived(GradBuckets *self, PyObject *unused)
{
    (void)unused;
    return PyBytes_FromStringAndSize(
        (const char *)zero_buckets_arrived(self->plan), (Py_ssize_t)self->n_params);
}

static PyObject *GradBuckets_detach(GradBuckets *self, PyObject *unused)
{
    (void)unused;
    Py_CLEAR(self->owner);
    drop_buffers(self);
    Py_RETURN_NONE;
}

static PyObject *GradBuckets_get_count(GradBuckets *self, void *closure)
{
    (void)closure;
    return PyLong_FromLongLong(zero_buckets_count(self->plan));
}

static PyObject *GradBuckets_get_started(GradBuckets *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(zero_buckets_started(self->plan));
}

static PyObject *GradBuckets_get_sent(GradBuckets *self, void *closure)
{
    (void)closure;
    return PyLong_FromLongLong(zero_buckets_sent(self->plan));
}

static PyMethodDef GradBuckets_methods[] = {
    {"hook", (PyCFunction)GradBuckets_hook, METH_O,
     "hook(i) -> callable\n--\n\nParameter i's post-accumulate-grad hook."},
    {"bucket", (PyCFunction)GradBuckets_bucket, METH_O,
     "bucket(b) -> (unit, start, end)\n--\n\nBucket b's range of its unit "
     "(a shared bucket: its first unit and [0, its size))."},
    {"bucket_units", (PyCFunction)GradBuckets_bucket_units, METH_O,
     "bucket_units(b) -> (first, last)\n--\n\nThe units bucket b holds: "
     "first < last for a bucket small units share ([Note: small units share "
     "a bucket] in csrc/zero.h)."},
    {"reset", (PyCFunction)GradBuckets_reset, METH_O,
     "reset(expected)\n--\n\nA new backward: drop every buffer; expected "
     "(bytes, one per parameter) or None to keep the last."},
    {"send_rest", (PyCFunction)GradBuckets_send_rest, METH_NOARGS,
     "send_rest()\n--\n\nSend every bucket not yet sent, in order."},
    {"late_buckets", (PyCFunction)GradBuckets_late_buckets, METH_NOARGS,
     "late_buckets() -> list\n--\n\nBuckets holding late pieces."},
    {"take_late", (PyCFunction)GradBuckets_take_late, METH_O,
     "take_late(b) -> tensor or None\n--\n\nBucket b's late buffer, handed "
     "over, the ranges no piece wrote zeroed."},
    {"arrived", (PyCFunction)GradBuckets_arrived, METH_NOARGS,
     "arrived() -> bytes\n--\n\nOne byte per parameter: 1 when its gradient "
     "arrived this backward."},
    {"detach", (PyCFunction)GradBuckets_detach, METH_NOARGS,
     "detach()\n--\n\nForget the owner: the hooks do nothing from now on."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef GradBuckets_getset[] = {
    {"count", (getter)GradBuckets_get_count, NULL, "buckets", NULL},
    {"started", (getter)GradBuckets_get_started, NULL,
     "a gradient arrived or a bucket was sent this backward", NULL},
    {"sent", (getter)GradBuckets_get_sent, NULL,
     "buckets sent this backward", NULL},
    {NULL},
};

static PyType_Slot GradBuckets_slots[] = {
    {Py_tp_doc,
     "GradBuckets(param_units, param_offsets, param_numels, unit_spans,\n"
     "bucket_elements, *, owner, dtype, tensor_type, strided, unit_parts=None,\n"
     "chunks=1): a flat group's\n"
     "gradient buckets ([Note: the bucket plan] in csrc/zero.h) and the\n"
     "hooks that fill them. owner (held weakly) makes and sends buffers:\n"
     "_new_bucket(b, late), _send_bucket(b, tensor), _unit_arrived(unit),\n"
     "_backward_began(), _add_piece(grad, bucket, bucket_start, grad_start,\n"
     "count) for a gradient the fast path does not take."},
    {Py_tp_new, GradBuckets_new},
    {Py_tp_dealloc, GradBuckets_dealloc},
    {Py_tp_methods, GradBuckets_methods},
    {Py_tp_getset, GradBuckets_getset},
    {0, NULL},
};

static PyType_Spec GradBuckets_spec = {
    .name = "zero._C.GradBuckets",
    .basicsize = sizeof(GradBuckets),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = GradBuckets_slots,
};

int add_buckets(PyObject *module)
{
    PyObject *hook_type = make_bucket_hook_type(module);
    if (!hook_type) {
        return -1;
    }
    get_state(module)->bucket_hook_type = (PyTypeObject *)hook_type;
    PyObject *type = PyType_FromModuleAndSpec(module, &GradBuckets_spec, NULL);
    if (!type) {
        return -1;
    }
    int error = PyModule_AddType(module, (PyTypeObject *)type);
    Py_DECREF(type);
    return error;
}
