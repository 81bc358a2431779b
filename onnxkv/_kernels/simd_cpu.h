/* onnxkv/_kernels/simd_cpu.h -- platform layer of the kernels: OpenMP helpers,
 * the instruction-set macros (OKV_X86_SIMD, OKV_AVX2, OKV_AVX512BW,
 * OKV_HAVE_VNNI, OKV_HAVE_AMX, OKV_HAVE_BF16), the settings of one kernel call
 * (okv_settings) and the run-time CPU checks (okv_cpu_*_ok).
 *
 * Define OKV_NO_SIMD to compile the scalar path only (also automatic on
 * non-x86 targets and non-GNU compilers).
 */
#ifndef ONNXKV_SIMD_CPU_H
#define ONNXKV_SIMD_CPU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
static int okv_openmp_enabled(void) { return 1; }
static int okv_omp_num_procs(void) { return omp_get_num_procs(); }
static int okv_thread_num(void) { return omp_get_thread_num(); }
#else
static int okv_openmp_enabled(void) { return 0; }
static int okv_omp_num_procs(void) { return 1; }
static int okv_thread_num(void) { return 0; }
#endif

/* A function the compiler must inline into every caller (a constant argument
 * such as an element type or a tile width then folds into its loops). */
/* OKV_NOINLINE: a function kept out of line (a large body the optimiser
 * handles better alone than inlined next to its siblings). */
#if defined(__GNUC__) || defined(__clang__)
#define OKV_INLINE static inline __attribute__((always_inline))
#define OKV_NOINLINE __attribute__((noinline))
#else
#define OKV_INLINE static inline
#define OKV_NOINLINE
#endif

#if !defined(OKV_NO_SIMD) && (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define OKV_X86_SIMD 1
#include <cpuid.h>
#include <immintrin.h>
#define OKV_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define OKV_X86_SIMD 0
#endif

/* Instruction sets on top of AVX2 and AVX-512 that the compiler may lack:
 * OKV_HAVE_VNNI (AVX-512 VNNI and AVX-VNNI: qmatmul_x86.h, imatmul.h) and OKV_HAVE_AMX
 * (AMX-TILE and AMX-INT8: attention_amx.h).  The build (meson.build of this
 * folder) defines each as 1 or 0 after compiling a test of its target
 * attribute and intrinsics; a set that is 0 is compiled out and its CPU check
 * answers 0.  Without such a definition, the compiler version decides (GCC 11
 * and Clang 12 brought both). */
#if OKV_X86_SIMD
#if defined(__clang__)
#define OKV_CC_HAS_VNNI_AMX (__clang_major__ >= 12)
#else
#define OKV_CC_HAS_VNNI_AMX (__GNUC__ >= 11)
#endif
#ifndef OKV_HAVE_VNNI
#define OKV_HAVE_VNNI OKV_CC_HAS_VNNI_AMX
#endif
#ifndef OKV_HAVE_AMX
#define OKV_HAVE_AMX OKV_CC_HAS_VNNI_AMX
#endif
#ifndef OKV_HAVE_BF16 /* AVX-512-BF16: matmul_bf16.h (GCC 10, Clang 9) */
#define OKV_HAVE_BF16 OKV_CC_HAS_VNNI_AMX
#endif
#else
#undef OKV_HAVE_VNNI
#undef OKV_HAVE_AMX
#undef OKV_HAVE_BF16
#define OKV_HAVE_VNNI 0
#define OKV_HAVE_AMX 0
#define OKV_HAVE_BF16 0
#endif

/* ------------------------------------------------------------------ */
/* Settings of one kernel call                                          */
/* ------------------------------------------------------------------ */

/* Thread count, instruction set and tuning of one kernel call.  The Python
 * wrapper of a kernel takes a copy of the calling thread's current settings
 * (onnxkv._kernels._runtime: okv_settings_get) and passes it down by value:
 * no kernel reads a global setting, and OpenMP workers see only the struct of
 * the call they work for, so two Python threads with different settings never
 * race.  The instruction-set fields are already limited to what the CPU and
 * OS can run. */
typedef struct okv_settings {
    int threads;      /* num_threads of every prange (>= 1) */
    int simd;         /* 1: AVX2+FMA+F16C paths, 0: the scalar path */
    int avx512;       /* 1: attention and matmul_packed may run their AVX-512 tiles */
    int amx;          /* 1: inside the AVX-512 attention tiles, quantized keys on AMX-INT8 */
    int prefetch;     /* okv_attn_args.prefetch: 0 off, 1 into L1, 2 into L2, n >= 3 into L2 n-1 blocks ahead */
    int pf_qk_lines;  /* okv_attn_args.pf_qk_lines */
    int prefill_rg;   /* okv_attn_args.prefill_rg: query rows per row group of prefill units (1..8) */
    int split_tasks;  /* attention: min. cache-split tasks per thread for long caches (0: split only to fill threads) */
    int paged_heads;  /* KV heads per paged decode work unit (0: all) */
    int adaptive;     /* 1: matmul_packed runs alone for a while after a late thread team */
    int vnni;         /* 1: qmatmul's int8 dot products use VNNI (AVX-512 or AVX-VNNI) where the CPU has it */
    int flash;        /* okv_attn_args.flash: prefill units of native K/V take the tiled unit (attention_flash.h) */
    int bf16;         /* 1: matmul_packed products of >= OKV_BF16_MIN_ROWS rows in bfloat16 (matmul_bf16.h) */
} okv_settings;

/* ------------------------------------------------------------------ */
/* CPU detection                                                        */
/* ------------------------------------------------------------------ */

static int okv_simd_compiled(void) { return OKV_X86_SIMD; }

/* Fills flags[0..6] with avx, avx2, fma, f16c, avx512f, sse4.2, popcnt. */
static void okv_cpu_flags(int *flags) {
    int i;
    for (i = 0; i < 7; i++) flags[i] = 0;
#if OKV_X86_SIMD
    __builtin_cpu_init();
    flags[0] = __builtin_cpu_supports("avx") != 0;
    flags[1] = __builtin_cpu_supports("avx2") != 0;
    flags[2] = __builtin_cpu_supports("fma") != 0;
    {   /* F16C: CPUID leaf 1, ECX bit 29 (__builtin_cpu_supports("f16c") needs GCC 11 or Clang 16) */
        unsigned int a, b, c, d;
        flags[3] = __get_cpuid(1, &a, &b, &c, &d) && ((c >> 29) & 1u);
    }
    flags[4] = __builtin_cpu_supports("avx512f") != 0;
    flags[5] = __builtin_cpu_supports("sse4.2") != 0;
    flags[6] = __builtin_cpu_supports("popcnt") != 0;
#endif
}

/* 1 when the AVX2+FMA+F16C path can run on this machine. */
static int okv_cpu_simd_ok(void) {
    int f[7];
    okv_cpu_flags(f);
    return f[0] && f[1] && f[2] && f[3];
}

#if OKV_X86_SIMD
/* Target of the 16-lane (AVX-512 F/BW/VL/DQ) kernels, on top of the AVX2 set;
 * only executed when okv_cpu_avx512_ok() says so. */
#define OKV_AVX512BW __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
/* ... and the AVX-512-BF16 conversions and dot products on top (okv_cpu_bf16_ok). */
#define OKV_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))
#endif

/* 1 when the AVX-512 F/BW/VL/DQ path can run: the AVX2 path can, the CPU has
 * the four extensions, and the OS saves their register state (OSXSAVE, and
 * XCR0 enables the SSE, AVX, opmask, ZMM0-15 upper half and ZMM16-31 state). */
static int okv_cpu_avx512_ok(void) {
#if OKV_X86_SIMD
    unsigned int a, b, c, d, xlo, xhi;
    if (!okv_cpu_simd_ok()) return 0;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq"))
        return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    (void)xhi;
    return (xlo & 0xE6u) == 0xE6u;
#else
    return 0;
#endif
}

/* 1 when the AVX-512-BF16 dot products and conversions can run: the AVX-512
 * set can, and CPUID leaf 7 sub-leaf 1 EAX bit 5 says AVX512_BF16 (compiled
 * out, 0, without OKV_HAVE_BF16). */
static int okv_cpu_bf16_ok(void) {
#if OKV_X86_SIMD && OKV_HAVE_BF16
    unsigned int a, b, c, d;
    if (!okv_cpu_avx512_ok() || __get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 1, a, b, c, d);
    return (a >> 5) & 1u;
#else
    return 0;
#endif
}

#if OKV_X86_SIMD && OKV_HAVE_VNNI
/* Targets of the VNNI dot products (qmatmul_x86.h, imatmul.h): AVX-VNNI (VEX, 8 lanes) on the AVX2 set,
 * AVX-512 VNNI on the AVX-512 set; run only where okv_cpu_avxvnni_ok / okv_cpu_vnni512_ok say so. */
#define OKV_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define OKV_VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#endif

/* 1 when this build and CPU run the AVX-512 VNNI path (on top of okv_cpu_avx512_ok). */
static int okv_cpu_vnni512_ok(void) {
#if OKV_X86_SIMD && OKV_HAVE_VNNI
    unsigned int a, b, c, d;
    if (!okv_cpu_avx512_ok() || __get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (c >> 11) & 1;
#else
    return 0;
#endif
}

/* 1 when this build and CPU run the AVX-VNNI (VEX) path. */
static int okv_cpu_avxvnni_ok(void) {
#if OKV_X86_SIMD && OKV_HAVE_VNNI
    unsigned int a, b, c, d;
    if (!okv_cpu_simd_ok() || __get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 1, a, b, c, d);
    return (a >> 4) & 1;
#else
    return 0;
#endif
}

#if OKV_X86_SIMD && OKV_HAVE_AMX && defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#define OKV_AMX_PERM_CHECK 1
/* arch_prctl(code, arg) as a raw x86-64 system call (no libc declaration
 * needed under -std=c11): 0 on success, -errno on failure. */
static long okv_arch_prctl(long code, unsigned long arg) {
    long ret;
    __asm__ volatile("syscall" : "=a"(ret) : "0"((long)SYS_arch_prctl), "D"(code), "S"(arg) : "rcx", "r11", "memory");
    return ret;
}
#else
#define OKV_AMX_PERM_CHECK 0
#endif

/* 1 when the AMX-INT8 tiles can run (on top of the AVX-512 set): CPUID leaf 7
 * EDX has AMX-TILE (bit 24) and AMX-INT8 (bit 25), XCR0 enables the tile
 * configuration and tile data state (bits 17, 18), and (Linux) the process
 * holds the permission to use tile data (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA, asked once per process: the result is cached).  Off on
 * other systems, 32-bit x86 and builds without AMX (OKV_HAVE_AMX 0). */
static int okv_cpu_amx_ok(void) {
#if OKV_AMX_PERM_CHECK
    static int cached = -1;
    unsigned int a, b, c, d, xlo, xhi;
    if (cached >= 0) return cached;
    cached = 0;
    if (!okv_cpu_avx512_ok()) return 0;
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    if (!(d & (1u << 24)) || !(d & (1u << 25))) return 0;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    (void)xhi;
    if ((xlo & (3u << 17)) != (3u << 17)) return 0;
    if (okv_arch_prctl(0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return 0;
    cached = 1;
    return 1;
#else
    return 0;
#endif
}

#endif /* ONNXKV_SIMD_CPU_H */
