/* module_aio_requests.c: what the Aio binding (module_aio.c) checks of a
 * request before it goes to the engine (the descriptor's mode, O_DIRECT's
 * alignment) and the OSError it raises when a request failed, naming the
 * descriptor, the byte where it failed and the request's range.
 */
#include "module.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef O_DIRECT
#define O_DIRECT 0
#endif

/* The descriptor is open, in a mode that allows the transfer, on
 * something with offsets (not a pipe, socket or terminal: a pipe's read
 * under io_uring waited for good, and close() with it; a write
 * to an O_APPEND descriptor went to the end, whatever the offset), and,
 * when opened with O_DIRECT, the transfer is aligned as the kernel needs. */
int check_descriptor(const char *function, int fd, int write,
                            const Buffer *b, int64_t offset, int64_t nbytes)
{
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0) {
        int error = errno;
        PyObject *exc = PyObject_CallFunction(
            PyExc_OSError, "iN", error,
            PyUnicode_FromFormat("%s: fd %d is not an open file descriptor "
                                 "(%s)",
                                 function, fd, strerror(error)));
        if (exc) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
        return -1;
    }
    int mode = flags & O_ACCMODE;
    if ((write && mode == O_RDONLY) || (!write && mode == O_WRONLY)) {
        PyErr_Format(PyExc_ValueError, "%s: fd %d is open for %s only", function,
                     fd, mode == O_RDONLY ? "reading" : "writing");
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) == 0 &&
        (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode) || isatty(fd))) {
        PyErr_Format(PyExc_ValueError,
                     "%s: fd %d is a pipe, socket or terminal, which has no "
                     "offsets to %s at (and may wait for data for good); "
                     "pass a file's descriptor",
                     function, fd, write ? "write" : "read");
        return -1;
    }
    if (write && (flags & O_APPEND)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: fd %d is open with O_APPEND, which writes at the "
                     "file's end whatever the offset; open it without",
                     function, fd);
        return -1;
    }
    if (O_DIRECT && (flags & O_DIRECT)) {
        const char *what = NULL;
        long long value = 0;
        if ((uintptr_t)b->data % ZERO_AIO_ALIGN) {
            what = "the tensor's address";
            value = (long long)(uintptr_t)b->data;
        } else if (offset % ZERO_AIO_ALIGN) {
            what = "offset";
            value = (long long)offset;
        } else if (nbytes % ZERO_AIO_ALIGN) {
            what = "the tensor's size in bytes";
            value = (long long)nbytes;
        }
        if (what) {
            PyErr_Format(PyExc_ValueError,
                         "%s: fd %d is open with O_DIRECT, so %s must be a "
                         "multiple of %d; got %lld",
                         function, fd, what, ZERO_AIO_ALIGN, value);
            return -1;
        }
    }
    return 0;
}

/* Set an OSError for a failed request: entry is its `held` tuple. */
void raise_failure(PyObject *entry, const zero_aio_result *r)
{
    int fd, write;
    long long offset, nbytes;
    PyObject *buffer;
    if (!PyArg_ParseTuple(entry, "OiLLi", &buffer, &fd, &offset, &nbytes,
                          &write)) {
        return;
    }
    const char *verb = write ? "writing" : "reading";
    PyObject *exc;
    if (r->error == ZERO_AIO_END_OF_FILE) {
        exc = PyObject_CallFunction(
            PyExc_OSError, "N",
            PyUnicode_FromFormat("%s %lld bytes at byte %lld of fd %d: the "
                                 "file ends at byte %lld (%lld bytes moved)",
                                 verb, nbytes, offset, fd,
                                 (long long)r->error_offset,
                                 (long long)r->moved));
    } else {
        exc = PyObject_CallFunction(
            PyExc_OSError, "iN", r->error,
            PyUnicode_FromFormat("%s %lld bytes at byte %lld of fd %d failed "
                                 "at byte %lld: %s",
                                 verb, nbytes, offset, fd,
                                 (long long)r->error_offset,
                                 strerror(r->error)));
    }
    if (!exc) {
        return;
    }
    PyObject *values[4] = {PyLong_FromLong(fd),
                           PyLong_FromLongLong(r->error_offset),
                           PyLong_FromLongLong(offset),
                           PyLong_FromLongLong(nbytes)};
    const char *names[4] = {"fd", "offset", "request_offset", "nbytes"};
    int ok = 1;
    for (int i = 0; i < 4; i++) {
        ok = ok && values[i] &&
             PyObject_SetAttrString(exc, names[i], values[i]) == 0;
        Py_XDECREF(values[i]);
    }
    if (ok) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    }
    Py_DECREF(exc);
}
