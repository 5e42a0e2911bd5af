/* optim.c: the optimizer entry points of zero.h.
 *
 * Each one turns its hyperparameters into the float constants the kernels
 * use (in double precision first, as torch.optim computes them in Python),
 * then splits the buffers over the thread pool and runs the active ISA's
 * kernel on each piece.
 */
#include <math.h>

#include "internal.h"

/* Chunks start at multiples of this many elements, so threads never share
 * a cache line of any buffer. */
#define GRAIN 64

typedef struct {
    optim_kernel kernel;
    optim_args args;
} optim_job;

static void run_optim_range(void *ctx, int64_t begin, int64_t end)
{
    optim_job *job = ctx;
    job->kernel(&job->args, begin, end);
}

static zero_status check_flat(const zero_flat *buf)
{
    if (!buf || buf->n < 0) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    if (!dtype_valid(buf->grad_dtype) ||
        (buf->copy_out && !dtype_valid(buf->copy_dtype))) {
        return ZERO_ERR_UNSUPPORTED_DTYPE;
    }
    if (buf->n > 0 && (!buf->param || !buf->grad)) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    return ZERO_OK;
}

static void fill_buffers(optim_args *args, const zero_flat *buf)
{
    args->param = buf->param;
    args->grad = buf->grad;
    args->grad_dtype = buf->grad_dtype;
    args->copy_out = buf->copy_out;
    args->copy_dtype = buf->copy_dtype;
}

static zero_status run_job(optim_job *job, int64_t n)
{
    return parallel_for(n, GRAIN, run_optim_range, job);
}

void adam_consts(const zero_adam_hparams *hp, optim_consts *k)
{
    k->weight_factor = hp->decoupled ? (float)(1.0 - hp->lr * hp->weight_decay)
                                     : 1.0f;
    k->l2 = hp->decoupled ? 0.0f : (float)hp->weight_decay;
    k->beta1 = (float)hp->beta1;
    k->beta2 = (float)hp->beta2;
    k->one_minus_beta1 = (float)(1.0 - hp->beta1);
    k->one_minus_beta2 = (float)(1.0 - hp->beta2);
    adam_bias_corrections(hp->lr, hp->beta1, hp->beta2, (double)hp->step,
                          &k->step_size, &k->bias_correction2_sqrt);
    k->eps = (float)hp->eps;
    k->amsgrad = hp->amsgrad != 0;
}

zero_status zero_adam_step(const zero_flat *buf, const zero_adam_state *state,
                           const zero_adam_hparams *hp)
{
    zero_status status = check_flat(buf);
    if (status != ZERO_OK) {
        return status;
    }
    if (!state || !hp || hp->step < 1) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    if (buf->n > 0 && (!state->exp_avg || !state->exp_avg_sq ||
                       (hp->amsgrad && !state->max_exp_avg_sq))) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    optim_job job = {.kernel = active_kernels()->adam};
    optim_args *a = &job.args;
    fill_buffers(a, buf);
    a->state1 = state->exp_avg;
    a->state2 = state->exp_avg_sq;
    a->state3 = state->max_exp_avg_sq;
    a->grad_scale = (float)hp->grad_scale;
    adam_consts(hp, &a->k);
    return run_job(&job, buf->n);
}

zero_status zero_sgd_step(const zero_flat *buf, float *momentum_buffer,
                          const zero_sgd_hparams *hp)
{
    zero_status status = check_flat(buf);
    if (status != ZERO_OK) {
        return status;
    }
    if (!hp || (hp->momentum != 0.0 && buf->n > 0 && !momentum_buffer)) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    optim_job job = {.kernel = active_kernels()->sgd};
    optim_args *a = &job.args;
    fill_buffers(a, buf);
    a->state1 = hp->momentum != 0.0 ? momentum_buffer : NULL;
    a->grad_scale = (float)hp->grad_scale;
    optim_consts *k = &a->k;
    k->l2 = (float)hp->weight_decay;
    k->momentum = (float)hp->momentum;
    k->one_minus_dampening = (float)(1.0 - hp->dampening);
    k->step_size = (float)hp->lr;
    k->nesterov = hp->nesterov != 0;
    k->first_step = hp->first_step != 0;
    return run_job(&job, buf->n);
}

zero_status zero_lion_step(const zero_flat *buf, float *exp_avg,
                           const zero_lion_hparams *hp)
{
    zero_status status = check_flat(buf);
    if (status != ZERO_OK) {
        return status;
    }
    if (!hp || (buf->n > 0 && !exp_avg)) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    optim_job job = {.kernel = active_kernels()->lion};
    optim_args *a = &job.args;
    fill_buffers(a, buf);
    a->state1 = exp_avg;
    a->grad_scale = (float)hp->grad_scale;
    optim_consts *k = &a->k;
    k->weight_factor = (float)(1.0 - hp->lr * hp->weight_decay);
    k->step_size = (float)hp->lr;
    k->beta1 = (float)hp->beta1;
    k->beta2 = (float)hp->beta2;
    k->one_minus_beta1 = (float)(1.0 - hp->beta1);
    k->one_minus_beta2 = (float)(1.0 - hp->beta2);
    return run_job(&job, buf->n);
}

zero_status zero_adagrad_step(const zero_flat *buf, float *state_sum,
                              const zero_adagrad_hparams *hp)
{
    zero_status status = check_flat(buf);
    if (status != ZERO_OK) {
        return status;
    }
    if (!hp || hp->step < 1 || (buf->n > 0 && !state_sum)) {
        return ZERO_ERR_INVALID_ARGUMENT;
    }
    optim_job job = {.kernel = active_kernels()->adagrad};
    optim_args *a = &job.args;
    fill_buffers(a, buf);
    a->state1 = state_sum;
    a->grad_scale = (float)hp->grad_scale;
    optim_consts *k = &a->k;
    k->l2 = (float)hp->weight_decay;
    k->step_size =
        (float)(hp->lr / (1.0 + (double)(hp->step - 1) * hp->lr_decay));
    k->eps = (float)hp->eps;
    return run_job(&job, buf->n);
}
