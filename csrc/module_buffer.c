/* module_buffer.c: the Buffer type (a DLPack tensor consumed once and checked
 * once) and the argument checks every binding function uses; see module.h.
 *
 * Tensors arrive as DLPack capsules (or objects with __dlpack__). A Buffer
 * checks dtype, shape, strides and alignment when it is made; the device is
 * checked by each function that takes it, so one Buffer type serves the CPU
 * core and the CUDA kernels. Core statuses become exceptions in one place,
 * raise_status().
 */
#include "module.h"

#include <string.h>

/* ---- Buffer ---------------------------------------------------------- */

static void Buffer_dealloc(Buffer *self)
{
    PyTypeObject *type = Py_TYPE(self);
    if (self->legacy && self->legacy->deleter) {
        self->legacy->deleter(self->legacy);
    }
    if (self->versioned && self->versioned->deleter) {
        self->versioned->deleter(self->versioned);
    }
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static int dtype_from_dl(dl_dtype dt, zero_dtype *out)
{
    if (dt.lanes != 1) {
        return -1;
    }
    if (dt.code == DL_CODE_FLOAT && dt.bits == 32) {
        *out = ZERO_F32;
    } else if (dt.code == DL_CODE_FLOAT && dt.bits == 16) {
        *out = ZERO_F16;
    } else if (dt.code == DL_CODE_BFLOAT && dt.bits == 16) {
        *out = ZERO_BF16;
    } else {
        return -1;
    }
    return 0;
}

static const char *device_name(int device_type)
{
    switch (device_type) {
    case DL_CPU:
        return "cpu";
    case DL_CUDA:
        return "cuda";
    case DL_CUDA_HOST:
        return "cuda pinned host";
    default:
        return "an unsupported device";
    }
}

/* Devices a function asks for; a Buffer can be made of either. */
enum { WANT_ANY = 0, WANT_CPU = 1, WANT_CUDA = 2 };

/* Raise unless a tensor on device_type can serve a function that wants
 * `want`. Pinned host memory is CPU memory to the core. */
static int check_device(int device_type, int want, const char *name)
{
    int is_cpu = device_type == DL_CPU || device_type == DL_CUDA_HOST;
    int is_cuda = device_type == DL_CUDA;
    const char *need = NULL;
    if (!is_cpu && !is_cuda) {
        need = "zero takes CPU or CUDA tensors";
    } else if (want == WANT_CPU && !is_cpu) {
        need = "this operation needs a CPU tensor: move it with .cpu()";
    } else if (want == WANT_CUDA && !is_cuda) {
        need = "the cuda_* functions need a CUDA tensor";
    }
    if (need) {
        PyErr_Format(PyExc_ValueError, "%s is on %s (device type %d); %s",
                     name, device_name(device_type), device_type, need);
        return -1;
    }
    return 0;
}

/* Fill self from a dl_tensor; on failure raise and return -1 (the caller
 * still owns the managed tensor and frees it through the Buffer). */
static int describe_tensor(Buffer *self, const dl_tensor *t, const char *name,
                           int want)
{
    self->device_type = t->device.device_type;
    self->device_id = t->device.device_id;
    if (check_device(t->device.device_type, want, name) != 0) {
        return -1;
    }
    if (dtype_from_dl(t->dtype, &self->dtype) != 0) {
        PyErr_Format(PyExc_TypeError,
                     "%s has an unsupported dtype (DLPack code %d, %d bits, "
                     "%d lanes); expected float32, bfloat16 or float16",
                     name, (int)t->dtype.code, (int)t->dtype.bits,
                     (int)t->dtype.lanes);
        return -1;
    }
    if (t->ndim < 0) {
        PyErr_Format(PyExc_ValueError, "%s has ndim %d", name, (int)t->ndim);
        return -1;
    }
    int64_t numel = 1;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] < 0) {
            PyErr_Format(PyExc_ValueError, "%s has a negative dimension",
                         name);
            return -1;
        }
        if (__builtin_mul_overflow(numel, t->shape[d], &numel)) {
            PyErr_Format(PyExc_ValueError,
                         "%s has more elements than 64 bits count", name);
            return -1;
        }
    }
    if (numel > 0 && t->strides) {
        int64_t expected = 1;
        for (int d = t->ndim - 1; d >= 0; d--) {
            if (t->shape[d] != 1 && t->strides[d] != expected) {
                PyErr_Format(PyExc_ValueError,
                             "%s is not contiguous (dimension %d has stride "
                             "%lld, contiguous would be %lld); pass "
                             "tensor.contiguous()",
                             name, d, (long long)t->strides[d],
                             (long long)expected);
                return -1;
            }
            expected *= t->shape[d];
        }
    }
    size_t item = zero_dtype_size(self->dtype);
    int64_t nbytes;
    if (__builtin_mul_overflow(numel, (int64_t)item, &nbytes)) {
        PyErr_Format(PyExc_ValueError,
                     "%s has more bytes than 64 bits count", name);
        return -1;
    }
    if (numel > 0 && !t->data) {
        /* a producer's capsule with no memory behind its elements: the
         * core would read or write near address 0 */
        PyErr_Format(PyExc_ValueError,
                     "%s has %lld elements but no data (a NULL pointer)",
                     name, (long long)numel);
        return -1;
    }
    char *data = (char *)t->data + t->byte_offset;
    if (numel > 0 && ((uintptr_t)data % item) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s starts at address %p, not aligned to its %zu-byte "
                     "elements",
                     name, (void *)data, item);
        return -1;
    }
    self->data = data;
    self->numel = numel;
    return 0;
}

/* Raise `type` with "<name> <message>", chained from the exception being
 * handled (its cause), as `raise ... from exc` would. */
static void raise_from_current(PyObject *type, const char *message,
                               const char *name)
{
    PyObject *cause_type, *cause, *cause_tb;
    PyErr_Fetch(&cause_type, &cause, &cause_tb);
    PyErr_NormalizeException(&cause_type, &cause, &cause_tb);
    if (cause_tb) {
        PyException_SetTraceback(cause, cause_tb);
    }
    PyErr_Format(type, "%s %s", name, message);
    PyObject *new_type, *value, *tb;
    PyErr_Fetch(&new_type, &value, &tb);
    PyErr_NormalizeException(&new_type, &value, &tb);
    if (cause) {
        PyException_SetContext(value, Py_NewRef(cause));
        PyException_SetCause(value, cause); /* steals cause */
    }
    Py_XDECREF(cause_type);
    Py_XDECREF(cause_tb);
    PyErr_Restore(new_type, value, tb);
}

/* Make a Buffer from a capsule or an object with __dlpack__. */
static Buffer *buffer_from_object(module_state *st, PyObject *obj,
                                  const char *name, int want)
{
    PyObject *capsule = NULL;
    if (PyCapsule_CheckExact(obj)) {
        capsule = Py_NewRef(obj);
    } else {
        PyObject *method = PyObject_GetAttrString(obj, "__dlpack__");
        if (!method) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "%s must be a tensor (an object with __dlpack__) or "
                         "a DLPack capsule, not %.100s",
                         name, Py_TYPE(obj)->tp_name);
            return NULL;
        }
        capsule = PyObject_CallNoArgs(method);
        Py_DECREF(method);
        if (!capsule) {
            /* An interrupt (Ctrl-C lands in torch's Python __dlpack__),
             * SystemExit or MemoryError is not about the tensor: it goes
             * on as it is, so `except KeyboardInterrupt` still sees it */
            if (!PyErr_ExceptionMatches(PyExc_Exception) ||
                PyErr_ExceptionMatches(PyExc_MemoryError)) {
                return NULL;
            }
            raise_from_current(PyExc_TypeError,
                               "could not be exported through DLPack (for a "
                               "parameter, pass param.detach())",
                               name);
            return NULL;
        }
    }
    Buffer *self = PyObject_New(Buffer, st->buffer_type);
    if (!self) {
        Py_DECREF(capsule);
        return NULL;
    }
    self->legacy = NULL;
    self->versioned = NULL;
    self->data = NULL;
    self->numel = 0;
    self->readonly = 0;
    self->device_type = DL_CPU;
    self->device_id = 0;
    const dl_tensor *tensor = NULL;
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        self->legacy = PyCapsule_GetPointer(capsule, "dltensor");
        tensor = &self->legacy->tensor;
        PyCapsule_SetName(capsule, "used_dltensor");
    } else if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        self->versioned = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (self->versioned->version.major != 1) {
            /* Not ours to read: leave the capsule to free it. */
            unsigned major = self->versioned->version.major;
            self->versioned = NULL;
            Py_DECREF(capsule);
            Py_DECREF(self);
            PyErr_Format(PyExc_TypeError,
                         "%s is a DLPack %u.x tensor; only 1.x is supported",
                         name, major);
            return NULL;
        }
        tensor = &self->versioned->tensor;
        self->readonly = (self->versioned->flags & DL_FLAG_READ_ONLY) != 0;
        PyCapsule_SetName(capsule, "used_dltensor_versioned");
    } else {
        Py_DECREF(capsule);
        Py_DECREF(self);
        PyErr_Format(PyExc_TypeError,
                     "%s is a capsule that holds no unused DLPack tensor "
                     "(a DLPack capsule can be consumed only once)",
                     name);
        return NULL;
    }
    Py_DECREF(capsule);
    if (describe_tensor(self, tensor, name, want) != 0) {
        Py_DECREF(self);
        return NULL;
    }
    return self;
}

static PyObject *Buffer_new(PyTypeObject *type, PyObject *args,
                            PyObject *kwargs)
{
    static char *keywords[] = {"tensor", NULL};
    PyObject *obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:Buffer", keywords,
                                     &obj)) {
        return NULL;
    }
    module_state *st = PyType_GetModuleState(type);
    if (!st) {
        return NULL;
    }
    return (PyObject *)buffer_from_object(st, obj, "tensor", WANT_ANY);
}

static PyObject *Buffer_get_numel(Buffer *self, void *closure)
{
    (void)closure;
    return PyLong_FromLongLong(self->numel);
}

static PyObject *Buffer_get_dtype(Buffer *self, void *closure)
{
    (void)closure;
    return PyUnicode_FromString(zero_dtype_name(self->dtype));
}

static PyObject *Buffer_get_address(Buffer *self, void *closure)
{
    (void)closure;
    return PyLong_FromVoidPtr(self->data);
}

static PyObject *Buffer_get_device(Buffer *self, void *closure)
{
    (void)closure;
    if (self->device_type == DL_CUDA) {
        return PyUnicode_FromFormat("cuda:%d", self->device_id);
    }
    return PyUnicode_FromString("cpu");
}

static PyObject *Buffer_repr(Buffer *self)
{
    PyObject *device = Buffer_get_device(self, NULL);
    if (!device) {
        return NULL;
    }
    PyObject *repr = PyUnicode_FromFormat(
        "<zero._C.Buffer %s[%lld] on %U at %p>", zero_dtype_name(self->dtype),
        (long long)self->numel, device, self->data);
    Py_DECREF(device);
    return repr;
}

static PyGetSetDef Buffer_getset[] = {
    {"numel", (getter)Buffer_get_numel, NULL, "number of elements", NULL},
    {"dtype", (getter)Buffer_get_dtype, NULL, "element type name", NULL},
    {"address", (getter)Buffer_get_address, NULL, "address of element 0",
     NULL},
    {"device", (getter)Buffer_get_device, NULL, "'cpu' or 'cuda:<index>'",
     NULL},
    {NULL},
};

static PyType_Slot Buffer_slots[] = {
    {Py_tp_doc, "Buffer(tensor): a flat view of a contiguous CPU or CUDA "
                "tensor, checked once and held for later calls."},
    {Py_tp_new, Buffer_new},
    {Py_tp_dealloc, Buffer_dealloc},
    {Py_tp_repr, Buffer_repr},
    {Py_tp_getset, Buffer_getset},
    {0, NULL},
};

static PyType_Spec Buffer_spec = {
    .name = "zero._C.Buffer",
    .basicsize = sizeof(Buffer),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Buffer_slots,
};

int add_buffer_type(PyObject *module)
{
    module_state *st = get_state(module);
    st->buffer_type = (PyTypeObject *)PyType_FromModuleAndSpec(
        module, &Buffer_spec, NULL);
    if (!st->buffer_type) {
        return -1;
    }
    return PyModule_AddType(module, st->buffer_type);
}

/* ---- argument helpers -------------------------------------------------- */

/* A Buffer for an argument on the device a function wants: a new reference
 * (the given Buffer, or one made from a tensor), or NULL with an exception
 * set. */

static Buffer *buffer_on(PyObject *module, PyObject *obj, const char *name,
                         int want)
{
    module_state *st = get_state(module);
    if (Py_IS_TYPE(obj, st->buffer_type)) {
        Buffer *b = (Buffer *)obj;
        if (check_device(b->device_type, want, name) != 0) {
            return NULL;
        }
        return (Buffer *)Py_NewRef(obj);
    }
    return buffer_from_object(st, obj, name, want);
}

Buffer *as_buffer(PyObject *module, PyObject *obj, const char *name)
{
    return buffer_on(module, obj, name, WANT_CPU);
}

Buffer *as_cuda_buffer(PyObject *module, PyObject *obj, const char *name)
{
    return buffer_on(module, obj, name, WANT_CUDA);
}

int check_dtype(const named_buffer *b, int allow_half)
{
    if (b->buf->dtype == ZERO_F32 || allow_half) {
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "%s must be float32, got %s", b->name,
                 zero_dtype_name(b->buf->dtype));
    return -1;
}

/* Sizes equal, written buffers writable, and no two buffers overlapping. */
int check_together(const named_buffer *bufs, int count)
{
    for (int i = 0; i < count; i++) {
        const Buffer *a = bufs[i].buf;
        if (!a) {
            continue;
        }
        if (a->numel != bufs[0].buf->numel) {
            PyErr_Format(PyExc_ValueError, "%s has %lld elements, %s has %lld",
                         bufs[i].name, (long long)a->numel, bufs[0].name,
                         (long long)bufs[0].buf->numel);
            return -1;
        }
        if (bufs[i].written && a->readonly) {
            PyErr_Format(PyExc_ValueError, "%s is read-only", bufs[i].name);
            return -1;
        }
        const char *a_begin = a->data;
        const char *a_end = a_begin + a->numel * zero_dtype_size(a->dtype);
        for (int j = 0; j < i; j++) {
            const Buffer *b = bufs[j].buf;
            if (!b || a->numel == 0) {
                continue;
            }
            const char *b_begin = b->data;
            const char *b_end = b_begin + b->numel * zero_dtype_size(b->dtype);
            if (a_begin < b_end && b_begin < a_end) {
                PyErr_Format(PyExc_ValueError,
                             "%s and %s overlap in memory; each needs its own "
                             "storage",
                             bufs[i].name, bufs[j].name);
                return -1;
            }
        }
    }
    return 0;
}

void release_buffers(named_buffer *bufs, int count)
{
    for (int i = 0; i < count; i++) {
        Py_XDECREF(bufs[i].buf);
        bufs[i].buf = NULL;
    }
}

/* Convert the objects to Buffers (NULL or None: an optional one absent);
 * -1 on error. */
int collect_buffers(PyObject *module, named_buffer *bufs, PyObject **objs,
                    int count)
{
    for (int i = 0; i < count; i++) {
        bufs[i].buf = NULL;
    }
    for (int i = 0; i < count; i++) {
        if (bufs[i].optional && (!objs[i] || objs[i] == Py_None)) {
            continue;
        }
        bufs[i].buf = as_buffer(module, objs[i] ? objs[i] : Py_None,
                                bufs[i].name);
        if (!bufs[i].buf) {
            release_buffers(bufs, count);
            return -1;
        }
    }
    return 0;
}

PyObject *raise_status(zero_status status, const char *what)
{
    PyObject *type = PyExc_RuntimeError;
    if (status == ZERO_ERR_INVALID_ARGUMENT) {
        type = PyExc_ValueError;
    } else if (status == ZERO_ERR_UNSUPPORTED_DTYPE) {
        type = PyExc_TypeError;
    } else if (status == ZERO_ERR_OUT_OF_MEMORY) {
        type = PyExc_MemoryError;
    }
    PyErr_Format(type, "%s failed: %s", what, zero_status_string(status));
    return NULL;
}

