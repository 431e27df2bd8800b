"""What the engine sets for the whole process once it is ready to serve (the end of
`LLMEngine.__init__`): the GIL's switch interval and, on CUDA, a frozen garbage-collector heap.

Both are about the engine's thread sharing one interpreter with threads that run Python: adapter
loaders, the HTTP server's event loop. Each time the engine's thread gives the GIL up (a graph
replay, a copy, a wait on the GPU) and a thread running Python takes it, the engine's thread waits
for it until that thread is made to let go, after the *switch interval*: 5 ms by default, half a
decode step. A step makes tens of such calls, so beside busy threads its time is mostly waits.
So the engine lowers it to `SERVING_SWITCH_INTERVAL_S` (a lower one set by the user stays): the
waits shrink tenfold, and the busy threads lose little of their throughput to the extra switches.

The cyclic garbage collector runs in whichever thread allocates when its counters say so, holding
the GIL for as long as it walks the heap: a full collection walks every object of the model,
transformers and the compiled graphs (hundreds of thousands of objects, a pause of many steps'
length, started by loader threads every hundred loads or so). ``gc.freeze()`` moves what exists
at start out of the collector's sight, so a collection walks only what came after (adapters,
requests), and the tail of the step time stays short. Done on CUDA only (a CPU
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
