/* module_cuda.c: placeholder */
#include "module.h"

int add_cuda_functions(PyObject *module)
{
    (void)module;
    return 0;
}
