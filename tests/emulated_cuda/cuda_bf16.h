/* cuda_bf16.h for the emulated kernels: the bfloat16 type and conversions are
 * in emulation.h. */
#include "emulation.h"
