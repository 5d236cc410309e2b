// heartbeat: one thread beats until meshd-mps writes CONTROL = HALT.
// STATE goes RUNNING at the start and EXITED just before the kernel returns.
#include "mesh_program.h"

MESH_DEFINE_RT_ABI();

MESH_MAIN {
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    mesh_slot_t s = mesh_slot(mailbox, slot);
    mesh_beat_t b;
    mesh_beat_init(s, &b);
    mesh_set_state(s, MESH_RUNNING);
    while (!mesh_halted(s))
        mesh_beat(s, &b);
    mesh_set_state(s, MESH_EXITED);
}
