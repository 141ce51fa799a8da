"""Fast data lanes: block bytes off the gRPC path (DESIGN 4).

gRPC stays the control plane; ``KVStoreLanes.OpenLane`` negotiates a lane and
the bytes of Put and Get move on it. Every lane runs the same store verbs as
the gRPC service (``kvstore/server/validate.py`` for requests,
``BlockStore.begin_put/commit_put/abort_put`` for writes, ``acquire/
materialize/release`` for reads), so validation, checksums, leases and status
codes are the same whichever lane carried the bytes.

Handshake (``negotiate.py`` on the client, ``servicer.py`` on the server)::

    client                                   server
    OpenLane(kinds=[shm, tcp], host_id) ──▶  same host_id and shm enabled: create
                                             /dev/shm/kvstore-lane-<128 random bits>
                                             (O_EXCL, mode 0600; fallocated as grants reach it)
    ◀── kind, lane_id, token, host_id,       else tcp: token for the bulk listener
        shm_path+shm_bytes | tcp_port,
        lease_seconds
    shm: open + mmap the path (checks owner, mode, size); the server unlinks it
         at the first request on the lane, or when the lease runs out unused
    tcp: connect, send TcpHello(lane_id, token); wrong token: the socket closes
    any failure ──▶ the next kind, and at the end the gRPC Put/Get

shm, same user, where the kernel allows cross-memory attach: the client then
connects to the node's direct socket (``direct.py``: its pid from
SO_PEERCRED, the lane token, a nonce read back from its memory). After that
the store reads Put payloads straight from the client's memory
(process_vm_readv) and writes Gets into the caller's ``out`` buffers
(process_vm_writev): one copy per block in all. The socket stays open as the
lane's channel (``shm_channel``), carrying LaneGet and LanePut messages as
frames instead of gRPC calls (0.1 ms instead of 0.5-0.9 ms per call here).

Copies per side (payload bytes; the CRC32C is computed on the bytes while they
are still in cache, fused with the copy, never as a separate pass over memory):

    lane  op   client                                server
    shm   put  1: payload -> granted region offsets  1: region -> arena slot (from begin_put)
    shm   get  1: region -> caller's `out`           1: arena slot -> region
               0: no `out`: lent in place (shm_loans)
    tcp   put  0: sendmsg straight from the payloads 0: recv_into straight into the arena slot
    tcp   get  0: recv_into `out` or a new buffer    0: sendmsg straight from the arena slots
    (tcp: the kernel copies once into and once out of the socket buffers)
    A block given as ``Segments`` (several buffers: ``segments.py``) moves with the same copies: the
    direct shm lane passes every part's (address, length) and the store reads or writes them with one
    multi-iovec process_vm_readv/writev per piece of the arena slot; through the region each part is
    copied (and CRC'd, chained) into or out of its place in the granted range; tcp gathers the parts with
    sendmsg and receives into them with recvmsg_into. cuda_ipc joins a block's parts once first.
    cuda_ipc put  1: tensor -> region (d2d)     1: region -> HBM slot (d2d) or DRAM slot (d2h)
    cuda_ipc get  1: region -> `out` tensor     1: HBM slot (d2d) or DRAM slot (h2d) -> region

cuda_ipc is the shm lane's protocol over a region in device memory, exported
as a CUDA IPC handle (``cuda_region``, ``cuda_server``, ``cuda_client``); its
copies are issued on a side stream and waited for once per commit or per
LaneGet message. The client asks for it on its own when a call carries CUDA
tensors and the store shares its host and GPU; puts carry no client CRC (the
server computes it where the block lands), and device destinations are not
CRC-checked on the client (that would cost the device->host copy the lane
avoids). ``--cuda-lane-device cpu`` runs the same lane over host memory so
CI exercises it.

Why shm keeps a server-side copy: the arena holds every tenant's blocks, so no
client may map it; and a client keeps writing access to its region, so the
server checks the CRC of the bytes *after* they landed in the arena slot (a
client that scribbles on its region after committing cannot change a stored
block).

Leases and ownership: a shm put grant reserves store slots and region ranges
for ``lease_seconds``; whatever is not committed by then is aborted (the slot
returns to the arena, the block never becomes visible). A commit may only name
offsets and lengths the server granted, in a grant of the lane whose token it
carries: anything else is PERMISSION_DENIED and touches nothing. A put
stream that ends (a killed client's included) gives back its uncommitted
slots at once. Get grants (region ranges holding copies for the client) hold
no store resources (the store lease ends as soon as the copy is made) and end
when the client releases them on a later request, or with the lane. Idle
lanes close after ten leases.

Modules, by side (the two halves never import each other; an import-linter contract in pyproject.toml
keeps it so):

- shared, in ``kvstore/lanes/``: ``base`` (the Lane interface, LaneError, LaneBroken), ``framing`` (TCP and
  channel frames), ``buffers`` (pooled receive buffers), ``cma`` (cross-memory
  attach; fused copy+CRC is ``kvstore/memops.py``, beside the checksum), ``direct`` (the handshake that proves a client's pid), ``copypool`` (copies of a message over a few
  threads), ``shm_region``, ``cuda_region`` (the mapped regions both ends open).
- ``client/``: ``negotiate`` (lane selection and the pool a NodeClient uses), ``shm``, ``tcp``, ``cuda`` (each
  lane's client end), ``channel`` (the shm lane's frames on the handshake socket), ``loans`` (Get results lent
  in place).
- ``server/``: ``wiring`` (``LaneServer``, plugged into StoreServer), ``servicer`` (the KVStoreLanes gRPC
  service), ``registry`` (lanes, tokens, expiry), ``lane`` (``ServerLane``), ``access`` (tenants and quotas),
  ``storeops`` (the store verbs shared by every lane), ``grants`` (region ranges and grant leases), ``shm``,
  ``tcp``, ``cuda`` (each lane's server end), ``channel`` (the server's end of the shm channel).
"""
