/* onnxkv/_kernels/quant.h -- integer KV page formats: quantize / dequantize rows.
 *
 * Layout contract (shared with the fused attention kernel; see the page format
 * table in docs/DESIGN.md): a quantized page of H heads, bs tokens and head
 * size D is
 *   header: float32 scale[H*G], float32 zero_point[H*G] (index h*G + g; G = 1
 *           per head or G = D per channel), zero padded to a multiple of 64 bytes
 *           (okv_q_header_bytes);
 *   codes:  head-major, token-major inside a head; one token row holds D codes
 *           packed low bits first into okv_q_row_bytes(fmt, D) bytes (signed
 *           codes two's complement in their bit width); token t of head h starts
 *           at header + (h*bs + t) * row_bytes.
 * Formats are ONNX TensorProto element codes: UINT8 2, INT8 3, UINT4 21, INT4 22,
 * UINT2 25, INT2 26.  D * bits must be a multiple of 8.
 *
 * Compact header (onnxkv.cache.formats header "compact": the per-channel key
 * pages of paged states), in place of the float32 one, same codes after it:
 *   float32 S[H], uint8 e[H*G], uint8 zc[H*G] (index h*G + g), zero padded to a
 *   multiple of 64 bytes (okv_q_compact_header_bytes); G <= OKV_Q_COMPACT_MAX_G.
 *   Decoded (okv_q_compact_decode): scale[h*G + g] = (S[h] * okv_q_steps[e & 15])
 *   * 2^-(e >> 4), two rounded float32 products (the second exact unless the
 *   result is subnormal; no FMA), i.e. S * 2^(-e/16); zero_point[h*G + g] = zc
 *   (unsigned).  The scalar and AVX2 decoders give bit-identical results, equal
 *   to onnxkv.cache.formats.decode_header and the NumPy twins.
 *
 * Channel-zero-point header (onnxkv.cache.formats header "channel-zp": key pages
 * with one scale per head and one zero point per channel), in place of the
 * float32 one, same codes after it:
 *   float32 s[H], float32 w[H], int8 o[H*G] (index h*G + g), zero padded to a
 *   multiple of 64 bytes (okv_q_czp_header_bytes).  Decoded (okv_q_czp_decode):
 *   scale[h*G + g] = s[h]; zero_point[h*G + g] = z0 + w[h] * o[h*G + g], z0 = 0
 *   for signed formats and 2^(bits - 1) for unsigned ones, w[h] a power of two
 *   in [1, 2^16]: integers, possibly outside the code range (the codes hold
 *   each channel's values around its own offset).
 *
 * Quantize (ONNX QuantizeLinear): q = saturate(rint(x / scale) + zp) with
 * round-half-to-even, float32 division and saturation to [qmin, qmax] done in
 * float (+-inf saturate; NaN gives qmin).  Dequantize: (q - zp) * scale in
 * float32 (q - zp is exact, then one rounded product: no FMA).  The AVX2 and
 * scalar paths give bit-identical results, equal to the NumPy twins.
 *
 * Row API (one token of one head; `scale`/`zp` point at the head's first header
 * entry, i.e. header + h*G; per_channel != 0 reads scale[c]/zp[c] per channel c,
 * otherwise scale[0]/zp[0] for all channels):
 *   okv_quant_row(x, fmt, scale, zp, per_channel, codes, D, simd)
 *   okv_dequant_row(codes, fmt, scale, zp, per_channel, out, D, simd)
 * Format helpers: okv_q_bits, okv_q_signed, okv_q_qmin, okv_q_qmax (0 bits =
 * not an integer format), okv_q_row_bytes, okv_q_header_bytes,
 * okv_q_compact_header_bytes; okv_q_compact_decode(S, e, z, scale, zp, G, simd)
 * decodes one head of a compact header into float32 scale[G] / zp[G].
 * Code helpers for hand-written loops: okv_q_get(row, fmt, c) returns code c of
 * a packed row as an int (sign-extended for signed formats); on x86 the AVX2
 * function okv_q_load8(row, fmt, c) returns codes c..c+8 (c a multiple of 8) as
 * __m256i int32 lanes, the AVX-512 function okv_q_load16_ps(row, fmt, c) codes
 * c..c+16 (c a multiple of 16) as __m512 float32 lanes, and for 4-bit formats
 * okv_q4_load16_ilv_ps(row, fmt, c) the same 16 codes in the interleaved lane
 * order OKV_Q4_ILV (one operation fewer; okv_q4_ilv_idx / okv_q4_nat_idx
 * convert float vectors between the two orders).
 */
#ifndef ONNXKV_QUANT_H
#define ONNXKV_QUANT_H

#include "simd.h"

/* ------------------------------------------------------------------ */
/* Format table                                                          */
/* ------------------------------------------------------------------ */

/* Bits per code of an integer format code, 0 for anything else. */
static inline int okv_q_bits(int fmt) {
    switch (fmt) {
    case 2: case 3: return 8;
    case 21: case 22: return 4;
    case 25: case 26: return 2;
    default: return 0;
    }
}

static inline int okv_q_signed(int fmt) { return fmt == 3 || fmt == 22 || fmt == 26; }

static inline int okv_q_qmin(int fmt) {
    int b = okv_q_bits(fmt);
    return okv_q_signed(fmt) ? -(1 << (b - 1)) : 0;
}

static inline int okv_q_qmax(int fmt) {
    int b = okv_q_bits(fmt);
    return okv_q_signed(fmt) ? (1 << (b - 1)) - 1 : (1 << b) - 1;
}

/* Bytes of one token row of D codes (D * bits must be a multiple of 8). */
static inline int64_t okv_q_row_bytes(int fmt, int64_t D) { return D * okv_q_bits(fmt) / 8; }

/* Header bytes of a page with H heads and G groups per head (64-byte multiple). */
static inline int64_t okv_q_header_bytes(int64_t H, int64_t G) { return (H * G * 8 + 63) / 64 * 64; }

/* ---- compact header (see the top of this file) ---- */

/* Most groups per head of a compact header (the attention kernel decodes one
 * head's header into stack arrays of this many floats). */
#define OKV_Q_COMPACT_MAX_G 512

/* Header bytes of a compact header with H heads and G groups per head (64-byte multiple). */
static inline int64_t okv_q_compact_header_bytes(int64_t H, int64_t G) { return (H * 4 + 2 * H * G + 63) / 64 * 64; }

/* 2^(-i/16) rounded to float32, i = 0..15. */
static const float okv_q_steps[16] = {
    0x1.000000p+0f, 0x1.ea4afap-1f, 0x1.d5818ep-1f, 0x1.c199bep-1f, 0x1.ae89fap-1f, 0x1.9c4918p-1f,
    0x1.8ace54p-1f, 0x1.7a1148p-1f, 0x1.6a09e6p-1f, 0x1.5ab07ep-1f, 0x1.4bfdaep-1f, 0x1.3dea64p-1f,
    0x1.306fe0p-1f, 0x1.2387a6p-1f, 0x1.172b84p-1f, 0x1.0b5586p-1f};

/* Decodes G groups of one head: scale[g] = (S * okv_q_steps[e[g] & 15]) * 2^-(e[g] >> 4), zp[g] = z[g]. */
static inline void okv_q_compact_decode_scalar(float S, const uint8_t *e, const uint8_t *z, float *scale, float *zp,
                                               int64_t G) {
    int64_t g;
    for (g = 0; g < G; g++) {
        const float p2 = okv_bits_f32((uint32_t)(127 - (e[g] >> 4)) << 23);   /* 2^-(e >> 4), a normal float */
        scale[g] = (S * okv_q_steps[e[g] & 15]) * p2;
        zp[g] = (float)z[g];
    }
}

/* ---- channel-zero-point header (see the top of this file) ---- */

/* Header bytes of a channel-zero-point header with H heads and G groups per head (64-byte multiple). */
static inline int64_t okv_q_czp_header_bytes(int64_t H, int64_t G) { return (H * 8 + H * G + 63) / 64 * 64; }

/* The zero point z0 that a channel-zero-point header's offsets are added to:
 * 0 for signed formats, 2^(bits - 1) (the middle code) for unsigned ones. */
static inline float okv_q_czp_z0(int fmt) { return okv_q_signed(fmt) ? 0.f : (float)(1 << (okv_q_bits(fmt) - 1)); }

/* Decodes G groups of head h of the channel-zero-point header at hdr (H heads;
 * s and w read bytewise: hdr need not be aligned): scale[g] = s[h], zp[g] =
 * z0 + w[h] * o[h*G + g] (exact: |zp| < 2^24). */
static inline void okv_q_czp_decode(const uint8_t *hdr, int64_t H, int64_t G, int64_t h, int fmt, float *scale,
                                    float *zp) {
    const int8_t *o = (const int8_t *)(hdr + 8 * H) + h * G;
    const float z0 = okv_q_czp_z0(fmt);
    float s, w;
    int64_t g;
    memcpy(&s, hdr + 4 * h, sizeof(float));
    memcpy(&w, hdr + 4 * (H + h), sizeof(float));
    for (g = 0; g < G; g++) {
        scale[g] = s;
        zp[g] = z0 + w * (float)o[g];
    }
}

/* Code c of a packed row, sign-extended for signed formats. */
static inline int okv_q_get(const uint8_t *row, int fmt, int64_t c) {
    int b = okv_q_bits(fmt);
    int per = 8 / b;
    int u = (row[c / per] >> ((int)(c % per) * b)) & ((1 << b) - 1);
    if (okv_q_signed(fmt) && u >= (1 << (b - 1))) u -= 1 << b;
    return u;
}

/* ------------------------------------------------------------------ */
/* Scalar rows                                                          */
/* ------------------------------------------------------------------ */

static inline int okv_q_code_scalar(float x, float s, float z, float lo, float hi) {
    float v = nearbyintf(x / s) + z;
    if (!(v >= lo)) v = lo;   /* NaN -> qmin */
    if (v > hi) v = hi;
    return (int)v;
}

/* Quantizes codes c0 <= c < D of a row (c0 * bits is a multiple of 8). */
static inline void okv_quant_row_scalar(const float *x, int fmt, const float *scale, const float *zp,
                                        int per_channel, uint8_t *codes, int64_t c0, int64_t D) {
    const int b = okv_q_bits(fmt), per = 8 / b, mask = (1 << b) - 1;
    const float lo = (float)okv_q_qmin(fmt), hi = (float)okv_q_qmax(fmt);
    int64_t c = c0;
    while (c < D) {
        int byte = 0, k;
        for (k = 0; k < per; k++, c++) {
            int64_t g = per_channel ? c : 0;
            byte |= (okv_q_code_scalar(x[c], scale[g], zp[g], lo, hi) & mask) << (k * b);
        }
        codes[(c - 1) / per] = (uint8_t)byte;
    }
}

static inline void okv_dequant_row_scalar(const uint8_t *codes, int fmt, const float *scale, const float *zp,
                                          int per_channel, float *out, int64_t c0, int64_t D) {
    int64_t c;
    for (c = c0; c < D; c++) {
        int64_t g = per_channel ? c : 0;
        out[c] = ((float)okv_q_get(codes, fmt, c) - zp[g]) * scale[g];
    }
}

/* ------------------------------------------------------------------ */
/* AVX2 rows                                                            */
/* ------------------------------------------------------------------ */
#if OKV_X86_SIMD

/* 8 codes (as int32, masked to the format's bits) of x[c..c+8). */
OKV_AVX2 static inline __m256i okv_q_codes8(const float *x, __m256 s, __m256 z, __m256 lo, __m256 hi, __m256i mask) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_add_ps(v, z);
    v = _mm256_max_ps(v, lo);   /* NaN -> lo (max returns its second operand) */
    v = _mm256_min_ps(v, hi);
    return _mm256_and_si256(_mm256_cvtps_epi32(v), mask);
}

OKV_AVX2 static inline void okv_quant_row_avx2(const float *x, int fmt, const float *scale, const float *zp,
                                               int per_channel, uint8_t *codes, int64_t D) {
    const int b = okv_q_bits(fmt);
    const __m256 lo = _mm256_set1_ps((float)okv_q_qmin(fmt)), hi = _mm256_set1_ps((float)okv_q_qmax(fmt));
    const __m256i mask = _mm256_set1_epi32((1 << b) - 1);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 s = _mm256_set1_ps(scale[0]), z = _mm256_set1_ps(zp[0]);
    int64_t c = 0;
    for (; c + 32 <= D; c += 32) {
        __m256i q[4], bytes;
        int k;
        for (k = 0; k < 4; k++) {
            if (per_channel) {
                s = _mm256_loadu_ps(scale + c + 8 * k);
                z = _mm256_loadu_ps(zp + c + 8 * k);
            }
            q[k] = okv_q_codes8(x + c + 8 * k, s, z, lo, hi, mask);
        }
        /* 32 codes -> 32 bytes in channel order (packs work per 128-bit lane). */
        bytes = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]), _mm256_packus_epi32(q[2], q[3]));
        bytes = _mm256_permutevar8x32_epi32(bytes, order);
        if (b == 8) {
            _mm256_storeu_si256((__m256i *)(codes + c), bytes);
        } else if (b == 4) {
            /* byte pairs -> c_even | c_odd << 4 in 16-bit lanes, then narrow to bytes */
            __m256i w = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x1001));
            w = _mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0x08);
            _mm_storeu_si128((__m128i *)(codes + c / 2), _mm256_castsi256_si128(w));
        } else {
            /* byte quads -> c0 | c1 << 2 | c2 << 4 | c3 << 6 in 32-bit lanes, then narrow */
            __m256i w = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x0401));
            w = _mm256_madd_epi16(w, _mm256_set1_epi32(0x00100001));
            w = _mm256_packus_epi32(w, w);
            w = _mm256_packus_epi16(w, w);
            w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
            _mm_storel_epi64((__m128i *)(codes + c / 4), _mm256_castsi256_si128(w));
        }
    }
    okv_quant_row_scalar(x, fmt, scale, zp, per_channel, codes, c, D);
}

/* 8 codes c..c+8 of a packed row as int32 (sign-extended for signed formats). */
OKV_AVX2 static inline __m256i okv_q_load8(const uint8_t *codes, int fmt, int64_t c) {
    const int b = okv_q_bits(fmt), sgn = okv_q_signed(fmt);
    __m256i v;
    if (b == 8) {
        __m128i raw = _mm_loadl_epi64((const __m128i *)(codes + c));
        return sgn ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
    }
    if (b == 4) {
        uint32_t w;
        memcpy(&w, codes + c / 2, 4);
        v = _mm256_sllv_epi32(_mm256_set1_epi32((int)w), _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0));
        return sgn ? _mm256_srai_epi32(v, 28) : _mm256_srli_epi32(v, 28);
    }
    {
        uint16_t w;
        memcpy(&w, codes + c / 4, 2);
        v = _mm256_sllv_epi32(_mm256_set1_epi32((int)w), _mm256_setr_epi32(30, 28, 26, 24, 22, 20, 18, 16));
        return sgn ? _mm256_srai_epi32(v, 30) : _mm256_srli_epi32(v, 30);
    }
}

/* 16 codes c..c+16 of a packed row as float32 (AVX-512; c a multiple of 16,
 * signed codes sign-extended).  8-bit: sign/zero extension of 16 bytes and a
 * conversion.  4- and 2-bit: a table lookup (vpermps reads the low 4 bits of
 * each lane) instead of shifting the code to the top and back and converting:
 * 4-bit, the 8 bytes broadcast, dword 0 into lanes 0-7 and dword 1 into lanes
 * 8-15, each lane shifted right to its nibble; 2-bit, one broadcast dword,
 * lane i shifted right by 2i (the table repeats every 4 entries). */
OKV_AVX512BW static inline __m512 okv_q_load16_ps(const uint8_t *codes, int fmt, int64_t c) {
    const int b = okv_q_bits(fmt), sgn = okv_q_signed(fmt);
    if (b == 8) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(codes + c));
        return _mm512_cvtepi32_ps(sgn ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw));
    }
    if (b == 4) {
        const __m512 tab = sgn ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1)
                               : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        uint64_t w;
        __m512i v;
        memcpy(&w, codes + c / 2, 8);
        v = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                     _mm512_set1_epi64((long long)w));
        v = _mm512_srlv_epi32(v, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28));
        return _mm512_permutexvar_ps(v, tab);
    }
    {
        const __m512 tab = sgn ? _mm512_setr_ps(0, 1, -2, -1, 0, 1, -2, -1, 0, 1, -2, -1, 0, 1, -2, -1)
                               : _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
        uint32_t w;
        memcpy(&w, codes + c / 4, 4);
        return _mm512_permutexvar_ps(
            _mm512_srlv_epi32(_mm512_set1_epi32((int)w),
                              _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)),
            tab);
    }
}

/* The interleaved lane order of 16 4-bit codes: lane 2k + h (k < 8, h < 2)
 * holds code 8h + k of the 16, i.e. codes 0, 8, 1, 9, ..., 7, 15 -- the order
 * in which one broadcast of the 8 code bytes (dword 0 in the even lanes, dword
 * 1 in the odd ones) and one per-lane shift by 4k put every nibble at the bottom
 * of its lane. */
#define OKV_Q4_ILV(m) ((((m) & 7) << 1) | ((m) >> 3))   /* lane of code m */

/* vpermps indices: natural -> interleaved (lane L takes element (L&1)*8 + L/2)
 * and interleaved -> natural (lane m takes lane OKV_Q4_ILV(m)). */
OKV_AVX512BW static inline __m512i okv_q4_ilv_idx(void) {
    return _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
}
OKV_AVX512BW static inline __m512i okv_q4_nat_idx(void) {
    return _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
}

/* 16 4-bit codes c..c+16 of a packed row (c a multiple of 16; fmt UINT4 or
 * INT4) as float32 in the OKV_Q4_ILV lane order: the 8 bytes broadcast (a
 * load), one variable shift, one table lookup (vpermps reads the low 4 bits
 * of each lane) -- two vector operations where okv_q_load16_ps's natural
 * order takes three. */
OKV_AVX512BW static inline __m512 okv_q4_load16_ilv_ps(const uint8_t *codes, int fmt, int64_t c) {
    const __m512 tab = okv_q_signed(fmt) ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1)
                                         : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    uint64_t w;
    memcpy(&w, codes + c / 2, 8);
    return _mm512_permutexvar_ps(
        _mm512_srlv_epi32(_mm512_set1_epi64((long long)w),
                          _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28)),
        tab);
}

/* okv_q_compact_decode_scalar, 8 groups at a time: the 16-entry step table
 * looked up as two 8-entry permutes blended on bit 3 of the index, 2^-(e >> 4)
 * built as exponent bits. */
OKV_AVX2 static inline void okv_q_compact_decode_avx2(float S, const uint8_t *e, const uint8_t *z, float *scale,
                                                      float *zp, int64_t G) {
    const __m256 tlo = _mm256_loadu_ps(okv_q_steps), thi = _mm256_loadu_ps(okv_q_steps + 8), vs = _mm256_set1_ps(S);
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
        const __m256i ei = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(e + g)));
        const __m256i lo = _mm256_and_si256(ei, _mm256_set1_epi32(15));
        const __m256 t = _mm256_blendv_ps(_mm256_permutevar8x32_ps(tlo, lo), _mm256_permutevar8x32_ps(thi, lo),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(lo, 28)));
        const __m256 p2 = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(127), _mm256_srli_epi32(ei, 4)), 23));
        _mm256_storeu_ps(scale + g, _mm256_mul_ps(_mm256_mul_ps(vs, t), p2));
        _mm256_storeu_ps(zp + g, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(z + g)))));
    }
    okv_q_compact_decode_scalar(S, e + g, z + g, scale + g, zp + g, G - g);
}

OKV_AVX2 static inline void okv_dequant_row_avx2(const uint8_t *codes, int fmt, const float *scale, const float *zp,
                                                 int per_channel, float *out, int64_t D) {
    __m256 s = _mm256_set1_ps(scale[0]), z = _mm256_set1_ps(zp[0]);
    int64_t c = 0;
    for (; c + 8 <= D; c += 8) {
        if (per_channel) {
            s = _mm256_loadu_ps(scale + c);
            z = _mm256_loadu_ps(zp + c);
        }
        _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(okv_q_load8(codes, fmt, c)), z), s));
    }
    okv_dequant_row_scalar(codes, fmt, scale, zp, per_channel, out, c, D);
}
#endif

/* ------------------------------------------------------------------ */
/* Dispatching rows (simd = 1 selects the AVX2 path)                    */
/* ------------------------------------------------------------------ */

static inline void okv_quant_row(const float *x, int fmt, const float *scale, const float *zp, int per_channel,
                                 uint8_t *codes, int64_t D, int simd) {
    OKV_DISPATCH(simd, okv_quant_row_avx2(x, fmt, scale, zp, per_channel, codes, D),
                 okv_quant_row_scalar(x, fmt, scale, zp, per_channel, codes, 0, D));
}

static inline void okv_q_compact_decode(float S, const uint8_t *e, const uint8_t *z, float *scale, float *zp,
                                        int64_t G, int simd) {
    OKV_DISPATCH(simd, okv_q_compact_decode_avx2(S, e, z, scale, zp, G),
                 okv_q_compact_decode_scalar(S, e, z, scale, zp, G));
}

static inline void okv_dequant_row(const uint8_t *codes, int fmt, const float *scale, const float *zp,
                                   int per_channel, float *out, int64_t D, int simd) {
    OKV_DISPATCH(simd, okv_dequant_row_avx2(codes, fmt, scale, zp, per_channel, out, D),
                 okv_dequant_row_scalar(codes, fmt, scale, zp, per_channel, out, 0, D));
}

#endif /* ONNXKV_QUANT_H */
