/* cast.cuh: copy with a cast (and a scale) between many tensors and one
 * flat bucket: packing gradients into a communication bucket, unpacking
 * gathered parameters out of one. The launcher points one side of each
 * pair into the bucket.
 */
#include "device.cuh"

extern "C" __global__ void __launch_bounds__(ZERO_K_THREADS)
    zero_k_cast(zero_k_cast_args a)
{
    block_work w = find_work(a.map);
    void *dst = a.dst[w.tensor];
    int dst_dtype = a.dst_dtype[w.tensor];
    float scale = a.scale;
    for_each_loaded(a.src[w.tensor], a.src_dtype[w.tensor], w.begin, w.end,
                    [&](int64_t i, float x) {
                        store_elem(dst, dst_dtype, i, x * scale);
                    });
}
