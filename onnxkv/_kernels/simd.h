/* onnxkv/_kernels/simd.h -- vector primitives for the onnxkv kernels.
 *
 * Every primitive has a portable scalar version (`*_scalar`) and, on x86 with
 * GCC/Clang, an AVX2+FMA+F16C version (`*_avx2`) written with intrinsics inside
 * functions marked __attribute__((target("avx2,fma,f16c"))).  Nothing here is
 * compiled with global -mavx2/-march flags: the AVX2 code is only *executed*
 * when okv_cpu_simd_ok() says the CPU (and OS) support it, and the caller
 * passes the decision as the `simd` flag of the dispatching wrappers.
 *
 * Scalar and AVX2 paths agree to float32 rounding (they sum in a different
 * order).  float64 kernels use the scalar path only (the compiler may still
 * auto-vectorise with the baseline ISA).  Define OKV_NO_SIMD to compile the
 * scalar path only (also automatic on non-x86 targets and non-GNU compilers).
 */
#ifndef ONNXKV_SIMD_H
#define ONNXKV_SIMD_H

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

#if !defined(OKV_NO_SIMD) && (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define OKV_X86_SIMD 1
#include <cpuid.h>
#include <immintrin.h>
#define OKV_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define OKV_X86_SIMD 0
#endif

/* Instruction sets on top of AVX2 and AVX-512 that the compiler may lack:
 * OKV_HAVE_VNNI (AVX-512 VNNI and AVX-VNNI: qmatmul_x86.h) and OKV_HAVE_AMX
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
#else
#undef OKV_HAVE_VNNI
#undef OKV_HAVE_AMX
#define OKV_HAVE_VNNI 0
#define OKV_HAVE_AMX 0
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

/* ------------------------------------------------------------------ */
/* Scalar primitives (float32)                                          */
/* ------------------------------------------------------------------ */

static inline float okv_dot_f32_scalar(const float *a, const float *b, int64_t n) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += a[i] * b[i];
        s1 += a[i + 1] * b[i + 1];
        s2 += a[i + 2] * b[i + 2];
        s3 += a[i + 3] * b[i + 3];
    }
    for (; i < n; i++) s0 += a[i] * b[i];
    return (s0 + s1) + (s2 + s3);
}

/* y += a * x */
static inline void okv_axpy_f32_scalar(float a, const float *x, float *y, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) y[i] += a * x[i];
}

/* y *= a */
static inline void okv_scal_f32_scalar(float a, float *y, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) y[i] *= a;
}

static inline float okv_max_f32_scalar(const float *x, int64_t n) {
    float m = -INFINITY;
    int64_t i;
    for (i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* x[i] = exp(x[i] - m); returns the sum.  exp(-inf) = 0. */
static inline float okv_exp_sub_sum_f32_scalar(float *x, float m, int64_t n) {
    float s = 0.f;
    int64_t i;
    for (i = 0; i < n; i++) {
        float e = expf(x[i] - m);
        x[i] = e;
        s += e;
    }
    return s;
}

static inline float okv_sumsq_f32_scalar(const float *x, int64_t n) {
    return okv_dot_f32_scalar(x, x, n);
}

/* out = x * s * g */
static inline void okv_scale_mul_f32_scalar(const float *x, float s, const float *g, float *out, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) out[i] = x[i] * s * g[i];
}

/* out = x + y (+ b if b != NULL) */
static inline void okv_add3_f32_scalar(const float *x, const float *y, const float *b, float *out, int64_t n) {
    int64_t i;
    if (b) for (i = 0; i < n; i++) out[i] = x[i] + y[i] + b[i];
    else   for (i = 0; i < n; i++) out[i] = x[i] + y[i];
}

static inline float okv_sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

/* mode 0: sigmoid(x); 1: x*sigmoid(x); 2: x*sigmoid(x)*up */
static inline void okv_act_f32_scalar(int mode, const float *x, const float *up, float *out, int64_t n) {
    int64_t i;
    if (mode == 0)      for (i = 0; i < n; i++) out[i] = okv_sigmoidf(x[i]);
    else if (mode == 1) for (i = 0; i < n; i++) out[i] = x[i] * okv_sigmoidf(x[i]);
    else                for (i = 0; i < n; i++) out[i] = x[i] * okv_sigmoidf(x[i]) * up[i];
}

/* Rotary embedding of one head row.  half = rotary_dim / 2; c, s = cos/sin rows. */
static inline void okv_rope_half_f32_scalar(const float *x, const float *c, const float *s, float *out, int64_t half) {
    int64_t i;
    for (i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[half + i];
        out[i] = x1 * c[i] - x2 * s[i];
        out[half + i] = x2 * c[i] + x1 * s[i];
    }
}

static inline void okv_rope_inter_f32_scalar(const float *x, const float *c, const float *s, float *out, int64_t half) {
    int64_t i;
    for (i = 0; i < half; i++) {
        float x1 = x[2 * i], x2 = x[2 * i + 1];
        out[2 * i] = x1 * c[i] - x2 * s[i];
        out[2 * i + 1] = x2 * c[i] + x1 * s[i];
    }
}

/* s[j] = scale * dot(q, k + j*D) for j < n (keys are rows of D floats). */
static inline void okv_scores_f32_scalar(const float *q, const float *k, int64_t n, int64_t D, float scale, float *s) {
    int64_t j;
    for (j = 0; j < n; j++) s[j] = okv_dot_f32_scalar(q, k + j * D, D) * scale;
}

/* acc[0:D] += sum_j p[j] * v[j*D : j*D+D] */
static inline void okv_pv_f32_scalar(const float *p, const float *v, int64_t n, int64_t D, float *acc) {
    int64_t j;
    for (j = 0; j < n; j++) okv_axpy_f32_scalar(p[j], v + j * D, acc, D);
}

/* Two query rows against the same keys (the AVX2 version shares the K/V loads). */
static inline void okv_scores2_f32_scalar(const float *q0, const float *q1, const float *k, int64_t n, int64_t D,
                                          float scale, float *s0, float *s1) {
    okv_scores_f32_scalar(q0, k, n, D, scale, s0);
    okv_scores_f32_scalar(q1, k, n, D, scale, s1);
}

static inline void okv_pv2_f32_scalar(const float *p0, const float *p1, const float *v, int64_t n, int64_t D,
                                      float *acc0, float *acc1) {
    okv_pv_f32_scalar(p0, v, n, D, acc0);
    okv_pv_f32_scalar(p1, v, n, D, acc1);
}

/* ------------------------------------------------------------------ */
/* Scalar primitives (float64) -- no SIMD path                          */
/* ------------------------------------------------------------------ */

static inline double okv_sumsq_f64(const double *x, int64_t n) {
    double s0 = 0., s1 = 0., s2 = 0., s3 = 0.;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += x[i] * x[i]; s1 += x[i + 1] * x[i + 1];
        s2 += x[i + 2] * x[i + 2]; s3 += x[i + 3] * x[i + 3];
    }
    for (; i < n; i++) s0 += x[i] * x[i];
    return (s0 + s1) + (s2 + s3);
}

static inline void okv_scale_mul_f64(const double *x, double s, const double *g, double *out, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) out[i] = x[i] * s * g[i];
}

static inline void okv_add3_f64(const double *x, const double *y, const double *b, double *out, int64_t n) {
    int64_t i;
    if (b) for (i = 0; i < n; i++) out[i] = x[i] + y[i] + b[i];
    else   for (i = 0; i < n; i++) out[i] = x[i] + y[i];
}

static inline double okv_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

static inline void okv_act_f64(int mode, const double *x, const double *up, double *out, int64_t n) {
    int64_t i;
    if (mode == 0)      for (i = 0; i < n; i++) out[i] = okv_sigmoid(x[i]);
    else if (mode == 1) for (i = 0; i < n; i++) out[i] = x[i] * okv_sigmoid(x[i]);
    else                for (i = 0; i < n; i++) out[i] = x[i] * okv_sigmoid(x[i]) * up[i];
}

static inline void okv_softmax_row_f64(const double *x, double *out, int64_t n) {
    double m = -INFINITY, s = 0.;
    int64_t i;
    for (i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    if (m == -INFINITY) { for (i = 0; i < n; i++) out[i] = 0.; return; }
    for (i = 0; i < n; i++) { double e = exp(x[i] - m); out[i] = e; s += e; }
    s = 1.0 / s;
    for (i = 0; i < n; i++) out[i] *= s;
}

/* ------------------------------------------------------------------ */
/* AVX2 + FMA + F16C primitives (float32)                               */
/* ------------------------------------------------------------------ */
#if OKV_X86_SIMD

OKV_AVX2 static inline float okv_hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

OKV_AVX2 static inline float okv_hmax256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_max_ps(lo, hi);
    lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_max_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* exp(x) for 8 floats (Cephes polynomial, ~1 ulp on the normal range).
 * x < -87.3 gives 0, x > 88.37 saturates to ~FLT_MAX*... (not inf).  NaN inputs
 * are not propagated. */
OKV_AVX2 static inline __m256 okv_exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f);
    const __m256 lo = _mm256_set1_ps(-87.3365447505531f);
    __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_min_ps(x, hi);
    x = _mm256_max_ps(x, lo);
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_cvttps_epi32(fx);
    e = _mm256_add_epi32(e, _mm256_set1_epi32(127));
    e = _mm256_slli_epi32(e, 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_and_ps(y, keep);
}

/* mask for the first r (0..7) lanes */
OKV_AVX2 static inline __m256i okv_tailmask(int64_t r) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)r), idx);
}

OKV_AVX2 static inline float okv_dot_f32_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    if (i < n) {
        __m256i m = okv_tailmask(n - i);
        s1 = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m), s1);
    }
    return okv_hsum256(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
}

/* 8 keys at a time: one q load feeds 8 FMAs, one transposing reduction
 * replaces 8 horizontal sums. */
OKV_AVX2 static inline void okv_scores_f32_avx2(const float *q, const float *k, int64_t n, int64_t D, float scale,
                                                float *s) {
    const __m256 vscale = _mm256_set1_ps(scale);
    const int64_t Dv = D & ~(int64_t)7;
    const __m256i tm = okv_tailmask(D - Dv);
    int64_t j = 0, i, u;
    for (; j + 8 <= n; j += 8) {
        const float *kj = k + j * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        __m256 a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps(), a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
        for (i = 0; i < Dv; i += 8) {
            __m256 vq = _mm256_loadu_ps(q + i);
            a0 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + i), a0);
            a1 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + D + i), a1);
            a2 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + 2 * D + i), a2);
            a3 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + 3 * D + i), a3);
            a4 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + 4 * D + i), a4);
            a5 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + 5 * D + i), a5);
            a6 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + 6 * D + i), a6);
            a7 = _mm256_fmadd_ps(vq, _mm256_loadu_ps(kj + 7 * D + i), a7);
        }
        if (Dv < D) {
            __m256 vq = _mm256_maskload_ps(q + Dv, tm);
            a0 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + Dv, tm), a0);
            a1 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + D + Dv, tm), a1);
            a2 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + 2 * D + Dv, tm), a2);
            a3 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + 3 * D + Dv, tm), a3);
            a4 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + 4 * D + Dv, tm), a4);
            a5 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + 5 * D + Dv, tm), a5);
            a6 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + 6 * D + Dv, tm), a6);
            a7 = _mm256_fmadd_ps(vq, _mm256_maskload_ps(kj + 7 * D + Dv, tm), a7);
        }
        {
            __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
            __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
            __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
            __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
            _mm256_storeu_ps(s + j, _mm256_mul_ps(r, vscale));
        }
    }
    for (u = j; u < n; u++) s[u] = okv_dot_f32_avx2(q, k + u * D, D) * scale;
}

/* acc[0:D] += sum_j p[j] * v[j*D : j*D+D]; acc is kept in registers 64 floats
 * at a time while the keys stream by. */
OKV_AVX2 static inline void okv_pvs_f32_avx2(const float *p, const float *v, int64_t n, int64_t D, int64_t S,
                                             float *acc) {
    int64_t i = 0, j;
    for (; i + 64 <= D; i += 64) {
        __m256 c0 = _mm256_loadu_ps(acc + i), c1 = _mm256_loadu_ps(acc + i + 8);
        __m256 c2 = _mm256_loadu_ps(acc + i + 16), c3 = _mm256_loadu_ps(acc + i + 24);
        __m256 c4 = _mm256_loadu_ps(acc + i + 32), c5 = _mm256_loadu_ps(acc + i + 40);
        __m256 c6 = _mm256_loadu_ps(acc + i + 48), c7 = _mm256_loadu_ps(acc + i + 56);
        for (j = 0; j < n; j++) {
            const float *vj = v + j * S + i;
            __m256 pj = _mm256_broadcast_ss(p + j);
            c0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj), c0);
            c1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8), c1);
            c2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 16), c2);
            c3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 24), c3);
            c4 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 32), c4);
            c5 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 40), c5);
            c6 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 48), c6);
            c7 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 56), c7);
        }
        _mm256_storeu_ps(acc + i, c0); _mm256_storeu_ps(acc + i + 8, c1);
        _mm256_storeu_ps(acc + i + 16, c2); _mm256_storeu_ps(acc + i + 24, c3);
        _mm256_storeu_ps(acc + i + 32, c4); _mm256_storeu_ps(acc + i + 40, c5);
        _mm256_storeu_ps(acc + i + 48, c6); _mm256_storeu_ps(acc + i + 56, c7);
    }
    for (; i + 8 <= D; i += 8) {
        __m256 c0 = _mm256_loadu_ps(acc + i);
        for (j = 0; j < n; j++) c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), _mm256_loadu_ps(v + j * S + i), c0);
        _mm256_storeu_ps(acc + i, c0);
    }
    if (i < D) {
        const __m256i tm = okv_tailmask(D - i);
        __m256 c0 = _mm256_maskload_ps(acc + i, tm);
        for (j = 0; j < n; j++)
            c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), _mm256_maskload_ps(v + j * S + i, tm), c0);
        _mm256_maskstore_ps(acc + i, tm, c0);
    }
}

OKV_AVX2 static inline void okv_pv_f32_avx2(const float *p, const float *v, int64_t n, int64_t D, float *acc) {
    okv_pvs_f32_avx2(p, v, n, D, D, acc);
}

/* Two rows x 4 keys per step: 6 loads feed 8 FMAs. */
OKV_AVX2 static inline void okv_scores2_f32_avx2(const float *q0, const float *q1, const float *k, int64_t n,
                                                 int64_t D, float scale, float *s0, float *s1) {
    const __m256 vscale = _mm256_set1_ps(scale);
    const int64_t Dv = D & ~(int64_t)7;
    const __m256i tm = okv_tailmask(D - Dv);
    int64_t j = 0, i, u;
    for (; j + 4 <= n; j += 4) {
        const float *kj = k + j * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
        for (i = 0; i < Dv; i += 8) {
            __m256 x0 = _mm256_loadu_ps(q0 + i), x1 = _mm256_loadu_ps(q1 + i), kk;
            kk = _mm256_loadu_ps(kj + i);         a0 = _mm256_fmadd_ps(x0, kk, a0); b0 = _mm256_fmadd_ps(x1, kk, b0);
            kk = _mm256_loadu_ps(kj + D + i);     a1 = _mm256_fmadd_ps(x0, kk, a1); b1 = _mm256_fmadd_ps(x1, kk, b1);
            kk = _mm256_loadu_ps(kj + 2 * D + i); a2 = _mm256_fmadd_ps(x0, kk, a2); b2 = _mm256_fmadd_ps(x1, kk, b2);
            kk = _mm256_loadu_ps(kj + 3 * D + i); a3 = _mm256_fmadd_ps(x0, kk, a3); b3 = _mm256_fmadd_ps(x1, kk, b3);
        }
        if (Dv < D) {
            __m256 x0 = _mm256_maskload_ps(q0 + Dv, tm), x1 = _mm256_maskload_ps(q1 + Dv, tm), kk;
            kk = _mm256_maskload_ps(kj + Dv, tm);         a0 = _mm256_fmadd_ps(x0, kk, a0); b0 = _mm256_fmadd_ps(x1, kk, b0);
            kk = _mm256_maskload_ps(kj + D + Dv, tm);     a1 = _mm256_fmadd_ps(x0, kk, a1); b1 = _mm256_fmadd_ps(x1, kk, b1);
            kk = _mm256_maskload_ps(kj + 2 * D + Dv, tm); a2 = _mm256_fmadd_ps(x0, kk, a2); b2 = _mm256_fmadd_ps(x1, kk, b2);
            kk = _mm256_maskload_ps(kj + 3 * D + Dv, tm); a3 = _mm256_fmadd_ps(x0, kk, a3); b3 = _mm256_fmadd_ps(x1, kk, b3);
        }
        {
            __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
            __m256 t2 = _mm256_hadd_ps(b0, b1), t3 = _mm256_hadd_ps(b2, b3);
            __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
            __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
            r = _mm256_mul_ps(r, vscale);
            _mm_storeu_ps(s0 + j, _mm256_castps256_ps128(r));
            _mm_storeu_ps(s1 + j, _mm256_extractf128_ps(r, 1));
        }
    }
    for (u = j; u < n; u++) {
        s0[u] = okv_dot_f32_avx2(q0, k + u * D, D) * scale;
        s1[u] = okv_dot_f32_avx2(q1, k + u * D, D) * scale;
    }
}

/* acc0 += p0 @ V, acc1 += p1 @ V sharing the V loads (32 columns per pass). */
OKV_AVX2 static inline void okv_pv2_f32_avx2(const float *p0, const float *p1, const float *v, int64_t n, int64_t D,
                                             float *acc0, float *acc1) {
    int64_t i = 0, j;
    for (; i + 32 <= D; i += 32) {
        __m256 c0 = _mm256_loadu_ps(acc0 + i), c1 = _mm256_loadu_ps(acc0 + i + 8);
        __m256 c2 = _mm256_loadu_ps(acc0 + i + 16), c3 = _mm256_loadu_ps(acc0 + i + 24);
        __m256 d0 = _mm256_loadu_ps(acc1 + i), d1 = _mm256_loadu_ps(acc1 + i + 8);
        __m256 d2 = _mm256_loadu_ps(acc1 + i + 16), d3 = _mm256_loadu_ps(acc1 + i + 24);
        for (j = 0; j < n; j++) {
            const float *vj = v + j * D + i;
            __m256 w0 = _mm256_broadcast_ss(p0 + j), w1 = _mm256_broadcast_ss(p1 + j), vv;
            vv = _mm256_loadu_ps(vj);      c0 = _mm256_fmadd_ps(w0, vv, c0); d0 = _mm256_fmadd_ps(w1, vv, d0);
            vv = _mm256_loadu_ps(vj + 8);  c1 = _mm256_fmadd_ps(w0, vv, c1); d1 = _mm256_fmadd_ps(w1, vv, d1);
            vv = _mm256_loadu_ps(vj + 16); c2 = _mm256_fmadd_ps(w0, vv, c2); d2 = _mm256_fmadd_ps(w1, vv, d2);
            vv = _mm256_loadu_ps(vj + 24); c3 = _mm256_fmadd_ps(w0, vv, c3); d3 = _mm256_fmadd_ps(w1, vv, d3);
        }
        _mm256_storeu_ps(acc0 + i, c0); _mm256_storeu_ps(acc0 + i + 8, c1);
        _mm256_storeu_ps(acc0 + i + 16, c2); _mm256_storeu_ps(acc0 + i + 24, c3);
        _mm256_storeu_ps(acc1 + i, d0); _mm256_storeu_ps(acc1 + i + 8, d1);
        _mm256_storeu_ps(acc1 + i + 16, d2); _mm256_storeu_ps(acc1 + i + 24, d3);
    }
    if (i < D) {
        okv_pvs_f32_avx2(p0, v + i, n, D - i, D, acc0 + i);   /* remaining columns, row stride D */
        okv_pvs_f32_avx2(p1, v + i, n, D - i, D, acc1 + i);
    }
}

OKV_AVX2 static inline void okv_axpy_f32_avx2(float a, const float *x, float *y, int64_t n) {
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
        _mm256_storeu_ps(y + i + 8, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8)));
    }
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

OKV_AVX2 static inline void okv_scal_f32_avx2(float a, float *y, int64_t n) {
    __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] *= a;
}

OKV_AVX2 static inline float okv_max_f32_avx2(const float *x, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    float r;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    r = okv_hmax256(m);
    for (; i < n; i++) r = x[i] > r ? x[i] : r;
    return r;
}

OKV_AVX2 static inline float okv_exp_sub_sum_f32_avx2(float *x, float m, int64_t n) {
    __m256 vm = _mm256_set1_ps(m), s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = okv_exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        s = _mm256_add_ps(s, e);
    }
    if (i < n) {
        __m256i mk = okv_tailmask(n - i);
        __m256 e = okv_exp256(_mm256_sub_ps(_mm256_maskload_ps(x + i, mk), vm));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(mk));
        _mm256_maskstore_ps(x + i, mk, e);
        s = _mm256_add_ps(s, e);
    }
    return okv_hsum256(s);
}

OKV_AVX2 static inline float okv_sumsq_f32_avx2(const float *x, int64_t n) {
    return okv_dot_f32_avx2(x, x, n);
}

OKV_AVX2 static inline void okv_scale_mul_f32_avx2(const float *x, float s, const float *g, float *out, int64_t n) {
    __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs), _mm256_loadu_ps(g + i)));
    for (; i < n; i++) out[i] = x[i] * s * g[i];
}

OKV_AVX2 static inline void okv_add3_f32_avx2(const float *x, const float *y, const float *b, float *out, int64_t n) {
    int64_t i = 0;
    if (b) {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)),
                                                    _mm256_loadu_ps(b + i)));
        for (; i < n; i++) out[i] = x[i] + y[i] + b[i];
    } else {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
        for (; i < n; i++) out[i] = x[i] + y[i];
    }
}

OKV_AVX2 static inline __m256 okv_sigmoid256(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.f);
    __m256 e = okv_exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
    return _mm256_div_ps(one, _mm256_add_ps(one, e));
}

OKV_AVX2 static inline void okv_act_f32_avx2(int mode, const float *x, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 vx = _mm256_loadu_ps(x + i);
        __m256 r = okv_sigmoid256(vx);
        if (mode >= 1) r = _mm256_mul_ps(r, vx);
        if (mode == 2) r = _mm256_mul_ps(r, _mm256_loadu_ps(up + i));
        _mm256_storeu_ps(out + i, r);
    }
    if (i < n) okv_act_f32_scalar(mode, x + i, up ? up + i : NULL, out + i, n - i);
}

OKV_AVX2 static inline void okv_rope_half_f32_avx2(const float *x, const float *c, const float *s, float *out, int64_t half) {
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
        __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
        __m256 o1 = _mm256_fnmadd_ps(x2, vs, _mm256_mul_ps(x1, vc));
        __m256 o2 = _mm256_fmadd_ps(x1, vs, _mm256_mul_ps(x2, vc));
        _mm256_storeu_ps(out + i, o1);
        _mm256_storeu_ps(out + half + i, o2);
    }
    for (; i < half; i++) {
        float x1 = x[i], x2 = x[half + i];
        out[i] = x1 * c[i] - x2 * s[i];
        out[half + i] = x2 * c[i] + x1 * s[i];
    }
}

OKV_AVX2 static inline void okv_rope_inter_f32_avx2(const float *x, const float *c, const float *s, float *out, int64_t half) {
    const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    int64_t i = 0;
    for (; i + 4 <= half; i += 4) {
        __m256 vx = _mm256_loadu_ps(x + 2 * i);
        __m256 vc = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(c + i)), dup);
        __m256 vs = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(s + i)), dup);
        __m256 sw = _mm256_permute_ps(vx, 0xB1); /* swap pairs */
        /* even: x0*c - x1*s ; odd: x1*c + x0*s */
        _mm256_storeu_ps(out + 2 * i, _mm256_fmaddsub_ps(vx, vc, _mm256_mul_ps(sw, vs)));
    }
    for (; i < half; i++) {
        float x1 = x[2 * i], x2 = x[2 * i + 1];
        out[2 * i] = x1 * c[i] - x2 * s[i];
        out[2 * i + 1] = x2 * c[i] + x1 * s[i];
    }
}

OKV_AVX2 static inline void okv_softmax_row_f32_avx2(const float *x, float *out, int64_t n) {
    float m = okv_max_f32_avx2(x, n), s;
    if (m == -INFINITY) { memset(out, 0, (size_t)n * sizeof(float)); return; }
    if (out != x) memcpy(out, x, (size_t)n * sizeof(float));
    s = okv_exp_sub_sum_f32_avx2(out, m, n);
    okv_scal_f32_avx2(1.f / s, out, n);
}

OKV_AVX2 static inline void okv_rms_row_f32_avx2(const float *x, const float *g, float eps, float *out, int64_t n) {
    float ms = okv_sumsq_f32_avx2(x, n) / (float)n;
    okv_scale_mul_f32_avx2(x, 1.f / sqrtf(ms + eps), g, out, n);
}

#endif /* OKV_X86_SIMD */

static inline void okv_softmax_row_f32_scalar(const float *x, float *out, int64_t n) {
    float m = okv_max_f32_scalar(x, n), s;
    if (m == -INFINITY) { memset(out, 0, (size_t)n * sizeof(float)); return; }
    if (out != x) memcpy(out, x, (size_t)n * sizeof(float));
    s = okv_exp_sub_sum_f32_scalar(out, m, n);
    okv_scal_f32_scalar(1.f / s, out, n);
}

static inline void okv_rms_row_f32_scalar(const float *x, const float *g, float eps, float *out, int64_t n) {
    float ms = okv_sumsq_f32_scalar(x, n) / (float)n;
    okv_scale_mul_f32_scalar(x, 1.f / sqrtf(ms + eps), g, out, n);
}

/* ------------------------------------------------------------------ */
/* IEEE half <-> float conversion (scalar: bit tricks after M. Dukhan's  */
/* FP16 library, round to nearest even; AVX2 path: F16C)                */
/* ------------------------------------------------------------------ */
static inline uint32_t okv_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float okv_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float okv_h2f_scalar(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = okv_bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = okv_bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    return okv_bits_f32(sign | (two_w < (1u << 27) ? okv_f32_bits(denormalized) : okv_f32_bits(normalized)));
}

static inline uint16_t okv_f2h_scalar(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = okv_f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u, bits, nonsign;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = okv_bits_f32((bias >> 1) + 0x07800000u) + base;
    bits = okv_f32_bits(base);
    nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline void okv_h2f_row_scalar(const uint16_t *x, float *out, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) out[i] = okv_h2f_scalar(x[i]);
}

static inline void okv_f2h_row_scalar(const float *x, uint16_t *out, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) out[i] = okv_f2h_scalar(x[i]);
}

/* bfloat16 <-> float: widening is exact (bits << 16); narrowing rounds to
 * nearest even, NaN stays NaN (quiet bit set), overflow gives +-inf. */
static inline float okv_bf2f_scalar(uint16_t h) { return okv_bits_f32((uint32_t)h << 16); }

static inline uint16_t okv_f2bf_scalar(float f) {
    const uint32_t u = okv_f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline void okv_bf2f_row_scalar(const uint16_t *x, float *out, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) out[i] = okv_bf2f_scalar(x[i]);
}

static inline void okv_f2bf_row_scalar(const float *x, uint16_t *out, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) out[i] = okv_f2bf_scalar(x[i]);
}

#if OKV_X86_SIMD
/* 8 bfloat16 -> 8 float (zero-extend, shift left 16). */
OKV_AVX2 static inline __m256 okv_bf16x8_to_ps(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

OKV_AVX2 static inline void okv_bf2f_row_avx2(const uint16_t *x, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, okv_bf16x8_to_ps(x + i));
    for (; i < n; i++) out[i] = okv_bf2f_scalar(x[i]);
}

OKV_AVX2 static inline void okv_f2bf_row_avx2(const float *x, uint16_t *out, int64_t n) {
    const __m256i one = _mm256_set1_epi32(1), rnd = _mm256_set1_epi32(0x7FFF);
    const __m256i absm = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    const __m256i qnan = _mm256_set1_epi32(0x0040);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i u0 = _mm256_castps_si256(_mm256_loadu_ps(x + i));
        __m256i u1 = _mm256_castps_si256(_mm256_loadu_ps(x + i + 8));
        __m256i r0 = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u0, rnd),
                                                        _mm256_and_si256(_mm256_srli_epi32(u0, 16), one)), 16);
        __m256i r1 = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u1, rnd),
                                                        _mm256_and_si256(_mm256_srli_epi32(u1, 16), one)), 16);
        __m256i n0 = _mm256_cmpgt_epi32(_mm256_and_si256(u0, absm), inf);
        __m256i n1 = _mm256_cmpgt_epi32(_mm256_and_si256(u1, absm), inf);
        r0 = _mm256_blendv_epi8(r0, _mm256_or_si256(_mm256_srli_epi32(u0, 16), qnan), n0);
        r1 = _mm256_blendv_epi8(r1, _mm256_or_si256(_mm256_srli_epi32(u1, 16), qnan), n1);
        /* packus works per 128-bit lane: fix the order with a 64-bit permute */
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8));
    }
    for (; i < n; i++) out[i] = okv_f2bf_scalar(x[i]);
}

OKV_AVX2 static inline void okv_h2f_row_avx2(const uint16_t *x, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    for (; i < n; i++) out[i] = okv_h2f_scalar(x[i]);
}

OKV_AVX2 static inline void okv_f2h_row_avx2(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) out[i] = okv_f2h_scalar(x[i]);
}
#endif

/* ------------------------------------------------------------------ */
/* Dispatching row kernels (simd = 1 selects the AVX2 path)             */
/* ------------------------------------------------------------------ */
#if OKV_X86_SIMD
#define OKV_DISPATCH(simd, call_avx2, call_scalar) do { if (simd) { call_avx2; } else { call_scalar; } } while (0)
#else
#define OKV_DISPATCH(simd, call_avx2, call_scalar) do { (void)(simd); call_scalar; } while (0)
#endif

static void okv_rms_row_f32(const float *x, const float *g, float eps, float *out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_rms_row_f32_avx2(x, g, eps, out, n), okv_rms_row_f32_scalar(x, g, eps, out, n));
}

static void okv_rms_row_f64(const double *x, const double *g, double eps, double *out, int64_t n) {
    double ms = okv_sumsq_f64(x, n) / (double)n;
    okv_scale_mul_f64(x, 1.0 / sqrt(ms + eps), g, out, n);
}

/* s = x + skip (+ bias) -> sum_out (optional); out = rms_norm(s) * g.  Row-wise,
 * safe when out == x or out == skip; sum_out must not overlap out. */
static void okv_skip_rms_row_f32(const float *x, const float *skip, const float *bias, const float *g, float eps,
                                 float *out, float *sum_out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_add3_f32_avx2(x, skip, bias, out, n), okv_add3_f32_scalar(x, skip, bias, out, n));
    if (sum_out) memcpy(sum_out, out, (size_t)n * sizeof(float));
    okv_rms_row_f32(out, g, eps, out, n, simd);
}

static void okv_skip_rms_row_f64(const double *x, const double *skip, const double *bias, const double *g, double eps,
                                 double *out, double *sum_out, int64_t n) {
    okv_add3_f64(x, skip, bias, out, n);
    if (sum_out) memcpy(sum_out, out, (size_t)n * sizeof(double));
    okv_rms_row_f64(out, g, eps, out, n);
}

static void okv_softmax_row_f32(const float *x, float *out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_softmax_row_f32_avx2(x, out, n), okv_softmax_row_f32_scalar(x, out, n));
}

static void okv_act_f32(int mode, const float *x, const float *up, float *out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_act_f32_avx2(mode, x, up, out, n), okv_act_f32_scalar(mode, x, up, out, n));
}

/* One head row of rotary embedding: rotates the first 2*half dims, copies the
 * rest (head_size - 2*half) when out != x. */
static void okv_rope_row_f32(const float *x, const float *c, const float *s, float *out, int64_t half,
                             int64_t head_size, int interleaved, int simd) {
    if (interleaved)
        OKV_DISPATCH(simd, okv_rope_inter_f32_avx2(x, c, s, out, half), okv_rope_inter_f32_scalar(x, c, s, out, half));
    else
        OKV_DISPATCH(simd, okv_rope_half_f32_avx2(x, c, s, out, half), okv_rope_half_f32_scalar(x, c, s, out, half));
    if (out != x && head_size > 2 * half)
        memcpy(out + 2 * half, x + 2 * half, (size_t)(head_size - 2 * half) * sizeof(float));
}

static void okv_h2f_row(const uint16_t *x, float *out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_h2f_row_avx2(x, out, n), okv_h2f_row_scalar(x, out, n));
}

static void okv_f2h_row(const float *x, uint16_t *out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_f2h_row_avx2(x, out, n), okv_f2h_row_scalar(x, out, n));
}

/* Sum of n floats with independent accumulators: a memory read-bandwidth probe
 * (benchmarks compare the attention kernels' K/V read rate against it). */
static inline double okv_read_sum_f32_scalar(const float *x, int64_t n) {
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t i = 0;
    int u;
    for (; i + 8 <= n; i += 8)
        for (u = 0; u < 8; u++) s[u] += x[i + u];
    for (; i < n; i++) s[0] += x[i];
    return ((double)s[0] + s[1] + s[2] + s[3]) + ((double)s[4] + s[5] + s[6] + s[7]);
}

#if OKV_X86_SIMD
OKV_AVX2 static inline double okv_read_sum_f32_avx2(const float *x, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_add_ps(s0, _mm256_loadu_ps(x + i));
        s1 = _mm256_add_ps(s1, _mm256_loadu_ps(x + i + 8));
        s2 = _mm256_add_ps(s2, _mm256_loadu_ps(x + i + 16));
        s3 = _mm256_add_ps(s3, _mm256_loadu_ps(x + i + 24));
    }
    return (double)okv_hsum256(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)))
           + okv_read_sum_f32_scalar(x + i, n - i);
}
#endif

static double okv_read_sum_f32(const float *x, int64_t n, int simd) {
#if OKV_X86_SIMD
    if (simd) return okv_read_sum_f32_avx2(x, n);
#endif
    (void)simd;
    return okv_read_sum_f32_scalar(x, n);
}

static void okv_bf2f_row(const uint16_t *x, float *out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_bf2f_row_avx2(x, out, n), okv_bf2f_row_scalar(x, out, n));
}

static void okv_f2bf_row(const float *x, uint16_t *out, int64_t n, int simd) {
    OKV_DISPATCH(simd, okv_f2bf_row_avx2(x, out, n), okv_f2bf_row_scalar(x, out, n));
}

#endif /* ONNXKV_SIMD_H */
