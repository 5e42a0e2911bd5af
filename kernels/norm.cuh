/* norm.cuh: the L2 norm of many tensors in two deterministic stages.
 *
 * Stage 1 gives each chunk of each tensor one block (the fixed mapping of
 * [Note: multi-tensor map]), which sums the squares of its elements in
 * double in a fixed order and writes one fp32 partial. Stage 2 is one block
 * that adds the partials, in double, in a fixed order. No atomics, so two
 * calls on the same data give the same bits.
 */
#include "device.cuh"

extern "C" __global__ void __launch_bounds__(ZERO_K_THREADS)
    zero_k_norm_partials(zero_k_norm_args a)
{
    block_work w = find_work(a.map);
    double sum = 0.0;
    for_each_loaded(a.data[w.tensor], a.dtype[w.tensor], w.begin, w.end,
                    [&](int64_t, float x) {
                        sum += (double)x * (double)x;
                    });
    sum = block_sum(sum);
    if (threadIdx.x == 0) {
        a.partials[a.first_partial + blockIdx.x] = (float)sum;
    }
}

extern "C" __global__ void __launch_bounds__(ZERO_K_THREADS)
    zero_k_norm_finish(zero_k_norm_finish_args a)
{
    double sum = 0.0;
    for (int64_t i = threadIdx.x; i < a.count; i += ZERO_K_THREADS) {
        sum += (double)a.partials[i];
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) {
        *a.out = a.squared ? (float)sum : (float)sqrt(sum);
    }
}
