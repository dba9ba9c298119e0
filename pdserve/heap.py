"""Long-lived processes (the proxy, a node's API process, its engine process) freeze what
their start-up allocated, once, before serving.

CPython's cycle collector walks every tracked object on each full collection. What a
process builds at start (modules, the tokenizer, the app, the model's modules: ~200k
objects in the proxy) lives as long as the process and is never garbage, yet each full
collection walks it: ~90 ms in the proxy on an idle core, and 200-360 ms as the slowest
429s of `pdserve bench routing --workload overload` on a loaded 2-core machine, where the
proxy gets a third of a core. `gc.freeze()` moves those objects out of the collector's
reach; the same bench's slowest 429 then took 38-44 ms (AVX-512 + BF16 class, two runs
each way). A node's engine process holds more (~300k objects with the default model: a
full collection took 153 ms, a stalled decode step). Objects allocated later are collected
as before.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collect what start-up left behind, then exempt everything alive from later
    collections (call once, after start-up, before serving)."""
    gc.collect()
    gc.freeze()
