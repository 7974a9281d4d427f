"""How long a flash-diff launch takes in the order the GPU starts its programs, against longest first.

    python benchmarks/launch_order.py

Under causal masking the programs of a launch have unequal work: a query block (forward, dQ) sees the keys up to its
last query, a key block (dK/dV) is seen by the queries from its first key on. The GPU starts programs in the order
of their ids, grid axis 0 fastest. A list-scheduling model of that: each free slot (programs resident at once) takes
the next program; a program's time is the tiles it walks. Rows: the makespan over the ideal (total work / slots)
with the block on the grid's fast axis (the kernels before 8d69d20) and on the slow axis (since: longest first), for
V1's ~1.1B shapes (16 heads over 4 kv heads). No GPU needed; benchmarks/RESULTS.md quotes the table.
"""

import heapq


def makespan(works: list[int], slots: int) -> int:
    """The end of the last program when `slots` run at once and each free slot takes the next of `works`."""
    ends = [0] * slots
    for work in works:
        heapq.heappush(ends, heapq.heappop(ends) + work)
    return max(ends)


def started_order(block_works: list[int], rows: int, block_fast: bool) -> list[int]:
    """The works of a (rows x blocks) launch in the order the GPU starts them: with `block_fast` each row's blocks
    one after another (the block on axis 0), else every row's first block, then every row's second, ..."""
    if block_fast:
        return [work for _ in range(rows) for work in block_works]
    return [work for work in block_works for _ in range(rows)]


def query_block_works(length: int, block_m: int, block_n: int) -> list[int]:
    """Key tiles each query block walks, last block first (the kernels' order within a head)."""
    return [(m * block_m + block_m + block_n - 1) // block_n for m in reversed(range(length // block_m))]


def key_block_works(length: int, block_n: int, block_m: int, heads: int) -> list[int]:
    """Query tiles each key block walks over `heads` query heads, first block first."""
    return [heads * ((length - n * block_n + block_m - 1) // block_m) for n in range(length // block_n)]


# (launch, tokens as (batch, length), rows of the grid, the blocks' works, slots)
HEADS, KV_HEADS = 16, 4
CASES = [
    ("dK/dV, whole groups", (4, 2048), 4 * KV_HEADS, key_block_works(2048, 64, 32, HEADS // KV_HEADS), 264),
    ("dK/dV, one head a program", (1, 8192), HEADS, key_block_works(8192, 64, 32, 1), 264),
    ("dK/dV, whole groups", (1, 8192), KV_HEADS, key_block_works(8192, 64, 32, HEADS // KV_HEADS), 264),
    ("dK/dV, whole groups", (1, 32768), KV_HEADS, key_block_works(32768, 64, 32, HEADS // KV_HEADS), 264),
    ("forward, 128-query blocks", (4, 2048), 4 * HEADS, query_block_works(2048, 128, 64), 264),
    ("forward, 128-query blocks", (4, 2048), 4 * HEADS, query_block_works(2048, 128, 64), 132),
    ("forward, 128-query blocks", (1, 8192), HEADS, query_block_works(8192, 128, 64), 264),
    ("forward, 128-query blocks", (1, 32768), HEADS, query_block_works(32768, 128, 64), 132),
]


def main() -> None:
    print("| launch | batch x length | programs | slots | makespan / ideal, block on the fast axis | longest first |")
    print("|---|---|---|---|---|---|")
    for name, (batch, length), rows, works, slots in CASES:
        ideal = rows * sum(works) / slots
        ratios = [makespan(started_order(works, rows, fast), slots) / ideal for fast in (True, False)]
        print(f"| {name} | {batch} x {length} | {rows * len(works)} | {slots} | {ratios[0]:.2f} | {ratios[1]:.2f} |")


if __name__ == "__main__":
    main()
