/* dtype.h: the element types the core and the kernels read and write.
 *
 * include/zero/ holds what csrc/ (gcc) and kernels/ (nvcc, or g++ in the
 * emulated driver of tests/emulated_cuda) both compile: these element
 * types, the Adam formula (optim_math.h), the fp32 <-> 16-bit conversions
 * (half.h) and the kernels' argument structs (kernels.h). Both folders
 * include it as "zero/<name>.h" (-Iinclude) and neither includes the
 * other's files, so includes run one way: csrc/ -> include/zero/ <- kernels/.
 * Plain C that nvcc and g++ also accept; nothing here includes a header
 * outside this folder but the C library's.
 */
#ifndef ZERO_DTYPE_H
#define ZERO_DTYPE_H

/* Element types of the buffers; the kernels store them in a byte. */
typedef enum {
    ZERO_F32 = 0,
    ZERO_BF16 = 1,
    ZERO_F16 = 2
} zero_dtype;

#endif /* ZERO_DTYPE_H */
