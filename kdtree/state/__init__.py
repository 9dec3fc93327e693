"""The files on the state volume (KDTREE_STATE_DIR), one module each, named for what it holds:

- mode_file: `mode`, the desired verify mode (the sidecar writes it, every rank follows it);
- rank_records: `rank-<N>.json`, each tensor-parallel rank's record (the ranks write, the sidecar reads);
- heartbeat: the rank's thread that writes its record and follows the mode file;
- process_record: `server-process.json` and `server.log` (the server's entrypoint writes, the sidecar reads);
- restart_request: `restart-request.json` (the sidecar writes, the entrypoint acts on it);
- owed_modes: `owed-modes.json` (a group's leader: the mode each worker node it could not reach is owed);
- atomic: how each of them is written (atomically) and read (bounded, regular files only);
- pids: whether a record's writer is alive.

Importing it needs pydantic only (no torch, no sglang, no fastapi): the server, the sidecar and kdtreectl share it.
"""
