/* emulation.h: what nvcc provides to the kernels, for g++, so that the
 * kernel source (kernels/kernels.cu) runs on the CPU inside the emulated
 * driver (fake_cuda.cpp). Force-included before the kernels.
 *
 * A CUDA thread is a coroutine; __syncthreads() returns to the block's
 * scheduler, which runs every thread of the block up to the barrier before
 * any goes on. Blocks run one after another, so __shared__ is static
 * storage. What this cannot show: data races between threads of a block
 * (they run one at a time), the GPU's memory model, and the hardware's
 * conversions (the reference ones of include/zero/half.h stand in; they
 * differ only in NaN payloads).
 */
#ifndef ZERO_EMULATION_H
#define ZERO_EMULATION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "zero/half.h"

#define __CUDACC__ 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(threads)
#define __shared__ static

struct emu_dim3 {
    unsigned int x, y, z;
};
extern emu_dim3 blockIdx, threadIdx;

void emu_syncthreads(void);
#define __syncthreads() emu_syncthreads()

template <typename T>
static inline T min(T a, T b)
{
    return b < a ? b : a;
}

struct float4 {
    float x, y, z, w;
};
struct uint2 {
    unsigned int x, y;
};

static inline float4 make_float4(float x, float y, float z, float w)
{
    return float4{x, y, z, w};
}

static inline uint2 make_uint2(unsigned int x, unsigned int y)
{
    return uint2{x, y};
}

/* cuda_bf16.h and cuda_fp16.h: a 16-bit float is its bits, converted by
 * the reference conversions of include/zero/half.h. */
struct __nv_bfloat16 {
    unsigned short bits;
};
struct __half {
    unsigned short bits;
};

static inline float __bfloat162float(__nv_bfloat16 h)
{
    return bf16_to_f32(h.bits);
}

static inline float __half2float(__half h)
{
    return f16_to_f32(h.bits);
}

static inline __nv_bfloat16 __float2bfloat16_rn(float x)
{
    return __nv_bfloat16{f32_to_bf16(x)};
}

static inline __half __float2half_rn(float x)
{
    return __half{f32_to_f16(x)};
}

#define __ushort_as_bfloat16(u) (__nv_bfloat16{(unsigned short)(u)})
#define __ushort_as_half(u) (__half{(unsigned short)(u)})
#define __bfloat16_as_ushort(h) ((h).bits)
#define __half_as_ushort(h) ((h).bits)

#endif /* ZERO_EMULATION_H */
