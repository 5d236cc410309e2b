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
#define MESH_SERVES 72u     /* u32, program writes MESH_SERVING when it polls the ring (mesh_take, mesh_ring_init) */
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
#define MESH_SERVING 1u /* SERVES: the ring is polled; meshd-mps refuses calls to a program whose slot lacks it */

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

/* One beat at time t: HEARTBEAT + 1, BEAT_TIME t, MAX_GAP the largest gap since
 * the host last wrote GAP_RESET = 1; `reset` is GAP_RESET as read (this zeroes it). */
static __device__ __forceinline__ void mesh_beat_at(mesh_slot_t s, mesh_beat_t *b, unsigned long long t, unsigned int reset) {
    if (reset) {
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

/* One beat now (a loop that beats every iteration, as heartbeat does). */
static __device__ __forceinline__ void mesh_beat(mesh_slot_t s, mesh_beat_t *b) {
    mesh_beat_at(s, b, mesh_now(), *mesh_u32(s, MESH_GAP_RESET));
}

/* ---- the request ring ----------------------------------------------------------------------- */
/* Requests seq = RESP_HEAD .. REQ_HEAD-1 are pending; request seq sits in entry
 * seq % RING of the request ring, its response goes to entry seq % RING of the
 * response ring.  An entry is a u32 length and the payload.  The host publishes
 * a request by incrementing REQ_HEAD after writing it; the program publishes a
 * response by incrementing RESP_HEAD after writing it.  Serve them in order.
 * The ring's helpers write SERVES = MESH_SERVING when they poll (mesh_take at each
 * call, mesh_ring_init once): meshd-mps refuses a call at once to a program whose
 * slot does not say so (zeroed at each launch), rather than post a request no one
 * reads.  Poll once before mesh_set_state(s, MESH_RUNNING) to be called from the start. */

/* The next pending request's sequence number in *seq; false if none is pending.
 * Marks the slot served (a posted store, not a round trip). */
static __device__ __forceinline__ bool mesh_take(mesh_slot_t s, unsigned int *seq) {
    *mesh_u32(s, MESH_SERVES) = MESH_SERVING;
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

/* ---- the request ring, served by one warp (section 6 of docs/program-abi.md) --------------- */
/* The fast path: a warp polls the request head in a tight loop and copies whole
 * entries a word per lane, so that a request costs little more than the bus does
 * (docs/benchmarks.md, row f, has it beside a bare poll-and-copy kernel).  Every
 * lane of one warp calls these together (converged); the warp's lane 0 writes the
 * heads and beats.  A warp holds its mesh_ring_t in registers. */

#define MESH_BEAT_EVERY 100000u /* ns: mesh_ring_wait's beat interval, unless the program picks another */
#define MESH_ENTRY_WORDS (MESH_ENTRY_BYTES / 4u) /* 48: an entry's length word and 47 payload words */
#define MESH_WARP 0xffffffffu

/* The ring's ordering.  From sm_70 on, the poll is an acquire load and RESP_HEAD a release
 * store: the entries are read after the head that published them, and written before the head
 * that publishes them, with no fence (a system-scope fence waits for every write in flight over
 * the bus).  MESH_RING_FENCES, or an older GPU, uses __threadfence_system() for both instead
 * (scripts/ring_variants.py measures the two). */
#if defined(MESH_RING_FENCES) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700)
#define MESH_RING_ACQREL 0
#else
#define MESH_RING_ACQREL 1
#endif

static __device__ __forceinline__ unsigned int mesh_load_acquire(const volatile unsigned int *p) {
#if MESH_RING_ACQREL
    unsigned int v;
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#else
    return *p;
#endif
}

static __device__ __forceinline__ void mesh_store_release(volatile unsigned int *p, unsigned int v) {
#if MESH_RING_ACQREL
    asm volatile("st.release.sys.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
#else
    *p = v;
#endif
}

typedef struct {
    mesh_slot_t s;
    unsigned int next;        /* the next request to serve: RESP_HEAD, which only the program writes */
    unsigned long long every; /* the beat interval, ns */
    unsigned long long due;   /* %globaltimer of the next beat */
    mesh_beat_t beat;         /* lane 0's */
} mesh_ring_t;

/* A ring entry in the warp's registers: lane i holds its words i and 32 + i
 * (word 0 is the length; lanes 16..31 hold no second word). */
typedef struct {
    unsigned int lo, hi;
} mesh_entry_t;

/* Warp-wide.  Continues the slot's ring (RESP_HEAD) and heartbeat, marks the slot
 * served (SERVES, made visible by the beat's fence: call it before saying RUNNING)
 * and beats once: a relaunched program serves what is pending.  `every`: the beat
 * interval in ns (MESH_BEAT_EVERY). */
static __device__ __forceinline__ void mesh_ring_init(mesh_slot_t s, mesh_ring_t *r, unsigned long long every) {
    r->s = s;
    r->next = *mesh_u32(s, MESH_RESP_HEAD);
    r->every = every;
    if ((threadIdx.x & 31u) == 0) {
        *mesh_u32(s, MESH_SERVES) = MESH_SERVING;
        mesh_beat_init(s, &r->beat);
        mesh_beat(s, &r->beat);
    }
    r->due = __shfl_sync(MESH_WARP, mesh_now(), 0) + every; /* one clock for the warp: its lanes agree */
}

/* Warp-wide: waits for requests and returns how many are pending (requests
 * r->next .. r->next + n - 1, at most MESH_RING), or 0 once CONTROL says HALT.
 * One poll is one read of the slot's first 128 bytes: lane 1 reads CONTROL, lane 2
 * GAP_RESET, the others REQ_HEAD, all in one round trip, so HALT is seen within a
 * poll.  It beats every r->every ns: while idle, or while busy once a beat is a
 * whole interval late (a program served without pause still beats). */
static __device__ __forceinline__ unsigned int mesh_ring_wait(mesh_ring_t *r) {
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int off = lane == 1u ? MESH_CONTROL : lane == 2u ? MESH_GAP_RESET : MESH_REQ_HEAD;
    for (;;) {
        const unsigned int v = mesh_load_acquire(mesh_u32(r->s, off));
        const unsigned int head = __shfl_sync(MESH_WARP, v, 0);
        const unsigned int control = __shfl_sync(MESH_WARP, v, 1);
        const unsigned int reset = __shfl_sync(MESH_WARP, v, 2);
        if (control == MESH_HALT)
            return 0;
        const unsigned long long t = __shfl_sync(MESH_WARP, mesh_now(), 0);
        if (t >= r->due && (head == r->next || t >= r->due + r->every)) {
            if (lane == 0)
                mesh_beat_at(r->s, &r->beat, t, reset);
            r->due = t + r->every;
        }
        if (head != r->next) {
#if !MESH_RING_ACQREL
            __threadfence_system(); /* the entries are read after the head that published them */
#endif
            __syncwarp(); /* every lane's entry loads after lane 0's acquire of the head */
            const unsigned int n = head - r->next;
            return n < MESH_RING ? n : MESH_RING;
        }
    }
}

/* Warp-wide: request seq's whole entry, both halves in flight at once (no wait
 * until a lane uses its words). */
static __device__ __forceinline__ mesh_entry_t mesh_ring_load(const mesh_ring_t *r, unsigned int seq) {
    const unsigned int lane = threadIdx.x & 31u;
    const volatile unsigned int *e =
        (const volatile unsigned int *)(r->s + MESH_REQ_BASE + (seq % MESH_RING) * MESH_ENTRY_BYTES);
    mesh_entry_t w;
    w.lo = e[lane];
    w.hi = lane + 32u < MESH_ENTRY_WORDS ? e[lane + 32u] : 0u;
    return w;
}

/* An entry's payload length, clamped to MESH_ENTRY_PAYLOAD, in every lane. */
static __device__ __forceinline__ unsigned int mesh_entry_len(mesh_entry_t w) {
    const unsigned int n = __shfl_sync(MESH_WARP, w.lo, 0);
    return n < MESH_ENTRY_PAYLOAD ? n : MESH_ENTRY_PAYLOAD;
}

/* Warp-wide: `w` (its payload words; word 0 is set to the length) written as the
 * response to request seq, `len` payload bytes: only the words that hold them.
 * Published by mesh_ring_post. */
static __device__ __forceinline__ void mesh_ring_store(const mesh_ring_t *r, unsigned int seq, mesh_entry_t w, unsigned int len) {
    const unsigned int lane = threadIdx.x & 31u;
    volatile unsigned int *e = (volatile unsigned int *)(r->s + MESH_RESP_BASE + (seq % MESH_RING) * MESH_ENTRY_BYTES);
    const unsigned int n = len < MESH_ENTRY_PAYLOAD ? len : MESH_ENTRY_PAYLOAD;
    const unsigned int words = 1u + (n + 3u) / 4u;
    if (lane == 0)
        w.lo = n;
    if (lane < words)
        e[lane] = w.lo;
    if (lane + 32u < words)
        e[lane + 32u] = w.hi;
}

/* Warp-wide: responses r->next .. r->next + n - 1 published.  Every lane's entry
 * words are ordered before RESP_HEAD by the warp barrier and lane 0's release
 * store (or one fence, MESH_RING_FENCES); nothing after the head needs ordering. */
static __device__ __forceinline__ void mesh_ring_post(mesh_ring_t *r, unsigned int n) {
#if !MESH_RING_ACQREL
    __threadfence_system();
#endif
    __syncwarp();
    r->next += n;
    if ((threadIdx.x & 31u) == 0)
        mesh_store_release(mesh_u32(r->s, MESH_RESP_HEAD), r->next);
}

/* ---- the program's data (section "Data" of docs/program-abi.md) ------------------------------ */
/* Device memory the program owns: loaded with it (`meshd-mps load DIR --data FILE`, or the
 * manifest's `data`/`data_bytes`), kept across its halts, relaunches and upgrades, and written by
 * the host while it runs (`meshd-mps write`).  The worker sets `mesh_data` and `mesh_data_bytes`
 * before each launch (0 and 0 without data).  The host adds 1 to the slot's DATA_SEQ once a
 * write's copy is complete on the device (zeroed at each launch): read it with mesh_data_seq(),
 * an acquire, before the data that a write may have changed, and compare it with the value you
 * last read, never with 0. */

#define MESH_DATA_SEQ 76u /* u32, host increments after each write to the program's data is complete */

/* Defines the u64 globals `mesh_data` (the data's device address) and `mesh_data_bytes` (its size). */
#define MESH_DEFINE_DATA()                                         \
    extern "C" __device__ unsigned long long mesh_data = 0;        \
    extern "C" __device__ unsigned long long mesh_data_bytes = 0

/* DATA_SEQ, as an acquire: the data read after it includes every write it counts. */
static __device__ __forceinline__ unsigned int mesh_data_seq(mesh_slot_t s) {
#if MESH_RING_ACQREL
    return mesh_load_acquire(mesh_u32(s, MESH_DATA_SEQ));
#else
    const unsigned int v = *mesh_u32(s, MESH_DATA_SEQ);
    __threadfence_system();
    return v;
#endif
}

/* ==== payloads of any size (docs/program-abi.md, section 6.2) ================================= */
/* A program whose manifest declares max_request or max_response over MESH_ENTRY_PAYLOAD (188 bytes)
 * has a payload region: host memory mapped into the GPU (as the mailbox is), with an area per ring
 * entry and direction.  A payload over 188 bytes lies there, and its ring entry holds its length
 * (word 0, over 188) and its offset in the region (word 1).  Request seq's area is at
 * (seq % MESH_RING) * REQUEST_STRIDE; its response's at MESH_RING * REQUEST_STRIDE + (seq % MESH_RING)
 * * RESPONSE_STRIDE.  meshd-mps writes the region's device address and layout into these slot words
 * before each launch, and rewrites an area only once its entry is free again: after the program has
 * answered its request (RESP_HEAD past it) and the host has read the answer.  So a request's bytes
 * stay as they are until the program answers it, and a response may name its own request's bytes (an
 * answer made in place, as echo's). */

#define MESH_PAYLOADS 96u         /* u64: the region's device address (0: the program has none) */
#define MESH_REQUEST_MAX 104u     /* u32: the most bytes a request may have (188 if none declared) */
#define MESH_RESPONSE_MAX 108u    /* u32: the most bytes a response may have */
#define MESH_REQUEST_STRIDE 112u  /* u32: bytes from one request area to the next (0: requests are inline) */
#define MESH_RESPONSE_STRIDE 116u /* u32: the same for the response areas */

typedef struct {
    unsigned char *base; /* the region's device address (0: none) */
    unsigned int request_max, response_max, request_stride, response_stride;
} mesh_payloads_t;

/* Any thread, once after the launch: the region's address and layout, from the slot. */
static __device__ __forceinline__ void mesh_payloads_init(mesh_slot_t s, mesh_payloads_t *p) {
    p->base = (unsigned char *)*mesh_u64(s, MESH_PAYLOADS);
    p->request_max = *mesh_u32(s, MESH_REQUEST_MAX);
    p->response_max = *mesh_u32(s, MESH_RESPONSE_MAX);
    p->request_stride = *mesh_u32(s, MESH_REQUEST_STRIDE);
    p->response_stride = *mesh_u32(s, MESH_RESPONSE_STRIDE);
}

/* An entry's payload length as it is, in every lane: over MESH_ENTRY_PAYLOAD, the payload lies in
 * the region (mesh_entry_len clamps it to the entry's). */
static __device__ __forceinline__ unsigned int mesh_entry_size(mesh_entry_t w) {
    return __shfl_sync(MESH_WARP, w.lo, 0);
}

/* A region payload's offset in the region (the entry's word 1), in every lane. */
static __device__ __forceinline__ unsigned int mesh_entry_offset(mesh_entry_t w) {
    return __shfl_sync(MESH_WARP, w.lo, 1);
}

/* Warp-wide: where request seq's bytes are (`w` its entry, from mesh_ring_load): its entry's payload
 * words in the mailbox, or its area of the region.  Read them after mesh_ring_wait (whose acquire
 * orders them after the head that published them) and past the L1 cache, which the host does not
 * keep coherent: volatile, or __ldcv (mesh_copy does). */
static __device__ __forceinline__ const volatile unsigned char *mesh_request_bytes(const mesh_ring_t *r,
                                                                                  const mesh_payloads_t *p,
                                                                                  unsigned int seq, mesh_entry_t w) {
    const unsigned int n = mesh_entry_size(w);
    if (n <= MESH_ENTRY_PAYLOAD)
        return r->s + MESH_REQ_BASE + (seq % MESH_RING) * MESH_ENTRY_BYTES + 4u;
    return p->base + mesh_entry_offset(w);
}

/* Where the response to request seq goes when it is over MESH_ENTRY_PAYLOAD bytes: its entry's
 * response area, p->response_max bytes. */
static __device__ __forceinline__ volatile unsigned char *mesh_response_area(const mesh_payloads_t *p, unsigned int seq) {
    return p->base + MESH_RING * p->request_stride + (seq % MESH_RING) * p->response_stride;
}

/* Warp-wide: the response to request seq is `len` bytes (over MESH_ENTRY_PAYLOAD) at offset `off`
 * of the region: in its own response area (off = mesh_response_area(p, seq) - p->base), or in its
 * request's (an answer made in place: off = mesh_entry_offset of its request).  The host refuses
 * (BadResponse) and never reads one that is longer than max_response or outside those two areas.
 * Published by mesh_ring_post, whose barrier and release order every byte this warp wrote before
 * RESP_HEAD; bytes written by other warps or blocks must be made visible by their writers first
 * (__threadfence_system(), then a flag this warp waits for). */
static __device__ __forceinline__ void mesh_ring_store_region(const mesh_ring_t *r, unsigned int seq, unsigned int len,
                                                              unsigned int off) {
    const unsigned int lane = threadIdx.x & 31u;
    volatile unsigned int *e = (volatile unsigned int *)(r->s + MESH_RESP_BASE + (seq % MESH_RING) * MESH_ENTRY_BYTES);
    if (lane == 0)
        e[0] = len;
    if (lane == 1)
        e[1] = off;
}

/* Warp-wide: n bytes from src to dst (host or device memory), 16 bytes a lane per load where both
 * are 16-byte aligned (the region's areas are), read past the L1 cache (__ldcv) and written through
 * it (__stwt). */
static __device__ __forceinline__ void mesh_copy(volatile unsigned char *dst, const volatile unsigned char *src,
                                                 unsigned int n) {
    const unsigned int lane = threadIdx.x & 31u;
    unsigned int done = 0;
    if ((((unsigned long long)dst | (unsigned long long)src) & 15ull) == 0) {
        const uint4 *s4 = (const uint4 *)src;
        uint4 *d4 = (uint4 *)dst;
        const unsigned int v = n / 16u;
        for (unsigned int k = lane; k < v; k += 32u)
            __stwt(d4 + k, __ldcv(s4 + k));
        done = v * 16u;
    }
    for (unsigned int k = done + lane; k < n; k += 32u)
        dst[k] = src[k];
}
/* ==== end of payloads of any size ============================================================== */

#endif /* MESH_PROGRAM_H */
