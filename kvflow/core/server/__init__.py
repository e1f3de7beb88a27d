"""The wire: a `KVFlowServer` process serving a `CacheEngine` to remote engines.

`protocol` types every message (msgspec, versioned), `server` answers them on a ZMQ
ROUTER socket, `client` is the engine-side `KVFlowClient`, `sharing`, `shm` and `ipc`
map the engine's KV tensors into the server (POSIX shared memory, CUDA IPC),
`addresses` reads the hosts of --host and of tcp:// endpoints (IPv6 in brackets), and
`cli` parses `kvflow server` and `kvflow status`.
"""
