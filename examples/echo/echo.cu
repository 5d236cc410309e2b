// echo: answers each request of the ring with a copy of it; beats while idle;
// returns when halted.
//
// Thread 0 watches the ring; the block's warp copies a request in 4-byte words,
// one word per thread.  The mailbox is host memory: each load crosses PCIe, and
// a byte-by-byte copy by one thread cost ~1 us a byte (a 64 B request ~70 us on
// the H200); the warp's loads go out together.
#include "mesh_program.h"

MESH_DEFINE_RT_ABI();

#define ECHO_IDLE 0u
#define ECHO_REQUEST 1u
#define ECHO_HALT 2u

MESH_MAIN {
    if (blockIdx.x != 0)
        return;
    mesh_slot_t s = mesh_slot(mailbox, slot);
    __shared__ unsigned int cmd, seq, len;
    mesh_beat_t b;
    if (threadIdx.x == 0) {
        mesh_beat_init(s, &b);
        mesh_set_state(s, MESH_RUNNING);
    }
    for (;;) {
        if (threadIdx.x == 0) {
            unsigned int q, n;
            if (mesh_halted(s)) {
                cmd = ECHO_HALT;
            } else if (mesh_take(s, &q)) {
                mesh_request(s, q, &n);
                seq = q;
                len = n;
                cmd = ECHO_REQUEST;
            } else {
                cmd = ECHO_IDLE;
            }
        }
        __syncthreads();
        const unsigned int c = cmd;
        if (c == ECHO_HALT)
            break;
        if (c == ECHO_REQUEST) {
            unsigned int n;
            const volatile unsigned int *req = (const volatile unsigned int *)mesh_request(s, seq, &n);
            volatile unsigned int *resp = (volatile unsigned int *)mesh_response(s, seq);
            for (unsigned int i = threadIdx.x; i < (len + 3u) / 4u; i += blockDim.x)
                resp[i] = req[i];  // entries are 4-byte aligned; whole words stay inside the entry
            __threadfence_system();  // this thread's words before thread 0 publishes them
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            if (c == ECHO_REQUEST)
                mesh_post(s, seq, len);
            mesh_beat(s, &b);
        }
    }
    if (threadIdx.x == 0)
        mesh_set_state(s, MESH_EXITED);
}
