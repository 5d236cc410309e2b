// echo: answers each request of the ring with a copy of it; beats every
// MESH_BEAT_EVERY ns; returns when halted.
//
// One warp serves the ring with the header's warp-wide helpers: it polls the
// request head in a tight loop, reads every pending entry at once (a word per
// lane, all in flight together: each load of host memory crosses PCIe, ~1 us,
// and a byte-by-byte copy by one thread cost ~1 us a byte), writes the responses
// and publishes them with one fence and one RESP_HEAD.  A request over 188 bytes lies in the
// program's payload region (its manifest's max_request): echo answers it in place, with a response
// entry that names the request's own bytes there (its length and offset), nothing copied.
#include "mesh_program.h"

MESH_DEFINE_RT_ABI();

MESH_MAIN {
    if (blockIdx.x != 0 || threadIdx.x >= 32)
        return;
    mesh_slot_t s = mesh_slot(mailbox, slot);
    mesh_ring_t r;
    mesh_ring_init(s, &r, MESH_BEAT_EVERY);
    if (threadIdx.x == 0)
        mesh_set_state(s, MESH_RUNNING);
    unsigned int n;
    while ((n = mesh_ring_wait(&r)) != 0) {
        mesh_entry_t e[MESH_RING];
#pragma unroll
        for (unsigned int k = 0; k < MESH_RING; k++)
            if (k < n)
                e[k] = mesh_ring_load(&r, r.next + k);
#pragma unroll
        for (unsigned int k = 0; k < MESH_RING; k++)
            if (k < n) {
                const unsigned int size = mesh_entry_size(e[k]);
                if (size <= MESH_ENTRY_PAYLOAD)
                    mesh_ring_store(&r, r.next + k, e[k], size);
                else /* in its payload region: answered in place, the response names the request's own bytes */
                    mesh_ring_store_region(&r, r.next + k, size, mesh_entry_offset(e[k]));
            }
        mesh_ring_post(&r, n);
    }
    if (threadIdx.x == 0)
        mesh_set_state(s, MESH_EXITED);
}
