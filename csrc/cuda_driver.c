/* cuda_driver.c: the CUDA driver, opened at run time, and the kernels'
 * module on each device.
 *
 * The extension has no link-time dependency on CUDA: libcuda.so.1 is
 * dlopened on the first call that needs it, so `import zero` works on any
 * machine and a failure to load becomes a status with a reason. Loading the
 * driver (cuInit) creates no context. A device's primary context, the one
 * the CUDA runtime and so torch use, is retained the first time a kernel is
 * launched on that device, and the embedded fatbin is loaded into it once;
 * both stay for the life of the process.
 *
 * Every driver call's result is checked; a failure's message names the
 * call and the driver's name and description of the error.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"

#define DEFAULT_LIBRARY "libcuda.so.1"
/* Names another driver library (a CUDA compat libcuda, or the emulated one
 * the tests use), read when the driver is first loaded. */
#define DRIVER_ENV "ZERO_CUDA_DRIVER"
#define MAX_DEVICES 64
#define MESSAGE_SIZE 768

/* cuDeviceGetAttribute's attributes (CUdevice_attribute values). */
#define ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76

/* Special stream handles: NULL, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD.
 * They belong to whatever context is current, so need no check. */
#define LAST_SPECIAL_STREAM 2

/* The driver functions used, named as in cuda.h. */
typedef struct {
    CUresult (*cuInit)(unsigned int flags);
    CUresult (*cuDriverGetVersion)(int *version);
    CUresult (*cuDeviceGetCount)(int *count);
    CUresult (*cuDeviceGet)(CUdevice *device, int ordinal);
    CUresult (*cuDeviceGetAttribute)(int *value, int attribute,
                                     CUdevice device);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *context,
                                         CUdevice device);
    CUresult (*cuDevicePrimaryCtxRelease)(CUdevice device);
    CUresult (*cuCtxPushCurrent)(CUcontext context);
    CUresult (*cuCtxPopCurrent)(CUcontext *context);
    CUresult (*cuModuleLoadData)(CUmodule *module, const void *image);
    CUresult (*cuModuleUnload)(CUmodule module);
    CUresult (*cuModuleGetFunction)(CUfunction *function, CUmodule module,
                                    const char *name);
    CUresult (*cuLaunchKernel)(CUfunction f, unsigned int grid_x,
                               unsigned int grid_y, unsigned int grid_z,
                               unsigned int block_x, unsigned int block_y,
                               unsigned int block_z, unsigned int shared,
                               CUstream stream, void **params, void **extra);
    CUresult (*cuStreamGetCtx)(CUstream stream, CUcontext *context);
    CUresult (*cuGetErrorName)(CUresult error, const char **name);
    CUresult (*cuGetErrorString)(CUresult error, const char **text);
} driver_api;

/* Exported names: cuda.h maps some API names to versioned symbols by macro
 * (cuCtxPushCurrent is cuCtxPushCurrent_v2); dlsym needs the symbol. */
static const struct {
    const char *symbol;
    size_t offset;
} driver_symbols[] = {
    {"cuInit", offsetof(driver_api, cuInit)},
    {"cuDriverGetVersion", offsetof(driver_api, cuDriverGetVersion)},
    {"cuDeviceGetCount", offsetof(driver_api, cuDeviceGetCount)},
    {"cuDeviceGet", offsetof(driver_api, cuDeviceGet)},
    {"cuDeviceGetAttribute", offsetof(driver_api, cuDeviceGetAttribute)},
    {"cuDevicePrimaryCtxRetain",
     offsetof(driver_api, cuDevicePrimaryCtxRetain)},
    {"cuDevicePrimaryCtxRelease_v2",
     offsetof(driver_api, cuDevicePrimaryCtxRelease)},
    {"cuCtxPushCurrent_v2", offsetof(driver_api, cuCtxPushCurrent)},
    {"cuCtxPopCurrent_v2", offsetof(driver_api, cuCtxPopCurrent)},
    {"cuModuleLoadData", offsetof(driver_api, cuModuleLoadData)},
    {"cuModuleUnload", offsetof(driver_api, cuModuleUnload)},
    {"cuModuleGetFunction", offsetof(driver_api, cuModuleGetFunction)},
    {"cuLaunchKernel", offsetof(driver_api, cuLaunchKernel)},
    {"cuStreamGetCtx", offsetof(driver_api, cuStreamGetCtx)},
    {"cuGetErrorName", offsetof(driver_api, cuGetErrorName)},
    {"cuGetErrorString", offsetof(driver_api, cuGetErrorString)},
};

static const char *const kernel_names[KERNEL_COUNT] = {
#define ZERO_K_NAME(name, args) #name,
    ZERO_K_LIST(ZERO_K_NAME)
#undef ZERO_K_NAME
};

/* Everything below `lock` changes only under it. Once `loaded` is set, api
 * and device_count never change again, and a device's entry never changes
 * once it is ready, so launches read them without the lock (cuda_enter
 * takes the lock first, which orders those reads after the writes). */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static zero_cuda_image image = {NULL, 0, "", "no kernels were embedded"};
static char library[256];        /* set by zero_cuda_set_library, or "" */
static int loaded;
static char load_failure[MESSAGE_SIZE]; /* why loading failed; empty: none */
static driver_api api;
static int driver_version;
static int device_count;
static cuda_device devices[MAX_DEVICES];
static int device_ready[MAX_DEVICES];

static _Thread_local char message[MESSAGE_SIZE];

zero_status cuda_fail(zero_status status, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    vsnprintf(message, sizeof message, format, args);
    va_end(args);
    return status;
}

const char *zero_cuda_error(void)
{
    return message;
}

/* ZERO_OK, or ZERO_ERR_CUDA with "<call> failed: <name>: <description>". */
static zero_status check(CUresult result, const char *call)
{
    if (result == CUDA_SUCCESS) {
        return ZERO_OK;
    }
    const char *name = NULL, *text = NULL;
    if (api.cuGetErrorName(result, &name) != CUDA_SUCCESS || !name) {
        name = "unknown CUDA error";
    }
    if (api.cuGetErrorString(result, &text) != CUDA_SUCCESS || !text) {
        text = "no description";
    }
    return cuda_fail(ZERO_ERR_CUDA, "%s failed: %s (%d): %s", call, name,
                     (int)result, text);
}

void zero_cuda_set_image(const zero_cuda_image *new_image)
{
    pthread_mutex_lock(&lock);
    image = *new_image;
    pthread_mutex_unlock(&lock);
}

zero_status zero_cuda_set_library(const char *name)
{
    if (!name || strlen(name) >= sizeof library) {
        return cuda_fail(ZERO_ERR_INVALID_ARGUMENT, "bad library name");
    }
    pthread_mutex_lock(&lock);
    zero_status status = ZERO_OK;
    if (loaded) {
        status = cuda_fail(ZERO_ERR_INVALID_ARGUMENT,
                           "the CUDA driver is already loaded");
    } else {
        strcpy(library, name);
        load_failure[0] = '\0';
    }
    pthread_mutex_unlock(&lock);
    return status;
}

/* Remember why loading failed (later calls answer the same without trying
 * again) and report it. */
static zero_status remember_failure(void)
{
    snprintf(load_failure, sizeof load_failure, "%s", message);
    return ZERO_ERR_CUDA_UNAVAILABLE;
}

/* Under lock: the library to dlopen. */
static const char *library_name(void)
{
    if (library[0]) {
        return library;
    }
    const char *env = getenv(DRIVER_ENV);
    return env && env[0] ? env : DEFAULT_LIBRARY;
}

/* Under lock: dlopen the driver, find its functions, cuInit, count the
 * devices. */
static zero_status load_driver(void)
{
    if (loaded) {
        return ZERO_OK;
    }
    if (load_failure[0]) {
        return cuda_fail(ZERO_ERR_CUDA_UNAVAILABLE, "%s", load_failure);
    }
    const char *name = library_name();
    void *handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        const char *why = dlerror();
        cuda_fail(ZERO_ERR_CUDA_UNAVAILABLE,
                  "%s could not be loaded, so no NVIDIA driver is usable "
                  "here (%s)",
                  name, why ? why : "dlopen failed");
        return remember_failure();
    }
    driver_api found;
    for (size_t i = 0; i < sizeof driver_symbols / sizeof *driver_symbols;
         i++) {
        void *symbol = dlsym(handle, driver_symbols[i].symbol);
        if (!symbol) {
            cuda_fail(ZERO_ERR_CUDA_UNAVAILABLE,
                      "%s has no %s: not a CUDA driver, or one too old",
                      name, driver_symbols[i].symbol);
            dlclose(handle);
            return remember_failure();
        }
        /* POSIX makes a function's address round-trip through void * */
        memcpy((char *)&found + driver_symbols[i].offset, &symbol,
               sizeof symbol);
    }
    api = found;
    /* From here the driver has run: it stays open even on failure. */
    zero_status status = check(api.cuInit(0), "cuInit");
    if (status == ZERO_OK) {
        status = check(api.cuDriverGetVersion(&driver_version),
                       "cuDriverGetVersion");
    }
    if (status == ZERO_OK) {
        status = check(api.cuDeviceGetCount(&device_count),
                       "cuDeviceGetCount");
    }
    if (status == ZERO_OK && device_count < 1) {
        cuda_fail(ZERO_ERR_CUDA_UNAVAILABLE,
                  "the CUDA driver sees no device");
    }
    if (status != ZERO_OK || device_count < 1) {
        return remember_failure();
    }
    if (device_count > MAX_DEVICES) {
        device_count = MAX_DEVICES;
    }
    loaded = 1;
    return ZERO_OK;
}

static zero_status image_present(void)
{
    if (image.size == 0) {
        return cuda_fail(ZERO_ERR_CUDA_UNAVAILABLE, "%s", image.note);
    }
    return ZERO_OK;
}

zero_status zero_cuda_probe(void)
{
    pthread_mutex_lock(&lock);
    zero_status status = image_present();
    if (status == ZERO_OK) {
        status = load_driver();
    }
    pthread_mutex_unlock(&lock);
    return status;
}

int zero_cuda_driver_version(void)
{
    pthread_mutex_lock(&lock);
    int version = loaded ? driver_version : 0;
    pthread_mutex_unlock(&lock);
    return version;
}

/* Under lock, with the primary context of d pushed: the module and its
 * kernels. */
static zero_status load_module(cuda_device *d)
{
    CUresult result = api.cuModuleLoadData(&d->module, image.fatbin);
    if (result != CUDA_SUCCESS) {
        check(result, "cuModuleLoadData");
        size_t used = strlen(message);
        snprintf(message + used, sizeof message - used,
                 " (kernels for %s, %s; the driver supports CUDA %d.%d)",
                 image.archs, image.note, driver_version / 1000,
                 driver_version % 1000 / 10);
        return ZERO_ERR_CUDA;
    }
    for (int k = 0; k < KERNEL_COUNT; k++) {
        zero_status status = check(
            api.cuModuleGetFunction(&d->kernels[k], d->module,
                                    kernel_names[k]),
            "cuModuleGetFunction");
        if (status != ZERO_OK) {
            api.cuModuleUnload(d->module);
            return status;
        }
    }
    return ZERO_OK;
}

/* Under lock: device `ordinal`'s context and module, loaded once. */
static zero_status load_device(int ordinal)
{
    if (ordinal < 0 || ordinal >= device_count) {
        return cuda_fail(ZERO_ERR_INVALID_ARGUMENT,
                         "CUDA device %d does not exist (the driver sees "
                         "%d)",
                         ordinal, device_count);
    }
    if (device_ready[ordinal]) {
        return ZERO_OK;
    }
    cuda_device *d = &devices[ordinal];
    memset(d, 0, sizeof *d);
    zero_status status = check(api.cuDeviceGet(&d->device, ordinal),
                               "cuDeviceGet");
    const struct {
        int attribute;
        int *value;
    } attributes[] = {
        {ATTRIBUTE_MULTIPROCESSOR_COUNT, &d->sm_count},
        {ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, &d->cc_major},
        {ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, &d->cc_minor},
    };
    for (int i = 0; i < 3 && status == ZERO_OK; i++) {
        status = check(api.cuDeviceGetAttribute(attributes[i].value,
                                                attributes[i].attribute,
                                                d->device),
                       "cuDeviceGetAttribute");
    }
    if (status != ZERO_OK) {
        return status;
    }
    if (d->cc_major < 8) {
        return cuda_fail(ZERO_ERR_CUDA_UNAVAILABLE,
                         "CUDA device %d has compute capability %d.%d; "
                         "zero's kernels need 8.0 (sm_80) or newer",
                         ordinal, d->cc_major, d->cc_minor);
    }
    status = check(api.cuDevicePrimaryCtxRetain(&d->context, d->device),
                   "cuDevicePrimaryCtxRetain");
    if (status != ZERO_OK) {
        return status;
    }
    status = check(api.cuCtxPushCurrent(d->context), "cuCtxPushCurrent");
    if (status == ZERO_OK) {
        status = load_module(d);
        CUcontext popped;
        zero_status pop = check(api.cuCtxPopCurrent(&popped),
                                "cuCtxPopCurrent");
        status = status == ZERO_OK ? pop : status;
    }
    if (status != ZERO_OK) {
        api.cuDevicePrimaryCtxRelease(d->device);
        return status;
    }
    device_ready[ordinal] = 1;
    return ZERO_OK;
}

zero_status cuda_enter(const zero_cuda_where *where,
                       const cuda_device **device)
{
    pthread_mutex_lock(&lock);
    zero_status status = image_present();
    if (status == ZERO_OK) {
        status = load_driver();
    }
    if (status == ZERO_OK) {
        status = load_device(where->device);
    }
    pthread_mutex_unlock(&lock);
    if (status != ZERO_OK) {
        return status;
    }
    const cuda_device *d = &devices[where->device];
    status = check(api.cuCtxPushCurrent(d->context), "cuCtxPushCurrent");
    if (status != ZERO_OK) {
        return status;
    }
    if (where->stream > LAST_SPECIAL_STREAM) {
        CUcontext owner = NULL;
        status = check(api.cuStreamGetCtx((CUstream)where->stream, &owner),
                       "cuStreamGetCtx");
        if (status == ZERO_OK && owner != d->context) {
            status = cuda_fail(
                ZERO_ERR_INVALID_ARGUMENT,
                "stream 0x%llx belongs to another context than CUDA "
                "device %d's (pass torch.cuda.current_stream(device)"
                ".cuda_stream of the tensors' device)",
                (unsigned long long)where->stream, where->device);
        }
        if (status != ZERO_OK) {
            return cuda_leave(status);
        }
    }
    *device = d;
    return ZERO_OK;
}

zero_status cuda_leave(zero_status status)
{
    CUcontext popped;
    CUresult result = api.cuCtxPopCurrent(&popped);
    if (status != ZERO_OK) {
        return status;
    }
    return check(result, "cuCtxPopCurrent");
}

zero_status cuda_launch(const cuda_device *device, int kernel, int64_t grid,
                        uintptr_t stream, void *args)
{
    if (grid < 1 || grid > INT32_MAX) {
        return cuda_fail(ZERO_ERR_INVALID_ARGUMENT,
                         "%s: a grid of %lld blocks", kernel_names[kernel],
                         (long long)grid);
    }
    void *params[] = {args};
    CUresult result = api.cuLaunchKernel(
        device->kernels[kernel], (unsigned int)grid, 1, 1, ZERO_K_THREADS, 1,
        1, 0, (CUstream)stream, params, NULL);
    if (result == CUDA_SUCCESS) {
        return ZERO_OK;
    }
    char call[96];
    snprintf(call, sizeof call, "cuLaunchKernel(%s)", kernel_names[kernel]);
    return check(result, call);
}
