/* dlpack_abi.h: the DLPack structures, as the DLPack specification lays them
 * out (v0.8 "dltensor" capsules and v1.x "dltensor_versioned" capsules).
 * Written from the specification's field list; only what the binding reads.
 */
#ifndef ZERO_DLPACK_ABI_H
#define ZERO_DLPACK_ABI_H

#include <stdint.h>

enum {
    DL_CPU = 1,
    DL_CUDA = 2,
    DL_CUDA_HOST = 3
};

enum {
    DL_CODE_INT = 0,
    DL_CODE_UINT = 1,
    DL_CODE_FLOAT = 2,
    DL_CODE_BFLOAT = 4
};

#define DL_FLAG_READ_ONLY (1ull << 0)

typedef struct {
    int32_t device_type;
    int32_t device_id;
} dl_device;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} dl_dtype;

typedef struct {
    void *data;
    dl_device device;
    int32_t ndim;
    dl_dtype dtype;
    int64_t *shape;   /* [ndim] */
    int64_t *strides; /* [ndim] in elements, or NULL for compact row-major */
    uint64_t byte_offset;
} dl_tensor;

typedef struct dl_managed {
    dl_tensor tensor;
    void *manager_ctx;
    void (*deleter)(struct dl_managed *self);
} dl_managed;

typedef struct {
    uint32_t major;
    uint32_t minor;
} dl_version;

typedef struct dl_managed_versioned {
    dl_version version;
    void *manager_ctx;
    void (*deleter)(struct dl_managed_versioned *self);
    uint64_t flags;
    dl_tensor tensor;
} dl_managed_versioned;

#endif /* ZERO_DLPACK_ABI_H */
