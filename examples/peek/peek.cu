// peek: reads its program data (docs/program-abi.md, "Data") and answers each request with what
// it found there: a request is a range of the data, `u64 offset, u32 length`; the response is the
// data's size (u64), DATA_SEQ as read before the data (u32), the byte sum of the range (u32, the
// range clamped to the data's end), then the range's first 172 bytes.  It beats every
// MESH_BEAT_EVERY ns and returns when halted.
//
// One warp serves the ring with the header's helpers (as echo does); each request's range is
// summed by the warp, a byte per lane at a time: a test of the data path, not a fast reader.
#include "mesh_program.h"

MESH_DEFINE_RT_ABI();
MESH_DEFINE_DATA();

#define PEEK_HEAD 16u                                   /* size, seq, sum */
#define PEEK_BYTES (MESH_ENTRY_PAYLOAD - PEEK_HEAD)     /* 172 */

MESH_MAIN {
    if (blockIdx.x != 0 || threadIdx.x >= 32)
        return;
    const unsigned int lane = threadIdx.x;
    mesh_slot_t s = mesh_slot(mailbox, slot);
    mesh_ring_t r;
    mesh_ring_init(s, &r, MESH_BEAT_EVERY);
    if (lane == 0)
        mesh_set_state(s, MESH_RUNNING);
    unsigned int n;
    while ((n = mesh_ring_wait(&r)) != 0) {
        for (unsigned int k = 0; k < n; k++) {
            const unsigned int seq_no = r.next + k;
            mesh_entry_t e = mesh_ring_load(&r, seq_no);
            const unsigned int len = mesh_entry_len(e);
            const unsigned int w1 = __shfl_sync(MESH_WARP, e.lo, 1), w2 = __shfl_sync(MESH_WARP, e.lo, 2);
            const unsigned int w3 = __shfl_sync(MESH_WARP, e.lo, 3);
            const unsigned long long off = len >= 8 ? ((unsigned long long)w2 << 32 | w1) : 0;
            const unsigned int want = len >= 12 ? w3 : 0;
            const unsigned int seq = mesh_data_seq(s);   /* before the data: an acquire */
            const unsigned char *d = (const unsigned char *)mesh_data;
            const unsigned long long size = mesh_data_bytes;
            const unsigned long long m = off < size ? (want < size - off ? want : size - off) : 0;
            unsigned int sum = 0;
            for (unsigned long long i = lane; i < m; i += 32)
                sum += d[off + i];
#pragma unroll
            for (int o = 16; o; o >>= 1)
                sum += __shfl_xor_sync(MESH_WARP, sum, o);
            const unsigned int shown = m < PEEK_BYTES ? (unsigned int)m : PEEK_BYTES;
            /* The response's words: 0 its length (mesh_ring_store), 1-2 the size, 3 seq, 4 sum, 5.. the bytes. */
            unsigned int word[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const unsigned int j = lane + 32u * h;
                unsigned int v = 0;
                if (j == 1) v = (unsigned int)size;
                else if (j == 2) v = (unsigned int)(size >> 32);
                else if (j == 3) v = seq;
                else if (j == 4) v = sum;
                else if (j >= 5 && j < MESH_ENTRY_WORDS) {
                    for (unsigned int b = 0; b < 4; b++) {
                        const unsigned int at = 4u * (j - 5u) + b;
                        if (at < shown)
                            v |= (unsigned int)d[off + at] << (8u * b);
                    }
                }
                word[h] = v;
            }
            mesh_entry_t out;
            out.lo = word[0];
            out.hi = word[1];
            mesh_ring_store(&r, seq_no, out, PEEK_HEAD + shown);
        }
        mesh_ring_post(&r, n);
    }
    if (lane == 0)
        mesh_set_state(s, MESH_EXITED);
}
