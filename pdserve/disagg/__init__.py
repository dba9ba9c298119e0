"""Prefill/decode disaggregation. Each module's first docstring line says which process
it runs in:

    launcher        config.py          role, failure policy, transport: KVTransferConfig
    API process     handoff.py         prefill: the handoff table
                    handoff_service.py prefill: that table's sweep, and freeing via the engine
    engine process  connectors.py      the prefill and decode KV connectors
                    control.py         decode: the client of /kv/*
                    transport.py       the data plane (and its in-process fake)
                    nixl_transport.py  NIXL over UCX
    both, the wire  messages.py        the /kv/* bodies, Outcome, ReleaseReason, handshake
                    params.py          kv_transfer_params, RemoteDecode/RemotePrefill, KVLayout

The prefill node's `/kv/*` routes are endpoints of its API process:
`pdserve/api/disagg_routes.py`.
"""
