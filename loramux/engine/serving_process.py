"""What the engine sets for the whole process once it is ready to serve (the end of
`LLMEngine.__init__`): the GIL's switch interval and, on CUDA, a frozen garbage-collector heap.

Both are about the engine's thread sharing one interpreter with threads that run Python: adapter
loaders, the HTTP server's event loop. Each time the engine's thread gives the GIL up (a graph
replay, a copy, a wait on the GPU) and a thread running Python takes it, the engine's thread waits
for it until that thread is made to let go, after the *switch interval*: 5 ms by default, for a
step of ~10 ms. On an H100 (``benchmarks/host_contention.py``, ``python``) four such threads made
the median step 355 ms instead of 3.6 ms. On the CPU (``benchmarks/loader_gil.py``) a step of 20
such calls (7 ms alone) took 116 ms beside one such thread at 5 ms, 20 ms at 0.5 ms, 15 ms at
0.2 ms; beside four, 416 ms and 70 ms at 0.5 ms; the busy threads lost 4-7% of their throughput.
So the engine lowers it to `SERVING_SWITCH_INTERVAL_S` (a lower one set by the user stays).

The cyclic garbage collector runs in whichever thread allocates when its counters say so, holding
the GIL for as long as it walks the heap: a full collection walks every object of the model,
transformers and the compiled graphs (~150-200 ms a collection on the CPU among 400,000 objects,
started by loader threads every hundred loads or so). ``gc.freeze()`` moves what exists at start
out of the collector's sight, so a collection walks only what came after (adapters, requests):
beside four loader threads that step's p99 went from 229 ms to 38 ms. Done on CUDA only (a CPU
engine does not serve at that scale, and the test suite builds hundreds), after unfreezing what
an earlier engine froze, so its garbage is collected again; closing an engine unfreezes it too.
"""

from __future__ import annotations

import atexit
import gc
import sys

__all__ = ["SERVING_SWITCH_INTERVAL_S", "prepare_process_for_serving", "release_frozen_heap"]

#: The GIL switch interval while serving (Python's default: 0.005 s).
SERVING_SWITCH_INTERVAL_S = 0.0005

_unfreeze_registered = False


def prepare_process_for_serving(*, freeze_gc: bool) -> None:
    """Lower the switch interval to `SERVING_SWITCH_INTERVAL_S` (unless it is lower already) and,
    with ``freeze_gc``, collect and freeze the garbage collector's heap (see the module docstring)."""
    global _unfreeze_registered
    if sys.getswitchinterval() > SERVING_SWITCH_INTERVAL_S:
        sys.setswitchinterval(SERVING_SWITCH_INTERVAL_S)
    if freeze_gc:
        gc.unfreeze()  # what an earlier engine froze, and may have dropped since, is collected again
        gc.collect()
        gc.freeze()
        if not _unfreeze_registered:  # at exit, frozen objects are freed like the others
            atexit.register(gc.unfreeze)
            _unfreeze_registered = True


def release_frozen_heap() -> None:
    """An engine closed: unfreeze the heap, so that what it leaves in reference cycles (frozen
    objects are never collected) is collected with the rest; the next engine freezes it again."""
    gc.unfreeze()
