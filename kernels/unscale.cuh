/* unscale.cuh: multiply gradients by the inverse loss scale in place and
 * flag an inf or NaN in device memory, for the Adam kernel to read (see
 * [Note: device-side skip] in adam.cuh). With scale 1 it only checks.
 * The value is judged as it is stored: x * scale may be finite in fp32
 * and still overflow fp16.
 */
#include "device.cuh"

extern "C" __global__ void __launch_bounds__(ZERO_K_THREADS)
    zero_k_unscale(zero_k_unscale_args a)
{
    block_work w = find_work(a.map);
    void *data = a.data[w.tensor];
    int dtype = a.dtype[w.tensor];
    bool bad = false;
    float scale = a.scale;
    for_each_loaded(data, dtype, w.begin, w.end, [&](int64_t i, float x) {
        float y = round_to(dtype, x * scale);
        bad = bad || !isfinite(y);
        if (scale != 1.0f) {
            store_elem(data, dtype, i, y);
        }
    });
    /* every writer writes the same value: no atomic needed */
    if (bad) {
        *a.found_inf = 1.0f;
    }
}
