"""A P/D cluster placed, restarted and scaled by Ray (`pdserve ray up|scale|status`).

Optional: `pip install pdserve[ray]`; nothing here is imported without it.
`ray_nodes.py` has the actors, `ray_cli.py` the commands.
"""
