/* status.c: names of statuses and dtypes, for messages and for the binding. */
#include "zero.h"

const char *zero_status_string(zero_status status)
{
    switch (status) {
    case ZERO_OK:
        return "ok";
    case ZERO_ERR_INVALID_ARGUMENT:
        return "invalid argument";
    case ZERO_ERR_UNSUPPORTED_DTYPE:
        return "unsupported dtype";
    case ZERO_ERR_UNSUPPORTED_ISA:
        return "SIMD path not supported by this CPU";
    case ZERO_ERR_OUT_OF_MEMORY:
        return "out of memory";
    case ZERO_ERR_THREADS:
        return "could not start a worker thread";
    case ZERO_ERR_CUDA_UNAVAILABLE:
        return "the CUDA path is not available";
    case ZERO_ERR_CUDA:
        return "a CUDA call failed";
    case ZERO_ERR_IO:
        return "a read or write failed";
    case ZERO_ERR_TIMEOUT:
        return "timed out with the request in flight";
    case ZERO_ERR_UNAVAILABLE:
        return "that I/O backend is not available here";
    }
    return "unknown status";
}

size_t zero_dtype_size(zero_dtype dtype)
{
    return dtype == ZERO_F32 ? 4 : 2;
}

const char *zero_dtype_name(zero_dtype dtype)
{
    switch (dtype) {
    case ZERO_F32:
        return "float32";
    case ZERO_BF16:
        return "bfloat16";
    case ZERO_F16:
        return "float16";
    }
    return "unknown";
}
