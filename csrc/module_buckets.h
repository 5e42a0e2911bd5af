/* module_buckets.h: what the two files of zero._C.GradBuckets share: the
 * object, its hook's object, and the hook side's entry points. The hook
 * side (module_buckets.c: reading a gradient, the buffers, the arrival)
 * and the type (module_grad_buckets.c: construction and methods) are
 * apart so that each reads in one sitting; see [Note: the hook in C].
 */
#ifndef ZERO_MODULE_BUCKETS_H
#define ZERO_MODULE_BUCKETS_H

#include "module.h"

typedef struct {
    PyObject *tensor; /* the bucket's buffer, or NULL until a piece needs it */
    char *data;       /* its first element when the fast path may write it */
} bucket_buffer;

typedef struct {
    PyObject_HEAD
    zero_buckets *plan;
    int64_t n_params;
    int64_t *param_numel;
    bucket_buffer *staging;  /* [buckets]: filling, until sent */
    bucket_buffer *late;     /* [buckets]: pieces that came after the send */
    PyObject *owner;         /* a weak reference; NULL once detached */
    PyObject *dtype;         /* the buckets' torch dtype */
    PyObject *tensor_type;   /* torch.Tensor: the fast path takes it exactly */
    PyObject *strided;       /* torch.strided */
    zero_dtype zdtype;
    size_t itemsize;
    PyObject *hook_type;
} GradBuckets;

typedef struct {
    PyObject_HEAD
    GradBuckets *buckets;
    int64_t index;
} BucketHook;

/* The live owner (a new reference), or NULL without an exception when it
 * is gone or detached. */
PyObject *live_owner(GradBuckets *self);
/* Drop every staging and late buffer. */
void drop_buffers(GradBuckets *self);
/* Send the buckets that are complete, in order (all that are left when
 * force), through the owner's _send_bucket. 0, or -1 with an exception. */
int send_ready(GradBuckets *self, PyObject *owner, int force);
/* Zero the ranges of bucket b's staging (late 0) or late buffer that no
 * piece wrote this backward ([Note: no zero-fill]): memset where the fast
 * path may write the buffer, else the owner's _zero_range. 0, or -1 with
 * an exception. */
int fill_gaps(GradBuckets *self, PyObject *owner, int64_t b, int late);
/* The hook's object (module_buckets.c) and the names both files use,
 * interned once; 0, or -1 with an exception. */
PyObject *make_bucket_hook_type(PyObject *module);

#endif /* ZERO_MODULE_BUCKETS_H */
