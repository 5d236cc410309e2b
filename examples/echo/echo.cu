// echo: answers each request of the ring with a copy of it; beats while idle;
// returns when halted.
#include "mesh_program.h"

MESH_DEFINE_RT_ABI();

MESH_MAIN {
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    mesh_slot_t s = mesh_slot(mailbox, slot);
    mesh_beat_t b;
    mesh_beat_init(s, &b);
    mesh_set_state(s, MESH_RUNNING);
    while (!mesh_halted(s)) {
        unsigned seq, len;
        if (mesh_take(s, &seq)) {
            const volatile unsigned char *req = mesh_request(s, seq, &len);
            volatile unsigned char *resp = mesh_response(s, seq);
            for (unsigned i = 0; i < len; i++)
                resp[i] = req[i];
            mesh_post(s, seq, len);
        }
        mesh_beat(s, &b);
    }
    mesh_set_state(s, MESH_EXITED);
}
