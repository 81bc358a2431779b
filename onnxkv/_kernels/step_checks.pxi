# onnxkv/_kernels/step_checks.pxi: what Program checks of each recorded call before it takes it (kinds,
# arities, and the ints that select a kernel's element types and modes against its arrays).
# Included by step.pyx (a Cython include: it shares that module's names).


cdef _check_call(int c, int kind, arrays, ints, floats):
    """Raise ValueError naming call ``c`` when its kind is unknown, its arity wrong, or its ints do not describe
    its arrays (element types, modes, table shapes)."""
    if kind not in _OPERANDS or len(arrays) != _OPERANDS[kind] or len(ints) > NI or len(floats) > NF:
        raise ValueError(f"Program: call {c} has an unknown kind or arity ({kind}, {len(arrays)} arrays)")
    if kind in _PAGE_TABLES and not _page_tables_ok(arrays, _PAGE_TABLES[kind], ints[_BLOCK[kind]]):
        raise ValueError(f"Program: paged call {c}: page addresses must be uint64 [planes, P] and block tables "
                         f"int32 [B, M] (operands {_PAGE_TABLES[kind]}), the block size in [1, 2**31 - 1]")
    if kind == KIND_DECODE_PAGED and not (
            arrays[5] is not None and arrays[6] is not None and arrays[5].ndim == 2 and arrays[6].ndim == 2
            and 0 <= ints[9] < arrays[5].shape[0] and 0 <= ints[10] < arrays[5].shape[0]
            and ints[8] == arrays[6].shape[0] >= 1 and ints[3] >= 1 and len(ints) > PAGED_S
            and ints[PAGED_S] >= 1
            and arrays[10] is not None and arrays[10].shape == (2, ints[8])):
        raise ValueError(f"Program: paged decode call {c}: planes {ints[9]}, {ints[10]} or {ints[8]} rows "
                         "do not fit its page and block tables")
    if kind == KIND_DECODE_TOKEN and not (
            len(ints) > 14 and ints[12] in (0, 1) and ints[13] in (0, 1, 2) and (ints[12] == 0 or ints[13] != 0)
            and all(arrays[j].itemsize == (2 if ints[12] else 4) for j in (0, 1, 2, 9))
            and all(arrays[j].itemsize == (4 if ints[13] == 0 else 2) for j in (5, 6, 11))):
        raise ValueError(f"Program: decode call {c}: token and cache types {ints[12:14]} are not its arrays'")
    if kind == KIND_DECODE_PAGED and not (
            len(ints) > 18 and ints[17] in (0, 1) and ints[18] in (0, 1, 2) and (ints[17] == 0 or ints[18] != 0)
            and all(arrays[j].itemsize == (2 if ints[17] else 4) for j in (0, 1, 2, 9))):
        raise ValueError(f"Program: paged decode call {c}: token and page types {ints[17:19]} are not its "
                         "arrays' or the pool's")
    if kind in (KIND_MASKED_DECODE, KIND_NONPAD_DECODE) and not (
            len(ints) > 12 and ints[9] in (0, 1, 2) and ints[11] in (0, 1) and ints[12] in (0, 1)
            and arrays[3].itemsize == (4, 1, 2)[ints[9]]
            and all(arrays[j].itemsize == (2 if ints[11] else 4) for j in (0, 4))
            and all(arrays[j].itemsize == (2 if ints[12] else 4) for j in (1, 2))):
        raise ValueError(f"Program: masked decode call {c}: mask, token and cache types {ints[9:13]} are not "
                         "its arrays'")
    if kind == KIND_CONVERT and not (
            len(ints) == 2 and ints[1] in (0, 1, 2) and arrays[0].size == arrays[1].size == ints[0]
            and (arrays[0].itemsize, arrays[1].itemsize) == ((2, 4), (4, 2), (4, 4))[ints[1]]):
        raise ValueError(f"Program: conversion call {c}: ints {list(ints)} do not describe its arrays")
    if kind == KIND_GATHER_ROWS and not (len(ints) == 4 and ints[3] in (0, 1)):
        raise ValueError(f"Program: gather call {c}: ints {list(ints)} are not (N, D, m, wrap 0 or 1)")
    if kind in (KIND_CACHE_ROWS, KIND_SCATTER_ROWS) and not (
            len(ints) > 5 and ints[5] in (2, 4) and arrays[0].itemsize == arrays[1].itemsize == ints[5]
            and (kind == KIND_CACHE_ROWS or arrays[3].itemsize == ints[5])):
        raise ValueError(f"Program: cache-row call {c}: element bytes {ints[5:6]} are not its arrays' "
                         "(2 or 4)")
    if kind == KIND_ACTIVATION and not (
            len(ints) == 2 and 0 <= ints[0] <= 7 and arrays[0].size == arrays[2].size == ints[1]
            and (arrays[1] is None) == (ints[0] < 2)
            and (arrays[1] is None or arrays[1].size == (1 if ints[0] >= 5 else ints[1]))
            and all(a is None or a.itemsize == 4 for a in arrays)):
        raise ValueError(f"Program: activation call {c}: ints {list(ints)} do not describe its arrays")
    if kind == KIND_CONCAT and not (
            len(ints) == 3 and ints[0] >= 1 and ints[1] >= 0 and ints[2] >= 0
            and all((arrays[j] is None) == (ints[j + 1] == 0) for j in (0, 1))
            and all(arrays[j] is None or arrays[j].nbytes == ints[0] * ints[j + 1] for j in (0, 1))
            and arrays[2].nbytes == ints[0] * (ints[1] + ints[2])):
        raise ValueError(f"Program: concatenation call {c}: ints {list(ints)} do not describe its arrays")
    if kind == KIND_COPY_ROWS and not (
            len(ints) == 3 and ints[0] >= 1 and ints[2] >= ints[1] >= 1
            and arrays[0].nbytes == (ints[0] - 1) * ints[2] + ints[1] and arrays[1].nbytes == ints[0] * ints[1]):
        raise ValueError(f"Program: row-copy call {c}: ints {list(ints)} do not describe its arrays")
    if kind == KIND_PAGE_ROWS and not (
            len(ints) > 15 and ints[6] in (0, 1) and ints[7] in (0, 1, 2) and (ints[6] == 0 or ints[7] != 0)
            and min(ints[:5]) >= 1 and arrays[0].shape == tuple(ints[:4])
            and arrays[0].itemsize == (2 if ints[6] else 4) and arrays[1].ndim == 2 and arrays[2].ndim == 2
            and 0 <= ints[5] < arrays[1].shape[0] and arrays[2].shape[0] == ints[0]
            and _ints(arrays[3], 8, (2, ints[0])) and _ints(arrays[4], 4, (ints[0],))):
        raise ValueError(f"Program: page-row call {c}: ints {list(ints)} do not describe its arrays and tables")
    if kind == KIND_MASKED_PAGED and not (
            len(ints) > 15 and ints[9] in (0, 1, 2) and ints[11] in (0, 1) and ints[12] in (0, 1, 2)
            and (ints[11] == 0 or ints[12] != 0) and min(ints[:5]) >= 1 and ints[1] % ints[2] == 0
            and ints[13] in (0, 1) and arrays[0].shape == arrays[4].shape == (ints[0], ints[1], 1, ints[3])
            and (arrays[1] is None) == (arrays[2] is None)
            and (arrays[1] is None or arrays[1].shape == arrays[2].shape == (ints[0], ints[2], 1, ints[3]))
            and all(a is None or a.itemsize == (2 if ints[11] else 4) for a in arrays[:3] + arrays[4:5])
            and arrays[3].ndim == 4 and arrays[3].shape[:3] == (ints[7], 1, 1) and ints[7] in (1, ints[0])
            and arrays[3].itemsize == (4, 1, 2)[ints[9]] and arrays[5].ndim == 2 and arrays[6].ndim == 2
            and 0 <= ints[5] < arrays[5].shape[0] and 0 <= ints[6] < arrays[5].shape[0]
            and arrays[6].shape[0] == ints[0] and _ints(arrays[7], 8, (2, ints[0]))
            and all(_ints(arrays[j], 4, (ints[0],)) for j in (8, 9, 10))):
        raise ValueError(f"Program: paged masked call {c}: ints {list(ints)} do not describe its arrays and tables")


#: (kind) -> the operand positions of its page addresses and block tables, and of its block size int.
_PAGE_TABLES = {KIND_DECODE_PAGED: (5, 6), KIND_PAGE_ROWS: (1, 2), KIND_MASKED_PAGED: (5, 6)}
_BLOCK = {KIND_DECODE_PAGED: 3, KIND_PAGE_ROWS: 4, KIND_MASKED_PAGED: 4}


def _page_tables_ok(arrays, positions, block_size) -> bool:
    """Whether a paged call's page addresses are uint64 [planes, P] and its block tables int32 [B, M] (as the
    replay reads them), and its block size is in [1, 2**31 - 1] (page positions then stay far from int64's
    range)."""
    addresses, tables = arrays[positions[0]], arrays[positions[1]]
    return (addresses is not None and tables is not None and addresses.dtype == np.uint64 and addresses.ndim == 2
            and tables.dtype == np.int32 and tables.ndim == 2 and 1 <= block_size <= INT32_MAX)
