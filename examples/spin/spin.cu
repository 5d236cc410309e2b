// spin: runs for N ms, N the u32 at USER_BASE of its slot (100 if 0), then
// returns; it beats meanwhile and returns early if halted.
#include "mesh_program.h"

MESH_DEFINE_RT_ABI();

MESH_MAIN {
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    mesh_slot_t s = mesh_slot(mailbox, slot);
    unsigned ms = *mesh_u32(s, MESH_USER_BASE);
    if (ms == 0)
        ms = 100;
    mesh_beat_t b;
    mesh_beat_init(s, &b);
    mesh_set_state(s, MESH_RUNNING);
    unsigned long long end = mesh_now() + (unsigned long long)ms * 1000000ull;
    while (mesh_now() < end && !mesh_halted(s))
        mesh_beat(s, &b);
    mesh_set_state(s, MESH_EXITED);
}
