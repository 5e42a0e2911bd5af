/* module_optim.c: the CPU optimizers of zero._C (adam_step, sgd_step,
 * lion_step, adagrad_step), one table each and one path for all.
 *
 * An optimizer is an optim_spec: its signature (module.h: the rows of its
 * buffers and hyperparameters, each hyperparameter row writing straight
 * into the core's hparams struct), the rules between arguments that no
 * single row can check, and the core call. optim_step() does the rest the
 * same way for each: parse and check the arguments, take the buffers
 * (dtype, size, writability, overlap), build the zero_flat range
 * [start, stop), and call the core with the GIL released.
 */
#include "module.h"

/* param, grad, up to three states, copy_out */
#define MAX_BUFFERS 6

typedef union {
    zero_adam_hparams adam;
    zero_sgd_hparams sgd;
    zero_lion_hparams lion;
    zero_adagrad_hparams adagrad;
} optim_hparams;

/* One call's arguments. The table's first rows are the buffers, in this
 * order: param, grad, the states, copy_out. */
typedef struct {
    PyObject *buffers[MAX_BUFFERS]; /* NULL: not given */
    optim_hparams hp;
    int64_t start, stop;
} optim_call;

/* The table's leading ARG_TENSOR rows are the buffers. */
typedef struct {
    signature sig;
    /* Checks between arguments, after the table's; or NULL. */
    int (*rules)(const optim_call *call);
    /* The core step; states[i] is state buffer i at start, or NULL. */
    zero_status (*step)(const zero_flat *flat, float *const *states,
                        const optim_hparams *hp);
} optim_spec;

/* Rows of the table, by where their value goes in an optim_call. */
#define BUFFER(i, name, flags)                                               \
    ARG(optim_call, buffers[i], name, ARG_TENSOR, CHECK_NONE, flags, 0)
#define PARAM_AND_GRAD                                                       \
    BUFFER(0, "param", ARG_WRITTEN), BUFFER(1, "grad", ARG_HALF)
#define STATE(i, name, flags) BUFFER(i, name, ARG_WRITTEN | (flags))
#define COPY_OUT(i)                                                          \
    BUFFER(i, "copy_out", ARG_WRITTEN | ARG_HALF | ARG_OPTIONAL)
/* A hyperparameter: the member of the same name of the core's hparams. */
#define HP(opt, member, kind, check, flags, initial)                         \
    ARG(optim_call, hp.opt.member, #member, kind, check, flags, initial)
/* The last rows of every optimizer. */
#define SCALE_AND_RANGE(opt)                                                 \
    HP(opt, grad_scale, ARG_DOUBLE, CHECK_FINITE, 0, 1.0),                   \
        ARG(optim_call, start, "start", ARG_INT64, CHECK_NONE, 0, 0),        \
        ARG(optim_call, stop, "stop", ARG_INT64, CHECK_NONE, 0, -1)

/* Resolve [start, stop) against n; stop < 0 means n. */
static int check_range(int64_t n, int64_t start, int64_t *stop)
{
    if (*stop < 0) {
        *stop = n;
    }
    if (start < 0 || start > *stop || *stop > n) {
        PyErr_Format(PyExc_ValueError,
                     "start=%lld, stop=%lld is not a range within the %lld "
                     "elements",
                     (long long)start, (long long)*stop, (long long)n);
        return -1;
    }
    return 0;
}

/* A zero_flat over [start, stop) of the buffers. */
static zero_flat flat_range(Buffer *param, Buffer *grad, Buffer *copy_out,
                            int64_t start, int64_t stop)
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

static int buffer_rows(const signature *sig)
{
    int count = 0;
    while (count < sig->count && count < MAX_BUFFERS &&
           sig->args[count].kind == ARG_TENSOR) {
        count++;
    }
    return count;
}

/* dtypes as the rows allow, then sizes, writability and overlap. */
static int check_buffers(const signature *sig, const named_buffer *bufs,
                         int count)
{
    for (int i = 0; i < count; i++) {
        int half_ok = (sig->args[i].flags & ARG_HALF) != 0;
        if (bufs[i].buf && check_dtype(&bufs[i], half_ok) != 0) {
            return -1;
        }
    }
    return check_together(bufs, count);
}

static PyObject *optim_step(PyObject *module, PyObject *args,
                            PyObject *kwargs, const optim_spec *spec)
{
    optim_call call;
    if (parse_args(&spec->sig, args, kwargs, &call) != 0 ||
        (spec->rules && spec->rules(&call) != 0)) {
        return NULL;
    }
    int count = buffer_rows(&spec->sig);
    named_buffer bufs[MAX_BUFFERS];
    for (int i = 0; i < count; i++) {
        int flags = spec->sig.args[i].flags;
        bufs[i] = (named_buffer){spec->sig.args[i].name, NULL,
                                 (flags & ARG_WRITTEN) != 0,
                                 (flags & ARG_OPTIONAL) != 0};
    }
    if (collect_buffers(module, bufs, call.buffers, count) != 0) {
        return NULL;
    }
    PyObject *result = NULL;
    int64_t start = call.start, stop = call.stop;
    if (check_buffers(&spec->sig, bufs, count) != 0 ||
        check_range(bufs[0].buf->numel, start, &stop) != 0) {
        goto done;
    }
    zero_flat flat = flat_range(bufs[0].buf, bufs[1].buf,
                                bufs[count - 1].buf, start, stop);
    float *states[MAX_BUFFERS] = {NULL};
    for (int i = 2; i < count - 1; i++) {
        states[i - 2] = bufs[i].buf ? (float *)bufs[i].buf->data + start
                                    : NULL;
    }
    zero_status status;
    Py_BEGIN_ALLOW_THREADS
    status = spec->step(&flat, states, &call.hp);
    Py_END_ALLOW_THREADS
    if (status != ZERO_OK) {
        raise_status(status, spec->sig.function);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release_buffers(bufs, count);
    return result;
}

/* <opt>_call for an optimizer with one state: zero_<opt>_step. */
#define ONE_STATE_STEP(opt)                                                  \
    static zero_status opt##_call(const zero_flat *flat,                     \
                                  float *const *states,                      \
                                  const optim_hparams *hp)                   \
    {                                                                        \
        return zero_##opt##_step(flat, states[0], &hp->opt);                 \
    }

static int given(PyObject *obj)
{
    return obj && obj != Py_None;
}

/* ---- Adam ------------------------------------------------------------ */

static const arg_spec adam_args[] = {
    PARAM_AND_GRAD,
    STATE(2, "exp_avg", 0),
    STATE(3, "exp_avg_sq", 0),
    STATE(4, "max_exp_avg_sq", ARG_OPTIONAL),
    COPY_OUT(5),
    ADAM_RATES(optim_call, hp.adam),
    HP(adam, step, ARG_INT64, CHECK_COUNT, ARG_REQUIRED, 0),
    HP(adam, decoupled, ARG_BOOL, CHECK_NONE, 0, 1),
    HP(adam, amsgrad, ARG_BOOL, CHECK_NONE, 0, 0),
    SCALE_AND_RANGE(adam),
};

static int adam_rules(const optim_call *c)
{
    if (c->hp.adam.amsgrad && !given(c->buffers[4])) {
        PyErr_SetString(PyExc_ValueError,
                        "amsgrad=True needs the max_exp_avg_sq buffer");
        return -1;
    }
    return 0;
}

static zero_status adam_call(const zero_flat *flat, float *const *states,
                             const optim_hparams *hp)
{
    zero_adam_state state = {states[0], states[1],
                             hp->adam.amsgrad ? states[2] : NULL};
    return zero_adam_step(flat, &state, &hp->adam);
}

static const optim_spec adam_spec = {
    SIGNATURE("adam_step", adam_args, 4, 6, optim_call),
    adam_rules, adam_call};

PyDoc_STRVAR(adam_step_doc,
"adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq=None,\n"
"          copy_out=None, *, lr, beta1, beta2, eps, weight_decay, step,\n"
"          decoupled=True, amsgrad=False, grad_scale=1.0, start=0, stop=-1)\n"
"--\n\n"
"One Adam (decoupled=False) or AdamW step over [start, stop) of flat\n"
"buffers, in place. grad may be float32, bfloat16 or float16 and is\n"
"multiplied by grad_scale; copy_out, when given, receives the updated\n"
"parameters cast with round-to-nearest-even.");

/* ---- SGD ------------------------------------------------------------- */

static const arg_spec sgd_args[] = {
    PARAM_AND_GRAD,
    STATE(2, "momentum_buffer", ARG_OPTIONAL),
    COPY_OUT(3),
    HP(sgd, lr, ARG_DOUBLE, CHECK_NONNEGATIVE, ARG_REQUIRED, 0),
    HP(sgd, momentum, ARG_DOUBLE, CHECK_NONNEGATIVE, 0, 0.0),
    HP(sgd, dampening, ARG_DOUBLE, CHECK_FINITE, 0, 0.0),
    HP(sgd, weight_decay, ARG_DOUBLE, CHECK_NONNEGATIVE, 0, 0.0),
    HP(sgd, nesterov, ARG_BOOL, CHECK_NONE, 0, 0),
    HP(sgd, first_step, ARG_BOOL, CHECK_NONE, 0, 0),
    SCALE_AND_RANGE(sgd),
};

static int sgd_rules(const optim_call *c)
{
    const zero_sgd_hparams *hp = &c->hp.sgd;
    if (hp->nesterov && (hp->momentum <= 0.0 || hp->dampening != 0.0)) {
        PyErr_SetString(PyExc_ValueError,
                        "nesterov=True needs momentum > 0 and dampening 0");
        return -1;
    }
    if (hp->momentum != 0.0 && !given(c->buffers[2])) {
        PyErr_SetString(PyExc_ValueError,
                        "momentum != 0 needs the momentum_buffer");
        return -1;
    }
    return 0;
}

ONE_STATE_STEP(sgd)

static const optim_spec sgd_spec = {
    SIGNATURE("sgd_step", sgd_args, 2, 4, optim_call),
    sgd_rules, sgd_call};

PyDoc_STRVAR(sgd_step_doc,
"sgd_step(param, grad, momentum_buffer=None, copy_out=None, *, lr,\n"
"         momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,\n"
"         first_step=False, grad_scale=1.0, start=0, stop=-1)\n"
"--\n\n"
"One SGD step in place. With momentum, first_step=True starts the\n"
"momentum buffer as the gradient, as torch.optim.SGD does.");

/* ---- Lion ------------------------------------------------------------ */

static const arg_spec lion_args[] = {
    PARAM_AND_GRAD,
    STATE(2, "exp_avg", 0),
    COPY_OUT(3),
    HP(lion, lr, ARG_DOUBLE, CHECK_NONNEGATIVE, ARG_REQUIRED, 0),
    HP(lion, beta1, ARG_DOUBLE, CHECK_BETA, ARG_REQUIRED, 0),
    HP(lion, beta2, ARG_DOUBLE, CHECK_BETA, ARG_REQUIRED, 0),
    HP(lion, weight_decay, ARG_DOUBLE, CHECK_NONNEGATIVE, 0, 0.0),
    SCALE_AND_RANGE(lion),
};

ONE_STATE_STEP(lion)

static const optim_spec lion_spec = {
    SIGNATURE("lion_step", lion_args, 3, 4, optim_call),
    NULL, lion_call};

PyDoc_STRVAR(lion_step_doc,
"lion_step(param, grad, exp_avg, copy_out=None, *, lr, beta1, beta2,\n"
"          weight_decay=0.0, grad_scale=1.0, start=0, stop=-1)\n"
"--\n\n"
"One Lion step in place (Chen et al. 2023, decoupled weight decay).");

/* ---- Adagrad --------------------------------------------------------- */

static const arg_spec adagrad_args[] = {
    PARAM_AND_GRAD,
    STATE(2, "state_sum", 0),
    COPY_OUT(3),
    HP(adagrad, lr, ARG_DOUBLE, CHECK_NONNEGATIVE, ARG_REQUIRED, 0),
    HP(adagrad, lr_decay, ARG_DOUBLE, CHECK_NONNEGATIVE, 0, 0.0),
    HP(adagrad, weight_decay, ARG_DOUBLE, CHECK_NONNEGATIVE, 0, 0.0),
    HP(adagrad, eps, ARG_DOUBLE, CHECK_NONNEGATIVE, 0, 1e-10),
    HP(adagrad, step, ARG_INT64, CHECK_COUNT, ARG_REQUIRED, 0),
    SCALE_AND_RANGE(adagrad),
};

ONE_STATE_STEP(adagrad)

static const optim_spec adagrad_spec = {
    SIGNATURE("adagrad_step", adagrad_args, 3, 4, optim_call),
    NULL, adagrad_call};

PyDoc_STRVAR(adagrad_step_doc,
"adagrad_step(param, grad, state_sum, copy_out=None, *, lr, lr_decay=0.0,\n"
"             weight_decay=0.0, eps=1e-10, step, grad_scale=1.0, start=0,\n"
"             stop=-1)\n"
"--\n\n"
"One Adagrad step in place, as torch.optim.Adagrad.");

/* ---- registration ---------------------------------------------------- */

KEYWORD_FUNCTION(adam_step, optim_step, adam_spec)
KEYWORD_FUNCTION(sgd_step, optim_step, sgd_spec)
KEYWORD_FUNCTION(lion_step, optim_step, lion_spec)
KEYWORD_FUNCTION(adagrad_step, optim_step, adagrad_spec)

static PyMethodDef optim_methods[] = {
    KEYWORD_METHOD(adam_step),
    KEYWORD_METHOD(sgd_step),
    KEYWORD_METHOD(lion_step),
    KEYWORD_METHOD(adagrad_step),
    {NULL, NULL, 0, NULL},
};

int add_optim_functions(PyObject *module)
{
    return PyModule_AddFunctions(module, optim_methods);
}
