"""Everything with I/O: the engine contract and lifecycle, the app-server client, the session
transcript mirror and thread binding, hooks, the turn orchestrator and compaction."""
