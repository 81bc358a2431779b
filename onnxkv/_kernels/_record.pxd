# Kernel-call recording (see _record.pyx), shared by cimport with the kernel modules.

cdef object recorder()
cdef void refuse(str reason)

# Kinds of noted calls (the replay in step.pyx switches on them).
cdef enum:
    KIND_MATMUL_PACKED = 1   # arrays (x, wp, bias or None, out); ints (M, K, P, N, float16 panels)
    KIND_RMS_NORM = 2        # arrays (x, gamma, out); ints (rows, n); floats (eps,)
    KIND_SKIP_RMS_NORM = 3   # arrays (x, skip, gamma, bias or None, out, sum_out or None); ints (rows, n); floats (eps,)
    KIND_ACTIVATION = 4      # arrays (x, up or None, out); ints (mode, n): up n values (modes 2-4), one (5-7)
    KIND_GATHER_ROWS = 5     # arrays (table, indices, out); ints (N, D, m, wrap); fails on an index out of range
    # S decode tokens of each of B rows into a state's contiguous caches (attention.decode_token_ptr), their
    # positions read when replayed: arrays (q, k, v (each the memory its B * S token rows span), cos or None, sin
    # or None, k_cache, v_cache [B, Hkv, Cap, D], seqlens_k int32 [B], total int32 [1], out, pos_io int64 [2, B],
    # undo [2, B, Hkv, S, D] of the caches' type); ints (Hq, Hkv, Cap, D, half, interleaved, window, cos rows, S,
    # q / k / v token-row strides in elements, float16 tokens (0 or 1), the caches' type
    # (_record.DECODE_CACHE_TYPES), B); floats (scale, softcap).  pos[b] = seqlens_k[b] + 1 - S; refused unless
    # every pos[b] <= pos_io[0, b] (the committed lengths, set before each replay; == with one row), 0 <= pos[b],
    # pos[b] + S <= Cap and <= cos rows, every pos[b] equal when S > 1, and total == max(pos) + S > S.  Runs with
    # pos_io[1] = pos, set before the kernel, and the committed bytes each row writes over (below the largest
    # pos_io[0]) copied into undo first (step_rewrites.pxi).
    KIND_DECODE_TOKEN = 6
    KIND_MATMUL_NBITS = 7    # arrays (x, PackedNBits weight, bias or None, out); ints (M, int8)
    # GroupQueryAttention's lengths from the mask (plan/ops/mask_lengths.py): arrays (mask int64 [B, L], seqlens
    # int32 [B], total int32 of one element); ints (B, L).  The mask is a whole external array whose last dim may
    # change from run to run (Program's ``ragged``): the replay reads L from it, then seqlens[b] =
    # int32(sum(mask[b]) - 1) (int64 arithmetic wrapping as NumPy's), total = L.  A *prelude* call: it reads
    # only externals and runs before every other call is admitted, so those may check what it wrote.
    KIND_MASK_LENGTHS = 8
    # S new tokens of each of B rows into a state's paged cache (attention.decode_paged_ptr), the rows'
    # positions read when replayed: arrays (q, k, v (each the memory its B rows span), cos or None, sin or None,
    # page addresses uint64 [planes, P] (the pool's whole table), block tables int32 [B, M], seqlens_k int32 [B],
    # total int32 [1], out, lengths int64 [2, B] (row 0: the committed lengths; row 1: the end of the positions
    # whose pages the run staged; both set before each replay)); ints (Hq, Hkv, D, block size, half, interleaved,
    # window, cos rows, B, K plane, V plane, q / k / v token row strides in elements, P, M, S: tokens per row,
    # float16 tokens (0 or 1), the pages' type (_record.DECODE_CACHE_TYPES)).
    # The two tables are whole external arrays whose last dim may change (Program's ``ragged``): the replay
    # reads P and M from them.  Refused unless every lengths[0, b] == seqlens_k[b] + 1 - S, seqlens_k[b] <
    # lengths[1, b] (with S > 1 every row's seqlens_k equal), S < total, max(seqlens_k) < total <=
    # max(lengths[0]) + S and every position and page the call writes or reads passes attention.decode_paged_ok.
    KIND_DECODE_PAGED = 9
    KIND_MATMUL_DYNAMIC = 10  # arrays (x, PackedInt8Weight weight, ws, out); ints (M,): imatmul.matmul_dynamic
    # S new positions of every row copied into a contiguous cache [B, H, Cap, D] at its committed length, read
    # when replayed (an export's cache Concat in place): arrays (new [B, H, S, D], cache, pos_io int64 [1]);
    # ints (B, H, S, D, Cap, element bytes: 4 for float32, 2 for a float16 model's float16 cache).  The cache
    # is a whole resizable external (its capacity read when replayed); refused unless 0 <= pos_io[0] and
    # pos_io[0] + S <= Cap.
    KIND_CACHE_ROWS = 11
    # Masked attention of S queries over a contiguous cache pair [B, Hkv, Cap, D] (an export's MaskedAttention,
    # an ONNX Attention node; attention.masked_decode_ptr): arrays (q [B, Hq, S, D], k_cache, v_cache, mask [mb,
    # 1, ms, T], out [B, Hq, S, D], pos_io int64 [1], kv_len int32 [B], kv_start int32 [B], q_pos int32 [B, S]:
    # the last three the call's own scratch); ints (B, Hq, Hkv, S, D, Cap, mb, ms, T, mask kind (0 additive
    # float32, 1 bool, 2 additive float16), causal, float16 q and out (0 or 1), float16 caches (0: float32));
    # floats (scale, softcap).  The caches are whole resizable externals and
    # the mask a whole ragged one: a replay reads Cap and T from them.  Refused unless T == pos_io[0] + S <= Cap
    # and the mask (with the causal bound) describes, for every (batch row, query), one non-empty range of
    # visible keys starting at the same key for every query of a batch row (attention.masked_ranges).
    KIND_MASKED_DECODE = 12
    # rotary.rope_ptr: arrays (x [B, S, H, D], cos [max_pos, half], sin, positions int64 [B, S], out); ints (B,
    # S, H, D, max_pos, half, interleaved); refused unless every position is in [0, max_pos).
    KIND_ROTARY = 13
    # float16 <-> float32 conversion (convert.convert_ptr): arrays (x, out), n elements each, C order; ints (n,
    # mode): mode 0 widens float16 to float32, 1 rounds float32 to float16 (nearest even, overflow to inf),
    # 2 copies float32 (a Cast to its input's type).
    KIND_CONVERT = 14
    # S new positions of every row written into a static contiguous cache [B, H, Cap, D] at the rows' own
    # positions, read when replayed (TensorScatter in place, linear mode): arrays (new [B, H, S, D], cache,
    # write_indices int64 [B], saved [B, H, S, D], starts int64 [B]: the last two the call's own scratch); ints
    # (B, H, S, D, Cap, element bytes: 4 or 2).  The cache is a whole resizable external (its capacity read when
    # replayed); refused unless every 0 <= write_indices[b] <= Cap - S.  Before writing a row, the call copies
    # the bytes it replaces into saved[b] and its position into starts[b] (what the cache keeps to undo the run).
    KIND_SCATTER_ROWS = 15
    # KIND_MASKED_DECODE over a static cache's every position with each row's valid keys given (an ONNX
    # Attention node's nonpad_kv_seqlen): arrays (q, k_cache, v_cache, mask [mb, 1, ms, T], out, ends int64 [B],
    # kv_len, kv_start, q_pos: the last three the call's own scratch); ints and floats as KIND_MASKED_DECODE's.
    # The mask is not ragged; the caches are whole resizable externals.  Refused unless T == Cap, every ends[b]
    # is in [0, T] and the mask, with the causal bound ends[b] - S + s and the end ends[b], describes ranges
    # (attention.masked_ranges); kv_len[b] = ends[b].
    KIND_NONPAD_DECODE = 16
    # Two C-contiguous arrays concatenated along one axis (convert.concat_ptr): arrays (a or None, b or None, out);
    # ints (outer, a_bytes, b_bytes): out is outer rows of a_bytes of a's row then b_bytes of b's (an operand of
    # no bytes is None).
    KIND_CONCAT = 17
    # A strided view copied into a C-contiguous array (convert.copy_rows_ptr): arrays (span, out), span the bytes
    # from the view's first element to its last (uint8); ints (rows, row_bytes, stride): out is the rows of
    # row_bytes at span + r * stride.
    KIND_COPY_ROWS = 18
    # S new positions of every row of a paged cache's plane written at the rows' committed lengths (an export's
    # cache Concat in a paged state; attention.page_rows_ptr): arrays (new [B, H, S, D] C order, float32 or
    # float16, page addresses uint64 [planes, P] (the pool's whole table), block tables int32 [B, M], lengths
    # int64 [2, B] (row 0: the committed lengths; row 1: the end of the positions whose pages the run staged;
    # both set before each replay), last int32 [B]: the call's scratch); ints (B, H, S, D, block size, plane,
    # float16 rows (0 or 1), the pages' type (_record.DECODE_CACHE_TYPES), 0 x 6, P, M: read when replayed).
    # The two tables are whole ragged externals.  Refused unless every 0 <= lengths[0, b] and lengths[0, b] + S
    # <= lengths[1, b], and every position and page of the row passes attention.decode_paged_ok.
    KIND_PAGE_ROWS = 19
    # Masked attention of one query per row over a paged cache (an export's MaskedAttention, an ONNX Attention
    # node, in a paged state; attention.decode_paged_ptr): arrays (q [B, Hq, 1, D], k and v [B, Hkv, 1, D] (the
    # rows written first, at the committed lengths) or both None (the rows are in the pages already), mask [mb,
    # 1, 1, T], out [B, Hq, 1, D], page addresses, block tables, lengths as KIND_PAGE_ROWS's, last, kv_start,
    # q_pos int32 [B]: the call's scratch); ints (B, Hq, Hkv, D, block size, K plane, V plane, mb, T, mask kind
    # (KIND_MASKED_DECODE's), causal, float16 q, k, v and out (0 or 1), the pages' type, ragged (0 or 1), P,
    # M); floats (scale, softcap).  The mask and the two tables are whole ragged externals (T, P and M read when
    # replayed).  Refused unless every lengths[0, b] + 1 == T (ragged: <= T, the longest row's == T) and
    # lengths[0, b] + 1 <= lengths[1, b], the mask (with the causal bound) shows each row's query one range of
    # keys ending at its own position lengths[0, b] (attention.masked_ranges; a ragged call's row shorter than
    # T - 1 has the keys lengths[0, b] .. T - 2, which it never wrote, hidden and dropped: ONNX Attention over
    # the rows of requests of different lengths, attention_onnx.ragged_mask), and every position and page read
    # passes attention.decode_paged_ok.
    KIND_MASKED_PAGED = 20
