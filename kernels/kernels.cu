/* kernels.cu: the one translation unit nvcc builds into the fatbin. Every
 * kernel file is included here, so that all kernels land in one module
 * (one cuModuleLoadData per device) and the PTX for newer GPUs keeps every
 * kernel; see docs/cuda.md.
 */
#include "adam.cuh"
#include "cast.cuh"
#include "norm.cuh"
#include "unscale.cuh"
