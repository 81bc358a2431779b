"""Decode attention over quantized paged KV caches: onnxkv paged_attention with
per-page formats vs ONNX Runtime com.microsoft.GroupQueryAttention (float32).

One new token (Sq = 1), batch 1, 32 query heads, 8 KV heads, head size 128,
block size 16, contexts 4096, 16384 and 32768 (by default), threads from
--threads (default 2).

* onnxkv paged, one variant per cache format, each its own cache with pages
  allocated the way a paged state allocates them by default (--allocator
  slab: a SlabAllocator per cache, keys from its lane 0 and values from lane
  1, so one plane's successive pages are adjacent in huge-page backed chunks;
  --allocator system: every page its own NumPy array, as with an explicit
  SystemAllocator), logical blocks allocated in logical order as decode
  appends them (key page then value page per block), page ids shuffled:
  float32 and float16 pages (kv_dtype, no format tables); int8 and int4 pages
  (symmetric, per-head scales for keys and values, k_formats / v_formats all
  int8 / int4: the "int8-head" and "int4" policies' pages); int4 with
  per-channel key scales (the header of a 16-token page then holds 8 KiB of
  key scales); int8_policy, the "int8" policy's pages (keys int8 with one
  scale per head and one zero point per channel in the "channel-zp" header a
  paged state writes -- float32 scale and zero-point unit per head, one
  zero-point byte per channel, 1088 bytes per 16-token page --, values int8
  per head); int8_kivi, the "int8-kivi" policy's pages (keys uint8 with a
  scale and zero point per channel in the compact header -- float32 S per
  head, one exponent byte and one zero-point byte per channel, 2112 bytes per
  16-token page --, values int8 per head); mixed: the newest 1024 tokens'
  pages float32, the older ones int4 (per-head).  Pages are quantized by
  onnxkv._kernels.quantize_page (QuantizeLinear semantics, round half to
  even) with the parameters of onnxkv.cache.formats.params_for (signed
  formats: scale = max|x| / qmax per group, zero point 0; unsigned:
  asymmetric over the group's range), or of onnxkv.cache.formats'
  compact_params / channel_zp_params for those headers.
* ONNX Runtime: the one-node GroupQueryAttention model of _common with past and
  present bound to the same float32 buffer (bench_decode_attention's shared
  buffer mode), intra_op_num_threads = threads.

All variants are measured interleaved, round by round
(bench_decode_attention.measure).  Prints one JSON document (machine, versions,
load averages, threads, the page allocator, shapes, raw samples in seconds,
medians, committed cache bytes per format with headers, byte ratios to
float32, speedups vs ORT and vs onnxkv float32 pages, max abs difference to
the float32 result, the counters the kernel returns) and a summary on stderr.  The bars (16384 tokens,
2 threads): int8 >= 8x and int4 >= 10x faster than ORT float32 GQA, int8 >= 2x
faster than onnxkv float32 pages, checked for both int8 layouts (int8: per-head
pages, the "int8-head" policy's; int8_policy: the "int8" policy's); committed
bytes int8 and int8_policy <= 0.27x, int4 <= 0.14x float32.  (int8_kivi is
measured for comparison, without a bar.)

    python benchmarks/bench_quant_decode.py [--threads 2] [--contexts 4096 16384 32768]
        [--repeat N] [--no-ort] [--allocator slab|system] [--isa auto|avx512|avx2]
        [--prefetch-qk-lines N] [--out FILE]

--allocator: where the pages live -- slab (default, as a paged state without
an allocator argument) or system (one allocation per page); recorded as
config.page_allocator.

--isa: the attention tiles -- auto (AVX-512 where usable, keys of quantized
pages on AMX-INT8 where usable: level "avx512+amx"), avx512 (AVX-512 without
AMX) or avx2; the level in use is recorded as config.attention_isa.
--prefetch-qk-lines: with AMX key scores, the cache lines of each (head, row
group) item's share of the next block's software prefetch issued together
with its key tiles (0: all of them, the earlier schedule); the rest are
spread over the probabilities-times-values loop of the item before (default
48: int8 pages' 64 lines per head split 48 + 16, int4 pages' 32 all with the
keys); recorded as config.prefetch_qk_lines.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import PAGE_ALLOCATORS, emit, kv_page_allocators, machine, versions  # noqa: E402
from bench_decode_attention import HKV, HQ, B, D, measure, ort_decode_on_copies, ort_session  # noqa: E402

import onnxkv._kernels as K  # noqa: E402
from onnxkv.cache import formats  # noqa: E402

BS = 16
RECENT = 1024  # mixed variant: tokens kept float32
INT8, INT4, UINT8, F32 = 3, 22, 2, 1
BARS = {
    "ctx": 16384,
    "threads": 2,
    "min_speedup_vs_ort": {"int8": 8.0, "int8_policy": 8.0, "int4": 10.0},
    "min_speedup_vs_onnxkv_f32": {"int8": 2.0, "int8_policy": 2.0},
    "max_bytes_over_f32": {"int8": 0.27, "int8_policy": 0.27, "int4": 0.14},
}


def quantize(pages: np.ndarray, fmt: str, granularity: str, header: str = "float32") -> np.ndarray:
    """float32 pages [n, H, bs, D] -> payloads uint8 [n, page bytes] in format
    ``fmt`` with the library's own parameters (onnxkv.cache.formats.params_for:
    signed formats symmetric, unsigned asymmetric; one scale per head, or per
    head and channel; header "compact": formats.compact_params, per channel;
    header "channel-zp": formats.channel_zp_params, a scale per head and a zero
    point per channel) and quantizer (onnxkv._kernels.quantize_page)."""
    n, h, bs, d = pages.shape
    code, g = formats.page_format(fmt).code, formats.groups_for(granularity, d)
    out = np.zeros((n, formats.page_bytes(fmt, h, bs, d, g, header)), np.uint8)
    for i in range(n):
        x = np.ascontiguousarray(pages[i])
        if header != "float32":
            params = formats.compact_params if header == "compact" else formats.channel_zp_params
            scale, zero, hdr = params(x, fmt)
            K.quantize_page(x, code, scale, zero, g, out[i], bs, header=hdr, header_kind=header)
        else:
            scale, zero = formats.params_for(x, fmt, granularity)
            K.quantize_page(x, code, scale, zero, g, out[i], bs)
    return out


class Pages:
    """Pages of one cache (logical block i of K/V in page table[0, i], ids a
    random permutation), each an aligned allocation holding its payload, made
    in logical block order, key page then value page, from the key and value
    plane allocators of kv_page_allocators(kind).  k_payloads / v_payloads:
    per logical block, an array (any dtype) copied byte for byte."""

    def __init__(self, k_payloads, v_payloads, table, kind):
        m = len(table)
        self.k_addr, self.v_addr = np.zeros(m, np.uint64), np.zeros(m, np.uint64)
        self.buffers, self.committed = [], 0
        allocators = kv_page_allocators(kind)
        for i in range(m):
            pid = int(table[i])
            for src, addr, alloc in zip((k_payloads[i], v_payloads[i]), (self.k_addr, self.v_addr), allocators):
                raw = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
                buf = alloc.allocate(raw.nbytes, 64)
                buf.view(np.uint8, (raw.nbytes,))[...] = raw
                addr[pid] = buf.address
                self.buffers.append(buf)
                self.committed += -(-raw.nbytes // 64) * 64


def build_variants(kf, vf, ctx, rng, kind):
    """{name: (Pages, paged_attention keyword arguments)} for every format, pages placed by ``kind``."""
    m = ctx // BS
    table = rng.permutation(m).astype(np.int32)
    kb = kf[0].reshape(HKV, m, BS, D).transpose(1, 0, 2, 3)  # [m, H, bs, D] logical blocks
    vb = vf[0].reshape(HKV, m, BS, D).transpose(1, 0, 2, 3)
    q8k, q8v = quantize(kb, "int8", "head"), quantize(vb, "int8", "head")
    q4k, q4v = quantize(kb, "int4", "head"), quantize(vb, "int4", "head")
    q4kc, u8kc = quantize(kb, "int4", "channel"), quantize(kb, "uint8", "channel", "compact")
    i8zc = quantize(kb, "int8", "channel", "channel-zp")
    fmt = np.empty(m, np.uint8)

    def fmt_table(per_block):
        fmt[table] = per_block  # page id table[i] holds block i
        return fmt.copy()

    old = np.arange(m) < m - RECENT // BS
    mixed_k = [q4k[i] if old[i] else kb[i] for i in range(m)]
    mixed_v = [q4v[i] if old[i] else vb[i] for i in range(m)]
    mixed_f = fmt_table(np.where(old, INT4, F32))
    return table, {
        "f32": (Pages(kb, vb, table, kind), {}),
        "f16": (Pages(kb.astype(np.float16), vb.astype(np.float16), table, kind), {"kv_dtype": "float16"}),
        "int8": (Pages(q8k, q8v, table, kind), {"k_formats": fmt_table(INT8), "v_formats": fmt_table(INT8)}),
        "int4": (Pages(q4k, q4v, table, kind), {"k_formats": fmt_table(INT4), "v_formats": fmt_table(INT4)}),
        "int4_keys_per_channel": (
            Pages(q4kc, q4v, table, kind),
            {"k_formats": fmt_table(INT4), "v_formats": fmt_table(INT4), "k_group": D},
        ),
        # the "int8" policy: keys int8 with a scale per (page, head) and a zero point per (page, head, channel),
        # channel-zp headers; values int8 per (page, head)
        "int8_policy": (
            Pages(i8zc, q8v, table, kind),
            {"k_formats": fmt_table(INT8), "v_formats": fmt_table(INT8), "k_group": D, "k_header": "channel-zp"},
        ),
        # the "int8-kivi" policy: keys uint8 per (page, head, channel), asymmetric, compact headers; values int8 per
        # (page, head)
        "int8_kivi": (
            Pages(u8kc, q8v, table, kind),
            {"k_formats": fmt_table(UINT8), "v_formats": fmt_table(INT8), "k_group": D, "k_header": "compact"},
        ),
        "mixed_f32_recent_int4_old": (
            Pages(mixed_k, mixed_v, table, kind),
            {"k_formats": mixed_f, "v_formats": mixed_f},
        ),
    }


def run_context(ctx, threads, repeat, sess, rng, kind) -> dict:
    scale = D**-0.5
    q = rng.standard_normal((B, HQ, 1, D)).astype(np.float32)
    kf = rng.standard_normal((B, HKV, ctx, D)).astype(np.float32)
    vf = rng.standard_normal((B, HKV, ctx, D)).astype(np.float32)
    kv_len, q_pos = np.array([ctx], np.int32), np.array([[ctx - 1]], np.int32)
    table, pages = build_variants(kf, vf, ctx, rng, kind)
    out = np.empty_like(q)
    K.set_num_threads(threads)
    case = {
        "threads": threads,
        "page_allocator": kind,
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "shapes": {
            "B": B,
            "Hq": HQ,
            "Hkv": HKV,
            "D": D,
            "Sq": 1,
            "ctx": ctx,
            "block_size": BS,
            "recent_f32_tokens_in_mixed": RECENT,
        },
        "committed_cache_bytes": {},
        "bytes_over_f32": {},
        "max_abs_diff_vs_f32": {},
        "kernel_counters": {},
    }

    def call(name):
        pg, kw = pages[name]
        return lambda: K.paged_attention(
            q, pg.k_addr, pg.v_addr, table[None, :], BS, HKV, kv_len, q_pos, scale, 0.0, -1, out, **kw
        )

    variants, ref = {}, None
    for name, (pg, _) in pages.items():
        counters = call(name)()
        if ref is None:
            ref = out.copy()
        case["max_abs_diff_vs_f32"][name] = float(np.max(np.abs(out - ref)))
        case["kernel_counters"][name] = counters
        case["committed_cache_bytes"][name] = pg.committed
        case["bytes_over_f32"][name] = pg.committed / pages["f32"][0].committed
        variants[f"onnxkv_paged_{name}"] = call(name)
    if sess is not None:
        ort_call, ort_ref = ort_decode_on_copies(sess, q, kf, vf, ctx)
        case["max_abs_diff_ort_vs_onnxkv_f32"] = float(np.max(np.abs(ort_ref - ref)))
        variants["ort_gqa_shared_buffer_f32"] = ort_call
    res = case["results"] = measure(variants, repeat)
    base, ort = res["onnxkv_paged_f32"], res.get("ort_gqa_shared_buffer_f32")
    for name, r in res.items():
        if name.startswith("onnxkv"):
            r["speedup_vs_onnxkv_f32"] = base["median_s"] / r["median_s"]
            if ort is not None:
                r["speedup_vs_ort_shared_buffer"] = ort["median_s"] / r["median_s"]
    case["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return case


def check_bars(case) -> dict:
    res, out = case["results"], {}
    for fmt, need in BARS["min_speedup_vs_ort"].items():
        got = res[f"onnxkv_paged_{fmt}"].get("speedup_vs_ort_shared_buffer")
        out[f"{fmt}_speedup_vs_ort"] = {"value": got, "need": need, "met": got is not None and got >= need}
    for fmt, need in BARS["min_speedup_vs_onnxkv_f32"].items():
        got = res[f"onnxkv_paged_{fmt}"]["speedup_vs_onnxkv_f32"]
        out[f"{fmt}_speedup_vs_onnxkv_f32"] = {"value": got, "need": need, "met": got >= need}
    for fmt, limit in BARS["max_bytes_over_f32"].items():
        got = case["bytes_over_f32"][fmt]
        out[f"{fmt}_bytes_over_f32"] = {"value": got, "limit": limit, "met": got <= limit}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", type=int, nargs="*", default=[4096, 16384, 32768])
    ap.add_argument("--repeat", type=int, default=21, help="timed rounds per context")
    ap.add_argument("--no-ort", action="store_true", help="skip the ONNX Runtime peer")
    ap.add_argument(
        "--allocator",
        choices=PAGE_ALLOCATORS,
        default=PAGE_ALLOCATORS[0],
        help="page storage: slab (a paged state's default: a SlabAllocator, one lane per plane) or "
        "system (one NumPy array per page)",
    )
    ap.add_argument(
        "--isa",
        choices=("auto", "avx512", "avx2"),
        default="auto",
        help="attention tiles: auto (AVX-512 and AMX where usable), avx512 (no AMX) or avx2 (to compare)",
    )
    ap.add_argument(
        "--prefetch-qk-lines",
        type=int,
        default=None,
        metavar="N",
        help="with AMX key scores: cache lines of each item's next-block prefetch issued with its key "
        "tiles, the rest spread over the p.v before (0: all with the keys; default: the "
        "library's, 48)",
    )
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    attn = sys.modules["onnxkv._kernels.attention"]
    attn.set_attention_avx512(args.isa != "avx2")
    attn.set_attention_amx(args.isa == "auto")
    qk_lines = attn._set_prefetch_qk_lines(0)  # the library's value, unless --prefetch-qk-lines
    if args.prefetch_qk_lines is not None:
        qk_lines = max(0, args.prefetch_qk_lines)
    attn._set_prefetch_qk_lines(qk_lines)
    if any(c % BS or c < RECENT for c in args.contexts):
        ap.error(f"contexts must be multiples of {BS} and >= {RECENT}")

    doc = {
        "benchmark": "quant_decode_attention",
        "machine": machine(),
        "versions": versions("onnxruntime"),
        "config": {
            "Hq": HQ,
            "Hkv": HKV,
            "D": D,
            "B": B,
            "Sq": 1,
            "block_size": BS,
            "contexts": args.contexts,
            "threads": args.threads,
            "repeat": args.repeat,
            "bars": BARS,
            "page_allocator": args.allocator,
            "attention_isa": attn.attention_simd_level(),
            "prefetch_qk_lines": qk_lines,
            "quantization": "symmetric, zero point 0, round half to even; per-head scales unless named",
            "peer": "onnxruntime com.microsoft.GroupQueryAttention, CPUExecutionProvider, past/present "
            "bound to the same float32 buffer via IOBinding",
        },
        "cases": [],
    }
    rng = np.random.default_rng(0)
    old = K.get_num_threads()
    sess, lines = None, []
    if not args.no_ort:
        try:
            sess = ort_session(args.threads, D**-0.5, False)
        except Exception as e:  # onnxruntime missing or the op unsupported
            doc["ort_error"] = f"{type(e).__name__}: {e}"
    try:
        for ctx in args.contexts:
            case = run_context(ctx, args.threads, args.repeat, sess, rng, args.allocator)
            doc["cases"].append(case)
            isa = doc["config"]["attention_isa"]
            lines.append(
                f"ctx={ctx} threads={args.threads} isa={isa} pages={args.allocator} "
                f"load {case['loadavg_before']}: "
                + ", ".join(f"{name}={r['median_s'] * 1e3:.3f}ms" for name, r in case["results"].items())
            )
            lines.append("  bytes/f32: " + ", ".join(f"{k}={v:.3f}" for k, v in case["bytes_over_f32"].items()))
            if ctx == BARS["ctx"] and args.threads == BARS["threads"]:
                doc["bar_result"] = check_bars(case)
                lines.append(
                    "  BARS: "
                    + ", ".join(
                        f"{k}={v['value'] if v['value'] is None else round(v['value'], 3)}"
                        f"({'MET' if v['met'] else 'NOT MET'})"
                        for k, v in doc["bar_result"].items()
                    )
                )
    finally:
        K.set_num_threads(old)
    emit(doc, args.out, lines, loadavg=True)


if __name__ == "__main__":
    main()
