/* mesh_program.h: program ABI v1 of meshd-mps, the device side (docs/program-abi.md).
 *
 * A program is one CUDA C file compiled to PTX; meshd-mps JITs it for the GPU
 * and launches its entry point as a resident kernel:
 *
 *     #include "mesh_program.h"
 *     MESH_DEFINE_RT_ABI();
 *     MESH_MAIN {                // extern "C" __global__ void mesh_main(unsigned long long mailbox, unsigned slot)
 *         mesh_slot_t s = mesh_slot(mailbox, slot);
 *         ...
 *     }
 *
 * The mailbox is host memory mapped into the GPU: a program and meshd-mps talk
 * through plain loads and stores to it, so every access here is volatile and
 * ordered with __threadfence_system().  The offsets below are the same as
 * meshd_mps/abi.py; every word is little-endian and naturally aligned.
 */
#ifndef MESH_PROGRAM_H
#define MESH_PROGRAM_H

/* ---- the ABI version and the entry point --------------------------------------------------- */

#define MESH_RT_ABI 1u

/* Defines the u32 global `mesh_rt_abi` that meshd-mps reads after loading the
 * module; a module without it (or with another value) is refused. */
#define MESH_DEFINE_RT_ABI() extern "C" __device__ unsigned int mesh_rt_abi = MESH_RT_ABI

/* Defines the u64 global `mesh_scratch`: meshd-mps writes there the device
 * address of the manifest's `scratch` bytes (zeroed) before the first launch. */
#define MESH_DEFINE_SCRATCH() extern "C" __device__ unsigned long long mesh_scratch = 0

/* The entry point: one launch of `nodes` blocks of 32 * warps threads. */
#define MESH_MAIN extern "C" __global__ void mesh_main(unsigned long long mailbox, unsigned int slot)

/* ---- the mailbox ---------------------------------------------------------------------------- */

#define MESH_SLOT_BYTES 4096u
#define MESH_SLOTS 256u

/* Offsets into one slot. */
#define MESH_CONTROL 0u     /* u32, host writes: MESH_RUN or MESH_HALT */
#define MESH_STATE 4u       /* u32, program writes: MESH_IDLE, MESH_RUNNING, MESH_EXITED */
#define MESH_HEARTBEAT 8u   /* u64, program increments */
#define MESH_BEAT_TIME 16u  /* u64, program writes %globaltimer (ns) at each beat */
#define MESH_MAX_GAP 24u    /* u64, program writes the largest gap between beats (ns) since the last reset */
#define MESH_GAP_RESET 32u  /* u32, host writes 1; the program zeroes MAX_GAP and this word */
#define MESH_REQ_HEAD 64u   /* u32, host increments after writing a request */
#define MESH_RESP_HEAD 68u  /* u32, program increments after writing the response to request RESP_HEAD */
#define MESH_RING 8u        /* entries in each ring */
#define MESH_ENTRY_BYTES 192u /* u32 length + up to 188 payload bytes */
#define MESH_ENTRY_PAYLOAD (MESH_ENTRY_BYTES - 4u)
#define MESH_REQ_BASE 128u
#define MESH_RESP_BASE (MESH_REQ_BASE + MESH_RING * MESH_ENTRY_BYTES)  /* 1664 */
#define MESH_USER_BASE (MESH_RESP_BASE + MESH_RING * MESH_ENTRY_BYTES) /* 3200: free for the program */

#define MESH_RUN 0u
#define MESH_HALT 1u
#define MESH_IDLE 0u
#define MESH_RUNNING 1u
#define MESH_EXITED 2u

typedef volatile unsigned char *mesh_slot_t;

/* The program's slot of the mailbox. */
static __device__ __forceinline__ mesh_slot_t mesh_slot(unsigned long long mailbox, unsigned int slot) {
    return (mesh_slot_t)(mailbox + (unsigned long long)slot * MESH_SLOT_BYTES);
}
static __device__ __forceinline__ volatile unsigned int *mesh_u32(mesh_slot_t s, unsigned int off) {
    return (volatile unsigned int *)(s + off);
}
static __device__ __forceinline__ volatile unsigned long long *mesh_u64(mesh_slot_t s, unsigned int off) {
    return (volatile unsigned long long *)(s + off);
}

/* The GPU's global nanosecond clock. */
static __device__ __forceinline__ unsigned long long mesh_now(void) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* True once meshd-mps asked the program to stop.  A resident program polls this
 * and returns promptly (well under a millisecond): blink mode reloads only after
 * every program of the context has returned. */
static __device__ __forceinline__ bool mesh_halted(mesh_slot_t s) {
    return *mesh_u32(s, MESH_CONTROL) == MESH_HALT;
}

/* STATE, made visible to the host before anything the program writes after it. */
static __device__ __forceinline__ void mesh_set_state(mesh_slot_t s, unsigned int state) {
    *mesh_u32(s, MESH_STATE) = state;
    __threadfence_system();
}

/* ---- the heartbeat -------------------------------------------------------------------------- */

/* A beater's own copy of what it publishes (one thread beats). */
typedef struct {
    unsigned long long n;    /* beats so far (continues the slot's HEARTBEAT) */
    unsigned long long last; /* %globaltimer at the last beat */
    unsigned long long gap;  /* largest gap since the last reset */
} mesh_beat_t;

static __device__ __forceinline__ void mesh_beat_init(mesh_slot_t s, mesh_beat_t *b) {
    b->n = *mesh_u64(s, MESH_HEARTBEAT);
    b->last = mesh_now();
    b->gap = 0;
}

/* One beat: HEARTBEAT + 1, BEAT_TIME now, MAX_GAP the largest gap since the
 * host last wrote GAP_RESET = 1 (which this zeroes). */
static __device__ __forceinline__ void mesh_beat(mesh_slot_t s, mesh_beat_t *b) {
    unsigned long long t = mesh_now();
    if (*mesh_u32(s, MESH_GAP_RESET)) {
        b->gap = 0;
        *mesh_u32(s, MESH_GAP_RESET) = 0;
    } else if (t - b->last > b->gap) {
        b->gap = t - b->last;
    }
    b->last = t;
    *mesh_u64(s, MESH_MAX_GAP) = b->gap;
    *mesh_u64(s, MESH_BEAT_TIME) = t;
    *mesh_u64(s, MESH_HEARTBEAT) = ++b->n;
    __threadfence_system();
}

/* ---- the request ring ----------------------------------------------------------------------- */
/* Requests seq = RESP_HEAD .. REQ_HEAD-1 are pending; request seq sits in entry
 * seq % RING of the request ring, its response goes to entry seq % RING of the
 * response ring.  An entry is a u32 length and the payload.  The host publishes
 * a request by incrementing REQ_HEAD after writing it; the program publishes a
 * response by incrementing RESP_HEAD after writing it.  Serve them in order. */

/* The next pending request's sequence number in *seq; false if none is pending. */
static __device__ __forceinline__ bool mesh_take(mesh_slot_t s, unsigned int *seq) {
    unsigned int head = *mesh_u32(s, MESH_REQ_HEAD);
    unsigned int next = *mesh_u32(s, MESH_RESP_HEAD);
    if (head == next)
        return false;
    __threadfence_system(); /* the entry is read after the head that published it */
    *seq = next;
    return true;
}

/* Request seq's payload, and its length (clamped to MESH_ENTRY_PAYLOAD) in *len. */
static __device__ __forceinline__ const volatile unsigned char *mesh_request(mesh_slot_t s, unsigned int seq, unsigned int *len) {
    mesh_slot_t e = s + MESH_REQ_BASE + (seq % MESH_RING) * MESH_ENTRY_BYTES;
    unsigned int n = *(volatile unsigned int *)e;
    *len = n < MESH_ENTRY_PAYLOAD ? n : MESH_ENTRY_PAYLOAD;
    return e + 4;
}

/* Where request seq's response payload goes (MESH_ENTRY_PAYLOAD bytes at most). */
static __device__ __forceinline__ volatile unsigned char *mesh_response(mesh_slot_t s, unsigned int seq) {
    return s + MESH_RESP_BASE + (seq % MESH_RING) * MESH_ENTRY_BYTES + 4;
}

/* Publish the response to request seq, of len bytes written at mesh_response(s, seq). */
static __device__ __forceinline__ void mesh_post(mesh_slot_t s, unsigned int seq, unsigned int len) {
    mesh_slot_t e = s + MESH_RESP_BASE + (seq % MESH_RING) * MESH_ENTRY_BYTES;
    *(volatile unsigned int *)e = len < MESH_ENTRY_PAYLOAD ? len : MESH_ENTRY_PAYLOAD;
    __threadfence_system(); /* the payload and length before the head */
    *mesh_u32(s, MESH_RESP_HEAD) = seq + 1u;
    __threadfence_system();
}

#endif /* MESH_PROGRAM_H */
