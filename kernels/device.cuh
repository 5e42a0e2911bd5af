/* device.cuh: device helpers every kernel uses: element loads and stores in
 * the three float formats, the chunk a block works on, a deterministic block
 * sum. Included by the kernel files through kernels.cu.
 *
 * Narrowing uses the hardware's round-to-nearest-even conversions, the ones
 * torch's CUDA casts use, so a bf16/fp16 copy-out is bit-identical to
 * casting the fp32 result with torch on the GPU. (NaN payloads may differ
 * from the CPU reference in zero/half.h; finite values never do.)
 */
#ifndef ZERO_DEVICE_CUH
#define ZERO_DEVICE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "zero/kernels.h"

/* Elements in flight per thread in the element-wise loops: enough loads
 * outstanding to cover memory latency at the occupancy these kernels get. */
#define ZERO_K_ILP 4

static __device__ __forceinline__ float load_elem(const void *data, int dtype,
                                                  int64_t i)
{
    switch (dtype) {
    case ZERO_BF16:
        return __bfloat162float(((const __nv_bfloat16 *)data)[i]);
    case ZERO_F16:
        return __half2float(((const __half *)data)[i]);
    default:
        return ((const float *)data)[i];
    }
}

static __device__ __forceinline__ void store_elem(void *data, int dtype,
                                                  int64_t i, float x)
{
    switch (dtype) {
    case ZERO_BF16:
        ((__nv_bfloat16 *)data)[i] = __float2bfloat16_rn(x);
        break;
    case ZERO_F16:
        ((__half *)data)[i] = __float2half_rn(x);
        break;
    default:
        ((float *)data)[i] = x;
        break;
    }
}

/* x as the dtype stores it (an fp16 overflow becomes inf). */
static __device__ __forceinline__ float round_to(int dtype, float x)
{
    switch (dtype) {
    case ZERO_BF16:
        return __bfloat162float(__float2bfloat16_rn(x));
    case ZERO_F16:
        return __half2float(__float2half_rn(x));
    default:
        return x;
    }
}

/* Four consecutive elements from i (a multiple of 4, on a 4-element
 * boundary of an aligned buffer) in one access. */
static __device__ __forceinline__ void load4(const void *data, int dtype,
                                             int64_t i, float out[4])
{
    if (dtype == ZERO_F32) {
        float4 x = ((const float4 *)data)[i / 4];
        out[0] = x.x;
        out[1] = x.y;
        out[2] = x.z;
        out[3] = x.w;
        return;
    }
    uint2 raw = ((const uint2 *)data)[i / 4];
    unsigned short h[4] = {
        (unsigned short)(raw.x & 0xffffu), (unsigned short)(raw.x >> 16),
        (unsigned short)(raw.y & 0xffffu), (unsigned short)(raw.y >> 16)};
    for (int j = 0; j < 4; j++) {
        out[j] = dtype == ZERO_BF16
                     ? __bfloat162float(__ushort_as_bfloat16(h[j]))
                     : __half2float(__ushort_as_half(h[j]));
    }
}

static __device__ __forceinline__ void store4(void *data, int dtype,
                                              int64_t i, const float x[4])
{
    if (dtype == ZERO_F32) {
        ((float4 *)data)[i / 4] = make_float4(x[0], x[1], x[2], x[3]);
        return;
    }
    unsigned short h[4];
    for (int j = 0; j < 4; j++) {
        h[j] = dtype == ZERO_BF16
                   ? __bfloat16_as_ushort(__float2bfloat16_rn(x[j]))
                   : __half_as_ushort(__float2half_rn(x[j]));
    }
    ((uint2 *)data)[i / 4] = make_uint2(h[0] | ((unsigned)h[1] << 16),
                                        h[2] | ((unsigned)h[3] << 16));
}

/* The tensor this block works on and its chunk [begin, end); see [Note:
 * multi-tensor map] in zero/kernels.h. */
struct block_work {
    int tensor;
    int64_t begin, end;
};

static __device__ __forceinline__ block_work find_work(const zero_k_map &map)
{
    int b = (int)blockIdx.x;
    int lo = 0, hi = map.count - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (map.first_block[mid] <= b) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    block_work w;
    w.tensor = lo;
    w.begin = (int64_t)(b - map.first_block[lo]) * ZERO_K_CHUNK;
    w.end = min(w.begin + (int64_t)ZERO_K_CHUNK, map.numel[lo]);
    return w;
}

/* op(i, src[i] as float) for every i of [begin, end) this thread owns,
 * ZERO_K_ILP loads issued before the first op: the compiler cannot move a
 * load above a store it might alias, so the loads are grouped by hand. The
 * order in which a thread visits its elements is fixed. */
template <typename Op>
static __device__ __forceinline__ void for_each_loaded(const void *src,
                                                       int src_dtype,
                                                       int64_t begin,
                                                       int64_t end, Op op)
{
    const int64_t step = (int64_t)ZERO_K_THREADS * ZERO_K_ILP;
    for (int64_t base = begin + threadIdx.x; base < end; base += step) {
        float x[ZERO_K_ILP];
#pragma unroll
        for (int j = 0; j < ZERO_K_ILP; j++) {
            int64_t i = base + (int64_t)j * ZERO_K_THREADS;
            x[j] = i < end ? load_elem(src, src_dtype, i) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < ZERO_K_ILP; j++) {
            int64_t i = base + (int64_t)j * ZERO_K_THREADS;
            if (i < end) {
                op(i, x[j]);
            }
        }
    }
}

/* Sum of x over the block, in a fixed tree order, so the result does not
 * depend on scheduling. Valid in thread 0. */
static __device__ __forceinline__ double block_sum(double x)
{
    __shared__ double partial[ZERO_K_THREADS];
    partial[threadIdx.x] = x;
    __syncthreads();
    for (int width = ZERO_K_THREADS / 2; width > 0; width /= 2) {
        if ((int)threadIdx.x < width) {
            partial[threadIdx.x] += partial[threadIdx.x + width];
        }
        __syncthreads();
    }
    return partial[0];
}

#endif /* ZERO_DEVICE_CUH */
