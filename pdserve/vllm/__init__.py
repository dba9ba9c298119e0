"""pdserve's handoff protocol inside vLLM: `PdserveConnector`, a KV connector that vLLM loads
by name, no fork (docs/vllm.md).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PdserveConnector",
        "kv_connector_module_path": "pdserve.vllm", "kv_role": "kv_producer"}'

vLLM's factory imports this package and reads `PdserveConnector` from it: that first read
checks, from the installed vLLM's source, that every vLLM name the connector touches is
still there (`versions.py`; what moved is named in a clear error) and imports the
connector, which loads only what it needs of pdserve: the handoff table, the control
messages and their client, never the engine or the server.
The protocol halves (`producer`, `consumer`, `control_server`, `signals`) import no vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PdserveConnector"]


def __getattr__(name: str) -> Any:
    if name != "PdserveConnector":
        raise AttributeError(f"module 'pdserve.vllm' has no attribute {name!r}")
    from pdserve.vllm.versions import check_vllm

    check_vllm()
    from pdserve.vllm.connector import PdserveConnector

    return PdserveConnector
