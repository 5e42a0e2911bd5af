/* adam.cuh: the fused Adam/AdamW step over many fp32 master tensors (a flat
 * partition is a list of one): gradient in fp32/bf16/fp16 times grad_scale,
 * update of the master and both moments, optional bf16/fp16/fp32 copy-out,
 * all in one pass over memory.
 *
 * [Note: device-side skip] An fp16 overflow must skip the step without the
 * host waiting for the check. found_inf (set by zero_k_unscale) is read on
 * the device: zero_k_adam_advance leaves the step count alone and every
 * zero_k_adam block returns before touching memory. The bias corrections
 * come from the step count in device memory, so the host never needs to
 * know whether the step happened.
 */
#include "device.cuh"

extern "C" __global__ void __launch_bounds__(ZERO_K_THREADS)
    zero_k_adam_advance(zero_k_advance_args a)
{
    if (threadIdx.x == 0 && blockIdx.x == 0 &&
        !(a.found_inf && *a.found_inf != 0.0f)) {
        *a.step += 1.0f;
    }
}

/* One tensor's buffers, picked out of the argument block. */
struct adam_tensor {
    float *param, *exp_avg, *exp_avg_sq;
    const void *grad;
    void *copy_out;
    int grad_dtype, copy_dtype;
};

/* Elements [begin, end) one at a time: for buffers off a 4-element
 * boundary. */
static __device__ __forceinline__ void adam_elements(const adam_tensor &t,
                                                     const optim_consts &k,
                                                     float grad_scale,
                                                     int64_t begin,
                                                     int64_t end)
{
    for (int64_t i = begin + threadIdx.x; i < end; i += ZERO_K_THREADS) {
        float g = load_elem(t.grad, t.grad_dtype, i) * grad_scale;
        float m = t.exp_avg[i], v = t.exp_avg_sq[i];
        float p = adam_update(&k, t.param[i], g, &m, &v, NULL);
        t.param[i] = p;
        t.exp_avg[i] = m;
        t.exp_avg_sq[i] = v;
        if (t.copy_out) {
            store_elem(t.copy_out, t.copy_dtype, i, p);
        }
    }
}

/* Elements [begin, end) four at a time; begin is a multiple of 4 and the
 * buffers are aligned, so each access moves 16 bytes (8 for 16-bit). The
 * last end % 4 elements go one at a time. */
static __device__ __forceinline__ void adam_vectors(const adam_tensor &t,
                                                    const optim_consts &k,
                                                    float grad_scale,
                                                    int64_t begin,
                                                    int64_t end)
{
    int64_t vector_end = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin + 4 * (int64_t)threadIdx.x; i < vector_end;
         i += 4 * ZERO_K_THREADS) {
        float p[4], g[4], m[4], v[4];
        load4(t.param, ZERO_F32, i, p);
        load4(t.grad, t.grad_dtype, i, g);
        load4(t.exp_avg, ZERO_F32, i, m);
        load4(t.exp_avg_sq, ZERO_F32, i, v);
        for (int j = 0; j < 4; j++) {
            p[j] = adam_update(&k, p[j], g[j] * grad_scale, &m[j], &v[j],
                               NULL);
        }
        store4(t.param, ZERO_F32, i, p);
        store4(t.exp_avg, ZERO_F32, i, m);
        store4(t.exp_avg_sq, ZERO_F32, i, v);
        if (t.copy_out) {
            store4(t.copy_out, t.copy_dtype, i, p);
        }
    }
    adam_elements(t, k, grad_scale, vector_end, end);
}

extern "C" __global__ void __launch_bounds__(ZERO_K_THREADS)
    zero_k_adam(zero_k_adam_args a)
{
    /* the same value in every thread: the whole block returns */
    if (a.found_inf && *a.found_inf != 0.0f) {
        return;
    }
    /* Two double-precision pows per block, not per thread: cheap on GPUs
     * with slow fp64 too. */
    __shared__ float corrections[2];
    if (threadIdx.x == 0) {
        adam_bias_corrections(a.lr, a.beta1, a.beta2, (double)*a.step,
                              &corrections[0], &corrections[1]);
    }
    __syncthreads();
    optim_consts k = a.k;
    k.step_size = corrections[0];
    k.bias_correction2_sqrt = corrections[1];

    block_work w = find_work(a.map);
    adam_tensor t;
    t.param = a.param[w.tensor];
    t.exp_avg = a.exp_avg[w.tensor];
    t.exp_avg_sq = a.exp_avg_sq[w.tensor];
    t.grad = a.grad[w.tensor];
    t.copy_out = a.copy_out[w.tensor];
    t.grad_dtype = a.grad_dtype[w.tensor];
    t.copy_dtype = a.copy_dtype[w.tensor];
    if (a.vector[w.tensor]) {
        adam_vectors(t, k, a.grad_scale, w.begin, w.end);
    } else {
        adam_elements(t, k, a.grad_scale, w.begin, w.end);
    }
}
