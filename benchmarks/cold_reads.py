"""Cold adapter reads at once (issue 10): does reading several cold files side by side help or hurt
each read's latency on this disk?

A cold TTFT waits for its adapter's file read. Under many adapters several loads run at once
(`--max-loading-workers`, default 4), so reads of cold files share the disk. This script writes
``--files`` files of ``--mb`` MB (the many-adapters trace's median cold adapter is 6.8 MB at
Llama-3.1-8B shapes), then, for each concurrency c of ``--concurrency``, drops them from the page
cache and reads them all with c threads through loramux's own read path
(`loramux.registry.weights_io.read_and_hash`: read into a host buffer, hashed on the way, the
digest awaited), all threads starting together. Reported per c: each read's latency (p50, p99),
the last read's completion (the batch's makespan) and the aggregate bandwidth. With equal reads,
c = 1 finishes the k-th read at k x t, c = n shares the disk so every read ends near n x t' (t'
the time of one read at n-way sharing): one at a time wins on mean latency unless the disk
reads faster in parallel.

    PYTHONPATH=. python benchmarks/cold_reads.py [--files 16 --mb 6.8 --concurrency 1,2,4,8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import drop_from_page_cache, filesystem_of  # noqa: E402
from loramux.registry.host_memory import PAGEABLE  # noqa: E402
from loramux.registry.weights_io import read_and_hash  # noqa: E402


def read_all(paths: list[Path], concurrency: int) -> tuple[list[float], float]:
    """(each read's seconds from the common start, makespan) reading ``paths`` with
    ``concurrency`` threads taking files in order, all starting together."""
    pending = list(reversed(paths))
    lock = threading.Lock()
    done: list[float] = []
    barrier = threading.Barrier(concurrency + 1)
    start = 0.0

    def worker() -> None:
        barrier.wait()
        while True:
            with lock:
                if not pending:
                    return
                path = pending.pop()
            _, digest = read_and_hash(path, PAGEABLE.allocate)
            digest()
            with lock:
                done.append(time.perf_counter() - start)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    barrier.wait()
    for thread in threads:
        thread.join()
    return done, time.perf_counter() - start


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--mb", type=float, default=6.8, help="each file's size, MB")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of every concurrency, interleaved")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.files < 1 or args.mb <= 0:
        ap.error("--files and --mb must be positive")
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        size = int(args.mb * 1e6)
        paths = []
        for i in range(args.files):
            path = Path(tmp) / f"adapter{i}.safetensors"
            path.write_bytes(os.urandom(size))
            paths.append(path)
        rows: dict[int, list[dict]] = {c: [] for c in levels}
        for _ in range(args.repeats):
            for c in levels:
                drop_from_page_cache(*paths)
                done, makespan = read_all(paths, c)
                rows[c].append(dict(p50_ms=1e3 * statistics.median(done), mean_ms=1e3 * statistics.fmean(done),
                                    p99_ms=1e3 * max(done), makespan_ms=1e3 * makespan,
                                    GBps=size * len(paths) / makespan / 1e9))
    result = dict(files=args.files, bytes_each=size, rounds={str(c): r for c, r in rows.items()},
                  filesystem=filesystem_of(Path(args.dir or tempfile.gettempdir())))
    print(f"{args.files} files of {args.mb} MB, read cold with c threads (median of {args.repeats} rounds):")
    print("  c | read done p50 | mean | last (makespan) | GB/s")
    for c, r in rows.items():
        med = {k: statistics.median(x[k] for x in r) for k in r[0]}
        result.setdefault("median", {})[str(c)] = med
        print(f"  {c} | {med['p50_ms']:.1f} ms | {med['mean_ms']:.1f} ms | {med['makespan_ms']:.1f} ms | "
              f"{med['GBps']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
