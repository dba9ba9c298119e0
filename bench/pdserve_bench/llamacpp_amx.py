"""Whether llama.cpp peers may repack the GGUF's weights on this CPU.

llama.cpp repacks Q4_0/Q4_1/Q8_0 weights into its AMX buffer where the CPU has AMX-INT8
(its "extra buffer types"). On the 2-core Sapphire Rapids class machines here, llama.cpp
of llama-cpp-python 0.3.36 then segfaults in the first batch of more than one token (a
1-token batch runs): the same crash as ggml-org/llama.cpp#20824 (segfault in
ggml_backend_amx_mul_mat, machine-dependent, closed unfixed), and #16315 reports wrong
results from that path for Q4_0/Q4_1. So on AMX machines the llama.cpp peers run with
repacking off (`use_extra_bufts=False` in the binding, `--no-repack` for llama-server):
llama.cpp's ordinary CPU path on AVX-512/VNNI, the path it takes on every other x86 CPU.
"""

from __future__ import annotations

from pdserve.model import cpu_isa

REPACK_OFF_REASON = (
    "llama.cpp weight repacking off: its AMX path segfaults on multi-token batches on this "
    "CPU (ggml-org/llama.cpp#20824)"
)


def repack_allowed() -> bool:
    """False where the CPU has AMX-INT8 (llama.cpp would repack into its AMX buffer)."""
    return "amx_int8" not in cpu_isa.cpu_flags()
