/* onnxkv/_kernels/claim.h -- work units (panels of a product) shared by a thread team without a fixed split.
 *
 * ranges[8 t] (one cache line per thread) holds thread t's range of units as
 * front | back << 32, initially [P t / nt, P (t + 1) / nt).  Thread t takes
 * chunk units at a time from the front of its own range -- so it streams a
 * contiguous range, as with a static split -- and, once that is empty, takes
 * chunks from the back of the other threads' ranges until every range is
 * empty.  A thread that starts late or runs slower then costs the team at most
 * the chunk it is working on, not the rest of its share.  Claims are
 * compare-and-swap on the packed word, so every unit is done exactly once.
 * P must be < 2^31.
 */
#ifndef ONNXKV_CLAIM_H
#define ONNXKV_CLAIM_H

#include <stdint.h>

/* Sets up okv_claim_run for nt threads over P units: each thread's range in
 * ranges[8 t] (ranges holds 8 nt words); returns the units per claim: about
 * eight claims per thread's range, a multiple of ``unit`` (whole tiles), at
 * least ``unit``. */
static int64_t okv_claim_setup(uint64_t *ranges, int64_t P, int nt, int64_t unit) {
    int64_t c;
    int t;
    for (t = 0; t < nt; t++)
        ranges[8 * t] = (uint64_t)(P * t / nt) | ((uint64_t)(P * (t + 1) / nt) << 32);
    c = P / ((int64_t)nt * 8);
    c = (c + unit - 1) / unit * unit;
    return c < unit ? unit : c;
}

/* Thread t of nt: claims chunks (see above) and calls work(ctx, lo, hi) for
 * each; returns the number of units it did. */
static int64_t okv_claim_run(uint64_t *ranges, int nt, int t, int64_t chunk,
                             void (*work)(void *ctx, int64_t lo, int64_t hi), void *ctx) {
    int64_t done = 0;
    int i;
    for (i = 0; i < nt; i++) {
        uint64_t *r = ranges + 8 * ((t + i) % nt);
        uint64_t s = __atomic_load_n(r, __ATOMIC_ACQUIRE);
        for (;;) {
            uint64_t f = s & 0xffffffffu, b = s >> 32, lo, hi, ns;
            if (f >= b) break;
            if (i == 0) { lo = f; hi = f + (uint64_t)chunk < b ? f + (uint64_t)chunk : b; ns = hi | (b << 32); }
            else        { hi = b; lo = b > f + (uint64_t)chunk ? b - (uint64_t)chunk : f; ns = f | (lo << 32); }
            if (__atomic_compare_exchange_n(r, &s, ns, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                work(ctx, (int64_t)lo, (int64_t)hi);
                done += (int64_t)(hi - lo);
                s = __atomic_load_n(r, __ATOMIC_ACQUIRE);
            }
        }
    }
    return done;
}

#endif /* ONNXKV_CLAIM_H */
