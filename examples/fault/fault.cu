// fault: writes to address 0x10, an illegal address.  The launch ends with
// CUDA_ERROR_ILLEGAL_ADDRESS, which is sticky: the worker's context is lost
// (and under MPS every client of the server with it).
#include "mesh_program.h"

MESH_DEFINE_RT_ABI();

MESH_MAIN {
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    mesh_slot_t s = mesh_slot(mailbox, slot);
    mesh_set_state(s, MESH_RUNNING);
    *(volatile unsigned int *)0x10ull = 0xdeadu;
    mesh_set_state(s, MESH_EXITED); // may still be written: the faulting store is posted
}
