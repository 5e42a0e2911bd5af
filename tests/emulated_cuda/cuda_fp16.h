/* cuda_fp16.h for the emulated kernels: the float16 type and conversions are
 * in emulation.h. */
#include "emulation.h"
