/* cpu_features.c: CPU feature detection and the choice of SIMD path.
 *
 * The path is picked at run time from cpuid and xgetbv (the OS must save
 * the wide registers, not only the CPU have them), never at build time.
 * ZERO_SIMD forces a path so tests can cover each one; zero_isa_set() does
 * the same from code. Reading the active table is one atomic load.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define ZERO_X86 1
#endif

static struct {
    int avx, avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512_bf16;
    int os_avx, os_avx512;
} cpu;

static char feature_names[160];
static char env_error[64];
static atomic_int active_isa = -1; /* -1: not chosen yet */

#ifdef ZERO_X86
static unsigned long long read_xcr0(void)
{
    unsigned int eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}

static void detect(void)
{
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) {
        return;
    }
    int osxsave = (ecx >> 27) & 1;
    cpu.avx = (ecx >> 28) & 1;
    cpu.fma = (ecx >> 12) & 1;
    cpu.f16c = (ecx >> 29) & 1;
    if (osxsave) {
        unsigned long long xcr0 = read_xcr0();
        cpu.os_avx = (xcr0 & 0x6) == 0x6;            /* XMM and YMM */
        cpu.os_avx512 = (xcr0 & 0xe6) == 0xe6;       /* + opmask, ZMM */
    }
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
        cpu.avx2 = (ebx >> 5) & 1;
        cpu.avx512f = (ebx >> 16) & 1;
        cpu.avx512bw = (ebx >> 30) & 1;
        cpu.avx512vl = (ebx >> 31) & 1;
    }
    if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) {
        cpu.avx512_bf16 = (eax >> 5) & 1;
    }
}
#else
static void detect(void) {}
#endif

static void append_feature(const char *name, int present)
{
    if (!present) {
        return;
    }
    size_t used = strlen(feature_names);
    snprintf(feature_names + used, sizeof feature_names - used, "%s%s",
             used ? " " : "", name);
}

static pthread_once_t detect_once = PTHREAD_ONCE_INIT;
static pthread_once_t choose_once = PTHREAD_ONCE_INIT;

static void detect_features(void)
{
    detect();
    append_feature("avx", cpu.avx && cpu.os_avx);
    append_feature("avx2", cpu.avx2 && cpu.os_avx);
    append_feature("fma", cpu.fma);
    append_feature("f16c", cpu.f16c);
    append_feature("avx512f", cpu.avx512f && cpu.os_avx512);
    append_feature("avx512bw", cpu.avx512bw && cpu.os_avx512);
    append_feature("avx512vl", cpu.avx512vl && cpu.os_avx512);
    append_feature("avx512_bf16", cpu.avx512_bf16 && cpu.os_avx512);
}

static const char *const isa_names[ZERO_ISA_COUNT] = {"scalar", "avx2",
                                                      "avx512"};

const char *zero_isa_name(zero_isa isa)
{
    return (unsigned)isa < ZERO_ISA_COUNT ? isa_names[isa] : "unknown";
}

int zero_isa_from_name(const char *name, zero_isa *isa)
{
    for (int i = 0; i < ZERO_ISA_COUNT; i++) {
        if (strcmp(name, isa_names[i]) == 0) {
            *isa = (zero_isa)i;
            return 0;
        }
    }
    return -1;
}

int zero_isa_supported(zero_isa isa)
{
    pthread_once(&detect_once, detect_features);
    switch (isa) {
    case ZERO_ISA_SCALAR:
        return 1;
#ifdef ZERO_X86
    case ZERO_ISA_AVX2:
        return cpu.os_avx && cpu.avx && cpu.avx2 && cpu.fma && cpu.f16c;
    case ZERO_ISA_AVX512:
        return zero_isa_supported(ZERO_ISA_AVX2) && cpu.os_avx512 &&
               cpu.avx512f && cpu.avx512bw && cpu.avx512vl;
#endif
    default:
        return 0;
    }
}

zero_isa zero_isa_best(void)
{
    for (int i = ZERO_ISA_COUNT - 1; i > 0; i--) {
        if (zero_isa_supported((zero_isa)i)) {
            return (zero_isa)i;
        }
    }
    return ZERO_ISA_SCALAR;
}

static void choose_isa(void)
{
    zero_isa chosen = zero_isa_best();
    const char *forced = getenv(ZERO_SIMD_ENV);
    if (forced && *forced) {
        zero_isa wanted;
        if (zero_isa_from_name(forced, &wanted) == 0 &&
            zero_isa_supported(wanted)) {
            chosen = wanted;
        } else {
            snprintf(env_error, sizeof env_error, "%s", forced);
        }
    }
    atomic_store(&active_isa, (int)chosen);
}

zero_isa zero_isa_active(void)
{
    if (atomic_load(&active_isa) < 0) {
        pthread_once(&choose_once, choose_isa);
    }
    return (zero_isa)atomic_load(&active_isa);
}

const char *zero_isa_env_error(void)
{
    zero_isa_active();
    return env_error[0] ? env_error : NULL;
}

const char *zero_cpu_features(void)
{
    zero_isa_active();
    return feature_names;
}

zero_status zero_isa_set(zero_isa isa)
{
    zero_isa_active();
    if ((unsigned)isa >= ZERO_ISA_COUNT || !zero_isa_supported(isa)) {
        return ZERO_ERR_UNSUPPORTED_ISA;
    }
    atomic_store(&active_isa, (int)isa);
    return ZERO_OK;
}

const isa_kernels *active_kernels(void)
{
    switch (zero_isa_active()) {
#ifdef ZERO_X86
    case ZERO_ISA_AVX512:
        return &avx512_kernels;
    case ZERO_ISA_AVX2:
        return &avx2_kernels;
#endif
    default:
        return &scalar_kernels;
    }
}
