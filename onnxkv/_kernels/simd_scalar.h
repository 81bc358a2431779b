/* onnxkv/_kernels/simd_scalar.h -- the portable scalar primitives (`*_scalar`,
 * float32; float64 primitives without a SIMD path).
 */
#ifndef ONNXKV_SIMD_SCALAR_H
#define ONNXKV_SIMD_SCALAR_H

#include "simd_cpu.h"

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

/* x[i] = exp(x[i] - m); returns the sum (accumulated in double: a vocabulary-sized row summed in one
 * float drifts past 1e-5 of the largest term, where the vector paths' eight partial sums do not).
 * exp(-inf) = 0. */
static inline float okv_exp_sub_sum_f32_scalar(float *x, float m, int64_t n) {
    double s = 0.;
    int64_t i;
    for (i = 0; i < n; i++) {
        float e = expf(x[i] - m);
        x[i] = e;
        s += e;
    }
    return (float)s;
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

/* gelu's tanh form as a sigmoid: 0.5 x (1 + tanh(a (x + c x^3))) = x sigmoid(2a (x + c x^3)), a = sqrt(2/pi). */
#define OKV_GELU_2A 1.5957691216057308f
#define OKV_GELU_C 0.044715f

/* mode 0: sigmoid(x); 1: x*sigmoid(x); 2: x*sigmoid(x)*up; 4: gelu_tanh(x)*up; 7: up[0]*tanh(x/up[0]) (a
 * softcap: the C library's tanhf) */
static inline void okv_act_f32_scalar(int mode, const float *x, const float *up, float *out, int64_t n) {
    int64_t i;
    if (mode == 0)      for (i = 0; i < n; i++) out[i] = okv_sigmoidf(x[i]);
    else if (mode == 7) { const float c = up[0]; for (i = 0; i < n; i++) out[i] = c * tanhf(x[i] / c); }
    else if (mode == 1) for (i = 0; i < n; i++) out[i] = x[i] * okv_sigmoidf(x[i]);
    else if (mode == 4) for (i = 0; i < n; i++)
        out[i] = x[i] * okv_sigmoidf(OKV_GELU_2A * (x[i] + OKV_GELU_C * x[i] * x[i] * x[i])) * up[i];
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
    else if (mode == 4) for (i = 0; i < n; i++)
        out[i] = x[i] * okv_sigmoid(1.5957691216057308 * (x[i] + 0.044715 * x[i] * x[i] * x[i])) * up[i];
    else if (mode == 7) { const double c = up[0]; for (i = 0; i < n; i++) out[i] = c * tanh(x[i] / c); }
    else                for (i = 0; i < n; i++) out[i] = x[i] * okv_sigmoid(x[i]) * up[i];
}

/* Softmax rows: a row that is entirely -inf is written as `dead` (0, or NaN as ONNX's Softmax gives). */
static inline void okv_softmax_row_f64(const double *x, double *out, int64_t n, double dead) {
    double m = -INFINITY, s = 0.;
    int64_t i;
    for (i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    if (m == -INFINITY) { for (i = 0; i < n; i++) out[i] = dead; return; }
    for (i = 0; i < n; i++) { double e = exp(x[i] - m); out[i] = e; s += e; }
    s = 1.0 / s;
    for (i = 0; i < n; i++) out[i] *= s;
}

static inline void okv_softmax_row_f32_scalar(const float *x, float *out, int64_t n, float dead) {
    float m = okv_max_f32_scalar(x, n), s;
    int64_t i;
    if (m == -INFINITY) { for (i = 0; i < n; i++) out[i] = dead; return; }
    if (out != x) memcpy(out, x, (size_t)n * sizeof(float));
    s = okv_exp_sub_sum_f32_scalar(out, m, n);
    okv_scal_f32_scalar(1.f / s, out, n);
}

/* 1 / sqrt(mean(x^2) + eps) with the squares summed in double: for rows whose float32 sum overflows
 * (|x| from about 1e18), where 1 / sqrt(inf) would make the whole row 0. */
static inline float okv_rms_inv_f64(const float *x, int64_t n, float eps) {
    double s = 0.;
    int64_t i;
    for (i = 0; i < n; i++) s += (double)x[i] * (double)x[i];
    return (float)(1.0 / sqrt(s / (double)n + (double)eps));
}

static inline void okv_rms_row_f32_scalar(const float *x, const float *g, float eps, float *out, int64_t n) {
    float ms = okv_sumsq_f32_scalar(x, n) / (float)n;
    okv_scale_mul_f32_scalar(x, ms < INFINITY ? 1.f / sqrtf(ms + eps) : okv_rms_inv_f64(x, n, eps), g, out, n);
}

#endif /* ONNXKV_SIMD_SCALAR_H */
