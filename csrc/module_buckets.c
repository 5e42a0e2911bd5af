/* module_buckets.c: the post-accumulate-grad hook of zero._C.GradBuckets
 * (the type itself: module_grad_buckets.c), which runs the bucket plan of
 * buckets.c over torch tensors.
 *
 * [Note: the hook in C] A flat group's backward calls its gradient hook once
 * per parameter; in Python that hook cost more than the rest of stage 3
 * together (bench/stage3_overhead.py). The hook is now a C callable: it
 * counts the arrival, writes the gradient's pieces into their buckets (the
 * core's copy or accumulate for a dense CPU tensor of the bucket's dtype,
 * else one call of the owner's _add_piece; [Note: no zero-fill] in
 * buckets.c), sends each bucket that completes, in
 * order, and drops the parameter's .grad. It calls back into Python only
 * per bucket (_new_bucket, _send_bucket), per unit (_unit_arrived) and once
 * per backward (_backward_began), on an owner it holds weakly: torch keeps
 * hooks where the garbage collector does not look, so a strong reference
 * would keep a dropped engine alive. The buffers are torch tensors the
 * owner makes; a bucket's data pointer is taken once, when it is made.
 */
#include "module_buckets.h"

#include <string.h>

/* Pieces of at least this many elements are added with the GIL released
 * (other threads run meanwhile); a smaller one is over before releasing and
 * taking the GIL back would pay for itself. */
#define GIL_FREE_ELEMENTS 65536

/* attribute and method names, interned once */
static PyObject *str_grad, *str_dtype, *str_is_cpu, *str_layout,
    *str_is_contiguous, *str_numel, *str_data_ptr, *str_new_bucket,
    *str_backward_began;

/* ---- reading a tensor ------------------------------------------------- */

/* The tensor's first element when it is a dense, contiguous CPU tensor of
 * exactly torch.Tensor, the buckets' dtype and numel elements; NULL (no
 * exception) when not, so the caller takes the slow path; NULL with an
 * exception when reading it failed. */
static char *fast_data(GradBuckets *self, PyObject *tensor, int64_t numel)
{
    if (Py_TYPE(tensor) != (PyTypeObject *)self->tensor_type) {
        return NULL;
    }
    PyObject *value = PyObject_GetAttr(tensor, str_dtype);
    int ok = value == self->dtype;
    Py_XDECREF(value);
    if (ok) {
        value = PyObject_GetAttr(tensor, str_layout);
        ok = value == self->strided;
        Py_XDECREF(value);
    }
    if (ok) {
        value = PyObject_GetAttr(tensor, str_is_cpu);
        ok = value == Py_True;
        Py_XDECREF(value);
    }
    if (ok) {
        value = PyObject_CallMethodNoArgs(tensor, str_is_contiguous);
        ok = value == Py_True;
        Py_XDECREF(value);
    }
    if (ok) {
        value = PyObject_CallMethodNoArgs(tensor, str_numel);
        ok = value && PyLong_AsLongLong(value) == numel;
        Py_XDECREF(value);
    }
    char *data = NULL;
    if (ok) {
        value = PyObject_CallMethodNoArgs(tensor, str_data_ptr);
        data = value ? PyLong_AsVoidPtr(value) : NULL;
        Py_XDECREF(value);
        ok = data != NULL;
    }
    if (!ok && PyErr_Occurred()) {
        return NULL;
    }
    return ok ? data : NULL;
}

/* ---- the buffers ------------------------------------------------------- */

static void drop_buffer(bucket_buffer *buffer)
{
    Py_CLEAR(buffer->tensor);
    buffer->data = NULL;
}

void drop_buffers(GradBuckets *self)
{
    if (!self->staging || !self->late) {
        return; /* a construction that failed half way */
    }
    int64_t n = zero_buckets_count(self->plan);
    for (int64_t b = 0; b < n; b++) {
        drop_buffer(&self->staging[b]);
        drop_buffer(&self->late[b]);
    }
}

/* The live owner (a new reference), or NULL without an exception when it
 * is gone or detached. */
PyObject *live_owner(GradBuckets *self)
{
    if (!self->owner) {
        return NULL;
    }
    /* borrowed: PyWeakref_GetRef is 3.13's */
    PyObject *owner = PyWeakref_GetObject(self->owner);
    if (!owner || owner == Py_None) {
        PyErr_Clear();
        return NULL;
    }
    return Py_NewRef(owner);
}

static int64_t bucket_size(GradBuckets *self, int64_t b)
{
    int64_t unit, start, end;
    zero_buckets_range(self->plan, b, &unit, &start, &end);
    return end - start;
}

/* Bucket b's staging (late 0) or late buffer, made by the owner when it
 * is not there yet. */
static bucket_buffer *buffer_of(GradBuckets *self, PyObject *owner, int64_t b,
                                int late)
{
    bucket_buffer *buffer = late ? &self->late[b] : &self->staging[b];
    if (buffer->tensor) {
        return buffer;
    }
    PyObject *index = PyLong_FromLongLong(b);
    if (!index) {
        return NULL;
    }
    PyObject *tensor = PyObject_CallMethodObjArgs(
        owner, str_new_bucket, index, late ? Py_True : Py_False, NULL);
    Py_DECREF(index);
    if (!tensor) {
        return NULL;
    }
    char *data = fast_data(self, tensor, bucket_size(self, b));
    if (!data && PyErr_Occurred()) {
        Py_DECREF(tensor);
        return NULL;
    }
    buffer->tensor = tensor;
    buffer->data = data;
    return buffer;
}

typedef struct {
    GradBuckets *self;
    PyObject *owner;
    bucket_buffer *buffer;
} gap_filling;

/* the owner's _zero_range took the buffer itself (a call back into
 * take_late or the sending) before its gaps were all zeroed */
static const char TAKEN_WHILE_ZEROED[] =
    "a bucket's buffer was taken while its unwritten ranges were being zeroed";

static int zero_gap(void *ctx, int64_t start, int64_t count)
{
    gap_filling *filling = ctx;
    if (filling->buffer->data) {
        size_t itemsize = filling->self->itemsize;
        memset(filling->buffer->data + (size_t)start * itemsize, 0,
               (size_t)count * itemsize);
        return 0;
    }
    if (!filling->owner) {
        PyErr_SetString(PyExc_RuntimeError,
                        "a bucket's unwritten ranges need its owner, which is gone");
        return -1;
    }
    if (!filling->buffer->tensor) {
        PyErr_SetString(PyExc_RuntimeError, TAKEN_WHILE_ZEROED);
        return -1;
    }
    PyObject *result = PyObject_CallMethod(filling->owner, "_zero_range", "OLL",
                                           filling->buffer->tensor,
                                           (long long)start, (long long)count);
    Py_XDECREF(result);
    return result ? 0 : -1;
}

int fill_gaps(GradBuckets *self, PyObject *owner, int64_t b, int late)
{
    bucket_buffer *buffer = late ? &self->late[b] : &self->staging[b];
    gap_filling filling = {self, owner, buffer};
    return zero_buckets_each_gap(self->plan, b, late, zero_gap, &filling) ? -1 : 0;
}

/* Send the buckets that are complete, in order (all that are left when
 * force): the owner's _send_bucket(b, tensor) launches the reduction. */
int send_ready(GradBuckets *self, PyObject *owner, int force)
{
    int64_t b;
    while ((b = zero_buckets_next(self->plan, force)) >= 0) {
        /* a bucket no expected gradient reached still travels (zeros) */
        bucket_buffer *buffer = buffer_of(self, owner, b, 0);
        if (!buffer || fill_gaps(self, owner, b, 0) != 0) {
            return -1;
        }
        PyObject *tensor = buffer->tensor;
        if (!tensor) {  /* taken by a call back from _zero_range */
            PyErr_SetString(PyExc_RuntimeError, TAKEN_WHILE_ZEROED);
            return -1;
        }
        buffer->tensor = NULL;
        buffer->data = NULL;
        PyObject *result = PyObject_CallMethod(owner, "_send_bucket", "LN",
                                               (long long)b, tensor);
        if (!result) {
            return -1;
        }
        Py_DECREF(result);
    }
    return 0;
}

/* Write piece k of parameter i's gradient into its bucket: a copy when it
 * is the first there this backward, else an add ([Note: no zero-fill]). */
static int add_piece(GradBuckets *self, PyObject *owner, int64_t i, int64_t k,
                     const zero_bucket_piece *piece, PyObject *grad,
                     const char *grad_data)
{
    int late = zero_buckets_left(self->plan, piece->bucket);
    bucket_buffer *buffer = buffer_of(self, owner, piece->bucket, late);
    if (!buffer) {
        return -1;
    }
    int first = zero_buckets_claim(self->plan, i, k, late);
    if (grad_data && buffer->data) {
        char *dst = buffer->data + (size_t)piece->bucket_start * self->itemsize;
        const char *src = grad_data + (size_t)piece->grad_start * self->itemsize;
        zero_status (*land)(void *, const void *, zero_dtype, int64_t) =
            first ? zero_copy : zero_accumulate;
        zero_status status;
        if (piece->count < GIL_FREE_ELEMENTS) {
            status = land(dst, src, self->zdtype, piece->count);
        } else {
            /* another thread may reset() or detach() meanwhile, dropping
             * the buffer's tensor: ours keeps its memory under the copy */
            PyObject *keep = Py_NewRef(buffer->tensor);
            Py_BEGIN_ALLOW_THREADS
            status = land(dst, src, self->zdtype, piece->count);
            Py_END_ALLOW_THREADS
            Py_DECREF(keep);
        }
        return status == ZERO_OK ? 0 : (raise_status(status, "accumulate"), -1);
    }
    PyObject *result = PyObject_CallMethod(
        owner, "_add_piece", "OOLLLO", grad, buffer->tensor,
        (long long)piece->bucket_start, (long long)piece->grad_start,
        (long long)piece->count, first ? Py_True : Py_False);
    Py_XDECREF(result);
    return result ? 0 : -1;
}

/* The hook's body for parameter i: see [Note: the hook in C]. */
static int grad_arrived(GradBuckets *self, PyObject *owner, int64_t i,
                        PyObject *param)
{
    int flags = zero_buckets_arrive(self->plan, i);
    if (flags < 0) {
        PyErr_Format(PyExc_IndexError, "parameter index %lld out of range",
                     (long long)i);
        return -1;
    }
    if (flags & ZERO_ARRIVE_BACKWARD) {
        PyObject *result = PyObject_CallMethodNoArgs(owner, str_backward_began);
        if (!result) {
            return -1;
        }
        Py_DECREF(result);
    }
    PyObject *grad = PyObject_GetAttr(param, str_grad);
    if (!grad) {
        return -1;
    }
    int error = 0;
    if (grad == Py_None) {
        /* torch ran the engine's post-accumulate hook with .grad None: a
           hook registered before it (the script's) dropped the gradient,
           as an optimizer stepped inside backward does */
        PyErr_Format(PyExc_RuntimeError,
                     "the engine's gradient hook of parameter %lld of its group found "
                     ".grad None: a post-accumulate-grad hook registered before "
                     "zero.initialize set it to None (an optimizer stepped in backward "
                     "does). At stages 2-3 the engine takes each gradient in its own hook "
                     "and steps the parameters itself: remove that hook, or use stage 0-1",
                     (long long)i);
        error = -1;
    }
    const char *data = NULL;
    if (!error) {
        data = fast_data(self, grad, self->param_numel[i]);
        error = !data && PyErr_Occurred() ? -1 : 0;
    }
    const zero_bucket_piece *pieces;
    int64_t count = zero_buckets_pieces(self->plan, i, &pieces);
    for (int64_t k = 0; k < count && !error; k++) {
        error = add_piece(self, owner, i, k, &pieces[k], grad, data);
        if (!error && (flags & ZERO_ARRIVE_COUNTED)) {
            zero_buckets_piece_added(self->plan, pieces[k].bucket);
            /* send as soon as a bucket completes, so a parameter spanning
             * many buckets never holds them all at once */
            error = send_ready(self, owner, 0);
        }
    }
    Py_DECREF(grad);
    if (error || PyObject_SetAttr(param, str_grad, Py_None) != 0) {
        return -1;
    }
    if (flags & ZERO_ARRIVE_FIRST) {
        int64_t unit = zero_buckets_unit_arrived(self->plan, i);
        if (unit >= 0) {
            PyObject *result =
                PyObject_CallMethod(owner, "_unit_arrived", "L", (long long)unit);
            if (!result) {
                return -1;
            }
            Py_DECREF(result);
        }
    }
    return 0;
}

/* ---- BucketHook --------------------------------------------------------- */

static PyObject *BucketHook_call(BucketHook *self, PyObject *args,
                                 PyObject *kwargs)
{
    PyObject *param;
    if ((kwargs && PyDict_GET_SIZE(kwargs) != 0) ||
        !PyArg_ParseTuple(args, "O:BucketHook", &param)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "BucketHook takes one parameter");
        }
        return NULL;
    }
    PyObject *owner = live_owner(self->buckets);
    if (!owner) {
        Py_RETURN_NONE; /* the engine is gone or closed: nothing to do */
    }
    int error = grad_arrived(self->buckets, owner, self->index, param);
    Py_DECREF(owner);
    if (error) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static void BucketHook_dealloc(BucketHook *self)
{
    PyTypeObject *type = Py_TYPE(self);
    Py_XDECREF(self->buckets);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static PyType_Slot BucketHook_slots[] = {
    {Py_tp_doc, "The post-accumulate-grad hook of one parameter of a "
                "GradBuckets (made by GradBuckets.hook)."},
    {Py_tp_call, BucketHook_call},
    {Py_tp_dealloc, BucketHook_dealloc},
    {0, NULL},
};

static PyType_Spec BucketHook_spec = {
    .name = "zero._C.BucketHook",
    .basicsize = sizeof(BucketHook),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = BucketHook_slots,
};

PyObject *make_bucket_hook_type(PyObject *module)
{
    struct {
        PyObject **at;
        const char *text;
    } names[] = {
        {&str_grad, "grad"},
        {&str_dtype, "dtype"},
        {&str_is_cpu, "is_cpu"},
        {&str_layout, "layout"},
        {&str_is_contiguous, "is_contiguous"},
        {&str_numel, "numel"},
        {&str_data_ptr, "data_ptr"},
        {&str_new_bucket, "_new_bucket"},
        {&str_backward_began, "_backward_began"},
    };
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        if (!*names[k].at &&
            !(*names[k].at = PyUnicode_InternFromString(names[k].text))) {
            return NULL;
        }
    }
    return PyType_FromModuleAndSpec(module, &BucketHook_spec, NULL);
}
