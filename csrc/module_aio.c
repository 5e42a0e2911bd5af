/* module_aio.c: the binding of the disk I/O engine (csrc/aio.c): the type
 * zero._C.Aio and the function aio_info().
 *
 * An Aio holds one engine. submit_read/submit_write take a descriptor, a
 * CPU tensor (a DLPack capsule or an object with __dlpack__) and a byte
 * offset, and return the request's id; wait(id) or wait() waits with the
 * GIL released. Until its request has been waited for, the tensor's Buffer
 * stays in the Aio (`held`), so the memory the engine moves outlives the
 * transfer even when the caller drops the tensor, an exception cuts a wait
 * short, or the Aio itself is freed (its engine is destroyed, waiting for
 * what is in flight, before the Buffers go).
 *
 * A failed request raises OSError with the errno, the file offset where it
 * failed, and the request's descriptor, offset and size, as the attributes
 * fd, offset, request_offset and nbytes, so the caller can name its file
 * (module_aio_requests.c, with the checks a request passes first).
 *
 * [Note: Aio and threads] submit and wait run the engine without the GIL,
 * so other threads may call in meanwhile. `users` counts the calls inside
 * the engine: close() while one is there is refused (it would free the
 * engine under it, and the held Buffers under transfers still running).
 * A waiter holds its own reference to the request's entry: two threads
 * waiting for one request each see it whole, and the one that loses is
 * told the request is no longer in flight. An Aio is its process's: a
 * forked child has none of the engine's threads (a wait there never
 * ended, and io_uring's completions went to the parent's reaper), so
 * submit and wait refuse in a child.
 */
#include "module.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

/* How long a wait blocks before it looks at Python's signals (Ctrl-C). */
#define SIGNAL_POLL_MS 100

typedef struct {
    PyObject_HEAD
    zero_aio *aio;         /* NULL once closed */
    PyObject *held;        /* {id: (Buffer, fd, offset, nbytes, write)} */
    pid_t pid;             /* the process that made it */
    int users;             /* calls inside the engine ([Note: Aio and threads]) */
} Aio;

/* ---- construction ------------------------------------------------------ */

typedef struct {
    int64_t queue_depth, block_size;
    PyObject *backend;
} aio_new_call;

static const arg_spec aio_new_args[] = {
    ARG(aio_new_call, queue_depth, "queue_depth", ARG_INT64, CHECK_COUNT, 0,
        32),
    ARG(aio_new_call, block_size, "block_size", ARG_INT64, CHECK_COUNT, 0,
        1 << 20),
    ARG(aio_new_call, backend, "backend", ARG_OBJECT, CHECK_NONE, 0, 0),
};

static const signature aio_new_sig =
    SIGNATURE("Aio", aio_new_args, 0, 3, aio_new_call);

static int backend_from(PyObject *obj, zero_aio_backend *out)
{
    if (!obj) {
        *out = ZERO_AIO_AUTO;
        return 0;
    }
    zero_aio_backend all[] = {ZERO_AIO_AUTO, ZERO_AIO_THREADS,
                              ZERO_AIO_URING};
    for (int i = 0; PyUnicode_Check(obj) && i < 3; i++) {
        if (PyUnicode_CompareWithASCIIString(
                obj, zero_aio_backend_name(all[i])) == 0) {
            *out = all[i];
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError,
                 "backend must be 'auto', 'threads' or 'io_uring', got %R",
                 obj);
    return -1;
}

static PyObject *Aio_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    aio_new_call call;
    zero_aio_backend backend;
    if (parse_args(&aio_new_sig, args, kwargs, &call) != 0 ||
        backend_from(call.backend, &backend) != 0) {
        return NULL;
    }
    if (call.queue_depth > ZERO_AIO_MAX_QUEUE_DEPTH) {
        PyErr_Format(PyExc_ValueError, "queue_depth must be at most %d, got %lld",
                     ZERO_AIO_MAX_QUEUE_DEPTH, (long long)call.queue_depth);
        return NULL;
    }
    if (call.block_size % ZERO_AIO_ALIGN != 0 ||
        call.block_size > ZERO_AIO_MAX_BLOCK) {
        PyErr_Format(PyExc_ValueError,
                     "block_size must be a multiple of %d bytes up to %lld, "
                     "got %lld",
                     ZERO_AIO_ALIGN, (long long)ZERO_AIO_MAX_BLOCK,
                     (long long)call.block_size);
        return NULL;
    }
    Aio *self = (Aio *)type->tp_alloc(type, 0);
    if (!self) {
        return NULL;
    }
    self->pid = getpid();
    self->held = PyDict_New();
    if (!self->held) {
        Py_DECREF(self);
        return NULL;
    }
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_aio_create(&self->aio, backend, (int)call.queue_depth,
                             call.block_size);
    Py_END_ALLOW_THREADS
    if (status == ZERO_ERR_UNAVAILABLE) {
        int error = zero_aio_uring_probe();
        PyErr_Format(PyExc_OSError,
                     "backend='io_uring' cannot run here (%s); use "
                     "backend='auto' or 'threads'",
                     strerror(error ? error : ENOSYS));
        Py_DECREF(self);
        return NULL;
    }
    if (status != ZERO_OK) {
        Py_DECREF(self);
        return raise_status(status, "Aio");
    }
    return (PyObject *)self;
}

/* Destroy the engine (it waits for what is in flight), then let the
 * Buffers go. */
static void close_engine(Aio *self)
{
    zero_aio *aio = self->aio;
    self->aio = NULL;
    if (aio) {
        Py_BEGIN_ALLOW_THREADS
        zero_aio_destroy(aio);
        Py_END_ALLOW_THREADS
    }
    if (self->held) {
        PyDict_Clear(self->held);
    }
}

static void Aio_dealloc(Aio *self)
{
    PyTypeObject *type = Py_TYPE(self);
    close_engine(self);
    Py_CLEAR(self->held);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static int check_open(const Aio *self)
{
    if (!self->aio) {
        PyErr_SetString(PyExc_ValueError, "this Aio was closed");
        return -1;
    }
    return 0;
}

/* Open, and this process's ([Note: Aio and threads]). */
static int check_usable(const Aio *self)
{
    if (check_open(self) != 0) {
        return -1;
    }
    if (getpid() != self->pid) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this Aio was made in another process (this one was "
                        "forked from it) and its engine's threads are "
                        "there: make a new Aio in this process");
        return -1;
    }
    return 0;
}

/* ---- submit ------------------------------------------------------------ */

typedef struct {
    int64_t fd;
    PyObject *tensor;
    int64_t offset;
} submit_call;

static const arg_spec submit_args[] = {
    ARG(submit_call, fd, "fd", ARG_INT64, CHECK_INDEX, ARG_REQUIRED, 0),
    ARG(submit_call, tensor, "tensor", ARG_TENSOR, CHECK_NONE, ARG_REQUIRED,
        0),
    ARG(submit_call, offset, "offset", ARG_INT64, CHECK_INDEX, 0, 0),
};

static const signature read_sig =
    SIGNATURE("submit_read", submit_args, 2, 3, submit_call);
static const signature write_sig =
    SIGNATURE("submit_write", submit_args, 2, 3, submit_call);

static PyObject *submit(Aio *self, PyObject *args, PyObject *kwargs,
                        const signature *sig, int write)
{
    submit_call call;
    if (check_usable(self) != 0 || parse_args(sig, args, kwargs, &call) != 0) {
        return NULL;
    }
    if (call.fd > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "fd must be a file descriptor, got %lld",
                     (long long)call.fd);
        return NULL;
    }
    PyObject *module = PyType_GetModule(Py_TYPE(self));
    if (!module) {
        return NULL;
    }
    Buffer *b = as_buffer(module, call.tensor, "tensor");
    if (!b) {
        return NULL;
    }
    PyObject *result = NULL, *entry = NULL;
    int64_t nbytes = b->numel * (int64_t)zero_dtype_size(b->dtype);
    if (!write && b->readonly) {
        PyErr_SetString(PyExc_ValueError,
                        "submit_read: tensor is read-only; a read writes it");
        goto done;
    }
    if (nbytes > INT64_MAX - call.offset) {
        PyErr_Format(PyExc_ValueError,
                     "%s: offset %lld + %lld bytes is past the largest file "
                     "offset",
                     sig->function, (long long)call.offset, (long long)nbytes);
        goto done;
    }
    if (check_descriptor(sig->function, (int)call.fd, write, b, call.offset,
                         nbytes) != 0) {
        goto done;
    }
    /* the tensor's __dlpack__ and the arguments' __index__ ran Python code,
     * which may have closed this Aio meanwhile */
    if (check_usable(self) != 0) {
        goto done;
    }
    zero_aio_request request = {(int)call.fd, b->data, nbytes, call.offset,
                                write};
    int64_t id = -1;
    zero_status status;
    zero_aio *aio = self->aio; /* close() is refused while users > 0 */
    self->users++;
    /* io_uring may do a buffered transfer inline: without the GIL */
    Py_BEGIN_ALLOW_THREADS
    status = zero_aio_submit(aio, &request, &id);
    Py_END_ALLOW_THREADS
    if (status != ZERO_OK) {
        self->users--;
        raise_status(status, sig->function);
        goto done;
    }
    /* from here the engine uses b's memory: it must be held, and if even
     * that fails, waited for before b goes */
    result = PyLong_FromLongLong(id);
    entry = Py_BuildValue("(OiLLi)", (PyObject *)b, (int)call.fd,
                          (long long)call.offset, (long long)nbytes, write);
    if (!result || !entry || PyDict_SetItem(self->held, result, entry) != 0) {
        zero_aio_result ignored;
        Py_BEGIN_ALLOW_THREADS
        zero_aio_wait(aio, id, -1, &ignored);
        Py_END_ALLOW_THREADS
        Py_CLEAR(result);
    }
    self->users--;
done:
    Py_XDECREF(entry);
    Py_DECREF(b);
    return result;
}

static PyObject *Aio_submit_read(Aio *self, PyObject *args, PyObject *kwargs)
{
    return submit(self, args, kwargs, &read_sig, 0);
}

static PyObject *Aio_submit_write(Aio *self, PyObject *args, PyObject *kwargs)
{
    return submit(self, args, kwargs, &write_sig, 1);
}

/* ---- wait -------------------------------------------------------------- */

static int not_in_flight(PyObject *key, const char *why)
{
    PyErr_Format(PyExc_ValueError, "request %R is not in flight on this Aio "
                 "(%s)", key, why);
    return -1;
}

/* Wait for request `key` (an int in held). 0: it succeeded; 1: it failed,
 * with its OSError set; 2: another thread's wait took it while this one
 * waited (missing_ok), -1 when not missing_ok; -1: no such request, or a
 * signal's exception (it is still in flight then). */
static int wait_one(Aio *self, PyObject *key, int missing_ok)
{
    PyObject *entry = PyDict_GetItemWithError(self->held, key);
    if (!entry) {
        if (PyErr_Occurred()) {
            return -1;
        }
        return missing_ok ? 2 : not_in_flight(key, "already waited for, or "
                                              "never submitted");
    }
    Py_INCREF(entry); /* another waiter may drop held's ([Note: Aio and threads]) */
    int64_t id = PyLong_AsLongLong(key);
    zero_aio *aio = self->aio; /* close() is refused while users > 0 */
    zero_aio_result result;
    zero_status status;
    self->users++;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        status = zero_aio_wait(aio, id, SIGNAL_POLL_MS, &result);
        Py_END_ALLOW_THREADS
        if (status != ZERO_ERR_TIMEOUT) {
            break;
        }
        if (PyErr_CheckSignals() != 0) {
            self->users--;
            Py_DECREF(entry);
            return -1;
        }
    }
    self->users--;
    if (status == ZERO_ERR_INVALID_ARGUMENT) {
        /* the engine knows the id no more: another thread's wait took it
         * (that wait drops the entry from held, if it has not yet) */
        Py_DECREF(entry);
        return missing_ok ? 2 : not_in_flight(key, "another thread waited "
                                              "for it");
    }
    int outcome = 0;
    if (status == ZERO_ERR_IO) {
        raise_failure(entry, &result);
        outcome = 1;
    } else if (status != ZERO_OK) {
        raise_status(status, "wait");
        outcome = -1;
    }
    PyObject *exc_type, *exc, *tb;
    PyErr_Fetch(&exc_type, &exc, &tb);
    /* held's entry for key is this request's: an id is never reused while
     * its entry is held, since the engine frees the id only in a wait */
    if (PyDict_DelItem(self->held, key) != 0) {
        PyErr_Clear();
    }
    PyErr_Restore(exc_type, exc, tb);
    Py_DECREF(entry);
    return outcome;
}

PyDoc_STRVAR(Aio_wait_doc,
"wait(request=None)\n--\n\n"
"Wait for one request (the id submit_read or submit_write returned), or\n"
"with None for every request in flight, and raise OSError if one failed\n"
"(the first one in submission order; all are waited for first). The\n"
"OSError has errno and the attributes fd, offset (where it failed),\n"
"request_offset and nbytes. A read past the end of the file is an\n"
"OSError without errno. Ctrl-C interrupts the wait, not the transfers:\n"
"their tensors stay held until a later wait.");

static PyObject *Aio_wait(Aio *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"request", NULL};
    PyObject *request = Py_None;
    if (check_usable(self) != 0 ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "|O:wait", keywords,
                                     &request)) {
        return NULL;
    }
    if (request != Py_None) {
        if (!PyLong_Check(request)) {
            PyErr_Format(PyExc_TypeError,
                         "request must be an int (a submit's id) or None, "
                         "not %.100s",
                         Py_TYPE(request)->tp_name);
            return NULL;
        }
        return wait_one(self, request, 0) == 0 ? Py_NewRef(Py_None) : NULL;
    }
    PyObject *keys = PyDict_Keys(self->held);
    if (!keys) {
        return NULL;
    }
    PyObject *first_type = NULL, *first = NULL, *first_tb = NULL;
    int stopped = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys) && !stopped; i++) {
        int outcome = wait_one(self, PyList_GET_ITEM(keys, i), 1);
        if (outcome == 1 && !first_type) {
            PyErr_Fetch(&first_type, &first, &first_tb);
        } else if (outcome == 1) {
            PyErr_Clear();
        } else if (outcome < 0) {
            stopped = 1; /* a signal: hand its exception on at once */
        }
    }
    Py_DECREF(keys);
    if (stopped) {
        Py_XDECREF(first_type);
        Py_XDECREF(first);
        Py_XDECREF(first_tb);
        return NULL;
    }
    if (first_type) {
        PyErr_Restore(first_type, first, first_tb);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Aio_close(Aio *self, PyObject *unused)
{
    (void)unused;
    if (self->users > 0 && getpid() == self->pid) { /* a child has no such thread */
        PyErr_SetString(PyExc_RuntimeError,
                        "close() while another thread submits to or waits on "
                        "this Aio: its transfers would lose their memory; "
                        "close it once that call returns");
        return NULL;
    }
    close_engine(self);
    Py_RETURN_NONE;
}

static PyObject *Aio_get_backend(Aio *self, void *closure)
{
    (void)closure;
    if (check_open(self) != 0) {
        return NULL;
    }
    return PyUnicode_FromString(
        zero_aio_backend_name(zero_aio_backend_of(self->aio)));
}

static PyObject *Aio_get_in_flight(Aio *self, void *closure)
{
    (void)closure;
    return PyLong_FromSsize_t(self->held ? PyDict_Size(self->held) : 0);
}

static PyObject *Aio_get_busy(Aio *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(self->users);
}

static PyMethodDef Aio_methods[] = {
    {"submit_read", (PyCFunction)(void (*)(void))Aio_submit_read,
     METH_VARARGS | METH_KEYWORDS,
     "submit_read(fd, tensor, offset=0) -> int\n--\n\n"
     "Start reading tensor's bytes from fd at byte offset; returns the\n"
     "request's id for wait()."},
    {"submit_write", (PyCFunction)(void (*)(void))Aio_submit_write,
     METH_VARARGS | METH_KEYWORDS,
     "submit_write(fd, tensor, offset=0) -> int\n--\n\n"
     "Start writing tensor's bytes to fd at byte offset; returns the\n"
     "request's id for wait()."},
    {"wait", (PyCFunction)(void (*)(void))Aio_wait,
     METH_VARARGS | METH_KEYWORDS, Aio_wait_doc},
    {"close", (PyCFunction)Aio_close, METH_NOARGS,
     "close()\n--\n\nWait for every transfer in flight (their failures are "
     "not raised), then stop the engine."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Aio_getset[] = {
    {"backend", (getter)Aio_get_backend, NULL,
     "'io_uring' or 'threads': the backend that runs", NULL},
    {"in_flight", (getter)Aio_get_in_flight, NULL,
     "requests not yet waited for", NULL},
    {"busy", (getter)Aio_get_busy, NULL,
     "calls inside the engine now (submits and waits of other threads): "
     "close() is refused while any is", NULL},
    {NULL},
};

static PyType_Slot Aio_slots[] = {
    {Py_tp_doc,
     "Aio(queue_depth=32, block_size=1048576, backend='auto'): an async\n"
     "disk I/O engine. Requests are cut into blocks of block_size bytes, at\n"
     "most queue_depth in flight. backend 'auto' takes io_uring where the\n"
     "kernel allows it (or what $ZERO_AIO says) and threads otherwise."},
    {Py_tp_new, Aio_new},
    {Py_tp_dealloc, Aio_dealloc},
    {Py_tp_methods, Aio_methods},
    {Py_tp_getset, Aio_getset},
    {0, NULL},
};

static PyType_Spec Aio_spec = {
    .name = "zero._C.Aio",
    .basicsize = sizeof(Aio),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Aio_slots,
};

/* ---- aio_info ---------------------------------------------------------- */

static PyObject *zero_C_aio_info(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    int error;
    Py_BEGIN_ALLOW_THREADS
    error = zero_aio_uring_probe();
    Py_END_ALLOW_THREADS
    const char *env = getenv(ZERO_AIO_ENV);
    int threads = error != 0 || (env && strcmp(env, "threads") == 0);
    return Py_BuildValue("{s:s,s:O,s:z,s:s,s:z}", "default",
                         threads ? "threads" : "io_uring", "io_uring",
                         error == 0 ? Py_True : Py_False, "io_uring_error",
                         error ? strerror(error) : NULL, "env_var",
                         ZERO_AIO_ENV, "env", env);
}

static PyMethodDef aio_functions[] = {
    {"aio_info", zero_C_aio_info, METH_NOARGS,
     "aio_info() -> dict\n--\n\nThe disk I/O backend Aio() takes by default "
     "('io_uring' or 'threads'), whether io_uring runs here and if not why, "
     "and the environment variable that forces one."},
    {NULL, NULL, 0, NULL},
};

int add_aio(PyObject *module)
{
    PyObject *type = PyType_FromModuleAndSpec(module, &Aio_spec, NULL);
    if (!type) {
        return -1;
    }
    int error = PyModule_AddType(module, (PyTypeObject *)type);
    Py_DECREF(type);
    if (error != 0) {
        return -1;
    }
    /* the limits Aio() checks, for the config's aio block to check by
     * name before any engine is built (config/_deepspeed_keys.py) */
    if (PyModule_AddIntConstant(module, "AIO_ALIGN", ZERO_AIO_ALIGN) != 0 ||
        PyModule_AddIntConstant(module, "AIO_MAX_BLOCK", (long)ZERO_AIO_MAX_BLOCK) != 0 ||
        PyModule_AddIntConstant(module, "AIO_MAX_QUEUE_DEPTH",
                                ZERO_AIO_MAX_QUEUE_DEPTH) != 0) {
        return -1;
    }
    return PyModule_AddFunctions(module, aio_functions);
}
