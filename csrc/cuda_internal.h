/* cuda_internal.h: what the CUDA host files share (cuda_driver.c loads the
 * driver and the kernels, cuda_launch.c packs arguments and launches) and
 * tests/c checks: the few driver API types the launchers use, declared here
 * so that the build needs no cuda.h, the per-device state, and the planning
 * of multi-tensor launches.
 */
#ifndef ZERO_CUDA_INTERNAL_H
#define ZERO_CUDA_INTERNAL_H

#include "zero/kernels.h"
#include "zero_cuda.h"

/* The driver API's types, as opaque handles (their ABI: an enum is an int,
 * a device an int ordinal, the rest pointers). */
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;

#define CUDA_SUCCESS 0

/* The kernels of zero/kernels.h, as indices. */
enum {
#define ZERO_K_ID(name, args) KERNEL_##name,
    ZERO_K_LIST(ZERO_K_ID)
#undef ZERO_K_ID
    KERNEL_COUNT
};

typedef struct {
    CUdevice device;
    CUcontext context;     /* the primary context, retained once */
    CUmodule module;       /* the fatbin, loaded into that context */
    CUfunction kernels[KERNEL_COUNT];
    int sm_count;
    int cc_major, cc_minor;
} cuda_device;

/* ---- cuda_driver.c -------------------------------------------------- */

/* Make `where` current for launches: the driver and the device loaded, the
 * device's primary context pushed on this thread, the stream checked to
 * belong to it. On ZERO_OK the caller must call cuda_leave. */
zero_status cuda_enter(const zero_cuda_where *where,
                       const cuda_device **device);
/* Pop the context; returns status, or the pop's failure if status is OK. */
zero_status cuda_leave(zero_status status);

/* grid blocks of ZERO_K_THREADS threads; args is the kernel's struct. */
zero_status cuda_launch(const cuda_device *device, int kernel, int64_t grid,
                        uintptr_t stream, void *args);

/* Set zero_cuda_error() for this thread (printf format); returns status. */
zero_status cuda_fail(zero_status status, const char *format, ...)
    __attribute__((format(printf, 2, 3)));

/* ---- cuda_launch.c: multi-tensor launches --------------------------- */

/* An empty map (see [Note: multi-tensor map] in zero/kernels.h). */
void cuda_map_reset(zero_k_map *map);

/* Append a tensor of numel > 0 elements: its slot, or -1 when the launch is
 * full (ZERO_K_TENSORS tensors, or a grid past INT32_MAX blocks). */
int cuda_map_add(zero_k_map *map, int64_t numel);

/* Blocks the map's launch needs. */
static inline int64_t cuda_map_blocks(const zero_k_map *map)
{
    return map->first_block[map->count];
}

#endif /* ZERO_CUDA_INTERNAL_H */
