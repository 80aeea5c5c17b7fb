"""Service discovery: TensorRT-LLM's `disagg_cluster` (workers that register themselves in a
cluster store and heart-beat; the coordinator watches) and its metadata server (`-m`).

| module | owns |
|---|---|
| `workers.py` | the key layout and the `WorkerInfo` value, byte for byte as upstream writes and reads them |
| `etcd_store.py` | etcd (`cluster_uri: etcd://...`): the coordinator's list + watch with resync, a worker's lease |
| `http_store.py` | the HTTP store the deployment serves itself (`cluster_uri: http://...`): routes, payloads, expiry |
| `registrar.py` | a worker's registration and heartbeat on either store (the simulator's `--disagg_cluster_uri`) |
| `metadata.py` | the older metadata-server form (`-m`, etcd keys `trtllm/*`): the poll and a worker's entry |

The coordinator applies what the stores say through `shmdisagg/coordinator/membership.py`.
Concurrency: everything here runs on one asyncio event loop (the coordinator's, or the
simulator's); no module starts a thread.
"""
